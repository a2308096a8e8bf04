"""``torch.utils.checkpoint`` inside a captured training step.

The reentrant variant (``use_reentrant=True``, torch's default when the
argument is left out, which older Hugging Face and timm code calls)
recomputes only under an eager ``.backward()``, while the captured step
differentiates with ``torch.autograd.grad``: it runs as the non-reentrant
variant, which computes the same values and gradients. As in PyTorch, a
reentrant checkpoint none of whose tensor inputs requires a gradient gives
no gradient to what it computes (``_Reentrant``).

A checkpointed part of ``forward`` runs again in the backward pass, where
the autograd engine runs without the TorchFunctionModes of the forward pass
and outside the module calls that enabled automatic casting there: the
recomputation would skip the capture's casts and layer rewrites (half/float
casting, automatic casting, cumulative BatchNorm averages, recurrent
layers) and differ from the forward pass, which torch reports as
recomputed tensors with different metadata; and it would draw new random
numbers (a new dropout mask), where PyTorch restores the generator's state
(``preserve_rng_state=True``). ``with_modes`` makes each recomputation run
inside the capture's modes and the automatic-casting scopes that were open
when the checkpoint was called, drawing the random numbers the forward pass
drew, by wrapping the function torch hands to its recomputation
(``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, a
torch 2.13 internal; without it nothing is wrapped).
"""
import contextlib
from typing import Callable, Iterator, List

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .graph_writes import schema_arguments
from .precision import automatic_casting

_GENERATOR = "_checkpoint_without_reentrant_generator"


class _RandomDraws:
    """The random numbers a checkpointed function drew in the forward pass,
    drawn again, in the same order, by its recomputation: as PyTorch's
    ``preserve_rng_state=True`` does by restoring the generator's state, so
    that a recomputed dropout keeps the forward pass's mask (a captured
    graph holds no generator state to restore)."""

    def __init__(self) -> None:
        self.values: List[object] = []

    def recording(self) -> TorchDispatchMode:
        return _Draws(self.values, replay=False)

    def replaying(self) -> TorchDispatchMode:
        return _Draws(list(self.values), replay=True)


def _draws_random_numbers(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _Draws(TorchDispatchMode):
    """Records the results of random operations, or hands them back in the
    order recorded. An operation that writes tensors (``bernoulli_``,
    ``normal(..., out=)``, rrelu's noise) has what it wrote recorded and
    written again; its result is the written tensor it returns, or the
    recorded one."""

    def __init__(self, values: List[object], replay: bool) -> None:
        super().__init__()
        self._values = values
        self._replay = replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _draws_random_numbers(func):
            return func(*args, **kwargs)
        written = _written_tensors(func, args, kwargs)
        if self._replay and self._values:
            result, values = self._values.pop(0)
            for tensor, value in zip(written, values):
                tensor.copy_(value)
            return written[result] if isinstance(result, int) else result
        result = func(*args, **kwargs)
        if not self._replay:
            returned = next((index for index, tensor in enumerate(written)
                             if result is tensor), result)
            self._values.append(
                (returned, [tensor.clone() for tensor in written]))
        return result


def _written_tensors(func, args, kwargs) -> List[torch.Tensor]:
    """The tensor arguments the operator's schema marks as written
    (``Tensor(a!)``)."""
    return [value for argument, value
            in schema_arguments(func._schema, args, kwargs)
            if argument.alias_info is not None and argument.alias_info.is_write
            and isinstance(value, torch.Tensor)]


def _forward_recorded(inner, draws: _RandomDraws):
    """torch's checkpoint generator ``inner`` (pre-forward logic, the
    forward pass, post-forward logic) with the forward pass's random draws
    recorded."""
    value = next(inner)
    try:
        with draws.recording():
            yield value
    except BaseException as error:
        inner.throw(error)
        raise
    yield from inner


class _Reentrant:
    """Stands for ``torch.utils.checkpoint.CheckpointFunction`` during a
    capture: ``checkpoint(..., use_reentrant=True)`` calls its ``apply``."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        if not any(isinstance(arg, torch.Tensor) and arg.requires_grad
                   for arg in args):
            with torch.no_grad():
                return function(*args)
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False,
            preserve_rng_state=preserve_rng_state)


@contextlib.contextmanager
def with_modes(enter_modes: Callable[[], contextlib.ExitStack]
               ) -> Iterator[None]:
    """While the block runs, each checkpoint recomputation runs inside the
    modes that ``enter_modes()`` enters, and reentrant checkpoints run as
    non-reentrant ones."""
    original = getattr(torch_checkpoint, _GENERATOR, None)
    if original is None:
        yield
        return

    def generator(function, preserve_rng_state=True, *args, **kwargs):
        scopes = automatic_casting.current_scopes()
        draws = _RandomDraws()

        def recompute(*inputs, **keywords):
            with enter_modes(), automatic_casting.scopes_as(scopes), \
                    (draws.replaying() if preserve_rng_state
                     else contextlib.nullcontext()):
                return function(*inputs, **keywords)

        inner = original(recompute, preserve_rng_state, *args, **kwargs)
        return (_forward_recorded(inner, draws) if preserve_rng_state
                else inner)

    reentrant = torch_checkpoint.CheckpointFunction
    setattr(torch_checkpoint, _GENERATOR, generator)
    torch_checkpoint.CheckpointFunction = _Reentrant
    try:
        yield
    finally:
        setattr(torch_checkpoint, _GENERATOR, original)
        torch_checkpoint.CheckpointFunction = reentrant
