"""Views that tolerate the layouts tensors have at run time.

A captured graph records the layout (strides) of every intermediate tensor
as PyTorch's fake kernels predict it, and a ``view`` is valid only for some
layouts. For some backward operations the prediction differs from what the
real kernel returns: ``elu_backward``, ``softplus_backward``,
``hardswish_backward``, ``hardsigmoid_backward`` and ``hardtanh_backward``,
given a contiguous gradient and a transposed input, are predicted to follow
the input's layout, while the CPU kernels follow the gradient's. A view
valid for the prediction then fails at run time ("view size is not
compatible with input tensor's size and stride"). ``reshape_views`` turns
the graph's views into reshapes, which are the same view whenever the
layout allows one and a copy otherwise: the values are the same, since the
graph writes to no view of another tensor (the graph backend's in-place
rewrites treat a reshape as a possible alias of its input).
"""
import torch

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def reshape_views(graph: torch.fx.Graph) -> None:
    """Every ``view`` / ``_unsafe_view`` of ``graph`` becomes a
    ``reshape``."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = torch.ops.aten.reshape.default
