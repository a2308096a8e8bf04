"""Max pooling through PyTorch's channels-last kernel on the CPU.

PyTorch's CPU kernel for ``max_pool2d_with_indices`` on a contiguous
``(N, C, H, W)`` tensor does not vectorise; its kernel for channels-last
tensors vectorises across the channels. On this project's 2-core machine a
2 x 2 pool of a 64 x 32 x 16 x 16 batch takes 2.3 ms the first way and
0.7 ms the second, both layout conversions included (0.57 ms against
0.23 ms for 16 samples). ``pool_channels_last`` rewrites each such pool of
a contiguous 4-d CPU tensor of several channels into the same operation on
a channels-last copy, and makes its output and indices contiguous again,
so everything after it sees the tensors it was traced with. The values are
the same: a maximum is exact, and the indices are positions within each
plane, whatever the layout. The backward kernel is faster on contiguous
tensors and stays as it is.
"""
import operator

import torch

Node = torch.fx.Node
aten = torch.ops.aten

_POOL = aten.max_pool2d_with_indices.default


def _pools_slowly(node: Node) -> bool:
    """A pool whose input is a contiguous 4-d CPU tensor of channels."""
    if node.op != "call_function" or node.target is not _POOL:
        return False
    value = node.args[0].meta.get("val")
    return (isinstance(value, torch.Tensor) and value.dim() == 4
            and value.device.type == "cpu" and value.shape[1] > 1
            and value.is_contiguous()
            and all(user.target is operator.getitem for user in node.users))


def _call(graph: torch.fx.Graph, target, args, kwargs=None) -> Node:
    """A new node, with the value ``target`` gives for its arguments'
    values (fake tensors) as its ``val``."""
    node = graph.call_function(target, args, kwargs or {})
    values = torch.fx.node.map_arg(args, lambda arg: arg.meta["val"])
    node.meta["val"] = target(*values, **(kwargs or {}))
    return node


def pool_channels_last(graph: torch.fx.Graph) -> None:
    """Rewrite ``graph`` (in place): slow max pools run on channels-last
    copies of their inputs."""
    for pool in [node for node in graph.nodes if _pools_slowly(node)]:
        with graph.inserting_before(pool):
            copy = _call(graph, aten.clone.default, (pool.args[0],),
                         {"memory_format": torch.channels_last})
            fast = _call(graph, _POOL, (copy,) + tuple(pool.args[1:]),
                         pool.kwargs)
        for user in list(pool.users):
            with graph.inserting_before(user):
                part = _call(graph, operator.getitem, (fast, user.args[1]))
                contiguous = _call(graph, aten.clone.default, (part,),
                                   {"memory_format":
                                    torch.contiguous_format})
            user.replace_all_uses_with(contiguous)
            graph.erase_node(user)
        graph.erase_node(pool)
