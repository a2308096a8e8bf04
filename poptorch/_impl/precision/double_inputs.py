"""float64 arguments. IPUs have no 64-bit floating point, and PopTorch
converted float64 tensors given to a model to float32, so PopTorch programs
pass them freely (a numpy float64 dataset made into tensors). Here they are
converted to float32 too, logged once, unless the model itself holds
float64 parameters: a float64 model runs in float64, as in PyTorch."""
from typing import Callable, List

import torch

from ..logger import warn_once
from ..weight_sync import host_reads_suspended


def as_float32(leaves: List, paths: Callable[[], List[str]],
               forward: Callable) -> List:
    """``leaves`` (one call's flattened arguments) with float64 tensors
    converted to float32, unless the module of ``forward`` has float64
    parameters; ``paths()`` names the leaves for the log."""
    doubles = [position for position, leaf in enumerate(leaves)
               if isinstance(leaf, torch.Tensor)
               and leaf.dtype == torch.float64]
    if not doubles or _has_float64_parameters(forward):
        return leaves
    warn_once(
        f"Argument '{paths()[doubles[0]]}' is a float64 tensor: it is "
        "converted to float32, as PopTorch converts 64-bit floating-point "
        "inputs (IPUs have none), and so are other float64 arguments. Pass "
        "float32 tensors to avoid the conversion.")
    return [leaf.float() if position in doubles else leaf
            for position, leaf in enumerate(leaves)]


def _has_float64_parameters(forward: Callable) -> bool:
    module = getattr(forward, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return False
    with host_reads_suspended():
        return any(param.dtype == torch.float64
                   for param in module.parameters())
