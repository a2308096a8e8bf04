"""``torch.no_grad()`` inside the forward pass of a multi-stage model.

A multi-stage model's forward graph is captured alone and its stages run
under autograd, which would differentiate every operation of the graph:
one the user's ``forward`` ran under ``torch.no_grad()`` (a distillation
teacher, an EMA of a buffer, a momentum encoder's update) would then take
part in the backward pass and train what PyTorch leaves alone.
``marked`` tags each operation traced while gradients are off;
``detach_inputs`` then reads each tagged operation's tensor inputs through
``detach``, so that autograd records none of them, as under ``no_grad``.

Batch normalisation's kernel updates its running statistics without
gradients, and autograd refuses them as differentiable inputs: a layer run
in two stages gets them from the stage before as an activation, which the
stage must pass to the kernel detached (``statistics_inputs``).
"""
import contextlib
from typing import Iterator, List, Set

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode

NO_GRAD_KEY = "poptorch_no_grad"


class _MarkNoGrad(TorchDispatchMode):

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.is_grad_enabled():
            return func(*args, **(kwargs or {}))
        with fx_traceback.annotate({NO_GRAD_KEY: True}):
            return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """Inside a capture: the operations traced while gradients are off
    carry ``NO_GRAD_KEY``. Gradients are on around the traced code, which
    decides itself where they are off."""
    with torch.enable_grad(), _MarkNoGrad():
        yield


_RUNNING_STATISTICS = ("running_mean", "running_var")


def detach_inputs(graph: fx.Graph) -> None:
    """Make each operation tagged ``NO_GRAD_KEY`` read its tensor inputs
    through ``detach`` (placed before the operation, in its block)."""
    for node in list(graph.nodes):
        if (node.meta.get("custom") or {}).get(NO_GRAD_KEY):
            _detach(graph, node)


def statistics_inputs(graph: fx.Graph) -> Set[int]:
    """The positions of the graph's inputs that a batch normalisation reads
    as running statistics."""
    position = {node: index for index, node in enumerate(
        node for node in graph.nodes if node.op == "placeholder")}
    return {position[value] for node in graph.nodes
            for value in _running_statistics(node) if value in position}


def _running_statistics(node: fx.Node) -> List[fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    return [value for argument, value in zip(schema.arguments, node.args)
            if argument.name in _RUNNING_STATISTICS
            and isinstance(value, fx.Node)]


def _detach(graph: fx.Graph, node: fx.Node) -> None:
    replaced = {}
    for source in node.all_input_nodes:
        if isinstance(source.meta.get("val"), torch.Tensor):
            with graph.inserting_before(node):
                detached = graph.call_function(torch.ops.aten.detach.default,
                                               (source,))
            detached.meta = {key: node.meta[key] for key in ("custom",)
                             if key in node.meta}
            detached.meta["val"] = source.meta["val"]
            replaced[source] = detached
    if replaced:
        node.args = fx.map_arg(node.args, lambda n: replaced.get(n, n))
        node.kwargs = fx.map_arg(node.kwargs, lambda n: replaced.get(n, n))
