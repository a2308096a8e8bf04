"""A multi-stage model as separate partitions: the forward graph cut by
stage, each stage an ``nn.Module`` that autograd differentiates.

The forward pass is captured once (fake mode, like every capture) as

    (parameters, buffers, micro-batch) -> (written buffers, outputs, [loss])

with each operation carrying its block annotation. The execution strategy's
placements give every block a stage; the graph is cut into those stages
(``partition.py``) and each stage becomes a ``StageModule``: its forward pass
takes the activations of the stage before (positional arguments) and the
micro-batch (keyword arguments, every stage gets them all) and returns the
activations the stages after it need. Each stage writes its own buffers as
its forward pass runs, so the next micro-batch of that stage reads them.
The last stage also returns the model's outputs and the loss.

Inside a stage, ``recomputationCheckpoint`` cuts the stage's graph into
segments. In training, each segment runs under ``torch.utils.checkpoint``:
only the segments' inputs (the stage's inputs and the checkpointed tensors)
are kept for the backward pass, and the rest of the stage's activations are
recomputed, a segment at a time, when the backward pass reaches them.
"""
import contextlib
import dataclasses
import functools
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.utils.checkpoint

from ...enums import ReductionType
from .. import blocks, losses
from . import no_grad_regions, partition
from ..capture import (ModelAnalysis, ModelCall, capture_scope, clone_written,
                       split_flat, tensor_outputs, trace_user_code)
from ..graph_writes import roots_and_writes, written_placeholders
from ..optimizers.gradient_reduction import GradientReduction
from ..profiling.ranges import profile_range
from ..replication.grouping import GroupedWeights
from .strategies import BlockPlacement

@dataclasses.dataclass
class StagedGraph:
    """The forward graph of a model cut into stages."""
    forward: fx.GraphModule
    stages: List[partition.Part]
    segments: List[List[partition.Part]]  # per stage, see ``segments``
    num_params: int
    num_buffers: int
    written_buffers: List[int]          # buffer indices, as in the outputs
    written_inputs: List[int]           # inputs forward writes in place
    num_outputs: int                    # model output tensors
    has_loss: bool
    output_metas: List[Tuple[torch.Size, torch.dtype]]  # model outputs
    # (buffer index, stage that reads it, later stage that writes it)
    buffers_written_later: List[Tuple[int, int, int]]

    def param_owners(self) -> List[List[int]]:
        """The stages that read each parameter."""
        owners: List[List[int]] = [[] for _ in range(self.num_params)]
        for index, stage in enumerate(self.stages):
            for source in stage.sources:
                if source < self.num_params:
                    owners[source].append(index)
        return owners

    def buffer_writers(self) -> List[List[int]]:
        """The buffers each stage writes."""
        return [[self.written_buffers[position]
                 for position in stage.own_outputs
                 if position < len(self.written_buffers)]
                for stage in self.stages]


def trace_forward(call: ModelCall, analysis: ModelAnalysis,
                  params: List[torch.Tensor], buffers: List[torch.Tensor],
                  inputs: List[torch.Tensor], training: bool,
                  training_flags: Dict[str, bool]) -> fx.GraphModule:
    """The forward graph (params, buffers, inputs) -> (written buffers,
    output tensors, [the final loss as a scalar])."""

    def forward(*flat):
        p, b, x = split_flat(flat, [len(params), len(buffers)])
        b = clone_written(b, analysis.written_buffers)
        with losses.LossRecorder() as recorder, \
                _no_grad_marked(training):
            output = call(p, b, x)
        returned = tensor_outputs(output)
        loss = ([analysis.backward_start(recorder.losses, returned)]
                if training else [])
        return [b[i] for i in analysis.written_buffers] + returned + loss

    with capture_scope(call.module, training_flags), \
            losses.recording_mode(training):
        graph = trace_user_code(forward, list(params) + list(buffers) +
                                list(inputs), keep_detaches=True)
    if training:
        no_grad_regions.detach_inputs(graph.graph)
        graph.recompile()
    return graph


def _no_grad_marked(training: bool):
    """In training, the operations ``forward`` runs under
    ``torch.no_grad()`` are marked for ``no_grad_regions.detach_inputs``."""
    return no_grad_regions.marked() if training else contextlib.nullcontext()


