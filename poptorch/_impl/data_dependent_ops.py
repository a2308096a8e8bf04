"""Operators whose output shape depends on the data, given a static shape
while a model is traced (``tracing_context.py``).

A captured model is a static graph: every shape is known when it is
captured, as on the IPU. An operator whose result size depends on its
input's values is captured when one of its arguments bounds that size:

* ``torch.bincount(x, weights=None, minlength=N)`` with ``N > 0`` returns
  exactly ``N`` bins: bin ``i`` counts the elements of ``x`` equal to ``i``
  (or sums their ``weights``). PyTorch returns ``max(max(x) + 1, N)`` bins;
  the results are equal when every value is below ``N``. Values outside
  ``[0, N)`` are not counted (a device graph cannot raise on a value
  without reading it back to the host), as a warning says once when a
  model using it is captured. The result is differentiable with respect to
  ``weights``. Without ``minlength`` the capture refuses the call, naming
  ``minlength`` (``compile_errors.py``).
* ``torch.repeat_interleave`` with tensor ``repeats`` is captured by
  PyTorch's own kernel when ``output_size`` is given (the sum of
  ``repeats``, checked when the graph runs); without it the capture
  refuses the call, naming ``output_size``.
* ``torch.nn.functional.one_hot`` without ``num_classes`` (its width is the
  largest value plus one) is refused as an operation whose result shape
  depends on the data, naming ``num_classes``.
"""
import contextlib
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from .logger import warn_once

_BINCOUNT = (torch.bincount, torch.Tensor.bincount)

_BINCOUNT_RANGE = (
    "torch.bincount in a captured model returns minlength bins: values "
    "outside [0, minlength) are not counted (PyTorch lengthens its result "
    "instead)")


def _bincount_arguments(input: torch.Tensor,
                        weights: Optional[torch.Tensor] = None,
                        minlength: int = 0
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], int]:
    return input, weights, minlength


def static_bincount(input: torch.Tensor, weights: Optional[torch.Tensor],
                    minlength: int) -> torch.Tensor:
    """``torch.bincount`` with exactly ``minlength`` bins: the values of
    ``input`` in ``[0, minlength)`` counted, or their ``weights`` summed
    (float32 weights give float32 sums, other weights float64 ones, as in
    PyTorch)."""
    if input.dim() != 1 or input.is_floating_point() or input.is_complex() \
            or input.dtype is torch.bool:
        raise RuntimeError(
            "bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and (weights.dim() != 1
                                or weights.shape[0] != input.shape[0]):
        raise RuntimeError(
            "weights should be 1-d and have the same length as input")
    warn_once(_BINCOUNT_RANGE)
    counted = (input >= 0) & (input < minlength)
    index = torch.where(counted, input, 0).long()
    if weights is None:
        values = counted.long()
    else:
        dtype = (torch.float32 if weights.dtype is torch.float32
                 else torch.float64)
        values = torch.where(counted, weights.to(dtype), 0)
    bins = torch.zeros(minlength, dtype=values.dtype, device=input.device)
    return bins.scatter_add(0, index, values)


def _one_hot_classes(tensor: torch.Tensor, num_classes: int = -1) -> int:
    return num_classes


class _StaticShapeOperators(TorchFunctionMode):
    """``torch.bincount`` with ``minlength`` -> ``static_bincount``;
    ``F.one_hot`` without ``num_classes`` refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BINCOUNT:
            input, weights, minlength = _bincount_arguments(*args, **kwargs)
            if minlength != 0:
                return static_bincount(input, weights, minlength)
        if func is F.one_hot and _one_hot_classes(*args, **kwargs) == -1:
            raise DynamicOutputShapeException(torch.ops.aten.one_hot.default)
        return func(*args, **kwargs)


@contextlib.contextmanager
def static_shape_operators() -> Iterator[None]:
    """While a model is traced: ``torch.bincount`` with ``minlength`` has
    ``minlength`` bins, ``F.one_hot`` needs ``num_classes``."""
    with _StaticShapeOperators():
        yield
