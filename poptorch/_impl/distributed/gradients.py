"""The gradient all-reduce inside the captured training step.

Between the reduction of a step's G x R local micro-batches and the
optimizer update, the update graph sums the gradients over the processes
(``ReductionType.Mean`` then divides by n: each process holds its local
G x R reduction, so the result is the mean over all n x G x R
micro-batches). The gradients go in buckets, as DistributedDataParallel
puts them: in reverse order of the parameters (about the order in which
the backward pass finishes them), per dtype, the first bucket closing at
1 MiB so that communication starts early, later ones at 25 MiB.

Each bucket is one flat tensor and two opaque ops (``collectives.py``):
``poptorch::all_reduce_start_`` starts its collective in the background
and ``poptorch::all_reduce_wait_`` waits for it through the fault monitor
(a failed peer raises ``poptorch.Error`` rather than hanging).
``start_all_reduces_early`` then moves each start (of an all-reduce, or of
a sharded step's reduce-scatter), with the operations that only exist to
feed it, to just after the last of its gradients is computed, so the
collectives of the last layers' gradients run while the backward pass of
the first layers computes; the waits stay before the update. Every process
runs the same graph, so they start the collectives in the same order.

``GradientExchange`` is what a training step asks of the run's processes:
here, the all-reduce; with replicated tensor sharding, the reduce-scatter,
shard updates and all-gather of ``sharding.py``.
"""
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..optimizers.rule import TensorNorms
from . import collectives

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


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
    returning them summed (``average``: averaged) over the processes; its
    collectives are ordered by the step's ``token`` (``collectives.py``),
    created where the step starts, so that nothing holds the collectives
    back."""

    def __init__(self, average: bool, token: torch.Tensor) -> None:
        self.average = average
        self.token = token

    def __call__(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        return self.wait(grads, self.start(grads))

    def start(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Start the collectives of ``grads``' buckets; their flat
        tensors, for ``wait``."""
        flats = []
        for bucket, positions in enumerate(buckets(grads)):
            flat = torch.cat([grads[i].reshape(-1) for i in positions])
            torch.ops.poptorch.all_reduce_start_(flat, bucket, self.token)
            flats.append(flat)
        return flats

    def wait(self, grads: List[torch.Tensor],
             flats: List[torch.Tensor]) -> List[torch.Tensor]:
        """``grads`` reduced: wait for the collectives ``start`` began."""
        reduced = list(grads)
        for bucket, (positions, flat) in enumerate(zip(buckets(grads),
                                                       flats)):
            torch.ops.poptorch.all_reduce_wait_(flat, bucket, self.average,
                                                self.token)
            pieces = flat.split([grads[i].numel() for i in positions])
            for index, piece in zip(positions, pieces):
                reduced[index] = piece.view(grads[index].shape)
        return reduced


class GradientExchange:
    """What a training step of an n-process run does with the other
    processes, traced into its graphs: the gradients all-reduced (summed,
    or averaged with ``average``) once per optimizer step, before the
    update, which every process computes whole. ``sharding.py``'s
    ``ShardedExchange`` updates rows of the parameters instead."""

    #: Whether the running gradient buffer holds reduced gradients (each
    #: micro-batch's reduced as it is added), rather than this process's.
    reduces_each_micro_batch = False
    #: Gradient statistics spread over the processes (clipping, automatic
    #: loss scaling): None, as every process holds every gradient.
    statistics = None

    def __init__(self, average: bool) -> None:
        self.average = average
        self.token: Optional[torch.Tensor] = None

    def begin(self, like: torch.Tensor) -> None:
        """A step is traced: its collectives are ordered through a new
        token (``collectives.py``) on ``like``'s device."""
        self.token = collectives.new_token(like)

    def reduce_micro_batch(self, grads: List[torch.Tensor]
                           ) -> List[torch.Tensor]:
        """One micro-batch's gradients as the running buffer adds them:
        this process's."""
        return grads

    def reduce(self, grads: List[torch.Tensor],
               rows_done: bool = False) -> List[torch.Tensor]:
        """The optimizer step's gradients combined over the processes."""
        return GradientAllReduce(self.average, self.token)(grads)

    def whole_weights(self, stored: List[torch.Tensor]
                      ) -> List[torch.Tensor]:
        """The trainable parameters whole from the step's inputs: as they
        are."""
        return stored

    def accumulators(self, params: List[torch.Tensor]
                     ) -> List[torch.Tensor]:
        """Tensors shaped as the running gradient buffer holds each
        parameter's gradient: the parameters."""
        return params

    def local(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The parts of the trainable parameters this process updates: all
        of them."""
        return params

    def gather(self, updated: List[torch.Tensor],
               params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The whole updated parameters from this process's parts."""
        return updated

    def norms(self, positions: Sequence[int]) -> Optional[TensorNorms]:
        """How the update of the trainable ``positions`` computes per-tensor
        norms (LAMB): None, the tensors are whole."""
        return None

    def row_shapes(self, named: Dict[str, Tuple[torch.fx.Node, int]]
                   ) -> Dict[str, Tuple[List[int], int]]:
        """Of the update graph's ``named`` parameters, gradients and
        optimizer state (name: node, the trainable position of its
        parameter), those that are this process's rows, with the whole
        shape and the number of processes: none."""
        return {}


def start_all_reduces_early(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so that each collective start (all-reduce or
    reduce-scatter), and the operations that only feed it, run as soon as
    their inputs exist. No operation moves above one that writes to a
    tensor in place or draws random numbers (writes, reads and random draws
    stay in the traced order)."""
    starts = [node for node in graph.nodes if collectives.is_start(node)]
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