def cut_into_stages(graph: fx.GraphModule,
                    placements: Dict[str, BlockPlacement],
                    analysis: ModelAnalysis, num_params: int,
                    num_buffers: int, training: bool) -> StagedGraph:
    """Cut the forward graph by the stage of each block; in training, cut
    each stage at its recomputation checkpoints too."""
    blocks.propagate_block_annotations(graph.graph.nodes)
    stage_ids = sorted({p.stage_id for p in placements.values()})
    stage_of_block = {block: stage_ids.index(p.stage_id)
                      for block, p in placements.items()}

    def given(node: fx.Node) -> Optional[int]:
        block = (node.meta.get("custom") or {}).get(blocks.BLOCK_KEY)
        if block is None and _reads_sources_only(node):
            return None
        return stage_of_block.get(block if block is not None
                                  else blocks.BEFORE_FIRST_BLOCK)

    def describe(index: int) -> str:
        names = sorted(b for b, s in stage_of_block.items() if s == index)
        return f"stage {stage_ids[index]} (block(s) {', '.join(names)})"

    parts = partition.assign_parts(graph.graph, given, describe)
    written = len(analysis.written_buffers)
    outputs = partition.output_values(graph.graph)
    output_parts = [parts.get(o, 0) for o in outputs[:written]]
    output_parts += [len(stage_ids) - 1] * (len(outputs) - written)
    stages = partition.split(graph, parts, len(stage_ids), output_parts)
    written_later = _buffers_written_later(
        graph.graph, parts, outputs[:written], analysis.written_buffers)
    return StagedGraph(
        forward=graph, stages=stages,
        segments=[segments(stage) if training else [] for stage in stages],
        num_params=num_params, num_buffers=num_buffers,
        written_buffers=list(analysis.written_buffers),
        written_inputs=list(analysis.written_inputs),
        num_outputs=len(outputs) - written - int(training),
        has_loss=training,
        output_metas=[(o.meta["val"].shape, o.meta["val"].dtype)
                      for o in outputs[written:len(outputs) - int(training)]],
        buffers_written_later=written_later)


def _buffers_written_later(graph: fx.Graph, parts: Dict[fx.Node, int],
                           written: Sequence[fx.Node],
                           buffers: Sequence[int]
                           ) -> List[Tuple[int, int, int]]:
    """(buffer index, reading stage, writing stage) of each written buffer
    that a stage after the first one reading it writes in place (a
    BatchNorm run by two stages, an EMA read early and updated late): its
    copy travels to the later stage as an activation, which that stage
    updates. Within a process both stages hold the same tensor; the next
    micro-batch of the earlier stage reads the later stage's write."""
    root_of, writers = roots_and_writes(graph)
    found = []
    for buffer, value in zip(buffers, written):
        root = root_of.get(value, value)
        reader = parts.get(root, 0)
        last = max((parts.get(w, 0) for w in writers.get(root, ())),
                   default=reader)
        if last > reader:
            found.append((buffer, reader, last))
    return found


def _is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and \
        node.target is torch.ops.poptorch.recomputation_checkpoint.default


def segments(stage: partition.Part) -> List[partition.Part]:
    """The stage's graph cut after each recomputation checkpoint (a node
    belongs to the latest segment among its inputs, a checkpoint starts a
    new one); empty when the stage has no checkpoint. A segment's sources
    index the stage graph's placeholders."""
    graph = stage.module.graph
    segment: Dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        inputs = [segment[s] for s in node.all_input_nodes if s in segment]
        segment[node] = max(inputs, default=0) + int(_is_checkpoint(node))
    count = max(segment.values(), default=0) + 1
    if count == 1:
        return []
    return partition.split(stage.module, segment, count)


