"""``torch.utils.checkpoint`` (non-reentrant) inside a captured training
step.

A checkpointed part of ``forward`` runs again in the backward pass, where
the autograd engine runs without the TorchFunctionModes of the forward pass
and outside the module calls that enabled automatic casting there: the
recomputation would skip the capture's casts and layer rewrites (half/float
casting, automatic casting, cumulative BatchNorm averages, recurrent
layers) and differ from the forward pass, which torch reports as
recomputed tensors with different metadata. ``with_modes`` makes each
recomputation run inside the capture's modes and the automatic-casting
scopes that were open when the checkpoint was called, by wrapping the
function torch hands to its recomputation
(``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, a
torch 2.13 internal; without it nothing is wrapped).
"""
import contextlib
from typing import Callable, Iterator

import torch.utils.checkpoint as torch_checkpoint

from .precision import automatic_casting

_GENERATOR = "_checkpoint_without_reentrant_generator"


@contextlib.contextmanager
def with_modes(enter_modes: Callable[[], contextlib.ExitStack]
               ) -> Iterator[None]:
    """While the block runs, each checkpoint recomputation runs inside the
    modes that ``enter_modes()`` enters."""
    original = getattr(torch_checkpoint, _GENERATOR, None)
    if original is None:
        yield
        return

    def generator(function, *args, **kwargs):
        scopes = automatic_casting.current_scopes()

        def recompute(*inputs, **keywords):
            with enter_modes(), automatic_casting.scopes_as(scopes):
                return function(*inputs, **keywords)

        return original(recompute, *args, **kwargs)

    setattr(torch_checkpoint, _GENERATOR, generator)
    try:
        yield
    finally:
        setattr(torch_checkpoint, _GENERATOR, original)
