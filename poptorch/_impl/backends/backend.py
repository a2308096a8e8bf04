"""The backend interface and the registry of backends by name."""
import abc
from typing import Callable, Dict, List, Sequence

import torch

from ...errors import Error

CompiledStep = Callable[..., Sequence[torch.Tensor]]


class Backend(abc.ABC):
    """Turns a captured graph into something the device loop can call."""

    name: str

    @abc.abstractmethod
    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor]) -> CompiledStep:
        """A callable taking the graph's flat inputs positionally."""


_BACKENDS: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise Error(f"Unknown backend {name!r}: available backends are "
                    f"{', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]
