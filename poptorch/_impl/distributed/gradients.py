"""The gradient all-reduce inside the captured training step.

Between the reduction of a step's G x R local micro-batches and the
optimizer update, the update graph sums the gradients over the processes
(``ReductionType.Mean`` then divides by n: each process holds its local
G x R reduction, so the result is the mean over all n x G x R
micro-batches). The gradients go in buckets, as DistributedDataParallel
puts them: in reverse order of the parameters (about the order in which
the backward pass finishes them), per dtype, the first bucket closing at
1 MiB so that communication starts early, later ones at 25 MiB.

Each bucket is one flat tensor and two opaque ops:
``poptorch::all_reduce_start_`` starts its collective in the background
and ``poptorch::all_reduce_wait_`` waits for it through the fault monitor
(a failed peer raises ``poptorch.Error`` rather than hanging).
``start_all_reduces_early`` then moves each start, with the operations that
only exist to feed it, to just after the last of its gradients is
computed, so the collectives of the last layers' gradients run while the
backward pass of the first layers computes; the waits stay before the
update. Every process runs the same graph, so they start the collectives in
the same order.
"""
from typing import Dict, List, Set

import torch

from ..profiling.ranges import profile_range
from . import process_group

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@torch.library.custom_op("poptorch::all_reduce_start_",
                         mutates_args=("flat",))
def _all_reduce_start_(flat: torch.Tensor, bucket: int) -> None:
    with profile_range("all-reduce"):
        process_group.current().start_all_reduce_(flat, bucket)


@_all_reduce_start_.register_fake
def _all_reduce_start_fake(flat: torch.Tensor, bucket: int) -> None:
    return None


@torch.library.custom_op("poptorch::all_reduce_wait_",
                         mutates_args=("flat",))
def _all_reduce_wait_(flat: torch.Tensor, bucket: int,
                      average: bool) -> None:
    with profile_range("all-reduce wait"):
        process_group.current().finish_all_reduce_(
            flat, bucket, average, "the gradient all-reduce")


@_all_reduce_wait_.register_fake
def _all_reduce_wait_fake(flat: torch.Tensor, bucket: int,
                          average: bool) -> None:
    return None


def buckets(grads: List[torch.Tensor]) -> List[List[int]]:
    """The positions of ``grads`` in each all-reduce bucket, in the order
    the buckets start."""
    closed: List[List[int]] = []
    open_buckets: Dict[torch.dtype, List[int]] = {}
    sizes: Dict[torch.dtype, int] = {}
    for index in reversed(range(len(grads))):
        dtype = grads[index].dtype
        open_buckets.setdefault(dtype, []).append(index)
        sizes[dtype] = (sizes.get(dtype, 0) +
                        grads[index].numel() * grads[index].element_size())
        limit = FIRST_BUCKET_BYTES if not closed else BUCKET_BYTES
        if sizes[dtype] >= limit:
            closed.append(open_buckets.pop(dtype))
            sizes[dtype] = 0
    return closed + [positions for positions in open_buckets.values()]


class GradientAllReduce:
    """A function of the step's gradients, traced into the update graph,
    returning them summed (``average``: averaged) over the processes."""

    def __init__(self, average: bool) -> None:
        self.average = average

    def __call__(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        groups = buckets(grads)
        flats = []
        for bucket, positions in enumerate(groups):
            flat = torch.cat([grads[i].reshape(-1) for i in positions])
            torch.ops.poptorch.all_reduce_start_(flat, bucket)
            flats.append(flat)
        reduced = list(grads)
        for bucket, (positions, flat) in enumerate(zip(groups, flats)):
            torch.ops.poptorch.all_reduce_wait_(flat, bucket, self.average)
            pieces = flat.split([grads[i].numel() for i in positions])
            for index, piece in zip(positions, pieces):
                reduced[index] = piece.view(grads[index].shape)
        return reduced


def start_all_reduces_early(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so that each all-reduce start, and the operations
    that only feed it, run as soon as their inputs exist. No operation
    moves above one that writes to a tensor in place or draws random
    numbers (writes, reads and random draws stay in the traced order)."""
    starts = [node for node in graph.nodes
              if node.target is torch.ops.poptorch.all_reduce_start_.default]
    if not starts:
        return
    early: Set[torch.fx.Node] = set()
    for start in starts:
        early |= _feeding(start)
    order = _as_early_as_possible(list(graph.nodes), early)
    output = next(node for node in graph.nodes if node.op == "output")
    for node in order:
        if node.op not in ("placeholder", "output"):
            output.prepend(node)
    graph.lint()


def _feeding(start: torch.fx.Node) -> Set[torch.fx.Node]:
    """``start``, its flat bucket, and the operations whose results only
    reach ``start`` through the bucket."""
    flat = start.args[0]
    feeding = {start, flat}
    frontier = list(flat.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if (node in feeding or node.op != "call_function"
                or not all(user in feeding for user in node.users)):
            continue
        feeding.add(node)
        frontier.extend(node.all_input_nodes)
    return feeding


def _order_sensitive(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes to a tensor in place or draws random numbers
    (it advances the generator), so that what runs before it matters."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload)
            and (target._schema.is_mutable
                 or torch.Tag.nondeterministic_seeded in target.tags))


def _as_early_as_possible(nodes: List[torch.fx.Node],
                          early: Set[torch.fx.Node]) -> List[torch.fx.Node]:
    """``nodes`` in a new order: the nodes of ``early`` as soon as their
    inputs and every order-sensitive node that preceded them are placed,
    the others as they were."""
    waits_for: Dict[torch.fx.Node, Set[torch.fx.Node]] = {}
    followers: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
    last_sensitive = None
    for node in nodes:
        if node in early:
            needs = set(node.all_input_nodes)
            if last_sensitive is not None:
                needs.add(last_sensitive)
            waits_for[node] = needs
            for need in needs:
                followers.setdefault(need, []).append(node)
        if _order_sensitive(node):
            last_sensitive = node
    placed: Set[torch.fx.Node] = set()
    order: List[torch.fx.Node] = []

    def place(node: torch.fx.Node) -> None:
        ready = [node]
        while ready:
            current = ready.pop()
            if current in placed:
                continue
            order.append(current)
            placed.add(current)
            ready.extend(follower for follower in followers.get(current, ())
                         if waits_for[follower] <= placed)

    for node in nodes:
        if node not in placed and (node not in early or not waits_for[node]):
            place(node)
    return order
