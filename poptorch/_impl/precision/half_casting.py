"""PopTorch's rule for operations that mix float16 and float32 tensors
(features chapter "Half / float16 support", ``Precision.halfFloatCasting``).

PyTorch promotes such an operation to float32, or refuses it (a float32
``Linear`` called on a float16 input). PopTorch instead casts every input to
float16 (``HalfFloatCastingBehavior.Default`` and ``FloatDowncastToHalf``),
so float32 weights are converted to float16 when an operation meets a
float16 input, while their gradients and updates stay float32;
``HalfUpcastToFloat`` casts the float16 inputs to float32 instead.

While the model's ``forward`` is captured, ``MixedPrecisionCasting`` looks
at each torch function call: when its tensors of more than 0 dimensions
include both float16 and float32 ones, those of the other dtype are cast to
the chosen one (0-d tensors follow PyTorch's promotion, as Python numbers
do). Calls that write to a tensor (in-place methods, ``out=``, item
assignment), that convert types on purpose (``to``, ``type_as``), batch
normalisation (its float32 running statistics are updated in place; PyTorch
already runs a float16 input with float32 statistics and weights) and the
backward pass (``torch.autograd.grad`` over parameters of both dtypes: cast
copies would get no gradients) are left as they are.

Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) check in Python that
their input has their weights' dtype, a check PyTorch skips under autocast;
while the rule applies it is skipped for float16/float32 mixes too, and the
layer's call (``torch.lstm``...) is cast like any other.
"""
import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ...enums import HalfFloatCastingBehavior

MIXED = frozenset({torch.float16, torch.float32})

LEFT_AS_THEY_ARE = frozenset({
    torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.type,
    torch.Tensor.__setitem__, torch.nn.functional.batch_norm,
    torch.nn.functional.instance_norm, torch.batch_norm,
    torch.instance_norm, torch.autograd.grad, torch.autograd.backward,
})


def target_dtype(behavior: HalfFloatCastingBehavior) -> torch.dtype:
    """The dtype that mixed float16/float32 operations compute in."""
    if behavior == HalfFloatCastingBehavior.HalfUpcastToFloat:
        return torch.float32
    return torch.float16


def writes(func, kwargs) -> bool:
    """Whether a call writes to a tensor (in place, ``out=``)."""
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or name.startswith("__i") or "out" in kwargs


def mixed_dtypes(values) -> set:
    """The float16/float32 dtypes among the tensors of more than 0
    dimensions in ``values``."""
    return {leaf.dtype for leaf in pytree.tree_leaves(values)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
            and leaf.dtype in MIXED}


class MixedPrecisionCasting(TorchFunctionMode):
    """Casts the float16/float32 tensors of mixed calls to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __enter__(self):
        self._checks = _mixed_recurrent_inputs()
        self._checks.__enter__()
        return super().__enter__()

    def __exit__(self, *exception):
        try:
            return super().__exit__(*exception)
        finally:
            self._checks.__exit__(*exception)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func not in LEFT_AS_THEY_ARE and not writes(func, kwargs)
                and mixed_dtypes((args, kwargs)) == MIXED):
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, self._cast, (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and tensor.dtype in MIXED:
            return tensor.to(self.dtype)
        return tensor


@contextlib.contextmanager
def _mixed_recurrent_inputs() -> Iterator[None]:
    """``RNNBase.check_input`` accepting a float16 input for float32
    weights and the reverse, as under autocast."""
    checked = torch.nn.RNNBase.check_input

    def check_input(layer, input, batch_sizes):
        if {input.dtype, layer._flat_weights[0].dtype} != MIXED:
            return checked(layer, input, batch_sizes)
        autocasting = torch._C._is_any_autocast_enabled
        torch._C._is_any_autocast_enabled = lambda: True
        try:
            return checked(layer, input, batch_sizes)
        finally:
            torch._C._is_any_autocast_enabled = autocasting

    torch.nn.RNNBase.check_input = check_input
    try:
        yield
    finally:
        torch.nn.RNNBase.check_input = checked
