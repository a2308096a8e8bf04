"""Arguments of an operation's vmap rule (vectorised replicas) with the
replica dimension first."""
from typing import Optional

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
