"""The optimizer-wide attributes of a training step: loss scaling and
gradient clipping (``loss_scaling``, ``max_grad_norm``).

Each is, in the captured step, one of:

* a compile-time constant (a Python number in the graph): a torch.optim
  optimizer's, or a ``poptorch.optim`` attribute marked constant;
* a runtime input (a 0-d float64 tensor after the param groups'
  hyper-parameters): a ``poptorch.optim`` attribute marked variable, so that
  ``setOptimizer`` applies a new value without capturing again. A variable
  ``max_grad_norm`` of inf disables clipping;
* for the loss scale with automatic loss scaling, optimizer state
  (``loss_scaling.py``).

The loss is multiplied by the scale before the backward pass; the gradients
are divided by the scale (and the mean reduction's divisor) before clipping
and the update. While loss scaling is in use, float16 and bfloat16 gradients
are unscaled in float32 so that small values survive; the update rules then
compute in float32 and store in the parameters' dtype.

A step whose gradients are spread over processes (a pipeline with one stage
per process) updates each process's weights alone, but clips by the norm of
all the step's gradients and skips the step everywhere when any of them
overflowed: ``PartialGradients`` totals those statistics over the processes
inside the traced update.
"""
import dataclasses
import math
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import loss_scaling
from .loss_scaling import AutomaticLossScaling
from .rule import cast, clip_grad_norm, clip_to_norm, in_dtype_of

LOSS_SCALING = "loss_scaling"
MAX_GRAD_NORM = "max_grad_norm"

Scalar = Union[float, Tensor]


@dataclasses.dataclass(frozen=True)
class GlobalAttributes:
    """How a training step gets its loss scale and clipping norm."""
    loss_scaling: Optional[float]   # the constant scale; None: input/automatic
    automatic: Optional[AutomaticLossScaling]
    max_grad_norm: Optional[float]  # the constant norm; None: none or input
    variable: Tuple[str, ...]       # the runtime inputs, in order

    @staticmethod
    def build(plan, automatic: bool) -> "GlobalAttributes":
        """From an optimizer plan and ``opts.Training.auto_loss_scaling``."""
        variable = tuple(name for name in (LOSS_SCALING, MAX_GRAD_NORM)
                         if name in plan.variable_globals
                         and not (automatic and name == LOSS_SCALING))
        return GlobalAttributes(
            loss_scaling=(None if automatic or LOSS_SCALING in variable
                          else float(plan.loss_scaling)),
            automatic=loss_scaling.SETTINGS if automatic else None,
            max_grad_norm=(None if MAX_GRAD_NORM in variable
                           else plan.max_grad_norm),
            variable=variable)

    def hyper_values(self, plan, device: torch.device) -> List[Tensor]:
        """The runtime inputs for ``plan``'s values."""
        values = {LOSS_SCALING: plan.loss_scaling,
                  MAX_GRAD_NORM: (math.inf if plan.max_grad_norm is None
                                  else plan.max_grad_norm)}
        return [torch.tensor(float(values[name]), dtype=torch.float64,
                             device=device) for name in self.variable]

    def initial_loss_scale(self, plan) -> float:
        """The loss scale of the first step."""
        if self.automatic is not None:
            return self.automatic.start_scale(plan.loss_scaling)
        return float(plan.loss_scaling)

    @property
    def state_size(self) -> int:
        """Tensors of automatic loss scaling state (after the groups')."""
        return 2 if self.automatic is not None else 0

    def initial_state(self, plan, device: torch.device,
                      saved: Optional[dict] = None) -> List[Tensor]:
        """Automatic loss scaling state: from ``saved`` (a state dict's
        ``loss_scale`` and ``good_steps``) when given, else the start."""
        if self.automatic is None:
            return []
        if saved is not None and saved.get("loss_scale") is not None:
            return self.automatic.initial_state(
                saved["loss_scale"], saved.get("good_steps", 0), device)
        return self.automatic.initial_state(
            self.automatic.start_scale(plan.loss_scaling), 0, device)

    def bind(self, hyper_tail: List[Tensor], state_tail: List[Tensor],
             partial: Optional["PartialGradients"] = None) -> "StepScaling":
        """The values inside a traced step, from its inputs after the param
        groups' hyper-parameters and state; ``partial`` when the step holds
        only some of the gradients."""
        inputs = dict(zip(self.variable, hyper_tail))
        if self.automatic is not None:
            scale = state_tail[0]
        else:
            scale = inputs.get(LOSS_SCALING, self.loss_scaling)
        max_norm = inputs.get(MAX_GRAD_NORM, self.max_grad_norm)
        if isinstance(max_norm, Tensor):
            max_norm = max_norm.to(torch.float32)
        return StepScaling(self, scale, max_norm, list(state_tail), partial)


