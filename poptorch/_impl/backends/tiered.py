"""The "auto" backend, the default: the graph backend's steps at once,
Inductor's once a model has run long enough (``tiering/``).

A backend alone compiles one graph; the tiers need the executable cache and
the model's calls, so the compile session hands the steps of an ``auto``
model to ``tiering.TieredCompilation``. Both tiers run the captured graph
that the graph backend wants (gradients summed into the device loop's
buffer), so a model can switch between calls.
"""
from typing import List, Optional

import torch

from .backend import Backend, CompiledStep, get_backend, register
from .in_place import Donation


class TieredBackend(Backend):
    name = "auto"
    key_name = "graph"      # its exported files hold the graph tier's graphs
    sums_gradients_in_buffer = True
    overwrites_donated_inputs = True

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor],
                donation: Optional[Donation] = None) -> CompiledStep:
        """The graph tier's step (the compile session adds the tier-up)."""
        return get_backend("graph").compile(graph, example_inputs, donation)


register(TieredBackend())
