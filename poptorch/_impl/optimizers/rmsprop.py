"""RMSprop, as torch.optim.RMSprop, and PopTorch's TensorFlow variant.

The TensorFlow variant (``use_tf_variant=True``) differs from torch in three
ways: the average of squared gradients starts at ones, epsilon is added inside
the square root, and the learning rate is folded into the momentum buffer
(``buf = momentum * buf + lr * g / avg``; ``w -= buf``). Its exported
``momentum_buffer`` therefore includes the learning rate.
"""
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .rule import (DEFAULT_ACCUM_TYPE, TensorNorms, TorchState, UpdateRule,
                   accum_type_of, add_scalar, add_scaled, cast, compute_dtypes,
                   decay_average, dtypes_of, in_dtype_of, lerp,
                   sorted_constants, started_state, state_tensors,
                   step_tensors, sub_scaled)


class RMSpropRule(UpdateRule):
    """torch.optim.RMSprop's update (weight decay, centred, momentum,
    maximize), or TensorFlow's variant of it."""

    def __init__(self, *, centered: bool, momentum: bool, maximize: bool,
                 tf_variant: bool = False,
                 first_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE,
                 second_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE) -> None:
        self.centered = centered
        self.momentum = momentum
        self.maximize = maximize
        self.tf_variant = tf_variant
        self.first_order_dtype = first_order_dtype
        self.second_order_dtype = second_order_dtype
        self.constants = sorted_constants(
            centered=centered, momentum=momentum, maximize=maximize,
            tf_variant=tf_variant, first_order_dtype=first_order_dtype,
            second_order_dtype=second_order_dtype)
        self.hyper_names = ("lr", "alpha", "eps", "weight_decay") + (
            ("momentum",) if momentum else ())
        self.state_names = ("square_avg",) + (
            ("momentum_buffer",) if momentum else ()) + (
            ("grad_avg",) if centered else ()) + ("step",)

    def hyper_values(self, group: Mapping[str, Any]) -> Dict[str, float]:
        values = {name: float(group[name])
                  for name in ("lr", "alpha", "eps", "weight_decay")}
        if self.momentum:
            values["momentum"] = float(group["momentum"])
        return values

    def _state_dtype(self, name: str) -> torch.dtype:
        return (self.second_order_dtype if name == "square_avg"
                else self.first_order_dtype)

    def init_state(self, params: List[Tensor],
                   torch_state: List[TorchState]) -> Dict[str, List[Tensor]]:
        state = {}
        for name in self.state_names[:-1]:
            fill = 1.0 if self.tf_variant and name == "square_avg" else 0.0
            state[name] = state_tensors(name, params, torch_state,
                                        self._state_dtype(name), fill)
        state["step"] = step_tensors(params, torch_state)
        return state

    def update(self, params: List[Tensor], grads: List[Tensor],
               state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor],
               norms: Optional[TensorNorms] = None
               ) -> Tuple[List[Tensor], Dict[str, List[Tensor]]]:
        tensor_names = self.state_names[:-1]
        dtypes = compute_dtypes(params, grads, *(state[n] for n in tensor_names))
        weights, grads = cast(params, dtypes), cast(grads, dtypes)
        if self.maximize:
            grads = torch._foreach_neg(grads)
        grads = add_scaled(grads, weights, hyper["weight_decay"])
        alpha = hyper["alpha"]
        new_state = {"square_avg": decay_average(
            cast(state["square_avg"], dtypes), grads, alpha)}
        variance = new_state["square_avg"]
        if self.centered:
            new_state["grad_avg"] = lerp(cast(state["grad_avg"], dtypes),
                                         grads, 1 - alpha)
            variance = torch._foreach_sub(variance, torch._foreach_mul(
                new_state["grad_avg"], new_state["grad_avg"]))
        if self.tf_variant:
            root = torch._foreach_sqrt(add_scalar(variance, hyper["eps"]))
        else:
            root = add_scalar(torch._foreach_sqrt(variance), hyper["eps"])
        normalised = torch._foreach_div(grads, root)
        if self.momentum:
            new_weights, new_state["momentum_buffer"] = self._momentum_step(
                weights, normalised, cast(state["momentum_buffer"], dtypes),
                hyper)
        else:
            new_weights = sub_scaled(weights, normalised, hyper["lr"])
        for name in tensor_names:
            new_state[name] = cast(new_state[name], dtypes_of(state[name]))
        new_state["step"] = torch._foreach_add(state["step"], 1.0)
        return cast(new_weights, dtypes_of(params)), new_state

    def _momentum_step(self, weights: List[Tensor], normalised: List[Tensor],
                       buffer: List[Tensor], hyper: Dict[str, Tensor]
                       ) -> Tuple[List[Tensor], List[Tensor]]:
        """New weights and new momentum buffer."""
        decayed = torch._foreach_mul(buffer,
                                     in_dtype_of(buffer, hyper["momentum"]))
        if self.tf_variant:
            buffer = add_scaled(decayed, normalised, hyper["lr"])
            return torch._foreach_sub(weights, buffer), buffer
        buffer = torch._foreach_add(decayed, normalised)
        return sub_scaled(weights, buffer, hyper["lr"]), buffer

    def export_state(self, params: List[Tensor],
                     state: Dict[str, List[Tensor]]) -> List[Dict[str, Tensor]]:
        return started_state(state, self.state_names)


def rule_for_group(group: Mapping[str, Any]) -> RMSpropRule:
    """The RMSprop rule for a torch.optim.RMSprop or poptorch.optim.RMSprop
    param group."""
    return RMSpropRule(
        centered=bool(group["centered"]), momentum=group["momentum"] > 0,
        maximize=bool(group.get("maximize", False)),
        tf_variant=bool(group.get("use_tf_variant", False)),
        first_order_dtype=accum_type_of(
            group, "first_order_momentum_accum_type"),
        second_order_dtype=accum_type_of(
            group, "second_order_momentum_accum_type"))