@dataclasses.dataclass(frozen=True)
class PartialGradients:
    """The gradients of one process's share of a step's weights (a pipeline
    stage's, or rows of sharded weights): ``counted`` says which of them
    this process counts in the step's statistics (a weight that several
    stages read is counted by one), ``total`` sums a 0-d float64 tensor over
    the processes in place (a collective traced into the update graph).
    ``everywhere`` marks gradients every process holds whole (the unsharded
    weights' of a sharded step): counted once, here, after the total."""
    counted: Tuple[bool, ...]
    total: Callable[[Tensor], None]
    device: torch.device
    everywhere: Tuple[bool, ...] = ()

    def _everywhere(self, grads: List[Tensor]) -> List[Tensor]:
        return [g for g, whole in zip(grads, self.everywhere) if whole]

    def _spread(self, grads: List[Tensor]) -> List[Tensor]:
        everywhere = self.everywhere or (False,) * len(grads)
        return [g for g, whole in zip(grads, everywhere) if not whole]

    def norm(self, grads: List[Tensor]) -> Tensor:
        """The 2-norm of every process's counted gradients."""
        counted = [g for g, keep in zip(grads, self.counted) if keep]
        squares = _sum_of_squares(counted, self.device)
        self.total(squares)
        everywhere = self._everywhere(grads)
        if everywhere:
            squares = squares + _sum_of_squares(everywhere, self.device)
        return squares.sqrt().to(torch.float32)

    def all_finite(self, grads: List[Tensor]) -> Tensor:
        """Whether every process's gradients are all finite."""
        finite = loss_scaling.all_finite(self._spread(grads))
        overflows = torch.zeros((), dtype=torch.float64, device=self.device)
        if finite is not None:
            overflows = torch.logical_not(finite).to(torch.float64)
        self.total(overflows)
        result = overflows == 0
        finite = loss_scaling.all_finite(self._everywhere(grads))
        return result if finite is None else result & finite


def _sum_of_squares(tensors: List[Tensor], device: torch.device) -> Tensor:
    """The sum of the squares of every element of ``tensors`` (0-d,
    float64)."""
    present = [t for t in tensors if t.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(present, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def _widened(grads: List[Tensor]) -> List[Tensor]:
    return cast(grads, [torch.promote_types(g.dtype, torch.float32)
                        for g in grads])


@dataclasses.dataclass
class StepScaling:
    """Loss scaling and clipping inside one traced step."""
    attributes: GlobalAttributes
    scale: Scalar
    max_norm: Optional[Scalar]
    state: List[Tensor]             # automatic loss scaling state in
    partial: Optional[PartialGradients] = None

    def scale_loss(self, value: Tensor, factor: float) -> Tensor:
        """The loss to differentiate: ``value * scale * factor``."""
        if not isinstance(self.scale, Tensor):
            multiplier = self.scale * factor
            return value if multiplier == 1.0 else value * multiplier
        dtype = torch.promote_types(value.dtype, torch.float32)
        return value * (self.scale * factor).to(dtype)

    def unscale(self, grads: List[Tensor], divisor: float) -> List[Tensor]:
        """Gradients divided by the loss scale and ``divisor``."""
        if not isinstance(self.scale, Tensor):
            if self.scale == 1.0:
                return (grads if divisor == 1.0
                        else list(torch._foreach_div(grads, divisor)))
            return list(torch._foreach_div(_widened(grads),
                                           self.scale * divisor))
        grads = _widened(grads)
        factor = self.scale * divisor
        return list(torch._foreach_div(grads, in_dtype_of(grads, factor)))

    def clip(self, grads: List[Tensor]) -> List[Tensor]:
        """Gradients clipped to the global norm ``max_grad_norm``."""
        if self.max_norm is None:
            return grads
        if self.partial is not None:
            return clip_to_norm(grads, self.max_norm, self.partial.norm(grads))
        return clip_grad_norm(grads, self.max_norm)

    def finite(self, grads: List[Tensor]) -> Optional[Tensor]:
        """Automatic loss scaling: whether all gradients are finite."""
        if self.attributes.automatic is None:
            return None
        if self.partial is not None:
            return self.partial.all_finite(grads)
        return loss_scaling.all_finite(grads)

    def finish(self, finite: Optional[Tensor], params: List[Tensor],
               new_params: List[Tensor], state: List[Tensor],
               new_state: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        """The step's new params and state: with automatic loss scaling, the
        old ones when a gradient overflowed, and the next scale state."""
        automatic = self.attributes.automatic
        if automatic is None:
            return new_params, new_state
        new_params = loss_scaling.keep_if_finite(finite, new_params, params)
        new_state = loss_scaling.keep_if_finite(finite, new_state, state)
        if finite is None:
            finite = torch.ones((), dtype=torch.bool,
                                device=self.state[0].device)
        return new_params, new_state + automatic.next_state(self.state, finite)
