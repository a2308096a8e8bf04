"""``base + other * scale`` as one operation.

The optimizer rules build every scaled addition (weight decay, momentum,
the moving averages, the parameter update itself) as a list product
followed by a list addition (``optimizers/rule.py``, ``add_scaled`` and
``sub_scaled``), which makes a temporary tensor per parameter and reads it
back. ``fuse_scaled_additions`` turns each such pair, when nothing else
reads the product, into the operation torch's own optimizers use:

* a number ``scale``: ``_foreach_add(base, other, alpha=±scale)``;
* 0-d tensor scales (variable hyper-parameters):
  ``_foreach_addcmul(base, other, scales, value=±1)``.

The product is rounded before the addition as before; only a fused
multiply-add in a kernel can round differently (once).
"""
import numbers
import operator
from typing import Optional

import torch

Node = torch.fx.Node
aten = torch.ops.aten

_ADDITIONS = {aten._foreach_add.List: 1, aten._foreach_sub.List: -1}
_PRODUCTS = (aten._foreach_mul.Scalar, aten._foreach_mul.Tensor,
             aten._foreach_mul.List)


def _product_of(terms) -> Optional[Node]:
    """The list product whose items are exactly ``terms``, each used once,
    or None."""
    if not isinstance(terms, (list, tuple)) or not terms:
        return None
    product = None
    for index, term in enumerate(terms):
        if not (isinstance(term, Node) and term.op == "call_function"
                and term.target is operator.getitem
                and term.args[1] == index and len(term.users) == 1):
            return None
        if product is None:
            product = term.args[0]
        elif term.args[0] is not product:
            return None
    if not (isinstance(product, Node) and product.op == "call_function"
            and product.target in _PRODUCTS
            and len(product.users) == len(terms)):
        return None
    return product


def _fused(graph: torch.fx.Graph, addition: Node,
           product: Node) -> Optional[Node]:
    """The fused operation inserted in ``graph``, or None (nothing
    inserted) when the pair does not fit."""
    base = addition.args[0]
    sign = _ADDITIONS[addition.target]
    other, scale = product.args[0], product.args[1]
    if product.target is aten._foreach_mul.Scalar:
        if not isinstance(scale, numbers.Number):
            return None
        return graph.call_function(aten._foreach_add.List, (base, other),
                                   {"alpha": sign * scale})
    scales = (list(scale) if product.target is aten._foreach_mul.List
              else [scale] * len(other))
    return graph.call_function(aten._foreach_addcmul.Scalar,
                               (base, other, scales), {"value": sign})


def fuse_scaled_additions(graph: torch.fx.Graph) -> None:
    """Rewrite ``graph`` (in place): list additions of a list product used
    nowhere else become one scaled addition."""
    for addition in list(graph.nodes):
        if addition.op != "call_function" or \
                addition.target not in _ADDITIONS or \
                addition.kwargs.get("alpha", 1) != 1:
            continue
        product = _product_of(addition.args[1])
        if product is None:
            continue
        with graph.inserting_before(addition):
            fused = _fused(graph, addition, product)
        if fused is None:
            continue
        fused.meta["val"] = addition.meta.get("val")
        addition.replace_all_uses_with(fused)
        graph.erase_node(addition)
        for term in list(product.users):
            graph.erase_node(term)
        graph.erase_node(product)
