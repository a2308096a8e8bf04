"""Replicated tensor sharding (RTS) of a training model's optimizer state
and running gradient buffer over the processes of a run: ZeRO stages 1
and 2 (and the exchange of stage 3, whose weights ``weight_sharding.py``
keeps).

PopTorch programs ask for it with
``opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings()
.useReplicatedTensorSharding(True))``: on IPUs each replica then keeps 1/R
of the optimizer state. Here the R replicas of one process are vectorised
over one copy of the weights and optimizer state, so a process already
holds the state once for all its replicas; sharding splits it over the
processes of the run instead (``poprun --num-instances n``, torchrun): each
of the n processes keeps the optimizer state of 1/n of every parameter with
more than ``minElementsForReplicatedTensorSharding`` elements (and at
least n), which is 1/R of the state per replica, as on IPUs. In a
one-process run the setting has nothing to split and is logged as having
no effect.

A parameter of N elements is flattened and padded with zeros to n x k
elements (k = ceil(N / n), fewer than N); process r keeps row r of that
``[n, k]`` view of each of its state tensors shaped like the parameter
(scalar state, such as step counts, stays whole). Each optimizer step
(traced into the update graph):

1. the gradients of sharded parameters are reduce-scattered in buckets
   (each process receives the sum, or mean, of its rows), started as soon
   as the backward pass has computed them; the other gradients are
   all-reduced as without sharding (``gradients.py``);
2. each process updates its rows of the weights with its rows of the
   gradients and state: the update rules are elementwise, except for the
   norms, which are totalled over the processes: LAMB's per-tensor trust
   ratio, clipping's global norm (``max_grad_norm``) and automatic loss
   scaling's overflow check;
3. the updated rows are all-gathered into the whole weights, which every
   process holds for the next forward pass.

With ``setAccumulatorLocation(...useReplicatedTensorSharding(True))`` as
well, the running gradient buffer of gradient accumulation is sharded too
(stage 2): each micro-batch's gradients are reduce-scattered and added to
this process's rows, so the buffer takes 1/n of the memory, for G
reduce-scatters per optimizer step instead of one all-reduce.

With ``setWeightLocation(...useReplicatedTensorSharding(True))`` the
weights are sharded too (stage 3, ``weight_sharding.py``): the step's
inputs and outputs are this process's rows of them, each gathered whole
just before its use, and step 3 above is left out.

Outside the graph, the state is built per parameter (process 0's values,
broadcast, then cut into rows) and ``optimizer.state_dict()`` gathers it
whole (``state_service.py``: one process alone may ask), so checkpoints
are the unsharded format (docs/replicated_tensor_sharding.md).
"""
import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..logger import info_once
from ..optimizers.global_attributes import PartialGradients
from ..optimizers.rule import TensorNorms
from . import collectives, process_group
from .collectives import padded_rows, shard_numel
from . import gradients
from .gradients import GradientAllReduce, GradientExchange, buckets
from .weight_sharding import WeightRows


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Which trainable parameters have sharded optimizer state (and, with
    ``weights``, are kept in rows themselves), over how many processes."""
    parts: int                       # n, the processes of the run
    sharded: Tuple[bool, ...]        # per trainable position
    accumulators: bool               # the running gradient buffer too
    weights: bool = False            # the weights too (ZeRO stage 3)
    shapes: Tuple[torch.Size, ...] = ()   # per trainable position, whole

    @staticmethod
    def build(options, trainable: Sequence[torch.Tensor], processes: int,
              stage_per_process: bool, staged: bool) -> Optional["Sharding"]:
        """The sharding that ``options.TensorLocations`` asks for, for the
        ``trainable`` parameters of a run of ``processes`` processes (a
        multi-stage model when ``staged``); None when there is nothing to
        shard (the reason logged once). Sharding the weights shards their
        optimizer state too, as ZeRO stage 3 does; the weight location's
        ``minElementsForReplicatedTensorSharding`` then chooses the
        tensors, else the optimizer location's."""
        locations = options.TensorLocations
        weights = _weights_sharded(locations.weight_location, staged)
        optimizer = locations.optimizer_location
        if not weights and not _asks_for_sharding(optimizer):
            if _asks_for_sharding(locations.accumulator_location):
                info_once(
                    "TensorLocations.setAccumulatorLocation with "
                    "useReplicatedTensorSharding(True) has no effect "
                    "without it on the optimizer location: the gradient "
                    "buffer is sharded together with the optimizer state")
            return None
        if processes == 1:
            info_once(
                "Replicated tensor sharding has no effect in a one-process "
                "run: its replicas already share one copy of the weights "
                "and optimizer state; it splits them over the processes of "
                "a poprun (or torchrun) run")
            return None
        if stage_per_process:
            info_once(
                "Replicated tensor sharding has no effect on a pipeline "
                "with one stage per process: each process already keeps "
                "the weights and optimizer state of its own stage only")
            return None
        chooser = locations.weight_location if weights else optimizer
        minimum = chooser.min_elements_for_replicated_tensor_sharding
        sharded = tuple(p.numel() > minimum and p.numel() >= processes
                        for p in trainable)
        if not any(sharded):
            info_once(
                f"Replicated tensor sharding has no effect: no trainable "
                f"parameter has more than "
                f"minElementsForReplicatedTensorSharding ({minimum}) "
                f"elements")
            return None
        accumulators = _asks_for_sharding(locations.accumulator_location)
        if accumulators and staged:
            info_once(
                "TensorLocations.setAccumulatorLocation with "
                "useReplicatedTensorSharding(True) has no effect on a "
                "multi-stage model: its stages sum their gradients outside "
                "the captured optimizer step, whole")
            accumulators = False
        return Sharding(processes, sharded, accumulators, weights,
                        tuple(p.shape for p in trainable))

    def is_sharded(self, position: int, tensor: torch.Tensor,
                   param: torch.Tensor) -> bool:
        """Whether ``tensor``, optimizer state of the trainable parameter
        ``param`` at ``position``, is kept in rows (it has the parameter's
        shape)."""
        return self.sharded[position] and tensor.shape == param.shape

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Row ``rank`` of ``tensor`` (a copy, so the whole can be freed)."""
        return padded_rows(tensor, self.parts)[rank].clone()

    def whole(self, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The tensor of ``shape`` from its ``rows`` gathered in rank
        order."""
        return rows[:shape.numel()].view(shape).clone()

    def wholes(self, gathered: List[List[torch.Tensor]],
               shapes: Sequence[torch.Size]) -> List[torch.Tensor]:
        """The tensors of ``shapes`` whole from every process's rows of
        them (``gathered``: one list per process, in rank order)."""
        return [self.whole(torch.cat([rank[j] for rank in gathered]), shape)
                for j, shape in enumerate(shapes)]


