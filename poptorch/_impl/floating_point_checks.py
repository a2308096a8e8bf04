"""Floating-point exceptions (``Precision.enableFloatingPointExceptions``).

An IPU traps on a floating-point overflow, a division by zero or an invalid
operation. CPUs and GPUs follow IEEE rules instead (inf and NaN results), so
here each training step checks that its values are finite and the call stops
at the first step that produced a non-finite one: the call is rolled back
(``failed_calls.py``) and ``poptorch.Error`` names the step and the first
place the value appeared.

What a step checks, as one float32 vector that the captured step returns
(``step_flags``), one value per check, not finite when the checked values
are not all finite: the loss itself, and the 2-norm of each tensor, computed
in float32, which propagates inf and NaN (and which a tensor of finite
values only overflows past a norm of about 1.8e19, a value no training
step holds):

1. the loss of each replica the step covers (one, or R on the vectorised
   replica path);
2. each trainable parameter's gradient: the sum of the optimizer step's
   micro-batches so far, not finite from the first micro-batch with a
   non-finite gradient on, since sums keep inf and NaN (skipped with
   automatic loss scaling, whose overflowing steps are expected and
   skipped);
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


def magnitudes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor, as one float32 vector: inf or NaN when the
    tensor holds inf or NaN. (One multi-tensor operation: the infinity norm
    would say the same without overflow, at four times the cost on CPUs.)"""
    return torch.stack(torch._foreach_norm(list(tensors), 2,
                                           dtype=torch.float32))


def step_flags(losses: torch.Tensor, grads: Optional[List[torch.Tensor]],
               updated: Optional[List[torch.Tensor]],
               trainable: int) -> torch.Tensor:
    """The flags of one training step (see the module docstring): the
    replicas' losses, then ``trainable`` gradient values, then ``trainable``
    updated-value values; the parts a step does not check are 0."""
    losses = losses.detach().reshape(-1).float()
    checked = (grads or []) + (updated or [])
    parts = [losses]
    if grads is None:
        parts.append(losses.new_zeros(trainable))
    if checked:
        parts.append(magnitudes(checked))
    if updated is None:
        parts.append(losses.new_zeros(trainable))
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
            self.add(position, magnitudes(floats))

    def raise_first(self, layout) -> None:
        """Raise ``poptorch.Error`` for the first step with a non-finite
        value, if any (one read of the flags by the host)."""
        if not self._flags:
            return
        failed = ~torch.isfinite(torch.stack(self._flags))
        rows = failed.any(dim=1)
        first = int(torch.argmax(rows.int()).item())
        if not bool(rows[first].item()):
            return
        flags = failed[first].tolist()
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
