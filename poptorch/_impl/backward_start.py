"""Where a training step's backward pass starts (docs/semantics.md,
"Losses in training"), found in the analysis trace's graph.

The recorded losses (``losses.py``) that feed no other recorded loss are
the final losses; of those, the ones that no returned tensor with gradients
uses (dead code, or metrics returned detached) are left out when another
is used. Dependencies follow the graph's edges and its in-place writes
(``graph_writes.DataFlow``). The backward pass starts from the
single-element tensor ``forward`` returns that is the model's total loss,
as ``total.backward()`` would in PyTorch, when there is one; else from the
final loss (several unrelated final losses are an error).

A returned single-element tensor computed from every final loss (and not
a final loss itself, nor a value without gradients: a logged
``ce.detach() * tokens`` or a sum under ``torch.no_grad()``) is a total
when it brings in more than one final loss's value: several final
losses (``0.3 * ctc + 0.7 * ce``), or terms of the model's inputs and
weights that do not pass through the final losses (``ce + 0.1 * l2``, a
VAE's ``recon + kl``, per-sample losses weighted by an input). One that
is a function of a single final loss alone (``2 * loss``, ``exp(ce)``)
reports it: it starts the backward pass only when the final loss itself
is not returned and no total is. Of several totals, the one computed from
all the others starts it; totals of which none is are an error, as
PyTorch's user would have to choose one.
"""
from typing import List, Optional, Set

import torch

from ..errors import Error
from . import losses
from .graph_writes import DataFlow

Node = torch.fx.Node


def final_losses(loss_nodes: List[Node], flow: DataFlow) -> List[Node]:
    """The recorded losses that feed no other recorded loss."""
    if not loss_nodes:
        raise Error(losses.NO_LOSS_MESSAGE)
    distinct = set(loss_nodes)
    return list(dict.fromkeys(
        node for node in loss_nodes
        if not flow.descendants(node) & distinct))


def used_losses(finals: List[Node], returned: List[Node], flow: DataFlow,
                without_gradients: Set[Node]) -> List[Node]:
    """The final losses whose value reaches a returned tensor that has
    gradients, when any does: a loss computed and never used
    (``unused = ce(logits, y)``) is dead code, which PopTorch's traced graph
    leaves out, and one returned only detached (``mse.detach()``) is a
    metric. ``without_gradients``: as for ``returned_total``."""
    outputs = set(returned) - without_gradients
    used = [node for node in finals
            if node in outputs or flow.descendants(node) & outputs]
    return used or finals


def _single_element(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _brings_in_more(node: Node, finals: List[Node], flow: DataFlow) -> bool:
    """Whether ``node`` depends on several final losses, or on an input or
    weight by a path that does not go through the final losses."""
    if len(finals) > 1:
        return True
    upstream = flow.ancestors(node, set(finals))
    return any(n.op == "placeholder" for n in upstream - set(finals))


def _last(nodes: List[Node], flow: DataFlow) -> Optional[Node]:
    """The node of ``nodes`` computed from all the others, if one is."""
    for node in nodes:
        if all(other is node or other in flow.ancestors(node)
               for other in nodes):
            return node
    return None


def returned_total(returned: List[Node], finals: List[Node],
                   flow: DataFlow,
                   without_gradients: Set[Node]) -> Optional[int]:
    """The index of the returned tensor the backward pass starts from (see
    the module docstring), or None for the final loss.
    ``without_gradients``: the returned tensors that do not require
    gradients though the model trains parameters."""
    computed = list(dict.fromkeys(
        node for node in returned
        if node not in finals and node not in without_gradients
        and _single_element(node) and set(finals) <= flow.ancestors(node)))
    totals = [node for node in computed
              if _brings_in_more(node, finals, flow)]
    if totals:
        last = _last(totals, flow)
        if last is None:
            positions = ", ".join(str(returned.index(n)) for n in totals)
            raise Error(losses.SEVERAL_TOTALS_MESSAGE.format(
                positions=positions))
        return returned.index(last)
    if computed and not any(node in finals for node in returned):
        last = _last(computed, flow)
        return None if last is None else returned.index(last)
    return None
