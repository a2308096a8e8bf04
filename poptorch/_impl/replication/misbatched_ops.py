"""Operations that ``torch.func.vmap`` computes otherwise than a replica run
alone (torch 2.13), so the vectorised replica path would give wrong results
without a word:

* ``select_scatter``: the gradient of the scattered values is multiplied by
  the size of the scattered dimension;
* ``F.embedding`` with ``scale_grad_by_freq=True`` (``nn.Embedding``): the
  token frequencies that scale the weight's gradient are counted over all
  the replicas' micro-batches, not over each replica's own;
* ``x[:, index] = value`` (``Tensor.__setitem__``, also ``index_put``)
  where a per-replica index tensor follows a slice, ``...`` or ``None``
  (a MoCo queue written at a pointer buffer): the batching rule places the
  indexed dimension wrongly, so the values land transposed or the write
  fails when the step runs.

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


def _frequency_scaled(args, kwargs) -> bool:
    return bool(kwargs.get("scale_grad_by_freq")
                or (len(args) > 5 and args[5]))


def _batched(value) -> bool:
    return isinstance(value, torch.Tensor) and is_batchedtensor(value)


def _batched_index_after_slice(args, kwargs) -> bool:
    """Whether the index (``args[1]`` of ``__setitem__`` and ``index_put``)
    holds a batched tensor after a slice, ``...`` or ``None``."""
    index = args[1] if len(args) > 1 else kwargs.get("indices")
    if not isinstance(index, (tuple, list)):
        return False
    sliced = False
    for item in index:
        if item is None or item is Ellipsis or isinstance(item, slice):
            sliced = True
        elif sliced and _batched(item):
            return True
    return False


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
    _batched_index_after_slice, "places the dimensions of x[:, index] = "
    "value wrongly when the index differs between replicas", True)

_MISBATCHED = {
    torch.select_scatter: _GRADIENT_OF_SELECT_SCATTER,
    torch.Tensor.select_scatter: _GRADIENT_OF_SELECT_SCATTER,
    F.embedding: _Misbatched(
        _frequency_scaled, "counts an embedding's scale_grad_by_freq "
        "frequencies over the replicas together", False),
    torch.Tensor.__setitem__: _WRITE_AT_INDEX,
    torch.Tensor.index_put_: _WRITE_AT_INDEX,
    torch.Tensor.index_put: _WRITE_AT_INDEX,
    torch.index_put: _WRITE_AT_INDEX,
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
