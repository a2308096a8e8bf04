"""Writes to a model's parameters and buffers that replace the tensor,
while the model's forward pass is captured.

A captured graph keeps a write to a parameter or buffer only as an in-place
write to it (the guide asks for in-place updates of buffers). Two common
forms replace the tensor instead, which PyTorch runs but a graph would
lose without a word (the tensor swapped in is the traced one, and the
module's own tensor comes back afterwards):

* ``param.data = value`` (MoCo's momentum update of its key encoder);
* assigning a registered buffer attribute
  (``self.ema = 0.9 * self.ema + 0.1 * x.mean(0)``).

``in_place_state_writes`` makes each a copy of ``value`` into the tensor,
without autograd, as the in-place form would be. A value of another shape
or dtype, which no static graph can hold in the tensor's place, raises
``poptorch.Error``.
"""
import contextlib
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..errors import Error

_DATA_SETTER = torch.Tensor.data.__set__


def _copied_into(target: torch.Tensor, value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.shape != target.shape \
            or value.dtype != target.dtype:
        given = (f"{value.dtype} of shape {tuple(value.shape)}"
                 if isinstance(value, torch.Tensor) else type(value).__name__)
        raise Error(
            f"{what} is given a new tensor while the model is captured: a "
            "static graph keeps it as a write into the tensor, so the value "
            f"must have its shape and dtype ({target.dtype} of shape "
            f"{tuple(target.shape)}), got {given}")
    with torch.no_grad():
        target.copy_(value)
    return target


class _DataAssignment(TorchFunctionMode):
    """``tensor.data = value`` -> a copy of ``value`` into ``tensor``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == _DATA_SETTER:
            tensor, value = args
            _copied_into(tensor, value, "A tensor's .data")
            return None
        return func(*args, **(kwargs or {}))


def _buffer_assignment(module: torch.nn.Module, name: str,
                       value) -> Optional[torch.Tensor]:
    """A registered buffer assigned a tensor keeps its tensor, into which
    the value is copied (a buffer registered anew is left alone)."""
    current = module._buffers.get(name)
    if current is None or value is None or value is current:
        return None
    return _copied_into(current, value,
                        f"Buffer {name!r} of {type(module).__name__}")


@contextlib.contextmanager
def in_place_state_writes() -> Iterator[None]:
    """While active, ``.data`` and buffer assignments write in place."""
    hook = torch.nn.modules.module.register_module_buffer_registration_hook(
        _buffer_assignment)
    try:
        with _DataAssignment():
            yield
    finally:
        hook.remove()
