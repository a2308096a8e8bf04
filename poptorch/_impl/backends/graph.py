"""The "graph" backend: run the captured FX graph directly.

Nothing is compiled, so it costs nothing before the first step; each step
dispatches the graph's tensor operations from the code FX generated for it,
without autograd, module hooks or optimizer bookkeeping.
"""
from typing import List

import torch

from .backend import Backend, CompiledStep, register


class GraphBackend(Backend):
    name = "graph"

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor]) -> CompiledStep:
        return graph


register(GraphBackend())
