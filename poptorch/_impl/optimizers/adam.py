"""Adam and AdamW, as torch.optim.Adam and torch.optim.AdamW.

AdamW is Adam with decoupled weight decay (the params are multiplied by
``1 - lr * weight_decay`` before the Adam step). PopTorch's AdamW can drop the
bias corrections (``bias_correction=False``). ``amsgrad`` is supported for
torch.optim objects (poptorch.optim refuses it, as the spec says).
"""
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .rule import (DEFAULT_ACCUM_TYPE, TensorNorms, TorchState, UpdateRule,
                   accum_type_of, add_scalar, add_scaled, cast, compute_dtypes,
                   decay_average, dtypes_of, in_dtype_of, is_zero_constant,
                   lerp, per_param, sorted_constants, stacked, started_state,
                   state_tensors, step_tensors, sub_scaled)


def first_and_second_moments(grads: List[Tensor], exp_avg: List[Tensor],
                             exp_avg_sq: List[Tensor], hyper: Dict[str, Tensor]
                             ) -> Tuple[List[Tensor], List[Tensor]]:
    """Adam's running averages of the gradient and of its square."""
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    return (lerp(exp_avg, grads, 1 - beta1),
            decay_average(exp_avg_sq, grads, beta2))


def bias_corrections(new_steps: List[Tensor], hyper: Dict[str, Tensor]
                     ) -> Tuple[Tensor, Tensor]:
    """Per param (as 1-D tensors), ``1 - beta1**t`` and ``1 - beta2**t``."""
    steps = stacked(new_steps, like=hyper["beta1"])
    return 1 - hyper["beta1"] ** steps, 1 - hyper["beta2"] ** steps


class AdamRule(UpdateRule):
    """torch.optim.Adam / AdamW's update."""

    hyper_names = ("lr", "beta1", "beta2", "eps", "weight_decay")

    def __init__(self, *, decoupled_weight_decay: bool, amsgrad: bool,
                 maximize: bool, bias_correction: bool = True,
                 first_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE,
                 second_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE) -> None:
        self.decoupled_weight_decay = decoupled_weight_decay
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.bias_correction = bias_correction
        self.first_order_dtype = first_order_dtype
        self.second_order_dtype = second_order_dtype
        self.constants = sorted_constants(
            decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad,
            maximize=maximize, bias_correction=bias_correction,
            first_order_dtype=first_order_dtype,
            second_order_dtype=second_order_dtype)
        self.state_names = ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if amsgrad else ()) + ("step",)

    def hyper_values(self, group: Mapping[str, Any]) -> Dict[str, float]:
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "beta1": float(beta1),
                "beta2": float(beta2), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"])}

    def _state_dtype(self, name: str) -> torch.dtype:
        return self.first_order_dtype if name == "exp_avg" else self.second_order_dtype

    def init_state(self, params: List[Tensor],
                   torch_state: List[TorchState]) -> Dict[str, List[Tensor]]:
        state = {name: state_tensors(name, params, torch_state,
                                     self._state_dtype(name))
                 for name in self.state_names if name != "step"}
        state["step"] = step_tensors(params, torch_state)
        return state

    def update(self, params: List[Tensor], grads: List[Tensor],
               state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor],
               norms: Optional[TensorNorms] = None
               ) -> Tuple[List[Tensor], Dict[str, List[Tensor]]]:
        moment_names = [name for name in self.state_names if name != "step"]
        dtypes = compute_dtypes(params, grads, *(state[n] for n in moment_names))
        weights, grads = cast(params, dtypes), cast(grads, dtypes)
        lr, weight_decay = hyper["lr"], hyper["weight_decay"]
        if self.maximize:
            grads = torch._foreach_neg(grads)
        if self.decoupled_weight_decay and not is_zero_constant(weight_decay):
            weights = torch._foreach_mul(
                weights, in_dtype_of(weights, 1 - lr * weight_decay))
        elif not self.decoupled_weight_decay:
            grads = add_scaled(grads, weights, weight_decay)
        exp_avg, exp_avg_sq = first_and_second_moments(
            grads, cast(state["exp_avg"], dtypes),
            cast(state["exp_avg_sq"], dtypes), hyper)
        new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                     "step": torch._foreach_add(state["step"], 1.0)}
        second_moment = exp_avg_sq
        if self.amsgrad:
            second_moment = torch._foreach_maximum(
                cast(state["max_exp_avg_sq"], dtypes), exp_avg_sq)
            new_state["max_exp_avg_sq"] = second_moment
        new_weights = self._apply(weights, exp_avg, second_moment,
                                  new_state["step"], hyper)
        for name in moment_names:
            new_state[name] = cast(new_state[name], dtypes_of(state[name]))
        return cast(new_weights, dtypes_of(params)), new_state

    def _apply(self, weights: List[Tensor], exp_avg: List[Tensor],
               second_moment: List[Tensor], new_steps: List[Tensor],
               hyper: Dict[str, Tensor]) -> List[Tensor]:
        """``w - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``."""
        root = torch._foreach_sqrt(second_moment)
        lr = hyper["lr"]
        if self.bias_correction:
            correction1, correction2 = bias_corrections(new_steps, hyper)
            root = torch._foreach_div(
                root, per_param(torch.sqrt(correction2), like=root))
            step_sizes = per_param(lr / correction1, like=weights)
        else:
            step_sizes = lr
        denominator = add_scalar(root, hyper["eps"])
        ratio = torch._foreach_div(exp_avg, denominator)
        return sub_scaled(weights, ratio, step_sizes)

    def export_state(self, params: List[Tensor],
                     state: Dict[str, List[Tensor]]) -> List[Dict[str, Tensor]]:
        return started_state(state, self.state_names)


def rule_for_group(group: Mapping[str, Any]) -> AdamRule:
    """The Adam rule for a torch.optim.Adam/AdamW or poptorch.optim.Adam/AdamW
    param group."""
    return AdamRule(
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        amsgrad=bool(group.get("amsgrad", False)),
        maximize=bool(group.get("maximize", False)),
        bias_correction=bool(group.get("bias_correction", True)),
        first_order_dtype=accum_type_of(
            group, "first_order_momentum_accum_type"),
        second_order_dtype=accum_type_of(
            group, "second_order_momentum_accum_type"))
