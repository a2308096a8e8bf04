"""Weight sharding: replicated tensor sharding on the weight location, as
ZeRO stage 3 (and FSDP) shard the weights of data-parallel training.

PopTorch programs ask for it with
``opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings()
.useReplicatedTensorSharding(True))``. In an n-process run each process
then keeps, between calls, row r of every sharded trainable weight (the
``[n, k]`` view of the weight flattened and padded with zeros, as
``sharding.py`` keeps optimizer state): 1/n of its memory. Their optimizer
state is sharded with them (the update step needs nothing else).

Inside the captured training step:

* each sharded weight is all-gathered whole just before the forward pass
  first uses it, so the whole tensor lives from there to its last use in
  the forward pass rather than through the whole step;
* the backward pass gathers it again just before its first use there
  (with the views of it that the forward pass saved for the backward pass,
  such as a linear layer's transposed weight), so that the whole weights
  are held a few layers at a time in each pass
  (``gather_weights_before_use``);
* the gradients are reduce-scattered and each process updates its rows,
  as with a sharded optimizer state, and the step's outputs are the new
  rows: there is no all-gather after the update.

Outside the step, ``WeightRows`` cuts weights into rows (at compilation,
after process 0's weights are broadcast, and on ``copyWeightsToDevice``)
and gathers them whole for the host (``copyWeightsToHost``, reads of the
module after a training call, inference models of the same module,
``compileAndExport``) through the state service (``state_service.py``), so
that one process may read them alone, as PopTorch programs save their
checkpoints and validate on process 0.
"""
from typing import Dict, List, Set

import torch

from ..profiling.facts import BACKWARD, PASS_KEY, is_backward
from .collectives import padded_rows


def gather_weights_before_use(graph: torch.fx.Graph) -> None:
    """Move each gather of a sharded weight (a ``gather_rows`` of a step
    input) to just before its first use, and give the backward pass its
    own gather, before its first use there, of the weight and of the views
    of it that the forward pass computed. The gathers stay ordered by the
    step's token (``collectives.py``), in the same order on every
    process."""
    for gather in [node for node in graph.nodes if _gathers_weight(node)]:
        _gather_again_for_backward(graph, gather)
        users = _in_order(graph, gather.users)
        if users:
            users[0].prepend(gather)
    graph.lint()


def _gathers_weight(node: torch.fx.Node) -> bool:
    return (node.op == "call_function"
            and node.target is torch.ops.poptorch.gather_rows.default
            and node.args[0].op == "placeholder")


def _in_order(graph: torch.fx.Graph, nodes) -> List[torch.fx.Node]:
    chosen = set(nodes)
    return [node for node in graph.nodes if node in chosen]


def _forward_views(gather: torch.fx.Node) -> Set[torch.fx.Node]:
    """``gather`` and the forward pass's views of its result (views of
    views included): what keeps the whole weight's memory alive."""
    views, frontier = {gather}, [gather]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (user not in views and not is_backward(user)
                    and _is_view(user) and user.args[0] is node):
                views.add(user)
                frontier.append(user)
    return views


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload)
            and (target.is_view
                 or target is torch.ops.aten._unsafe_view.default))


def _gather_again_for_backward(graph: torch.fx.Graph,
                               gather: torch.fx.Node) -> None:
    """Make the backward pass's uses of ``gather``'s weight (and of the
    forward views of it) read a second gather and copies of those views,
    inserted before the first of those uses."""
    views = _forward_views(gather)
    uses = [(user, view) for view in views for user in view.users
            if is_backward(user)]
    if not uses:
        return
    needed: Set[torch.fx.Node] = set()
    for _, view in uses:
        node = view
        while node not in needed:
            needed.add(node)
            if node is gather:
                break
            node = node.args[0]
    copies: Dict[torch.fx.Node, torch.fx.Node] = {}
    first_use = _in_order(graph, [user for user, _ in uses])[0]
    with graph.inserting_before(first_use):
        for node in _in_order(graph, needed):
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            copy.meta["custom"] = dict(node.meta.get("custom") or {},
                                       **{PASS_KEY: BACKWARD})
            copies[node] = copy
    for user, view in uses:
        user.replace_input_with(view, copies[view])


class WeightRows:
    """The rows of the sharded trainable weights this process keeps between
    calls, at ``indices`` of ``DeviceState.params``, of weights shaped
    ``shapes``, over ``parts`` processes. Gathering them whole asks every
    process's state service (``state_service.py``) for its rows after the
    same number of calls, so one process may gather alone."""

    def __init__(self, indices: List[int], shapes: List[torch.Size],
                 parts: int, group) -> None:
        self.indices = indices
        self.shapes = shapes
        self.parts = parts
        self.group = group
        self.calls = 0
        self.number = group.state_service().register(self)

    def cut(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` with the sharded weights (whole) replaced by this
        process's rows of them (copies, so the whole can be freed)."""
        rank = self.group.rank
        cut = list(params)
        for index in self.indices:
            cut[index] = padded_rows(params[index], self.parts)[rank].clone()
        return cut

    def whole(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` (as this process keeps them) with every sharded
        weight whole, from all the processes' rows after ``calls``
        calls."""
        gathered = self.group.state_service().gather(
            self.number, self.calls, [params[i] for i in self.indices])
        whole = list(params)
        for j, (index, shape) in enumerate(zip(self.indices, self.shapes)):
            flat = torch.cat([rows[j] for rows in gathered])
            whole[index] = flat[:shape.numel()].view(shape).clone()
        return whole

    def whole_shaped(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` with each sharded weight's rows replaced by a tensor
        of the whole weight's shape, dtype and device that takes no memory
        (an expanded scalar; its values are not the weight's): what code
        that reads only those properties may use."""
        shaped = list(params)
        for index, shape in zip(self.indices, self.shapes):
            shaped[index] = params[index].new_empty(()).expand(shape)
        return shaped

    def publish(self, params: List[torch.Tensor]) -> None:
        """Serve this process's rows in ``params`` to the other
        processes."""
        self.group.state_service().publish(
            self.number, self.calls, [params[i] for i in self.indices])

    def after_call(self, completed: bool,
                   params: List[torch.Tensor]) -> None:
        """A call ended: it updated the rows (``completed``), or it failed
        and they are as before."""
        self.calls += completed
        self.publish(params)
