"""Stochastic gradient descent, with optional momentum, as torch.optim.SGD.

PopTorch's two momentum variants compute torch's maths and differ in how
the velocity is stored:

* separate tensors (default): the velocity is kept as is, in
  ``velocity_accum_type`` (float32 by default, whatever the parameter's
  dtype);
* combined (``use_combined_accum=True``): the velocity is kept multiplied by
  ``velocity_scaling`` in the parameter's dtype, and divided by it when the
  parameters are updated. The scale in use is kept per parameter, so a new
  ``velocity_scaling`` rescales the stored velocity exactly instead of
  over- or under-estimating it for a while.

With ``momentum == 0`` there is no state and the variant settings are ignored.
"""
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .rule import (DEFAULT_ACCUM_TYPE, TensorNorms, TorchState, UpdateRule,
                   accum_type_of, add_scaled, cast, compute_dtypes, dtypes_of,
                   has_started, in_dtype_of, is_zero_constant, per_param,
                   sorted_constants, stacked, state_tensors, step_tensors,
                   sub_scaled)

_VELOCITY = "momentum_buffer"
_SCALED_VELOCITY = "scaled_velocity"
_VELOCITY_SCALE = "velocity_scaling"


class SGDRule(UpdateRule):
    """torch.optim.SGD's update (weight decay, momentum, dampening, Nesterov,
    maximize); torch starts the velocity at the first gradient."""

    def __init__(self, *, momentum: bool, nesterov: bool, maximize: bool,
                 combined: bool = False,
                 velocity_dtype: torch.dtype = DEFAULT_ACCUM_TYPE) -> None:
        self.momentum = momentum
        self.nesterov = nesterov and momentum
        self.maximize = maximize
        self.combined = combined and momentum
        self.velocity_dtype = (velocity_dtype
                               if momentum and not self.combined else None)
        self.constants = sorted_constants(
            momentum=self.momentum, nesterov=self.nesterov,
            maximize=self.maximize, combined=self.combined,
            velocity_dtype=self.velocity_dtype)
        self.hyper_names = ("lr", "weight_decay")
        self.state_names = ()
        if self.momentum:
            self.hyper_names += ("momentum", "dampening")
            self.state_names = (_VELOCITY, "step")
        if self.combined:
            self.hyper_names += ("velocity_scaling",)
            self.state_names = (_SCALED_VELOCITY, _VELOCITY_SCALE, "step")

    def hyper_values(self, group: Mapping[str, Any]) -> Dict[str, float]:
        values = {"lr": float(group["lr"]),
                  "weight_decay": float(group["weight_decay"])}
        if self.momentum:
            values["momentum"] = float(group["momentum"])
            values["dampening"] = float(group["dampening"])
        if self.combined:
            values["velocity_scaling"] = float(group.get("velocity_scaling", 1.0))
        return values

    def init_state(self, params: List[Tensor],
                   torch_state: List[TorchState]) -> Dict[str, List[Tensor]]:
        if not self.momentum:
            return {}
        # torch's SGD keeps no step count: a stored velocity means that the
        # param has been updated (any count > 0 gives the same maths).
        started = [{"step": 1.0} if given.get(_VELOCITY) is not None else {}
                   for given in torch_state]
        steps = step_tensors(params, started)
        velocity = state_tensors(_VELOCITY, params, torch_state,
                                 self.velocity_dtype)
        if not self.combined:
            return {_VELOCITY: velocity, "step": steps}
        scales = [torch.ones((), dtype=torch.float32, device=p.device)
                  for p in params]
        return {_SCALED_VELOCITY: velocity, _VELOCITY_SCALE: scales,
                "step": steps}

    def update(self, params: List[Tensor], grads: List[Tensor],
               state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor],
               norms: Optional[TensorNorms] = None
               ) -> Tuple[List[Tensor], Dict[str, List[Tensor]]]:
        if not self.momentum:
            dtypes = compute_dtypes(params, grads)
            weights = cast(params, dtypes)
            direction = self._decayed_gradient(weights, cast(grads, dtypes), hyper)
            return cast(sub_scaled(weights, direction, hyper["lr"]),
                        dtypes_of(params)), {}
        stored = state[self.state_names[0]]
        dtypes = compute_dtypes(params, grads, stored)
        weights = cast(params, dtypes)
        grads = self._decayed_gradient(weights, cast(grads, dtypes), hyper)
        momentum_step = self._combined_momentum if self.combined else self._momentum
        direction, velocity, new_state = momentum_step(
            grads, cast(stored, dtypes), state, hyper)
        new_state[self.state_names[0]] = cast(velocity, dtypes_of(stored))
        new_state["step"] = torch._foreach_add(state["step"], 1.0)
        new_weights = sub_scaled(weights, direction, hyper["lr"])
        return cast(new_weights, dtypes_of(params)), new_state

    def _decayed_gradient(self, weights: List[Tensor], grads: List[Tensor],
                          hyper: Dict[str, Tensor]) -> List[Tensor]:
        if self.maximize:
            grads = torch._foreach_neg(grads)
        return add_scaled(grads, weights, hyper["weight_decay"])

    @staticmethod
    def _gradient_coefficients(state: Dict[str, List[Tensor]],
                               hyper: Dict[str, Tensor]) -> Tensor:
        """Per param, the weight of the gradient in the new velocity:
        ``1 - dampening``, except on the first step where torch sets the
        velocity to the gradient (the velocity starts at zero, so a weight of
        1 gives exactly the gradient)."""
        dampening = hyper["dampening"]
        steps = stacked(state["step"], like=dampening)
        return torch.where(steps == 0, torch.ones_like(steps), 1 - dampening)

    def _momentum(self, grads: List[Tensor], velocity: List[Tensor],
                  state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor]
                  ) -> Tuple[List[Tensor], List[Tensor], Dict[str, List[Tensor]]]:
        """Direction, new velocity and other new state (separate variant)."""
        momentum = hyper["momentum"]
        decayed = torch._foreach_mul(velocity, in_dtype_of(velocity, momentum))
        if is_zero_constant(hyper["dampening"]):
            # The velocity starts at zero, so the first step gives exactly
            # torch's velocity = gradient without a first-step case.
            velocity = torch._foreach_add(decayed, grads)
        else:
            coefficients = per_param(
                self._gradient_coefficients(state, hyper), like=grads)
            velocity = add_scaled(decayed, grads, coefficients)
        direction = (add_scaled(grads, velocity, momentum) if self.nesterov
                     else velocity)
        return direction, velocity, {}

    def _combined_momentum(self, grads: List[Tensor], scaled: List[Tensor],
                           state: Dict[str, List[Tensor]],
                           hyper: Dict[str, Tensor]
                           ) -> Tuple[List[Tensor], List[Tensor], Dict[str, List[Tensor]]]:
        """Direction, new scaled velocity and new scales (combined variant).

        The stored velocity is ``velocity_scaling * v``; the gradient enters
        it multiplied by ``velocity_scaling`` and the direction divides it
        out again. A stored velocity kept with another scale is rescaled.
        Scales are float32, like the per-param scale state.
        """
        momentum = hyper["momentum"]
        scale = torch.as_tensor(hyper["velocity_scaling"], dtype=torch.float32)
        old_scales = stacked(state[_VELOCITY_SCALE])
        decay = per_param(momentum * (scale / old_scales))
        coefficients = per_param(self._gradient_coefficients(state, hyper) * scale)
        scaled = add_scaled(torch._foreach_mul(scaled, decay), grads, coefficients)
        velocity = torch._foreach_div(scaled, scale)
        direction = (add_scaled(grads, velocity, momentum) if self.nesterov
                     else velocity)
        new_scales = per_param(torch.ones_like(old_scales) * scale)
        return direction, scaled, {_VELOCITY_SCALE: new_scales}

    def export_state(self, params: List[Tensor],
                     state: Dict[str, List[Tensor]]) -> List[Dict[str, Tensor]]:
        if not self.momentum:
            return [{} for _ in params]
        exported = []
        for index, step in enumerate(state["step"]):
            if not has_started(step):
                exported.append({})
            elif self.combined:
                scaled = state[_SCALED_VELOCITY][index]
                scale = state[_VELOCITY_SCALE][index]
                exported.append({_VELOCITY: (scaled / scale).to(scaled.dtype)})
            else:
                exported.append({_VELOCITY: state[_VELOCITY][index].clone()})
        return exported


def rule_for_group(group: Mapping[str, Any]) -> SGDRule:
    """The SGD rule for a torch.optim.SGD or poptorch.optim.SGD param group."""
    return SGDRule(momentum=group["momentum"] != 0,
                   nesterov=bool(group["nesterov"]),
                   maximize=bool(group.get("maximize", False)),
                   combined=bool(group.get("use_combined_accum", False)),
                   velocity_dtype=accum_type_of(group, "velocity_accum_type"))
