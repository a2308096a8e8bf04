"""Operations that ``torch.func.vmap`` computes otherwise than a replica run
alone (torch 2.13), so the vectorised replica path would give wrong results
without a word:

* ``select_scatter``: the gradient of the scattered values is multiplied by
  the size of the scattered dimension;
* ``F.embedding`` with ``scale_grad_by_freq=True`` (``nn.Embedding``): the
  token frequencies that scale the weight's gradient are counted over all
  the replicas' micro-batches, not over each replica's own; with a
  ``padding_idx`` and a per-replica weight (computed from the data, or
  grouped), the weight's gradient is wrong;
* ``x[:, index] = value`` (``Tensor.__setitem__``, also ``index_put``)
  where a per-replica index tensor follows a slice, ``...`` or ``None``
  (a MoCo queue written at a pointer buffer), or where index tensors are
  separated by one (``x[a, :, b] = value``) on a per-replica ``x``: the
  batching rule places the indexed dimensions wrongly, so the values land
  transposed or the write fails when the step runs;
* ``index_fill`` with a per-replica tensor as the value, or a per-replica
  index: the values (and the value's gradient) are wrong.

``refused_in_vmap`` makes such an operation on a batched tensor fail while
a step is traced vectorised; the failure sends the model to the sequential
path (``replicas.py``), where each replica runs as the model alone.
"""
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch._C._functorch import is_batchedtensor
from torch.overrides import TorchFunctionMode

from ...errors import Error


def _always(args, kwargs) -> bool:
    return True


def _argument(args, kwargs, position: int, name: str, default=None):
    return args[position] if len(args) > position else kwargs.get(name,
                                                                  default)


def _misbatched_embedding(args, kwargs) -> bool:
    """scale_grad_by_freq, or a padding index with a per-replica weight."""
    return bool(_argument(args, kwargs, 5, "scale_grad_by_freq")) or (
        _argument(args, kwargs, 2, "padding_idx") is not None
        and _batched(_argument(args, kwargs, 1, "weight")))


def _batched(value) -> bool:
    return isinstance(value, torch.Tensor) and is_batchedtensor(value)


def _misplaced_index(args, kwargs) -> bool:
    """Whether the index (``args[1]`` of ``__setitem__`` and ``index_put``)
    holds a batched tensor after a slice, ``...`` or ``None``, or index
    tensors separated by one (on a batched tensor: the caller checks)."""
    index = _argument(args, kwargs, 1, "indices")
    if not isinstance(index, (tuple, list)):
        return False
    indexed = sliced = indexed_before_slice = False
    for item in index:
        if item is None or item is Ellipsis or isinstance(item, slice):
            sliced = True
            indexed_before_slice = indexed
        elif isinstance(item, torch.Tensor):
            if sliced and (_batched(item) or indexed_before_slice):
                return True
            indexed = True
    return False


def _batched_fill(args, kwargs) -> bool:
    """``index_fill(dim, index, value)`` with a per-replica index or value
    tensor."""
    return (_batched(_argument(args, kwargs, 2, "index"))
            or _batched(_argument(args, kwargs, 3, "value")))


@dataclasses.dataclass(frozen=True)
class _Misbatched:
    #: Whether the operation's arguments make vmap compute it wrongly.
    applies: Callable
    #: What vmap gets wrong, for the message.
    what: str
    #: Whether the forward values are wrong (else only the gradients).
    in_forward: bool


_GRADIENT_OF_SELECT_SCATTER = _Misbatched(
    _always, "computes select_scatter's gradient over the replicas "
    "together", False)
_WRITE_AT_INDEX = _Misbatched(
    _misplaced_index, "places the dimensions of x[..., index] = value "
    "wrongly when the index follows a slice and differs between replicas, "
    "or when index tensors are separated by a slice", True)
_FILL_AT_INDEX = _Misbatched(
    _batched_fill, "computes index_fill with a per-replica index or value "
    "wrongly", True)

_MISBATCHED = {
    torch.select_scatter: _GRADIENT_OF_SELECT_SCATTER,
    torch.Tensor.select_scatter: _GRADIENT_OF_SELECT_SCATTER,
    F.embedding: _Misbatched(
        _misbatched_embedding, "computes an embedding's weight gradient "
        "wrongly (scale_grad_by_freq frequencies counted over the replicas "
        "together, or a padding index with a per-replica weight)", False),
    torch.Tensor.__setitem__: _WRITE_AT_INDEX,
    torch.Tensor.index_put_: _WRITE_AT_INDEX,
    torch.Tensor.index_put: _WRITE_AT_INDEX,
    torch.index_put: _WRITE_AT_INDEX,
    torch.Tensor.index_fill: _FILL_AT_INDEX,
    torch.Tensor.index_fill_: _FILL_AT_INDEX,
    torch.index_fill: _FILL_AT_INDEX,
}


class _RefuseMisbatched(TorchFunctionMode):

    def __init__(self, training: bool) -> None:
        super().__init__()
        self._training = training

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        misbatched = _MISBATCHED.get(func)
        if (misbatched is not None
                and (self._training or misbatched.in_forward)
                and any(_batched(arg) for arg in args)
                and misbatched.applies(args, kwargs)):
            raise Error(f"vmap {misbatched.what}")
        return func(*args, **kwargs)


def refused_in_vmap(training: bool) -> TorchFunctionMode:
    """A context in which an operation vmap computes wrongly on a batched
    tensor raises ``poptorch.Error``: in a training step those whose values
    or gradients are wrong, in an inference step those whose values are."""
    return _RefuseMisbatched(training)
