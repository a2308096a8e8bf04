"""Which backend runs a model's captured steps.

``Options.setBackend(name)`` chooses one, else the ``POPTORCH_BACKEND``
environment variable, else ``"auto"``, on every device: the "graph"
backend's steps, which start at once, then Inductor's, compiled in the
background once the model has run long enough (``tiered.py``). "graph" and
"inductor" may still be forced.
"""
import os
from typing import Optional

from ...errors import Error
from .backend import Backend, backend_names, get_backend

AUTO = "auto"
ENVIRONMENT_VARIABLE = "POPTORCH_BACKEND"


def backend_choices():
    """The names ``setBackend`` and ``POPTORCH_BACKEND`` accept, the
    default first."""
    return (AUTO, *[name for name in backend_names() if name != AUTO])


def requested_backend(explicit: Optional[str]) -> str:
    """The backend name set by ``setBackend``, else by the environment."""
    if explicit is not None:
        return explicit
    return os.environ.get(ENVIRONMENT_VARIABLE) or AUTO


def select_backend(requested: str, source: str = "setBackend") -> Backend:
    """The backend named ``requested``; ``source`` names where the name
    came from for the error message."""
    if requested not in backend_choices():
        raise Error(f"{source}: unknown backend {requested!r}; allowed: "
                    f"{', '.join(repr(c) for c in backend_choices())}")
    return get_backend(requested)
