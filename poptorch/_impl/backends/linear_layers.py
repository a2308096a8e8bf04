"""Linear layers as one ``addmm``.

A linear layer traced on a batch of matrices (as the vectorised replica
path traces it under ``torch.func.vmap``, ``replication/replicas.py``) becomes a
matrix product of the flattened rows, a view back to the batch shape, and
a separate addition of the bias scaled by ``beta = 1``::

    view(mm(x, w), shape) + mul(b, 1)

``fuse_linear_layers`` turns it back into what the same layer traces to on
one batch, ``view(addmm(b, x, w), shape)``: the bias enters the product's
output as it is written, instead of in a second pass over it. The bias is
rounded into the product's sum by the matrix kernel rather than added to
the rounded product.
"""
import torch

Node = torch.fx.Node
aten = torch.ops.aten

_ADDITION = aten.add.Tensor
_VIEWS = (aten._unsafe_view.default, aten.view.default)


def _is_call(node, target) -> bool:
    return (isinstance(node, Node) and node.op == "call_function"
            and node.target in (target if isinstance(target, tuple)
                                else (target,)))


def _unit_scaled(node) -> bool:
    """``mul(b, 1)``: the bias as it is."""
    return _is_call(node, aten.mul.Scalar) and node.args[1] == 1


def _product_view(node) -> bool:
    """A view of an ``mm`` result that nothing else reads."""
    return (_is_call(node, _VIEWS) and len(node.users) == 1
            and _is_call(node.args[0], aten.mm.default)
            and len(node.args[0].users) == 1)


def _fits(bias: Node, product: Node) -> bool:
    value, result = bias.meta.get("val"), product.meta.get("val")
    return (isinstance(value, torch.Tensor)
            and isinstance(result, torch.Tensor) and value.dim() == 1
            and value.shape[0] == result.shape[-1]
            and value.dtype == result.dtype)


def fuse_linear_layers(graph: torch.fx.Graph) -> None:
    """Rewrite ``graph`` (in place): ``view(mm(x, w)) + mul(b, 1)`` becomes
    ``view(addmm(b, x, w))``, where the addition was (the bias may be
    computed after the product: a sharded bias is gathered just before its
    first use, ``distributed/weight_sharding.py``)."""
    for addition in list(graph.nodes):
        if not _is_call(addition, _ADDITION) or \
                addition.kwargs.get("alpha", 1) != 1:
            continue
        scaled, view = addition.args[0], addition.args[1]
        if not _unit_scaled(scaled):
            scaled, view = view, scaled
        if not (_unit_scaled(scaled) and _product_view(view)):
            continue
        product, bias = view.args[0], scaled.args[0]
        if not (isinstance(bias, Node) and _fits(bias, product)):
            continue
        with graph.inserting_before(addition):
            fused = graph.call_function(aten.addmm.default,
                                        (bias,) + tuple(product.args[:2]))
        addition.prepend(view)
        fused.meta["val"] = product.meta.get("val")
        product.replace_all_uses_with(fused)
        view.meta["val"] = addition.meta.get("val")
        addition.replace_all_uses_with(view)
        graph.erase_node(addition)
        graph.erase_node(product)
        if not scaled.users:
            graph.erase_node(scaled)
