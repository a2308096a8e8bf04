"""Tensors a compiled model holds as constants (plain tensor attributes,
closure tensors): frozen at compilation, as PopTorch freezes them
(``tracing_context.GraphConstants``). A program that changes one on the
host between calls (a per-epoch class weighting kept as a plain attribute)
would otherwise see no effect without a word: the change is reported once,
naming the attribute and what to do instead."""
from typing import List

import torch

from .logger import warn_once
from .weight_sync import host_reads_suspended


class FrozenConstants:
    """The user's tensors a compilation read as constants, and how often
    each had been written when it was compiled."""

    def __init__(self, module: torch.nn.Module,
                 tensors: List[torch.Tensor]) -> None:
        self._module = module
        self._tensors = [(tensor, tensor._version) for tensor in tensors]
        self._reported = False

    def report_changes(self) -> None:
        """Warn once when a constant has been written since compilation."""
        if self._reported:
            return
        changed = [tensor for tensor, version in self._tensors
                   if tensor._version != version]
        if changed:
            self._reported = True
            warn_once(
                f"{self._describe(changed)} changed after the model was "
                "compiled. The compiled model keeps the values they had "
                "when it was compiled, as PopTorch does for tensors that "
                "are not parameters, buffers or arguments. To change such "
                "a tensor between calls, register it as a buffer "
                "(module.register_buffer) and call copyWeightsToDevice(), "
                "or pass it as an argument; destroy() compiles the model "
                "again with the new values.")

    def _describe(self, tensors: List[torch.Tensor]) -> str:
        with host_reads_suspended():
            named = {id(value): f"'{prefix}{'.' if prefix else ''}{name}'"
                     for prefix, sub in self._module.named_modules()
                     for name, value in vars(sub).items()
                     if isinstance(value, torch.Tensor)}
        names = [named.get(id(tensor), f"one of shape {tuple(tensor.shape)} "
                           "(a closure or global)")
                 for tensor in tensors]
        return f"Tensors that forward reads as constants ({', '.join(names)})"
