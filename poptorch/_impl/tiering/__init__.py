"""Tiered compilation for the ``auto`` backend: the graph tier at once,
Inductor's steps compiled in another process once a model has run long
enough to repay it (``threshold.py``, ``tier_up.py``, ``background.py``,
``worker.py``)."""
from .tier_up import TieredCompilation, TieredStep

__all__ = ["TieredCompilation", "TieredStep"]
