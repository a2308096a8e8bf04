"""Sparse gradients requested by an operation: embedding layers created
with ``sparse=True`` (``torch.nn.Embedding``, ``torch.nn.EmbeddingBag``),
and ``F.embedding(..., sparse=True)``, ``F.embedding_bag(..., sparse=True)``
and ``torch.gather(..., sparse_grad=True)`` called directly.

Sparse gradients cannot enter a captured training step: the step keeps
each gradient in a dense buffer and the optimizer rules are dense tensor
operations (IPUs have no sparse gradients either). While a model is
captured these operations run with the flag off (``DenseGradients``), so
their gradient is the equal dense tensor, with zero rows where no index
points; the modules keep their own setting. The numerics are those of
dense gradients: for plain SGD the same update as PyTorch's sparse one;
optimizers that treat absent rows differently from zero rows (momentum,
weight decay) update every row, as with ``sparse=False``.
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .logger import info_once

#: Each operation taking a sparse-gradient flag: (the flag's keyword, its
#: position among the arguments).
_SPARSE_FLAGS = {
    F.embedding: ("sparse", 6),
    F.embedding_bag: ("sparse", 7),
    torch.gather: ("sparse_grad", 3),
    torch.Tensor.gather: ("sparse_grad", 3),
}


class DenseGradients(TorchFunctionMode):
    """Operations asked for sparse gradients compute dense ones."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flag = _SPARSE_FLAGS.get(func)
        if flag is not None:
            args, kwargs = _flag_off(flag, list(args), dict(kwargs))
        return func(*args, **kwargs)


def _flag_off(flag, args: list, kwargs: dict):
    keyword, position = flag
    if kwargs.get(keyword) or (len(args) > position and args[position]):
        info_once("Operations asked for sparse gradients (sparse=True, "
                  "sparse_grad=True) compute dense gradients in a captured "
                  "training step (sparse_gradients.py)")
        if keyword in kwargs:
            kwargs[keyword] = False
        else:
            args[position] = False
    return tuple(args), kwargs
