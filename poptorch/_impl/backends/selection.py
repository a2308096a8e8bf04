"""Which backend runs a model's captured steps.

``Options.setBackend(name)`` chooses one, else the ``POPTORCH_BACKEND``
environment variable, else ``"auto"``: the default of the device type the
model runs on, chosen from ``benchmarks/compiled.py`` (README,
"Performance"). The "graph" backend is the default on every device: it
starts at once and is faster than the eager PyTorch loop; "inductor" is
faster per step on larger models but compiles for seconds to tens of
seconds, so it is asked for explicitly.
"""
import os
from typing import Optional

import torch

from ...errors import Error
from .backend import Backend, backend_names, get_backend

AUTO = "auto"
ENVIRONMENT_VARIABLE = "POPTORCH_BACKEND"

#: Backend used by "auto" on each device type.
DEFAULT_BACKENDS = {"cpu": "graph", "cuda": "graph"}


def backend_choices():
    """The names ``setBackend`` and ``POPTORCH_BACKEND`` accept."""
    return (AUTO, *backend_names())


def requested_backend(explicit: Optional[str]) -> str:
    """The backend name set by ``setBackend``, else by the environment."""
    if explicit is not None:
        return explicit
    return os.environ.get(ENVIRONMENT_VARIABLE) or AUTO


def select_backend(requested: str, device: torch.device,
                   source: str = "setBackend") -> Backend:
    """The backend for a model on ``device``; ``source`` names where the
    name came from for the error message."""
    if requested not in backend_choices():
        raise Error(f"{source}: unknown backend {requested!r}; allowed: "
                    f"{', '.join(repr(c) for c in backend_choices())}")
    if requested == AUTO:
        requested = DEFAULT_BACKENDS.get(device.type, "graph")
    return get_backend(requested)
