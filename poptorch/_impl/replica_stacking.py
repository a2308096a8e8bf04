"""Arguments of an operation's vmap rule (vectorised replicas) with the
replica dimension first."""
from typing import Callable, Optional

import torch
from torch import Tensor


def replicas_first(tensor: Optional[Tensor], dim: Optional[int],
                   replicas: int) -> Optional[Tensor]:
    """``tensor`` with its replica dimension ``dim`` first (expanded when
    the replicas share it: ``dim`` None); None stays None."""
    if tensor is None:
        return None
    if dim is None:
        return tensor.unsqueeze(0).expand(replicas, *tensor.shape)
    return tensor.movedim(dim, 0)


def _replica(value, dim, index: int):
    """Replica ``index`` of an argument batched along ``dim`` (lists of
    tensors with a list of dims; unbatched values as they are)."""
    if isinstance(value, (list, tuple)):
        dims = dim if isinstance(dim, (list, tuple)) else [dim] * len(value)
        return [_replica(item, item_dim, index)
                for item, item_dim in zip(value, dims)]
    if dim is None:
        return value
    return value.select(dim, index)


def per_replica_rule(op: Callable) -> Callable:
    """A vmap rule running ``op`` (which returns a list of tensors) once
    per replica and stacking its outputs along dimension 0."""
    def rule(info, in_dims, *args):
        results = [op(*(_replica(value, dim, index)
                        for value, dim in zip(args, in_dims)))
                   for index in range(info.batch_size)]
        stacked = [torch.stack(outputs) for outputs in zip(*results)]
        return stacked, [0] * len(stacked)
    return rule
