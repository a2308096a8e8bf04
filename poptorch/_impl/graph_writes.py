"""In-place writes in a captured (not functionalized) graph.

An operator writes a tensor when its schema marks the argument
``Tensor(a!)`` (``copy_``, ``add_``, ``index_put_``; ``x[2:5] = h`` is a
``copy_`` into a ``slice`` view), or when it is one of the batch
normalisation kernels, which update their running statistics without
saying so (``_UNDECLARED_WRITES``). Views and the results of in-place
operators alias their argument: every node is mapped to the node whose
storage it uses (its root), so that a write through any view is a write to
the root.

A value read after a write depends on what was written, which the graph's
edges do not show: ``buf = zeros(); buf[:, 4:12] = h; loss(buf)`` reads the
``zeros`` node, and ``h`` only reaches ``copy_``. ``DataFlow`` follows
those writes too.
"""
import operator
from typing import (AbstractSet, Callable, Dict, Iterable, Iterator, List,
                    Set, Tuple)

import torch

Node = torch.fx.Node

# Batch normalisation kernels update running_mean and running_var (argument
# positions 3 and 4) in place when ``training`` (position 5) is True, but
# their schemas do not declare the write.
_UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


def _undeclared_writes(node: Node) -> List[Node]:
    positions = _UNDECLARED_WRITES.get(node.target, ())
    if not positions or len(node.args) < 6 or node.args[5] is not True:
        return []
    return [node.args[p] for p in positions
            if isinstance(node.args[p], Node)]


def schema_arguments(schema, args, kwargs):
    """(argument schema, value) pairs of an operator call with ``args`` and
    ``kwargs`` (a graph node's, or a dispatched call's)."""
    for index, argument in enumerate(schema.arguments):
        if index < len(args):
            yield argument, args[index]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _nodes_in(value) -> List[Node]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, Node)]


def _operator_writes(node: Node) -> Iterator[Tuple[Node, bool, Set[str]]]:
    """(argument node, whether it is written, its alias set names) for the
    arguments of an operator node that its schema aliases."""
    for argument, value in schema_arguments(node.target._schema, node.args,
                                            node.kwargs):
        info = argument.alias_info
        if info is not None:
            for arg_node in _nodes_in(value):
                yield arg_node, info.is_write, set(info.before_set)


def roots_and_writes(graph: torch.fx.Graph
                     ) -> Tuple[Dict[Node, Node], Dict[Node, List[Node]]]:
    """(each node -> the node whose storage it uses, each root -> the
    nodes that write to it, directly or through a view)."""
    root: Dict[Node, Node] = {}
    writers: Dict[Node, List[Node]] = {}

    def root_of(node: Node) -> Node:
        return root.get(node, node)

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            if node.args[0] in root:
                root[node] = root[node.args[0]]
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        for written in _undeclared_writes(node):
            writers.setdefault(root_of(written), []).append(node)
        aliases = {}
        for arg_node, is_write, alias_set in _operator_writes(node):
            if is_write:
                writers.setdefault(root_of(arg_node), []).append(node)
            aliases.update(dict.fromkeys(alias_set, root_of(arg_node)))
        for returned in node.target._schema.returns:
            if returned.alias_info is not None:
                for alias in returned.alias_info.before_set:
                    if alias in aliases:
                        root[node] = aliases[alias]
    return root, writers


def written_placeholders(graph: torch.fx.Graph) -> List[int]:
    """Indices of the inputs the graph writes to, directly or through
    views."""
    return DataFlow(graph).written_placeholders()


def reachable(node: Node, neighbours: Callable[[Node], Iterable[Node]],
              blocked: AbstractSet[Node] = frozenset()) -> Set[Node]:
    """Nodes reachable from ``node`` through ``neighbours(node)``, not
    going through ``blocked`` nodes."""
    seen, todo = set(), [node]
    while todo:
        for other in neighbours(todo.pop()):
            if other not in seen:
                seen.add(other)
                if other not in blocked:
                    todo.append(other)
    return seen


class DataFlow:
    """What each node of a graph depends on and feeds, through its edges
    and through the in-place writes to the tensors it reads (a write
    counts for the reads that follow it)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self._order = {node: index for index, node in enumerate(graph.nodes)}
        self._root, self._writers = roots_and_writes(graph)
        self._aliases: Dict[Node, List[Node]] = {}
        for node, root in self._root.items():
            self._aliases.setdefault(root, []).append(node)
        self._written: Dict[Node, List[Node]] = {}
        for root, writers in self._writers.items():
            for writer in writers:
                self._written.setdefault(writer, []).append(root)

    def inputs(self, node: Node) -> List[Node]:
        """``node``'s inputs and the earlier writes to the tensors they are
        or view."""
        inputs = node.all_input_nodes
        earlier = [writer for read in inputs
                   for writer in self._writers.get(self._root.get(read, read),
                                                   [])
                   if self._order[writer] < self._order[node]]
        return [*inputs, *earlier]

    def users(self, node: Node) -> List[Node]:
        """``node``'s users and, when it writes a tensor, the later readers
        of that tensor and its views."""
        fed = list(node.users)
        for root in self._written.get(node, []):
            fed += [user for alias in (root, *self._aliases.get(root, []))
                    for user in alias.users
                    if self._order[user] > self._order[node]]
        return fed

    def written_placeholders(self) -> List[int]:
        """Indices of the inputs the graph writes to, directly or through
        views."""
        return [index for index, node in enumerate(self._placeholders)
                if node in self._writers]

    def stored_outputs(self, outputs: List[Node]) -> List[int]:
        """Positions of the ``outputs`` nodes that are an input or a
        constant of the graph, or a view of one: the graph hands back that
        tensor itself, not a result of its own."""
        return [index for index, node in enumerate(outputs)
                if isinstance(node, Node) and self._root.get(node, node).op
                in ("placeholder", "get_attr")]

    def ancestors(self, node: Node,
                  blocked: AbstractSet[Node] = frozenset()) -> Set[Node]:
        return reachable(node, self.inputs, blocked)

    def descendants(self, node: Node) -> Set[Node]:
        return reachable(node, self.users)
