"""The "graph" backend: run the captured FX graph directly.

Nothing is compiled, so it costs nothing before the first step; each step
dispatches the graph's tensor operations from the code FX generated for it,
without autograd, module hooks or optimizer bookkeeping. Rewrites of a
copy of the graph make it move as little memory as torch's eager training
loop: gradients are added to the running gradient sum as soon as they are
computed (``accumulation.py``), linear layers traced under vmap get their
bias added by the matrix product again (``linear_layers.py``), the
optimizer's scaled additions run as one operation each
(``scaled_addition.py``), max pools on the CPU use the vectorised
channels-last kernel (``pooling.py``), and elementwise operations whose
first operand is dead afterwards (a tensor the step made, or an input the
caller donates: the parameters and optimizer state a training step
replaces) run in place (``in_place.py``). Views become reshapes, which
tolerate the layouts tensors have at run time where PyTorch's prediction
at capture differs (``reshapes.py``).
"""
from typing import List, Optional

import torch

from .accumulation import accumulate_where_computed
from .backend import Backend, CompiledStep, register
from .in_place import Donation, reuse_dead_tensors
from .linear_layers import fuse_linear_layers
from .pooling import pool_channels_last
from .reshapes import reshape_views
from .scaled_addition import fuse_scaled_additions


class GraphBackend(Backend):
    name = "graph"
    #: New tensors as large as the weights cost page faults on every step;
    #: products added into the reused buffer (``accumulation.py``) do not.
    sums_gradients_in_buffer = True
    overwrites_donated_inputs = True

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor],
                donation: Optional[Donation] = None) -> CompiledStep:
        rewritten = torch.fx.Graph()
        rewritten.output(rewritten.graph_copy(graph.graph, {}))
        accumulate_where_computed(rewritten)
        fuse_linear_layers(rewritten)
        fuse_scaled_additions(rewritten)
        pool_channels_last(rewritten)
        reshape_views(rewritten)
        reuse_dead_tensors(rewritten, donation or Donation({}))
        # The generated code itself: a call of the module would run the
        # user's global module hooks (register_module_forward_hook) on it.
        return torch.fx.GraphModule(graph, rewritten).forward


register(GraphBackend())
