"""The backend interface and the registry of backends by name."""
import abc
import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from ...errors import Error
from .in_place import Donation

CompiledStep = Callable[..., Sequence[torch.Tensor]]


class Backend(abc.ABC):
    """Turns a captured graph into something the device loop can call.

    A backend whose compilation is worth keeping (``keeps_executables``)
    can also turn a compiled step into bytes and back: the executable cache
    and exported files store those bytes so that a later process skips the
    compilation.
    """

    name: str
    #: The name executable keys hold: backends whose steps are the same
    #: compiled graphs share keys (and exported files).
    @property
    def key_name(self) -> str:
        return self.name

    keeps_executables: bool = False
    #: Whether a training step of one micro-batch should still add its
    #: gradients into the running gradient buffer that the device loop
    #: keeps (zeroed for each step) rather than make new gradient tensors.
    sums_gradients_in_buffer: bool = False
    #: Whether compiled steps overwrite the inputs the caller donates
    #: (``donation``) rather than leave every input as it was.
    overwrites_donated_inputs: bool = False

    @abc.abstractmethod
    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor],
                donation: Optional[Donation] = None) -> CompiledStep:
        """A callable taking the graph's flat inputs positionally.
        ``donation`` names the inputs whose old values the caller drops
        after a call (``in_place.py``); a backend may overwrite them."""

    def settings_fingerprint(self) -> str:
        """What else decides the executables this backend makes (its own
        configuration in this process), as text; the executable cache keeps
        an entry per value."""
        return ""

    def serialize(self, step: CompiledStep,
                  portable: bool = False) -> Optional[bytes]:
        """The compiled step as bytes, or None when there is nothing worth
        keeping beyond the graph itself. ``portable`` bytes also hold what
        the backend keeps in its own cache (compiled kernels), for another
        machine."""
        return None

    def deserialize(self, data: bytes) -> CompiledStep:
        """A compiled step from the bytes ``serialize`` gave."""
        raise Error(f"The {self.name!r} backend keeps no compiled "
                    "executables")

    def storage(self, directory: Optional[str]) -> ContextManager[None]:
        """Compile and load inside this scope to keep the backend's own
        on-disk files (compiled kernels) in ``directory``."""
        return contextlib.nullcontext()


_BACKENDS: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def backend_names() -> List[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise Error(f"Unknown backend {name!r}: available backends are "
                    f"{', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]
