"""Which outputs a call returns and in what shape (docs/semantics.md,
"What a call returns").

The device loop hands every micro-batch step's output tensors to an
``OutputCollector``; it keeps only what the ``OutputMode`` needs and combines
it at the end. With b the number of kept micro-batch outputs (R for Final and
Sum), b > 1 multiplies dimension 0 by b (0-d outputs become 1-d of length b)
in [D, G, R] order, and b = 1 returns exactly the model's shapes.
"""
import copy
from typing import List, Optional, Sequence

import torch

from ..enums import OutputMode
from ..errors import Error


def resolve_output_mode(mode: OutputMode, training: bool) -> OutputMode:
    """``Default`` means ``Final`` for training and ``All`` for inference."""
    if mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return mode


def check_return_period(mode: OutputMode, period: int,
                        device_iterations: int) -> None:
    """EveryN needs the D device iterations of a call to be a multiple of
    N (as PopART's return period must divide its batches per step)."""
    if mode == OutputMode.EveryN and device_iterations % period:
        raise Error(
            f"outputMode(EveryN, {period}) returns the outputs of device "
            f"iterations {period}, {2 * period}, ..., but a call runs "
            f"deviceIterations "
            f"= {device_iterations}, which is not a multiple of {period}")


class OutputCollector:
    """Collects one call's outputs for ``iterations`` x ``replicas`` steps,
    ``accumulation`` micro-batch steps per device iteration. EveryN keeps
    every micro-batch of device iterations N - 1, 2 N - 1, ... (PopART's
    return period counts batches per step; an anchor's shape has the
    accumulation dimension). The outputs at the ``stored`` positions are
    tensors the steps read rather than compute (a parameter or buffer
    returned as it is), which later steps may write in place: they are
    copied as they are collected."""

    def __init__(self, mode: OutputMode, period: int, iterations: int,
                 replicas: int, accumulation: int = 1,
                 stored: Sequence[int] = ()) -> None:
        self.mode = mode
        self.period = period
        self.iterations = iterations
        self.replicas = replicas
        self.accumulation = accumulation
        self._stored = frozenset(stored)
        self._kept: List[List[torch.Tensor]] = []
        self._sums: List[Optional[List[torch.Tensor]]] = [None] * replicas

    def wants(self, iteration: int) -> bool:
        """Whether the outputs of ``iteration`` are needed at all."""
        if self.mode in (OutputMode.All, OutputMode.Sum):
            return True
        if self.mode == OutputMode.EveryN:
            return (iteration // self.accumulation + 1) % self.period == 0
        return iteration == self.iterations - 1

    def add(self, iteration: int, replica: int,
            outputs: List[torch.Tensor]) -> None:
        if not self.wants(iteration):
            return
        if self._stored:
            outputs = [t.clone() if index in self._stored else t
                       for index, t in enumerate(outputs)]
        if self.mode == OutputMode.Sum:
            previous = self._sums[replica]
            self._sums[replica] = (list(outputs) if previous is None else
                                   [a + b for a, b in zip(previous, outputs)])
        else:
            self._kept.append(list(outputs))

    def result(self) -> List[torch.Tensor]:
        """The combined outputs, one tensor per model output tensor."""
        rows = self._sums if self.mode == OutputMode.Sum else self._kept
        if len(rows) == 1:
            return list(rows[0])
        return [_combine([row[i] for row in rows])
                for i in range(len(rows[0]))]


def _combine(tensors: List[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() == 0:
        return torch.stack(tensors)
    return torch.cat(tensors)


class TrainingOutput(torch.Tensor):
    """An output tensor of a training model.

    It behaves as a plain tensor (operations on it return plain tensors), but
    calling ``.backward()`` on it explains that the backward pass already ran
    inside the model call.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, **kwargs) -> str:
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), **kwargs)

    def __format__(self, format_spec: str) -> str:
        """``f"{loss:.3f}"`` formats a 0-d output as a plain tensor's value."""
        return self.as_subclass(torch.Tensor).__format__(format_spec)

    def __deepcopy__(self, memo) -> torch.Tensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)

    def __reduce_ex__(self, protocol):
        """Saved and pickled as a plain tensor (``torch.load`` with
        ``weights_only=True`` loads it)."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def backward(self, *args, **kwargs):
        raise Error(
            "backward() was called on an output of a poptorch training model. "
            "The backward pass and the optimizer step run automatically "
            "inside each call of the training model, starting from the loss "
            "computed in forward(); remove the call to backward() (and to "
            "optimizer.step()).")


def as_training_outputs(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t.as_subclass(TrainingOutput) for t in tensors]
