"""Backends run captured graphs. Each one turns an FX graph over flat tensor
inputs into a callable returning the flat outputs; the device loop does not
know which backend it calls.

* ``auto`` (the default) starts on ``graph`` and moves to ``inductor``
  once a model has run long enough (``tiered.py``, ``../tiering/``);
* ``graph`` runs the captured graph as it is (no compile time);
* ``inductor`` compiles it with TorchInductor;
* ``aot_eager`` runs AOTAutograd's functionalized graph (debugging).

``selection`` picks one per model; ``cuda_graphs`` replays a whole call as
one CUDA graph on CUDA devices.
"""
from . import aot_eager, graph, inductor, tiered  # noqa: F401  (register)
from .backend import Backend, get_backend
from .selection import select_backend

__all__ = ["Backend", "get_backend", "select_backend"]
