"""Automatic loss scaling (``opts.Training.setAutomaticLossScaling(True)``).

The loss scale is state of the captured training step: two 0-d float32
tensors, the current scale and the number of optimizer steps in a row whose
gradients were finite. They sit after the param groups' state in the flat
optimizer state, so the device loop carries them from step to step with no
host synchronisation. Each optimizer step:

* the loss is multiplied by the current scale before the backward pass and
  the gradients are divided by it before the update;
* if any gradient is inf or NaN (overflow), the step is skipped — weights and
  optimizer state keep their values — and the scale is multiplied by
  ``backoff_factor``;
* otherwise the update is applied, and after ``growth_interval`` finite steps
  in a row the scale is multiplied by ``growth_factor``.

The scale starts at the optimizer's ``loss_scaling``, or at ``initial_scale``
when that is 1.0 (the default); it stays within ``[min_scale, max_scale]``.
This is the rule of ``torch.amp.GradScaler`` with its default factors.
"""
import dataclasses
from typing import List, Optional

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class AutomaticLossScaling:
    """The constants of the dynamic loss scale."""
    initial_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0 ** -16
    max_scale: float = 2.0 ** 64

    def start_scale(self, loss_scaling: float) -> float:
        """The first scale: the optimizer's ``loss_scaling`` unless it is 1.0."""
        return self.initial_scale if loss_scaling == 1.0 else loss_scaling

    def initial_state(self, scale: float, good_steps: int,
                      device: torch.device) -> List[Tensor]:
        """The state tensors: ``[scale, finite steps in a row]``."""
        return [torch.tensor(float(scale), dtype=torch.float32, device=device),
                torch.tensor(float(good_steps), dtype=torch.float32,
                             device=device)]

    def next_state(self, state: List[Tensor], finite: Tensor) -> List[Tensor]:
        """The state after a step whose gradients were all ``finite`` (a 0-d
        bool tensor): grow after ``growth_interval`` finite steps in a row,
        back off on an overflow."""
        scale, good_steps = state
        good_steps = torch.where(finite, good_steps + 1,
                                 torch.zeros_like(good_steps))
        grow = good_steps >= self.growth_interval
        scale = torch.where(
            finite, torch.where(grow, scale * self.growth_factor, scale),
            scale * self.backoff_factor)
        scale = torch.clamp(scale, self.min_scale, self.max_scale)
        good_steps = torch.where(grow, torch.zeros_like(good_steps),
                                 good_steps)
        return [scale, good_steps]


#: The settings automatic loss scaling uses.
SETTINGS = AutomaticLossScaling()


def all_finite(grads: List[Tensor]) -> Optional[Tensor]:
    """A 0-d bool tensor: whether every gradient value is finite (None when
    there are no gradient values)."""
    present = [g for g in grads if g.numel()]
    if not present:
        return None
    maxima = torch._foreach_max(torch._foreach_abs(present))
    return torch.stack([torch.isfinite(m) for m in maxima]).all()


def keep_if_finite(finite: Optional[Tensor], new: List[Tensor],
                   old: List[Tensor]) -> List[Tensor]:
    """``new`` where the step's gradients were finite, else ``old``."""
    if finite is None:
        return list(new)
    return [torch.where(finite, n, o) for n, o in zip(new, old)]
