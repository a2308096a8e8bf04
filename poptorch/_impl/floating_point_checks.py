"""Floating-point exceptions (``Precision.enableFloatingPointExceptions``).

An IPU traps on a floating-point overflow, a division by zero or an invalid
operation. CPUs and GPUs follow IEEE rules instead (inf and NaN results), so
here each training step checks that its values are finite and the call stops
at the first step that produced a non-finite one: the call is rolled back
(``failed_calls.py``) and ``poptorch.Error`` names the step and the first
place the value appeared.

What a step checks, as one boolean vector that the captured step returns
(``step_flags``), True where a value is not finite:

1. the loss of each replica the step covers (one, or R on the vectorised
   replica path);
2. each trainable parameter's gradient of the micro-batch, before it joins
   the step's sum (skipped with automatic loss scaling, whose overflowing
   steps are expected and skipped);
3. each trainable parameter's value after the optimizer update (update steps
   only).

The flags stay on the device: the device loop keeps one vector per step
(``StepFlags``) and reads them once, after the call's last step, so a call
costs one host synchronisation more, whatever its number of steps.
Inference models check their outputs the same way.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import Error

Position = Tuple[int, int, int]      # device iteration, micro-batch, replica


def not_finite(tensors: Sequence[torch.Tensor],
               like: torch.Tensor) -> torch.Tensor:
    """One flag per tensor, True when any of its elements is inf or NaN
    (their infinity norm propagates both)."""
    if not tensors:
        return like.new_zeros(0, dtype=torch.bool)
    norms = torch._foreach_norm(list(tensors), float("inf"))
    return ~torch.isfinite(torch.stack([n.float() for n in norms]))


def step_flags(losses: torch.Tensor, grads: Optional[List[torch.Tensor]],
               updated: Optional[List[torch.Tensor]],
               trainable: int) -> torch.Tensor:
    """The flags of one training step (see the module docstring): the
    replicas' losses, then ``trainable`` gradient flags, then ``trainable``
    updated-value flags; the parts a step does not check are False."""
    losses = losses.detach().reshape(-1)
    parts = [~torch.isfinite(losses)]
    for checked in (grads, updated):
        parts.append(not_finite(checked, losses) if checked is not None
                     else losses.new_zeros(trainable, dtype=torch.bool))
    return torch.cat(parts)


class StepFlags:
    """The flags of a call's steps, kept on the device, and the first step
    whose flags say a value was not finite."""

    def __init__(self, param_names: Sequence[str], replicas_per_step: int,
                 outputs: bool = False) -> None:
        self._names = list(param_names)
        self._losses = replicas_per_step
        self._outputs = outputs
        self._flags: List[torch.Tensor] = []
        self._positions: List[Position] = []

    def add(self, position: Position, flags: torch.Tensor) -> None:
        self._positions.append(position)
        self._flags.append(flags)

    def add_outputs(self, position: Position,
                    outputs: Sequence[torch.Tensor]) -> None:
        """The flags of an inference step: one per floating-point output."""
        floats = [t for t in outputs if t.is_floating_point()]
        if floats:
            self.add(position, not_finite(floats, floats[0]))

    def raise_first(self, layout) -> None:
        """Raise ``poptorch.Error`` for the first step with a non-finite
        value, if any (one read of the flags by the host)."""
        if not self._flags:
            return
        rows = torch.stack(self._flags).any(dim=1)
        first = int(torch.argmax(rows.int()).item())
        if not bool(rows[first].item()):
            return
        flags = self._flags[first].tolist()
        iteration, micro_batch, replica = self._positions[first]
        raise Error(
            f"Floating-point exception (enableFloatingPointExceptions): "
            f"{self._place(flags.index(True))} is not finite in "
            f"{self._step_name(layout, iteration, micro_batch, replica)}. "
            "The call was rolled back: the model's weights, buffers, "
            "optimizer state and random generator state are as they were "
            "before the call.")

    def _place(self, index: int) -> str:
        """What flag ``index`` checks."""
        if self._outputs:
            return f"output {index}"
        if index < self._losses:
            return ("the loss" if self._losses == 1
                    else f"the loss of replica {index}")
        index -= self._losses
        count = len(self._names)
        if index < count:
            return f"the gradient of {self._names[index]}"
        return (f"the value of {self._names[index - count]} after the "
                "optimizer update")

    def _step_name(self, layout, iteration: int, micro_batch: int,
                   replica: int) -> str:
        text = (f"device iteration {iteration} of "
                f"{layout.device_iterations}")
        if not self._outputs and self._losses == 0:
            return f"the optimizer step of {text}"
        if layout.gradient_accumulation > 1:
            text += (f", micro-batch {micro_batch} of "
                     f"{layout.gradient_accumulation}")
        if layout.replicas > 1 and self._losses == 1:
            text += f", replica {replica} of {layout.replicas}"
        return text
