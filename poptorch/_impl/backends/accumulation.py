"""Gradient sums accumulated where each gradient is computed.

A traced training step adds its micro-batch's gradients to the running
gradient buffer in one ``_foreach_add_`` after the whole backward pass (or,
with one micro-batch per optimizer step, writes them into it with one
``_foreach_copy_``; ``optimizers/gradient_reduction.py``), so every weight
gradient of the model is alive at once and each is written, then read
again. Torch's autograd instead adds each gradient into ``.grad`` as soon
as it is computed. ``accumulate_where_computed`` gives the graph backend
the same order, and goes one step further:

* the list operation becomes one ``add_`` (``copy_``) per gradient, placed
  right after that gradient is computed (when nothing reads the buffer and
  nothing is written in between), so a gradient's memory is released and
  reused at once;
* ``running += a @ b`` (a weight gradient of a linear layer, possibly
  through transposes) becomes ``running.addmm_(a, b)``, and
  ``running.copy_(a @ b)`` becomes ``torch.mm(a, b, out=running)``: the
  matrix product writes into the buffer, with no gradient tensor and no
  separate pass.

The sum's value is the same up to floating-point rounding: ``addmm_``
rounds ``running + a @ b`` once instead of rounding the product first.
"""
import bisect
import operator
from typing import List, Optional, Tuple

import torch

Node = torch.fx.Node
aten = torch.ops.aten

_TRANSPOSES = (aten.t.default,)

#: In-place list operation into the buffer -> its operation per tensor.
_PER_TENSOR = {aten._foreach_add_.List: aten.add_.Tensor,
               aten._foreach_copy_.default: aten.copy_.default}


def _positions(graph: torch.fx.Graph):
    return {node: i for i, node in enumerate(graph.nodes)}


def _read_between(tensor: Node, start: int, end: int, positions,
                  ignore: Node) -> bool:
    """Whether a node strictly between positions ``start`` and ``end``,
    other than ``ignore``, uses ``tensor``."""
    return any(start < positions.get(user, -1) < end and user is not ignore
               for user in tensor.users)


def _writes(node: Node) -> bool:
    """Whether ``node`` may write to a tensor (taking the element of a
    result list does not)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return (not isinstance(node.target, torch._ops.OpOverload)
            or node.target._schema.is_mutable)


def _split_list_operation(graph: torch.fx.Graph, node: Node) -> None:
    """One ``add_`` (``copy_``) per tensor of an in-place list operation,
    each right after its operands are ready, unless the buffer is read or
    anything is written in between (then at the list operation's place)."""
    sums, terms = node.args[0], node.args[1]
    per_tensor = _PER_TENSOR[node.target]
    keywords = ({"alpha": node.kwargs.get("alpha", 1)}
                if per_tensor is aten.add_.Tensor else {})
    positions = _positions(graph)
    end = positions[node]
    writes = [positions[n] for n in graph.nodes
              if _writes(n) and positions[n] < end]
    for total, term in zip(sums, terms):
        ready = max((t for t in (total, term) if isinstance(t, Node)),
                    key=positions.__getitem__)
        start = positions[ready]
        anchor = ready
        if _read_between(total, start, end, positions, node) or \
                bisect.bisect_right(writes, start) < len(writes):
            anchor = node.prev
        with graph.inserting_after(anchor):
            added = graph.call_function(per_tensor, (total, term), keywords)
        added.meta["val"] = total.meta.get("val")
    graph.erase_node(node)


def _product_behind(term: Node) -> Optional[Tuple[Node, int]]:
    """The ``mm`` node ``term`` is (through single-use transposes) and how
    many transposes lie between them."""
    transposes = 0
    while term.op == "call_function" and term.target in _TRANSPOSES:
        if len(term.users) != 1:
            return None
        term, transposes = term.args[0], transposes + 1
    if term.op == "call_function" and term.target is aten.mm.default \
            and len(term.users) == 1:
        return term, transposes
    return None


def _fuse_product(graph: torch.fx.Graph, added: Node) -> None:
    """``total.add_(a @ b)`` -> ``total.addmm_(a, b)``;
    ``total.copy_(a @ b)`` -> ``torch.mm(a, b, out=total)``."""
    total, term = added.args[0], added.args[1]
    if not isinstance(term, Node) or total.op != "placeholder":
        return
    found = _product_behind(term)
    if found is None:
        return
    product, transposes = found
    value, result = total.meta.get("val"), product.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)
            and value.dim() == 2 and value.dtype == result.dtype
            and value.shape == term.meta["val"].shape):
        return
    positions = _positions(graph)
    if positions[total] > positions[product] or _read_between(
            total, positions[product], positions[added], positions, added):
        return
    left, right = product.args[0], product.args[1]
    with graph.inserting_before(product):
        if transposes % 2:
            left, right = (graph.call_function(aten.t.default, (right,)),
                           graph.call_function(aten.t.default, (left,)))
        if added.target is aten.copy_.default:
            fused = graph.call_function(aten.mm.out, (left, right),
                                        {"out": total})
        else:
            fused = graph.call_function(
                aten.addmm_.default, (total, left, right),
                {"alpha": added.kwargs.get("alpha", 1)})
    fused.meta["val"] = value
    added.replace_all_uses_with(fused)
    chain: List[Node] = [added]
    node = term
    while node is not product:
        chain.append(node)
        node = node.args[0]
    chain.append(product)
    for node in chain:
        graph.erase_node(node)


def accumulate_where_computed(graph: torch.fx.Graph) -> None:
    """Rewrite ``graph`` (in place) so that in-place list additions (and
    copies) into the step's inputs add (write) each tensor as soon as it is
    computed, fusing matrix products into them."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _PER_TENSOR \
                and not node.users \
                and all(total.op == "placeholder" for total in node.args[0]):
            _split_list_operation(graph, node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (
                aten.add_.Tensor, aten.copy_.default):
            _fuse_product(graph, node)