class StageState:
    """The tensors the stages read: parameters (the trainable ones as
    ``nn.Parameter`` leaves whose ``.grad`` collects the step's gradient
    sum) and the buffers, which stages replace as they write them: one set,
    or one per replica when replicas keep their own buffers. A grouped
    weight (``replicaGrouping``) is held as its rows, and each micro-batch
    reads its replica's value (``GroupedWeights.per_replica``, whose
    backward pass reduces the gradients within the group). With either, a
    micro-batch says its replica under ``REPLICA_KEY``.

    With ``combine_gradients`` (an ``accum_type`` other than a parameter's
    dtype, or the ``Running`` mean), each micro-batch's gradient is instead
    combined into a buffer of the reduction as soon as autograd has added
    it to ``.grad`` (``GradientReduction.add``, as the single-graph step
    does)."""

    def __init__(self, params: List[torch.Tensor], trainable: Sequence[int],
                 buffer_sets: List[List[torch.Tensor]],
                 grouped: GroupedWeights) -> None:
        trainable = set(trainable)
        self.params: List[torch.Tensor] = [
            torch.nn.Parameter(t, requires_grad=True) if i in trainable
            else t for i, t in enumerate(params)]
        self.buffer_sets = buffer_sets
        self.grouped = grouped
        self.step_reduction: Optional[ReductionType] = None
        self._reduction: Optional[GradientReduction] = None
        self._combined: Dict[int, List[torch.Tensor]] = {}
        self._sums: Dict[int, torch.Tensor] = {}

    @property
    def per_replica(self) -> bool:
        """Whether micro-batches must say their replica."""
        return len(self.buffer_sets) > 1 or bool(self.grouped)

    def param(self, index: int,
              inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Parameter ``index`` as the micro-batch's replica sees it."""
        param = self.params[index]
        if index not in self.grouped.groupings:
            return param
        replica = int(inputs[REPLICA_KEY][0])
        return self.grouped.per_replica(index, param,
                                        self.step_reduction)[replica]

    def combine_gradients(self, reduction: GradientReduction,
                          indices: Sequence[int],
                          shared: AbstractSet[int] = frozenset()) -> None:
        """Combine the gradients of parameters ``indices`` per micro-batch
        into ``reduction``'s buffers. The gradient of a ``shared`` weight
        (read by several stages) arrives in parts, one per stage, possibly
        between other micro-batches' parts: for the running mean, its parts
        are summed in float32 and the sum divided by the step's
        micro-batches at the end."""
        self._reduction = reduction
        for i in indices:
            summed = reduction.keeps_running_mean and i in shared
            if summed:
                self._sums[i] = self._zero_sum(i)
            else:
                self._combined[i] = reduction.start([self.params[i]])
            self.params[i].register_post_accumulate_grad_hook(
                functools.partial(self._add_part if summed
                                  else self._combine, i))

    def _combine(self, index: int, param: torch.Tensor) -> None:
        self._combined[index] = self._reduction.add(self._combined[index],
                                                    [param.grad])
        param.grad = None

    def _zero_sum(self, index: int) -> torch.Tensor:
        param = self.params[index]
        return torch.zeros_like(param, dtype=torch.promote_types(
            param.dtype, torch.float32))

    def _add_part(self, index: int, param: torch.Tensor) -> None:
        self._sums[index] += param.grad
        param.grad = None

    def _mean_of_parts(self, index: int) -> torch.Tensor:
        """A shared weight's running-mean gradient, from its parts' sum."""
        dtype = self._reduction.buffer_dtype(self.params[index])
        mean = (self._sums[index] / self._reduction.micro_batches).to(dtype)
        self._sums[index] = self._zero_sum(index)
        return mean

    def rebind(self, params: List[torch.Tensor],
               buffer_sets: List[List[torch.Tensor]]) -> None:
        """Point the stages at the current device state."""
        for i, tensor in enumerate(params):
            if isinstance(self.params[i], torch.nn.Parameter):
                self.params[i].data = tensor
            else:
                self.params[i] = tensor
        self.buffer_sets = buffer_sets

    @property
    def combined(self) -> Dict[int, List[torch.Tensor]]:
        """The combined gradient buffers, by parameter index."""
        return self._combined

    def buffers(self, inputs: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        """The buffers of the micro-batch's replica (the only set when
        replicas share buffers)."""
        if len(self.buffer_sets) == 1:
            return self.buffer_sets[0]
        return self.buffer_sets[int(inputs[REPLICA_KEY][0])]

    def gradients(self, indices: Sequence[int]) -> List[torch.Tensor]:
        """The summed (combined) gradients of parameters ``indices`` (zeros
        for those the loss did not reach), then reset for the next step."""
        grads = []
        for i in indices:
            param = self.params[i]
            if i in self._sums:
                grads.append(self._mean_of_parts(i))
                continue
            if i in self._combined:
                grads.append(self._combined[i][0])
                self._combined[i] = self._reduction.start([param])
                continue
            grads.append(torch.zeros_like(param) if param.grad is None
                         else param.grad)
            param.grad = None
        return grads


class StageModule(torch.nn.Module):
    """One stage: ``forward(*activations, **micro_batch)``, where each
    micro-batch tensor (and the replica index, see ``StageState``) comes
    with a leading dimension of size 1 (a schedule cuts the stacked
    micro-batches of a step along it).

    A stage that reads input tensors which ``forward`` writes in place
    writes them in copies, then copies them into the micro-batch tensors it
    was given: the micro-batches of a step are slices of one stacked
    tensor, so writing them directly would invalidate tensors that earlier
    micro-batches saved for their backward pass.

    Running statistics of a batch normalisation that a stage before
    updated arrive as activations, and are passed to the stage's graph
    detached (``no_grad_regions.statistics_inputs``).

    ``skip_effects_once`` makes the first call a dry run (no buffer written,
    no output recorded, in-place writes to inputs made on copies), for the
    pipeline schedule's shape inference."""

    def __init__(self, staged: StagedGraph, index: int, state: StageState,
                 training: bool) -> None:
        super().__init__()
        self.index = index
        self.part = staged.stages[index]
        self.segments = [_on_copies_of_written(segment.module)
                         for segment in staged.segments[index]]
        self._segment_sources = [segment.sources
                                 for segment in staged.segments[index]]
        self.is_last = index == len(staged.stages) - 1
        self.staged = staged
        self.state = state
        self.training_stage = training
        self.recorded: List[List[torch.Tensor]] = []
        self.skip_effects_once = False
        first_input = staged.num_params + staged.num_buffers
        self._written_inputs = [input_name(i) for i in staged.written_inputs
                                if first_input + i in self.part.sources]
        self._carried_statistics = no_grad_regions.statistics_inputs(
            self.part.module.graph)
        self._written_positions = frozenset(
            written_placeholders(self.part.module.graph))
        for i in self.part.sources:
            if i < staged.num_params and \
                    isinstance(state.params[i], torch.nn.Parameter):
                self.register_parameter(f"param{i}", state.params[i])

    def _source(self, index: int, buffers: List[torch.Tensor],
                inputs: Dict[str, torch.Tensor]):
        staged = self.staged
        if index < staged.num_params:
            return self.state.param(index, inputs)
        index -= staged.num_params
        if index < staged.num_buffers:
            return buffers[index]
        return inputs[input_name(index - staged.num_buffers)][0]

    def __call__(self, *carried: torch.Tensor, **inputs: torch.Tensor):
        """``forward``, without module hooks: the user's global ones
        (``register_module_forward_hook``) ran on their own modules when
        the model was captured, and must not see the stages."""
        return self.forward(*carried, **inputs)

    def forward(self, *carried: torch.Tensor, **inputs: torch.Tensor):
        with profile_range(f"stage {self.index} forward"):
            return self._forward(carried, inputs)

    def _forward(self, carried: Tuple[torch.Tensor, ...],
                 inputs: Dict[str, torch.Tensor]):
        differentiable = self.training_stage and torch.is_grad_enabled()
        if differentiable:
            carried = tuple(_as_differentiable_leaf(t) for t in carried)
        dry_run = self.skip_effects_once
        if dry_run:
            _zero_in_place(carried)
            inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        written = {name: inputs[name] for name in self._written_inputs}
        inputs.update({name: t.clone() for name, t in written.items()})
        buffers = self.state.buffers(inputs)
        stage_inputs = [t.detach() if position in self._carried_statistics
                        else t for position, t in enumerate(carried)]
        stage_inputs += [self._source(i, buffers, inputs)
                         for i in self.part.sources]
        stage_inputs = self._copies_to_write(stage_inputs, len(carried),
                                             dry_run)
        if self.segments:
            result = self._run_segments(stage_inputs)
        else:
            result = self.part.module.forward(*stage_inputs)
        passed = tuple(result[:self.part.carried_out])
        if differentiable:
            passed = tuple(_as_differentiable_leaf(t) for t in passed)
        own = list(result[self.part.carried_out:])
        with torch.no_grad():
            for name, original in written.items():
                original.copy_(inputs[name])
        if self.skip_effects_once:
            self.skip_effects_once = False
        else:
            self._apply_effects(own, buffers)
        if not self.is_last:
            return passed
        return tuple(own[-(self.staged.num_outputs +
                           int(self.staged.has_loss)):])

    def _copies_to_write(self, stage_inputs: List[torch.Tensor],
                         carried: int, dry_run: bool) -> List[torch.Tensor]:
        """Copies of the inputs the stage writes in place: of activations
        from the stage before that have gradients (leaves of its backward
        pass, which autograd does not let be written: the copy passes their
        gradient on; running statistics carried from an earlier stage stay
        shared with it) and, in the dry run, of everything (a frozen weight
        the stage updates, as a momentum encoder is, must be written once
        per micro-batch)."""
        return [value.clone() if position in self._written_positions and
                (dry_run or (position < carried and value.requires_grad))
                else value for position, value in enumerate(stage_inputs)]

    def _apply_effects(self, own: List[torch.Tensor],
                       buffers: List[torch.Tensor]) -> None:
        written = self.staged.written_buffers
        for position, value in zip(self.part.own_outputs, own):
            if position < len(written):
                buffers[written[position]] = value.detach()
        if self.is_last:
            results = own[len(own) - self.staged.num_outputs -
                          int(self.staged.has_loss):]
            self.recorded.append([t.detach() for t in
                                  results[:self.staged.num_outputs]])

    def _run_segments(self, stage_inputs: List[torch.Tensor]):
        carried: Sequence[torch.Tensor] = ()
        for run, sources in zip(self.segments, self._segment_sources):
            values = list(carried) + [stage_inputs[i] for i in sources]
            if torch.is_grad_enabled():
                carried = torch.utils.checkpoint.checkpoint(
                    run, *values, use_reentrant=False)
            else:
                carried = run(*values)
        return carried


def _on_copies_of_written(module: fx.GraphModule):
    """``module``'s code (called without module hooks) run on copies of the
    inputs it writes in place (a copy of a buffer BatchNorm updates): its
    recomputation in the backward pass then starts from the values the
    forward pass started from, and leaves the values that pass returned as
    they were."""
    written = set(written_placeholders(module.graph))
    if not written:
        return module.forward

    def run(*values: torch.Tensor):
        return module.forward(*(value.clone() if index in written else value
                                for index, value in enumerate(values)))
    return run


def _reads_sources_only(node: fx.Node) -> bool:
    """Whether ``node`` is a deterministic operation on placeholders and
    constants alone (the copies of written buffers made before the model
    runs, a transposed weight): outside any block, it joins the first
    stage that uses it rather than the layers before the first block, so
    that no stage receives a buffer as an activation."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and \
            torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return all(source.op in ("placeholder", "get_attr")
               for source in node.all_input_nodes)


def input_name(index: int) -> str:
    """The keyword under which stages receive micro-batch tensor ``index``."""
    return f"input{index}"


#: The keyword under which stages receive the micro-batch's replica index
#: (when replicas keep their own buffers or weights are grouped).
REPLICA_KEY = "replica"


def _as_differentiable_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """Floating-point activations passed between stages all take part in the
    backward pass: those from a stage in the same process arrive detached,
    and the stage must still report their gradient to the stage before it;
    those computed without a gradient (a mask, a detached value) get a zero
    one, so that every stage agrees on which activations have gradients."""
    if tensor.is_leaf and not tensor.requires_grad and \
            tensor.is_floating_point():
        tensor.requires_grad_()
    return tensor


@torch.no_grad()
def _zero_in_place(tensors: Sequence[torch.Tensor]) -> None:
    """The pipeline's shape inference runs each stage once on uninitialised
    activations: zeros keep integer activations valid as indices."""
    for tensor in tensors:
        tensor.zero_()
