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
* weights gathered one after another in a pass share one collective, in
  buckets of up to ``GATHER_BUCKET_BYTES``, and each bucket's collective
  starts as soon as the previous bucket has arrived, so that it runs while
  the step computes with the previous one (FSDP's prefetch);
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
import math
from typing import Dict, List, Set

import torch

from ..profiling.facts import BACKWARD, PASS_KEY, is_backward
from .collectives import shard_numel


#: Whole bytes of the weights gathered by one collective at most (a larger
#: weight is gathered alone).
GATHER_BUCKET_BYTES = 4 << 20


def gather_weights_before_use(graph: torch.fx.Graph) -> None:
    """Place the gathers of the sharded weights (``gather_rows`` of step
    inputs, as traced) where they are needed: each weight is needed just
    before its first use, and again before its first use in the backward
    pass (with the views of it that the forward pass computed). Then
    gather consecutive weights of a pass together, in buckets of up to
    ``GATHER_BUCKET_BYTES``, each bucket's collective started when the
    previous bucket has arrived, so that it runs while the step computes
    with the previous bucket. The collectives stay ordered by the step's
    token (``collectives.py``), in the same order on every process."""
    for gather in [node for node in graph.nodes if _gathers_weight(node)]:
        _gather_again_for_backward(graph, gather)
        users = _in_order(graph, gather.users)
        if users:
            users[0].prepend(gather)
    previous = None
    for number, bucket in enumerate(_buckets(graph)):
        previous = _gathered_together(graph, bucket, number, previous)
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


def _buckets(graph: torch.fx.Graph) -> List[List[torch.fx.Node]]:
    """The weight gathers of ``graph`` in order, cut into buckets: runs of
    the same pass and dtype of up to ``GATHER_BUCKET_BYTES`` whole."""
    buckets: List[List[torch.fx.Node]] = []
    size = 0
    for gather in (node for node in graph.nodes if _gathers_weight(node)):
        value = gather.meta["val"]
        nbytes = value.numel() * value.element_size()
        if (not buckets or size + nbytes > GATHER_BUCKET_BYTES
                or is_backward(gather) != is_backward(buckets[-1][0])
                or value.dtype != buckets[-1][0].meta["val"].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(gather)
        size += nbytes
    return buckets


def _gathered_together(graph: torch.fx.Graph, bucket: List[torch.fx.Node],
                       number: int, previous) -> torch.fx.Node:
    """Replace the ``bucket`` of gathers by one collective: its start
    after the node ``previous`` (the previous bucket's wait; else just
    before its own wait), its wait where the first gather was, followed by
    the whole weights cut from what it gathered. Returns the wait."""
    first = bucket[0]
    parts, token = first.args[1], first.args[3]
    node = _NodeMaker(graph, first)
    with graph.inserting_before(previous.next if previous is not None
                                else first):
        flat = node(torch.ops.aten.cat.default,
                    [gather.args[0] for gather in bucket])
        node(torch.ops.poptorch.all_gather_start_.default, flat, number,
             token)
    with graph.inserting_before(first):
        wait = node(torch.ops.poptorch.all_gather_wait.default, flat,
                    number, parts, token)
        weights = _cut(node, wait, parts,
                       [list(gather.args[2]) for gather in bucket])
    for gather, weight in zip(bucket, weights):
        gather.replace_all_uses_with(weight)
        graph.erase_node(gather)
    return wait


def _cut(node, whole: torch.fx.Node, parts: int,
         shapes: List[List[int]]) -> List[torch.fx.Node]:
    """Nodes computing the tensors shaped ``shapes`` whose rows, one
    tensor after another, every process gathered into ``whole``
    (``[parts, K]`` flat): views of ``whole`` for a bucket of one, else
    copies of its columns."""
    aten = torch.ops.aten
    numels = [math.prod(shape) for shape in shapes]
    if len(shapes) == 1:
        return [node(aten.view.default,
                     node(aten.slice.Tensor, whole, 0, 0, numels[0]),
                     shapes[0])]
    table = node(aten.view.default, whole, [parts, -1])
    weights, start = [], 0
    for numel, shape in zip(numels, shapes):
        size = shard_numel(numel, parts)
        columns = node(aten.slice.Tensor, table, 1, start, start + size)
        copied = node(aten.clone.default, columns,
                      memory_format=torch.contiguous_format)
        flat = node(aten.view.default, copied, [-1])
        weights.append(node(aten.view.default,
                            node(aten.slice.Tensor, flat, 0, 0, numel),
                            shape))
        start += size
    return weights


class _NodeMaker:
    """Makes call nodes in ``graph`` with the pass annotation of ``like``
    and their ``meta["val"]`` computed in its fake mode."""

    def __init__(self, graph: torch.fx.Graph, like: torch.fx.Node) -> None:
        self.graph = graph
        self.annotation = dict(like.meta.get("custom") or {})
        self.fake_mode = like.meta["val"].fake_mode

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta["custom"] = dict(self.annotation)
        values = torch.fx.node.map_arg(args, lambda arg: arg.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*values, **kwargs)
        return node


class WeightRows:
    """The rows this process keeps between calls of the trainable weights
    that ``sharding`` (``sharding.Sharding``) shards, the model's
    parameters at ``trainable`` indices (of ``DeviceState.params``) being
    its trainable positions. Gathering them whole asks every process's
    state service (``state_service.py``) for its rows after the same
    number of calls, so one process may gather alone."""

    def __init__(self, sharding, trainable: List[int], group) -> None:
        positions = [p for p, sharded in enumerate(sharding.sharded)
                     if sharded]
        self.sharding = sharding
        self.indices = [trainable[p] for p in positions]
        self.shapes = [sharding.shapes[p] for p in positions]
        self.group = group
        self.calls = 0
        self.number = group.state_service().register(self)

    def cut(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` with the sharded weights (whole) replaced by this
        process's rows of them (copies, so the whole can be freed)."""
        cut = list(params)
        for index in self.indices:
            cut[index] = self.sharding.shard(params[index], self.group.rank)
        return cut

    def whole(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` (as this process keeps them) with every sharded
        weight whole, from all the processes' rows after ``calls``
        calls."""
        gathered = self.group.state_service().gather(
            self.number, self.calls, [params[i] for i in self.indices])
        whole = list(params)
        for index, tensor in zip(self.indices,
                                 self.sharding.wholes(gathered, self.shapes)):
            whole[index] = tensor
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
