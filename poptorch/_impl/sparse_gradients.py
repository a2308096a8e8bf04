"""Embedding layers created with ``sparse=True`` (``torch.nn.Embedding``,
``torch.nn.EmbeddingBag``).

Their sparse gradients cannot enter a captured training step: the step
keeps each gradient in a dense buffer and the optimizer rules are dense
tensor operations (IPUs have no sparse gradients either). While a model is
captured these layers run with ``sparse=False``, so their weight gradient
is the equal dense tensor, with zero rows where no index points; the
module's own setting is restored after the capture. The numerics are those
of dense gradients: for plain SGD the same update as PyTorch's sparse one;
optimizers that treat absent rows differently from zero rows (momentum,
weight decay) update every row, as with ``sparse=False``.
"""
from typing import Iterable

import torch

from .logger import info_once

_SPARSE_LAYERS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def use_dense_gradients(modules: Iterable[torch.nn.Module]) -> None:
    """Set ``sparse=False`` on the embedding layers among ``modules`` (the
    capture restores their attributes afterwards)."""
    for module in modules:
        if isinstance(module, _SPARSE_LAYERS) and module.sparse:
            info_once("Embedding layers with sparse=True compute dense "
                      "gradients in a captured training step "
                      "(sparse_gradients.py)")
            module.sparse = False
