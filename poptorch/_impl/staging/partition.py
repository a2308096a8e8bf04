"""Cutting a captured forward graph into consecutive parts: the stages of a
multi-stage model and, inside a stage, the segments between recomputation
checkpoints.

Each node is given a part; a part may use values of earlier parts but never
of later ones. Part ``k`` is a graph of

    (carried values from earlier parts..., source placeholders it uses...)
        -> (values later parts use..., [the source graph's outputs])

where only the last part returns the source graph's outputs. A value needed
two parts later is passed through the part between, so each part only talks
to the next one, as pipeline stages do. Placeholders (parameters, buffers,
the micro-batch) and constants are not carried: every part reads the ones it
uses directly.
"""
import dataclasses
import operator
from typing import Callable, Dict, List, Optional

import torch.fx as fx

from ...errors import Error

_COMPUTE = ("call_function", "call_method", "call_module")


@dataclasses.dataclass
class Part:
    """One part of a partitioned graph."""
    module: fx.GraphModule
    sources: List[int]          # source placeholder indices, in input order
    carried_out: int            # number of values for the next part
    own_outputs: List[int]      # source outputs returned after them


def placeholders(graph: fx.Graph) -> List[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_values(graph: fx.Graph) -> List[fx.Node]:
    output = next(n for n in graph.nodes if n.op == "output")
    values = output.args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def assign_parts(graph: fx.Graph,
                 given: Callable[[fx.Node], Optional[int]],
                 describe: Callable[[int], str]) -> Dict[fx.Node, int]:
    """The part of each compute node: ``given(node)`` where it says, else the
    earliest part among the node's users (part 0 when it has none).

    Raises ``poptorch.Error`` when a node would use a value of a later part:
    parts run in order, so a part can only read what earlier ones made.
    """
    parts: Dict[fx.Node, int] = {}
    for node in reversed(list(graph.nodes)):
        if node.op not in _COMPUTE:
            continue
        part = given(node)
        if part is None:
            users = [parts[u] for u in node.users if u in parts]
            part = min(users) if users else 0
        parts[node] = part
    for node in graph.nodes:
        if node.op in _COMPUTE and node.target is operator.getitem \
                and node.args[0] in parts:
            parts[node] = parts[node.args[0]]
    for node in graph.nodes:
        for source in node.all_input_nodes:
            if node in parts and source in parts and \
                    parts[source] > parts[node]:
                raise Error(
                    f"{describe(parts[node])} uses a value computed in "
                    f"{describe(parts[source])}, which runs after it "
                    f"({_where(node)}). Blocks must be placed so that each "
                    "stage only uses values of the stages before it.")
    return parts


def _where(node: fx.Node) -> str:
    stack = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in stack.splitlines()
              if line.strip().startswith("File ")]
    return frames[-1] if frames else f"operation {node.name}"


def split(module: fx.GraphModule, parts: Dict[fx.Node, int], count: int,
          output_parts: Optional[List[int]] = None) -> List[Part]:
    """Cut ``module`` into ``count`` parts (see the module docstring).

    ``output_parts[i]`` is the part that returns the source graph's output
    ``i`` (the last part by default); a part returns its values for the next
    part first, then its outputs."""
    graph = module.graph
    outputs = output_values(graph)
    if output_parts is None:
        output_parts = [count - 1] * len(outputs)
    sources = {node: i for i, node in enumerate(placeholders(graph))}
    last_use = _last_use(graph, parts, outputs, output_parts)
    result, carried = [], []
    for index in range(count):
        members = [n for n in graph.nodes if parts.get(n) == index]
        later = [n for n in list(carried) + members
                 if n.op in _COMPUTE and last_use.get(n, -1) > index]
        own = [i for i, part in enumerate(output_parts) if part == index]
        result.append(_build_part(module, sources, carried, members,
                                  later, outputs, own))
        carried = later
    return result


def _last_use(graph: fx.Graph, parts: Dict[fx.Node, int],
              outputs: List, output_parts: List[int]) -> Dict[fx.Node, int]:
    """The last part reading each computed value (an output is read by the
    part that returns it)."""
    last: Dict[fx.Node, int] = {}
    reads = [(parts.get(node), node.all_input_nodes) for node in graph.nodes]
    reads += [(part, [value]) for part, value in zip(output_parts, outputs)
              if isinstance(value, fx.Node)]
    for reader, sources in reads:
        if reader is None:
            continue
        for source in sources:
            last[source] = max(last.get(source, -1), reader)
    return last


def _build_part(module: fx.GraphModule, sources: Dict[fx.Node, int],
                carried: List[fx.Node], members: List[fx.Node],
                later: List[fx.Node], outputs: List,
                own: List[int]) -> Part:
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for node in carried:
        env[node] = graph.placeholder(f"carried_{node.name}")
        env[node].meta = dict(node.meta)
    used = {s for n in members for s in n.all_input_nodes if s in sources}
    returned = later + [outputs[i] for i in own]
    used |= {o for o in returned if isinstance(o, fx.Node) and o in sources}
    used = sorted(used, key=sources.__getitem__)
    for node in used:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in members:
        for source in node.all_input_nodes:
            if source not in env and source.op == "get_attr":
                env[source] = graph.node_copy(source)
        env[node] = graph.node_copy(node, env.__getitem__)
    for node in returned:
        if isinstance(node, fx.Node) and node not in env and \
                node.op == "get_attr":
            env[node] = graph.node_copy(node)
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o
                       for o in returned))
    part = fx.GraphModule(module, graph)
    return Part(part, [sources[n] for n in used], len(later), own)
