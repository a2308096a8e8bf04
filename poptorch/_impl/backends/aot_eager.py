"""The "aot_eager" backend: AOTAutograd's functionalization of the captured
graph, run by PyTorch's eager kernels, without Inductor.

It runs the same graph transformation the "inductor" backend compiles from
(in-place writes to inputs become functional updates copied back into the
inputs), in well under a second, so a difference between "graph" and
"inductor" can be narrowed down to functionalization or to Inductor's code
generation. It is for debugging, not speed. Its views become reshapes, as
the graph backend's do (``reshapes.py``).
"""
from typing import List, Optional

import torch

from .backend import Backend, CompiledStep, register
from .in_place import Donation
from .reshapes import reshape_views


def _run_graph(graph: torch.fx.GraphModule, example_inputs) -> CompiledStep:
    """The functionalized graph, its views made reshapes as the graph
    backend's are (``reshapes.py``)."""
    from functorch.compile import make_boxed_func
    reshape_views(graph.graph)
    graph.recompile()
    return make_boxed_func(graph.forward)


class AotEagerBackend(Backend):
    name = "aot_eager"

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor],
                donation: Optional[Donation] = None) -> CompiledStep:
        """Runs the functionalized graph as it is: ``donation`` is not
        used."""
        from torch._functorch.aot_autograd import aot_module_simplified
        return aot_module_simplified(graph, list(example_inputs),
                                     fw_compiler=_run_graph)


register(AotEagerBackend())
