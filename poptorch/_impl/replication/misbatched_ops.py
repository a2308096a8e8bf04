"""Operations whose gradients ``torch.func.vmap`` computes otherwise than
a replica run alone (torch 2.13), so the vectorised replica path would
train wrongly without a word:

* ``select_scatter``: the gradient of the scattered values is multiplied by
  the size of the scattered dimension;
* ``F.embedding`` with ``scale_grad_by_freq=True`` (``nn.Embedding``): the
  token frequencies that scale the weight's gradient are counted over all
  the replicas' micro-batches, not over each replica's own.

``refused_in_vmap`` makes such an operation on a batched tensor fail while
a training step is traced vectorised; the failure sends the model to the
sequential path (``replicas.py``), where each replica runs as the model
alone.
"""
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


#: Each misbatched operation: (when its gradient is wrong, what goes wrong).
_MISBATCHED = {
    torch.select_scatter: (_always, "select_scatter's gradient"),
    torch.Tensor.select_scatter: (_always, "select_scatter's gradient"),
    F.embedding: (_frequency_scaled,
                  "an embedding's scale_grad_by_freq frequencies"),
}


class _RefuseMisbatched(TorchFunctionMode):

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        misbatched = _MISBATCHED.get(func)
        if (misbatched is not None and misbatched[0](args, kwargs) and
                any(isinstance(arg, torch.Tensor) and is_batchedtensor(arg)
                    for arg in args)):
            raise Error(f"vmap computes {misbatched[1]} over the replicas "
                        "together")
        return func(*args, **kwargs)


def refused_in_vmap() -> TorchFunctionMode:
    """A context in which a misbatched operation on a batched tensor raises
    ``poptorch.Error``."""
    return _RefuseMisbatched()