def _asks_for_sharding(location) -> bool:
    return location is not None and location.replicated_tensor_sharding


def _weights_sharded(location, staged: bool) -> bool:
    """Whether the weight ``location`` shards the weights of a model
    (``staged``: a multi-stage one, whose weights stay whole, logged)."""
    if not _asks_for_sharding(location):
        return False
    if staged:
        info_once(
            "TensorLocations.setWeightLocation with "
            "useReplicatedTensorSharding(True) has no effect on a "
            "multi-stage model: weight sharding gathers the weights inside "
            "one captured step, and the stages of a multi-stage model are "
            "separate steps, so their weights stay whole (the optimizer "
            "location's sharding still applies)")
        return False
    return True


class StatePlacement:
    """Where a distributed model's optimizer state lives: process 0's
    values at the start, then each process's rows of the sharded tensors
    (the ``placement`` of ``OptimizerDeviceState``). The rows are gathered
    by ``state_service.py``, which works when one process alone asks."""

    def __init__(self, sharding: Optional[Sharding],
                 group: "process_group.ProcessGroup") -> None:
        self.sharding = sharding
        self.group = group
        self.number: Optional[int] = None

    def broadcast_(self, tensors: List[torch.Tensor]) -> None:
        """Process 0's values of ``tensors``, in place."""
        self.group.broadcast_(tensors, "the start-up weight broadcast")

    def shards(self, position: int, tensor: torch.Tensor,
               param: torch.Tensor) -> bool:
        """Whether the state ``tensor`` of the trainable ``param`` at
        ``position`` is kept in rows."""
        return (self.sharding is not None
                and self.sharding.is_sharded(position, tensor, param))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's rows of a sharded state ``tensor``."""
        return self.sharding.shard(tensor, self.group.rank)

    def weight_rows(self, trainable: Sequence[int]) -> Optional[WeightRows]:
        """With sharded weights, the rows this process keeps of them, the
        model's parameters at ``trainable`` indices being the trainable
        positions; None when the weights stay whole."""
        if self.sharding is None or not self.sharding.weights:
            return None
        return WeightRows(self.sharding, trainable, self.group)

    def register(self, state) -> None:
        """Serve the rows of ``state`` (an ``OptimizerDeviceState``) to the
        other processes, when it has any."""
        if self.sharding is not None:
            self.number = self.group.state_service().register(state)

    def publish(self, calls: int, rows: List[torch.Tensor]) -> None:
        """The registered state's ``rows`` after ``calls`` calls, for the
        other processes."""
        if self.number is not None:
            self.group.state_service().publish(self.number, calls, rows)

    def whole(self, calls: int, rows: List[torch.Tensor],
              params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The sharded state tensors of ``params`` whole, from this
        process's ``rows`` of them after ``calls`` calls and every other
        process's rows of the registered state."""
        gathered = self.group.state_service().gather(self.number, calls,
                                                     rows)
        return self.sharding.wholes(gathered, [p.shape for p in params])


class ShardedExchange(GradientExchange):
    """A sharded training step's exchange with the other processes (see the
    module's docstring), traced into its graphs."""

    def __init__(self, sharding: Sharding, average: bool) -> None:
        super().__init__(average)
        self.sharding = sharding
        self.reduces_each_micro_batch = sharding.accumulators

    def begin(self, like: torch.Tensor) -> None:
        """A step is traced: its token, and its gradient statistics
        (``StepScaling``'s ``partial``): the rows of sharded parameters'
        gradients counted where they are held and totalled over the
        processes, the whole gradients counted once, here."""
        super().begin(like)
        self.statistics = PartialGradients(
            self.sharding.sharded, self._total, like.device,
            everywhere=tuple(not s for s in self.sharding.sharded))

    def _total(self, value: torch.Tensor) -> None:
        torch.ops.poptorch.total_(value, self.token)

    def reduce_micro_batch(self, grads: List[torch.Tensor]
                           ) -> List[torch.Tensor]:
        """With a sharded running buffer, one micro-batch's gradients of
        the sharded parameters reduce-scattered (this process's rows), the
        others as they are."""
        if not self.sharding.accumulators:
            return grads
        return self._reduced(grads, [], self._sharded_positions(grads))

    def reduce(self, grads: List[torch.Tensor],
               rows_done: bool = False) -> List[torch.Tensor]:
        """The step's gradients combined over the processes: those of
        sharded parameters reduce-scattered (unless ``rows_done``: the
        running buffer holds reduced rows already), the others
        all-reduced."""
        sharded = [] if rows_done else self._sharded_positions(grads)
        whole = [i for i in range(len(grads)) if not self.sharding.sharded[i]]
        return self._reduced(grads, whole, sharded)

    def _sharded_positions(self, grads: List[torch.Tensor]) -> List[int]:
        return [i for i in range(len(grads)) if self.sharding.sharded[i]]

    def _reduced(self, grads: List[torch.Tensor], all_reduced: List[int],
                 scattered: List[int]) -> List[torch.Tensor]:
        """``grads`` with those at ``scattered`` reduce-scattered and those
        at ``all_reduced`` all-reduced: every collective started before the
        first wait, so that all can start during the backward pass."""
        to_scatter = [grads[i] for i in scattered]
        to_reduce = [grads[i] for i in all_reduced]
        all_reduce = GradientAllReduce(self.average, self.token)
        scattering = self._start_scatter(to_scatter)
        reducing = all_reduce.start(to_reduce)
        reduced = list(grads)
        for index, rows in zip(scattered, self._wait_scatter(to_scatter,
                                                             scattering)):
            reduced[index] = rows
        for index, value in zip(all_reduced,
                                all_reduce.wait(to_reduce, reducing)):
            reduced[index] = value
        return reduced

    def _start_scatter(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Start reduce-scattering ``grads``: one collective per bucket laid
        out as ``[n, K]``, row r holding every gradient's row r. Returns
        the buckets' flat tensors, for ``_wait_scatter``."""
        flats = []
        for bucket, positions in enumerate(buckets(grads)):
            flat = torch.cat([padded_rows(grads[i], self.sharding.parts)
                              for i in positions], dim=1).reshape(-1)
            torch.ops.poptorch.reduce_scatter_start_(flat, bucket,
                                                     self.token)
            flats.append(flat)
        return flats

    def _wait_scatter(self, grads: List[torch.Tensor],
                      flats: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each of ``grads``' rows of this process, summed (averaged) over
        the processes."""
        parts = self.sharding.parts
        rows = list(grads)
        for bucket, (positions, flat) in enumerate(zip(buckets(grads),
                                                       flats)):
            mine = torch.ops.poptorch.reduce_scatter_wait(
                flat, bucket, parts, self.average, self.token)
            sizes = [shard_numel(grads[i].numel(), parts) for i in positions]
            for index, piece in zip(positions, mine.split(sizes)):
                rows[index] = piece
        return rows

    def whole_weights(self, stored: List[torch.Tensor]
                      ) -> List[torch.Tensor]:
        """The trainable parameters whole, from the ``stored`` step inputs:
        with sharded weights, the rows of the sharded ones all-gathered
        (``weight_sharding.gather_weights_before_use`` then gathers each
        just before its first use, and again for the backward pass)."""
        if not self.sharding.weights:
            return stored
        return [torch.ops.poptorch.gather_rows(
                    rows, self.sharding.parts, list(shape), self.token)
                if sharded else rows
                for rows, sharded, shape in zip(stored, self.sharding.sharded,
                                                self.sharding.shapes)]

    def accumulators(self, params: List[torch.Tensor]
                     ) -> List[torch.Tensor]:
        """Tensors shaped as the running buffer holds the gradients of the
        trainable parameters stored as ``params``: rows for the sharded
        ones with a sharded buffer, else whole."""
        parts = self.sharding.parts
        shaped = []
        for param, sharded, shape in zip(params, self.sharding.sharded,
                                         self.sharding.shapes):
            if sharded and self.sharding.accumulators:
                param = param.new_empty(shard_numel(shape.numel(), parts))
            elif sharded and self.sharding.weights:
                param = param.new_empty(shape)
            shaped.append(param)
        return shaped

    def local(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """This process's rows of the sharded parameters (stored as rows
        already when the weights are sharded), the others whole."""
        if self.sharding.weights:
            return params
        parts = self.sharding.parts
        return [torch.ops.poptorch.local_shard(p, parts) if sharded else p
                for p, sharded in zip(params, self.sharding.sharded)]

    def gather(self, updated: List[torch.Tensor],
               params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The updated parameters as the step stores them, shaped as
        ``params``: with sharded weights, the rows as they are; else the
        rows of the sharded ones all-gathered whole, the others as they
        are. A parameter of at least ``gradients.FIRST_BUCKET_BYTES`` is
        gathered alone, straight into its whole tensor; smaller ones share
        buckets (by dtype and size), cut into their tensors by a copy."""
        if self.sharding.weights:
            return updated
        parts = self.sharding.parts
        positions = [i for i, sharded in enumerate(self.sharding.sharded)
                     if sharded]
        large = [i for i in positions
                 if params[i].numel() * params[i].element_size()
                 >= gradients.FIRST_BUCKET_BYTES]
        small = [i for i in positions if i not in large]
        result = list(updated)
        for index in large:
            result[index] = torch.ops.poptorch.gather_rows(
                updated[index], parts, list(params[index].shape), self.token)
        for group in buckets([updated[i] for i in small]):
            indices = [small[j] for j in group]
            flat = torch.cat([updated[i] for i in indices])
            whole = torch.ops.poptorch.all_gather(
                flat, parts, self.token).view(parts, -1)
            pieces = whole.split([updated[i].numel() for i in indices], dim=1)
            for index, piece in zip(indices, pieces):
                param = params[index]
                result[index] = piece.reshape(-1)[:param.numel()].view(
                    param.shape)
        return result

    def row_shapes(self, named: Dict[str, Tuple[torch.fx.Node, int]]
                   ) -> Dict[str, Tuple[List[int], int]]:
        """Of the update graph's ``named`` parameters, gradients and
        optimizer state (name: node, the trainable position of its
        parameter), those that are this process's rows (shaped ``[k]``,
        which a sharded parameter of N > k elements never is), with the
        whole shape and the number of processes."""
        parts = self.sharding.parts
        rows = {}
        for name, (node, position) in named.items():
            shape = self.sharding.shapes[position]
            size = shard_numel(shape.numel(), parts)
            if (self.sharding.sharded[position] and node is not None
                    and tuple(node.meta["val"].shape) == (size,)):
                rows[name] = (list(shape), parts)
        return rows

    def norms(self, positions: Sequence[int]) -> Optional[TensorNorms]:
        """Per-tensor norms for the update of the trainable ``positions``:
        those of sharded parameters' rows totalled over the processes."""
        sharded = [self.sharding.sharded[p] for p in positions]
        if not any(sharded):
            return None
        return functools.partial(_whole_norms, sharded, self.token)


def gathered_rows(graph: torch.fx.GraphModule, node: torch.fx.Node,
                  shape: List[int], parts: int) -> torch.fx.Node:
    """A node computing the whole tensor of which ``node`` is this
    process's rows (an anchored gradient or optimizer state), added to
    ``graph`` after its other collectives, in order with them (the step's
    token)."""
    token = next(n.args[-1] for n in graph.graph.nodes
                 if collectives.is_start(n))
    with graph.graph.inserting_before(graph.graph.output_node()):
        gathered = graph.graph.call_function(
            torch.ops.poptorch.gather_rows.default,
            (node, parts, shape, token))
    value = node.meta["val"]
    with value.fake_mode:
        gathered.meta["val"] = torch.ops.poptorch.gather_rows(
            value, parts, shape, token.meta["val"])
    return gathered


def _whole_norms(sharded: List[bool], token: torch.Tensor,
                 tensors: List[torch.Tensor],
                 dtype: torch.dtype) -> List[torch.Tensor]:
    """The 2-norms of whole tensors from ``tensors``, some of them
    (``sharded``) this process's rows: their squares totalled over the
    processes (float64), the others' norms computed here."""
    norms = list(torch._foreach_norm(tensors, 2, dtype=dtype))
    rows = [i for i, row in enumerate(sharded) if row]
    squares = torch.stack([norms[i] for i in rows]).to(torch.float64)
    squares = squares * squares
    torch.ops.poptorch.total_(squares, token)
    for index, total in zip(rows, squares.sqrt().to(dtype).unbind()):
        norms[index] = total
    return norms
