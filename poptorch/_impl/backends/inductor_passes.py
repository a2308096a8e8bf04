"""Rewrites of a captured step that the "inductor" backend applies before
compiling it: each replaces a pattern Inductor's ``standalone_compile``
compiles wrongly (checked against the graph backend and PyTorch) with one
that computes the same values. Vectorised replicas make these patterns:
a tensor the model creates (``torch.zeros(3, 4)``) is the same for every
replica, and vmap expands it over the replicas instead of copying it.

The names of the passes are part of the executable cache key
(``InductorBackend.settings_fingerprint``), so that steps compiled before
a pass existed are not loaded.
"""
import torch

#: The passes, by name, in the order ``apply`` runs them (with the
#: backend's own lifting of constants into inputs, which comes first).
PASSES = ("constants as inputs", "dense templates of random operators",
          "dense destinations of puts")

_UNINITIALISED = (torch.ops.aten.empty.memory_format,
                  torch.ops.aten.empty_like.default,
                  torch.ops.aten.new_empty.default)


def apply(graph: torch.fx.GraphModule) -> None:
    """Rewrite ``graph`` in place."""
    _dense_templates_of_random_operators(graph)
    _dense_destinations_of_puts(graph)
    graph.graph.eliminate_dead_code()
    graph.recompile()


def _dense_templates_of_random_operators(graph: torch.fx.GraphModule
                                         ) -> None:
    """A random operator whose input is an uninitialised tensor expanded
    to its shape (vectorised replicas' dropout: ``bernoulli.p`` of a scalar
    ``empty`` expanded over the replicas) gets a dense uninitialised tensor
    of that shape instead, which holds values as undefined. From the
    expanded one, Inductor's step returned a dropout of all zeros (with
    gradient accumulation and replicas) where PyTorch draws a mask."""
    for node in _calls(graph):
        target = node.target
        if torch.Tag.nondeterministic_seeded not in target.tags or \
                not node.args or not _expanded_uninitialised(node.args[0]):
            continue
        value = node.args[0].meta["val"]
        with graph.graph.inserting_before(node):
            dense = graph.graph.call_function(
                torch.ops.aten.empty.memory_format, (list(value.shape),),
                {"dtype": value.dtype, "device": value.device})
        node.replace_input_with(node.args[0], dense)


#: Operators returning a copy of their first argument with values put in,
#: which Inductor writes into that argument's layout.
_PUTTING = (torch.ops.aten.index_put.default,
            torch.ops.aten.diagonal_scatter.default,
            torch.ops.aten.as_strided_scatter.default)


def _dense_destinations_of_puts(graph: torch.fx.GraphModule) -> None:
    """``index_put`` (or ``diagonal_scatter``) into a tensor with a
    broadcast dimension (vectorised replicas' ``torch.zeros(3,
    4).index_put(...)``: the zeros expanded over the replicas) puts into a
    dense copy of it. Into the expanded tensor, Inductor's step wrote every
    replica's values into the one memory they share, and each replica
    returned the sum of all replicas' results (``diagonal_scatter`` failed
    to compile)."""
    for node in _calls(graph):
        if node.target not in _PUTTING or not _broadcast(node.args[0]):
            continue
        with graph.graph.inserting_before(node):
            dense = graph.graph.call_function(
                torch.ops.aten.clone.default, (node.args[0],),
                {"memory_format": torch.contiguous_format})
        node.replace_input_with(node.args[0], dense)


def _calls(graph: torch.fx.GraphModule):
    return [node for node in graph.graph.nodes
            if node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)]


def _broadcast(value) -> bool:
    """Whether ``value`` is a tensor with a dimension of stride 0 over
    several elements."""
    tensor = value.meta.get("val") if isinstance(value, torch.fx.Node) \
        else None
    return isinstance(tensor, torch.Tensor) and any(
        stride == 0 and size > 1
        for size, stride in zip(tensor.shape, tensor.stride()))


def _expanded_uninitialised(value) -> bool:
    """Whether ``value`` is an ``expand`` of an uninitialised tensor."""
    if not isinstance(value, torch.fx.Node) or "val" not in value.meta or \
            value.target is not torch.ops.aten.expand.default:
        return False
    while value.target is torch.ops.aten.expand.default:
        value = value.args[0]
        if not isinstance(value, torch.fx.Node):
            return False
    return value.target in _UNINITIALISED
