"""Backends run captured graphs. Each one turns an FX graph over flat tensor
inputs into a callable returning the flat outputs; the device loop does not
know which backend it calls."""
from . import graph  # noqa: F401  (registers the backend)
from .backend import Backend, get_backend

__all__ = ["Backend", "get_backend"]
