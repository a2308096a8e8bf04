"""``copy.deepcopy`` of a tensor while a model is traced with fake tensors.

PyTorch deep-copies a tensor by copying its storage and setting the new
tensor's storage to the copy (``Tensor.set_``); a storage cannot enter a
traced graph, so the trace fails. torchmetrics does such copies in a step
(``Metric.add_state`` copies each state's default; Lightning's
``self.log`` creates a metric per logged name while the step runs). While
a model is traced, a deep copy of a tensor is a new tensor with the same
values, dtype, device and ``requires_grad``: the graph copies it
(``aten.clone``). As in PyTorch, only leaf tensors may be deep-copied;
others raise PyTorch's own ``RuntimeError``.
"""
import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _DeepcopyAsClone(TorchFunctionMode):
    """``Tensor.__deepcopy__`` of a leaf tensor as a traced ``clone``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__deepcopy__ and args[0].is_leaf:
            return _traced_copy(args[0])
        return func(*args, **kwargs)


def _traced_copy(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        copy = tensor.clone()
    return copy.requires_grad_(tensor.requires_grad)


@contextlib.contextmanager
def deepcopy_as_clone() -> Iterator[None]:
    """While a model is traced: ``copy.deepcopy`` of a tensor is traced as
    a copy of its values."""
    with _DeepcopyAsClone():
        yield
