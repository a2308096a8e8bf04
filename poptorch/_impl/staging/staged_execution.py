"""Running a model whose blocks form several stages, each stage a separate
partition (``stages.py``) run in the execution strategy's order:
``PipelinedExecution`` training by ``torch.distributed.pipelining``
(``pipeline.py``); ``ShardedExecution``, the phased strategies and
inference stage after stage (``sequential_stages.py``): a forward-only
pipeline in one process would only reorder independent work.

Training runs, for each of the call's D iterations, the forward and backward
passes of the G x R micro-batches (autograd sums their gradients into the
parameters' ``.grad``), then one optimizer step: the same pure update as the
single-graph path (``training_step.trace_update_step``), so optimizers,
loss scaling, clipping and the Sum/Mean reductions mean the same here; the
graph backend runs it, writing the new weights and optimizer state into the
old tensors (``backends/in_place.py``). The results equal those of the
unannotated model within float tolerance.

Anchored tensors (``anchorTensor``) are extra outputs of the forward graph
before it is cut, so they travel to the last stage with its outputs.

Under ``poprun`` with whole replicas in each instance, every process runs
all the stages of its replicas and the update all-reduces the gradients,
as for single-graph models. Otherwise, in an n-process run, a training
model runs one stage per process
(``distributed/pipeline_processes.py``); each process updates its stage's
weights and receives the others' from their owners after each call. A
weight read by several stages gets their summed gradient and the same
update in each; clipping and automatic loss scaling take the statistics of
every stage's gradients.

Input tensors that ``forward`` writes in place are written in each
micro-batch's stacked copy and copied back into the call's inputs after
the step.

With R replicas in one process, the G x R micro-batches of a step all go
through the stages and share one update (replicas hold identical weights);
with ``broadcastBuffers(False)`` each micro-batch reads and writes its
replica's buffers, and a grouped weight (``replicaGrouping``) gives each
micro-batch its replica's value.

Not available yet with several stages (each raises ``poptorch.Error`` at
compilation): replication in a multi-process run that places one stage per
process, models writing to their input tensors when the stages run in
separate processes or are recomputed, and buffers that a stage reads and a
later stage writes when the stages run in separate processes
(``check_buffers_across_processes``). The stage graphs run as captured
graphs under autograd, with every backend.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...enums import ReductionType
from ...errors import Error
from ..backends import get_backend
from ..batching import BatchLayout, micro_batch
from ..device_loop import TrainingState
from ..distributed.gradients import GradientExchange
from ..distributed.pipeline_processes import PipelineProcesses
from ..failed_calls import CallProgress
from ..floating_point_checks import StepFlags
from ..logger import info_once
from ..optimizers.global_attributes import PartialGradients
from ..outputs import OutputCollector
from ..profiling.ranges import profile_range
from .pipeline import PipelineSchedule
from ..replication.grouping import GroupedWeights
from .sequential_stages import SequentialSchedule
from .stages import (REPLICA_KEY, StagedGraph, StageModule, StageState,
                     input_name)
from .strategies import PipelinedExecution
from ..training_step import (StepSettings, TrainingLayout, trace_update_step,
                             update_donation)


def _what(stages: int) -> str:
    return f"The model's blocks form {stages} stages, and"


def check_supported(layout: BatchLayout, processes: int,
                    written_inputs: bool, stages: int,
                    training: bool) -> None:
    """Raise ``poptorch.Error`` for what several stages cannot run yet."""
    what = _what(stages)
    if training and layout.replicas > 1 and processes > 1:
        raise Error(f"{what} replicationFactor is {layout.replicas} in a "
                    "multi-process run, which places one stage per process: "
                    "use replicationFactor(1) and K x R processes for R "
                    "pipelines of K stages.")
    if training and processes > 1 and processes % stages:
        raise Error(f"{what} the run has {processes} processes: a "
                    "multi-stage model places one stage per process, so the "
                    f"number of processes must be a multiple of {stages}.")
    if written_inputs and training and processes > 1:
        raise Error(f"{what} forward writes to its input tensors: in-place "
                    "writes to inputs are not available when the stages run "
                    "in separate processes.")


def check_buffers_across_processes(staged: StagedGraph,
                                   buffer_names: Sequence[str],
                                   processes: int, training: bool) -> None:
    """Raise ``poptorch.Error`` when stages in separate processes would
    read a buffer that a later stage writes: the stages work on different
    micro-batches at once, so the earlier stage cannot see the later one's
    write of the micro-batch before, as running them in order does."""
    if not training or processes <= 1:
        return
    found = staged.buffers_written_later
    if not found:
        return
    listed = ", ".join(f"{buffer_names[buffer]!r} (read by stage {reader}, "
                       f"written by stage {writer})"
                       for buffer, reader, writer in found)
    raise Error(f"{_what(len(staged.stages))} the run places one stage per "
                f"process, but stages read buffers that a later stage "
                f"writes: {listed}. A stage's next micro-batch would not see "
                "the later stage's update, which runs at the same time in "
                "another process. Put the layers that read and write each "
                "of these buffers in one block (stage), or run every stage "
                "in each process (poprun with --num-instances equal to "
                "--num-replicas).")


def check_recomputation(staged: StagedGraph, written_inputs: bool) -> None:
    """Raise ``poptorch.Error`` when a stage that is recomputed in the
    backward pass could write to the model's inputs again."""
    if written_inputs and any(staged.segments):
        raise Error(f"{_what(len(staged.stages))} forward writes to its "
                    "input tensors in place while recomputationCheckpoint "
                    "makes stages run their forward pass again in the "
                    "backward pass, which would write the inputs twice: "
                    "remove the checkpoints or the in-place writes.")


def _combines_gradients(settings: StepSettings,
                        params: List[torch.Tensor]) -> bool:
    """Whether gradients need combining per micro-batch (in another dtype
    than the parameters', or as a running mean) rather than autograd's
    sum in ``.grad``."""
    gradients = settings.gradients
    return gradients.keeps_running_mean or any(
        p.dtype != gradients.buffer_dtype(p) for p in params)


class StagedExecution:
    """The stages of a model and the schedule that runs them."""

    def __init__(self, staged: StagedGraph, strategy, params, trainable,
                 buffer_sets, grouped: GroupedWeights, device: torch.device,
                 training: bool, written_inputs: List[int]) -> None:
        self._staged = staged
        self._written_inputs = written_inputs
        self._owners = staged.param_owners()
        self._shared = {index for index, stages in enumerate(self._owners)
                        if len(stages) > 1}
        self._strategy = strategy
        self._device = device
        self._view = StageState(params, trainable, buffer_sets, grouped)
        self._modules = [StageModule(staged, index, self._view, training)
                         for index in range(len(staged.stages))]
        self._last = self._modules[-1]
        self._schedule = self._sequential_schedule()
        info_once(f"{type(strategy).__name__}: the model runs as "
                  f"{len(self._modules)} stage partitions on {device}")
        self._update: Optional[Callable] = None
        self._training_layout: Optional[TrainingLayout] = None
        self._settings: Optional[StepSettings] = None
        self._processes: Optional[PipelineProcesses] = None

    def _sequential_schedule(self) -> SequentialSchedule:
        return SequentialSchedule(self._modules, self._device,
                                  self._strategy.liveness)

    @property
    def stage_count(self) -> int:
        return len(self._modules)

    @property
    def modules(self) -> List[StageModule]:
        """The stage partitions, in order."""
        return list(self._modules)

    @property
    def schedule(self):
        """The schedule that runs the stages' micro-batches."""
        return self._schedule

    @property
    def graph(self) -> StagedGraph:
        """The forward graph and its stages."""
        return self._staged

    @property
    def training_layout(self) -> Optional[TrainingLayout]:
        return self._training_layout

    @property
    def settings(self) -> Optional[StepSettings]:
        """The training step's settings."""
        return self._settings

    @property
    def gradient_buffers(self) -> Dict[int, List[torch.Tensor]]:
        """The per-micro-batch gradient buffers of the parameters whose
        gradients are combined outside ``.grad`` (another dtype, running
        means), by parameter index."""
        return self._view.combined

    @property
    def forward_graph(self) -> torch.fx.GraphModule:
        """The forward graph cut into the stages."""
        return self._staged.forward

    def prepare_training(self, layout: TrainingLayout,
                         settings: StepSettings,
                         example: Dict[str, List[torch.Tensor]],
                         micro_batches: int,
                         processes: Optional[PipelineProcesses],
                         exchange: Optional[GradientExchange]) -> None:
        """Check the step's settings, capture the optimizer step and set up
        the schedule: with ``processes``, this process runs one stage of a
        pipeline; otherwise ``exchange`` (in a multi-process run whose
        processes each run all the stages) combines the step's gradients
        with the other processes' for the update."""
        if self._view.grouped:
            self._view.grouped.check_update(layout, settings)
        self._view.step_reduction = settings.reduction
        if _combines_gradients(settings, example["trainable"]):
            self._view.combine_gradients(settings.gradients,
                                         layout.trainable, self._shared)
        positions = self._owned_positions(layout, processes)
        partial = None
        if processes is not None:
            partial = processes.partial_gradients(
                [self._owners[layout.trainable[p]][0] == processes.stage
                 for p in positions], self._device)
        self._update = PartialUpdate(
            layout, settings, example, positions, partial,
            None if processes is not None else exchange)
        self._training_layout = layout
        self._settings = settings
        self._processes = processes
        if processes is not None or \
                isinstance(self._strategy, PipelinedExecution):
            self._schedule = PipelineSchedule(self._modules, self._device,
                                              micro_batches, processes)

    def _collect(self, collector: OutputCollector,
                 positions: List[Tuple[int, int, int]],
                 layout: BatchLayout,
                 weights: Sequence[torch.Tensor] = ()) -> None:
        """Hand the outputs of the micro-batches at ``positions``
        (iteration, step, replica) to the collector; outputs that share
        memory with ``weights``, which the update then overwrites, are
        copied."""
        recorded = self._last.recorded
        if self._processes is not None:
            recorded = self._processes.share_outputs(
                recorded, self._staged.output_metas, len(positions),
                self._device)
        storages = {w.untyped_storage().data_ptr() for w in weights}
        recorded = [[t.clone() if t.untyped_storage().data_ptr() in storages
                     else t for t in outputs] for outputs in recorded]
        for (iteration, step, replica), outputs in zip(positions, recorded):
            collector.add(iteration * layout.gradient_accumulation + step,
                          replica, outputs)
        self._last.recorded.clear()

    def run_inference(self, params: List[torch.Tensor],
                      buffer_sets: List[List[torch.Tensor]],
                      inputs: List[torch.Tensor], layout: BatchLayout,
                      collector: OutputCollector, progress: CallProgress,
                      flags: Optional[StepFlags] = None) -> None:
        """One inference call: the D x R micro-batches through the
        stages (one step for the schedule: ``progress`` is at its start;
        with ``flags``, each micro-batch's outputs are checked)."""
        progress.step(0, 0, 0)
        self._view.rebind(params, buffer_sets)
        positions = [(iteration, 0, replica)
                     for iteration in range(layout.device_iterations)
                     for replica in range(layout.replicas)]
        stacked = self._stacked(inputs, positions, layout)
        self._schedule.run(stacked, len(positions))
        self._write_back(stacked, inputs, positions, layout)
        if flags is not None:
            for position, outputs in zip(positions, self._last.recorded):
                flags.add_outputs(position, outputs)
        self._collect(collector, positions, layout)

    def run_training(self, state: TrainingState, inputs: List[torch.Tensor],
                     layout: BatchLayout, collector: OutputCollector,
                     progress: CallProgress,
                     flags: Optional[StepFlags] = None) -> None:
        """One training call: D optimizer steps of G x R micro-batches
        each (a step for ``progress`` per optimizer step; ``flags`` get
        each update's floating-point flags)."""
        if self._processes is None:
            self._run_steps(state, inputs, layout, collector, progress,
                            flags)
            return
        with self._processes.monitor.explaining("the pipeline's call"):
            self._processes.check_same_inputs(inputs)
            self._run_steps(state, inputs, layout, collector, progress,
                            flags)
            self._processes.broadcast_from_owners(self._owned(state))

    def updated_names(self, param_names: Sequence[str]) -> List[str]:
        """The names of the parameters this process's updates change, in
        the order of the update's floating-point flags, each with the
        stage that reads it (``fc1.weight (stage 0)``)."""
        trainable = self._training_layout.trainable
        names = []
        for position in self._update.positions:
            index = trainable[position]
            stages = ", ".join(str(s) for s in self._owners[index])
            plural = "s" if len(self._owners[index]) > 1 else ""
            names.append(f"{param_names[index]} (stage{plural} {stages})")
        return names

    def _run_steps(self, state: TrainingState, inputs: List[torch.Tensor],
                   layout: BatchLayout, collector: OutputCollector,
                   progress: CallProgress,
                   flags: Optional[StepFlags]) -> None:
        training = self._training_layout
        for iteration in range(layout.device_iterations):
            progress.step(iteration, 0, 0)
            with profile_range("device iteration"):
                self._run_step(state, inputs, layout, collector, iteration,
                               progress.position, flags)
        self._view.rebind(training.merge(state.trainable, state.frozen),
                          state.buffer_sets)

    def _run_step(self, state: TrainingState, inputs: List[torch.Tensor],
                  layout: BatchLayout, collector: OutputCollector,
                  iteration: int, position,
                  flags: Optional[StepFlags]) -> None:
        """One optimizer step: the G x R micro-batches through the stages,
        then the update."""
        training = self._training_layout
        self._view.rebind(training.merge(state.trainable, state.frozen),
                          state.buffer_sets)
        scaling = self._settings.attributes.bind(
            state.hyper[training.hyper_size():],
            state.optimizer[training.state_size():])
        factor = self._settings.gradients.loss_factor()
        positions = [(iteration, step, replica)
                     for step in range(layout.gradient_accumulation)
                     for replica in range(layout.replicas)]
        stacked = self._stacked(inputs, positions, layout)
        with torch.enable_grad():
            self._schedule.run(stacked, len(positions),
                               lambda loss: scaling.scale_loss(loss, factor))
        self._write_back(stacked, inputs, positions, layout)
        grads = self._view.gradients(training.trainable)
        self._combine_over_processes(grads)
        self._collect(collector, positions, layout, state.trainable)
        with profile_range("optimizer update"):
            step_flags = self._update(state, grads)
        if flags is not None and step_flags is not None:
            flags.add(position, step_flags)

    def _stacked(self, inputs: List[torch.Tensor],
                 positions: List[Tuple[int, int, int]],
                 layout: BatchLayout) -> Dict[str, torch.Tensor]:
        return _stacked(inputs, positions, layout, self._view.per_replica)

    def _write_back(self, stacked: Dict[str, torch.Tensor],
                    inputs: List[torch.Tensor],
                    positions: List[Tuple[int, int, int]],
                    layout: BatchLayout) -> None:
        """Copy the micro-batches' input tensors that forward wrote in place
        back into the call's inputs."""
        if not self._written_inputs:
            return
        for k, (iteration, step, replica) in enumerate(positions):
            micro = micro_batch(inputs, iteration, step,
                                layout.data_index(replica))
            for index in self._written_inputs:
                micro[index].copy_(stacked[input_name(index)][k])

    def _combine_over_processes(self, grads: List[torch.Tensor]) -> None:
        """In a multi-process pipeline: the gradients of weights read by
        several stages summed over the stages, then this stage's gradients
        reduced over the pipelines (in place)."""
        processes = self._processes
        if processes is None:
            return
        indices = self._training_layout.trainable
        shared = [grad for index, grad in zip(indices, grads)
                  if index in self._shared]
        with profile_range("all-reduce"):
            if shared:
                processes.sum_shared_gradients_(shared)
            processes.reduce_gradients_(
                [grad for index, grad in zip(indices, grads)
                 if processes.stage in self._owners[index]],
                self._settings.reduction == ReductionType.Mean)

    def _owned_positions(self, layout: TrainingLayout,
                         processes: Optional[PipelineProcesses]) -> List[int]:
        """The trainable positions this process updates: all of them in one
        process; in a multi-process pipeline, its stage's (the others come
        from their owners after each call, and its stage never reads
        them)."""
        if processes is None:
            return list(range(len(layout.trainable)))
        return [position for position, index in enumerate(layout.trainable)
                if processes.stage in self._owners[index]]

    def _owned(self, state: TrainingState) -> List[List[torch.Tensor]]:
        """Per stage, the trained weights, optimizer state and written
        buffers it owns."""
        training = self._training_layout
        state_of = training.state_indices()
        owned: List[List[torch.Tensor]] = [[] for _ in self._modules]
        for position, index in enumerate(training.trainable):
            stage = self._owners[index][0]
            owned[stage].append(state.trainable[position])
            owned[stage].extend(state.optimizer[i]
                                for i in state_of.get(position, []))
        for stage, written in enumerate(self._staged.buffer_writers()):
            for buffers in state.buffer_sets:
                owned[stage].extend(buffers[i] for i in written)
        return owned


class PartialUpdate:
    """The optimizer step of some trainable positions: the captured update
    of their restricted layout, run by the graph backend, which writes the
    new weights and optimizer state into the old tensors
    (``backends/in_place.py``). With ``partial``, other processes hold the
    step's other gradients (a pipeline over processes); ``exchange``
    combines the gradients with the other processes' (processes that each
    run all the stages; ``distributed/``)."""

    def __init__(self, layout: TrainingLayout, settings: StepSettings,
                 example: Dict[str, List[torch.Tensor]],
                 positions: List[int],
                 partial: Optional[PartialGradients] = None,
                 exchange: Optional[GradientExchange] = None) -> None:
        part, self._state, self._hyper = layout.restricted(positions)
        self.positions = positions
        self._flagged = settings.finite_checks and bool(positions)
        self._state_tail = layout.state_size()
        self._hyper_tail = layout.hyper_size()
        example = {"trainable": [example["trainable"][p] for p in positions],
                   "state": self._state_of(example["state"]),
                   "hyper": self._hyper_of(example["hyper"])}
        self._step = get_backend("graph").compile(
            trace_update_step(part, settings, example, partial,
                              exchange), [],
            update_donation(example))

    def _state_of(self, flat: List[torch.Tensor]) -> List[torch.Tensor]:
        return [flat[i] for i in self._state] + flat[self._state_tail:]

    def _hyper_of(self, flat: List[torch.Tensor]) -> List[torch.Tensor]:
        return [flat[i] for i in self._hyper] + flat[self._hyper_tail:]

    def __call__(self, state: TrainingState,
                 grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """Update ``state`` (trainable weights, optimizer state) with the
        step's summed ``grads`` (all trainable positions); return the
        update's floating-point flags when it checks them."""
        params = [state.trainable[p] for p in self.positions]
        result = self._step(*params, *[grads[p] for p in self.positions],
                            *self._state_of(state.optimizer),
                            *self._hyper_of(state.hyper))
        flags = result[-1] if self._flagged else None
        if self._flagged:
            result = result[:-1]
        trainable, optimizer = list(state.trainable), list(state.optimizer)
        for position, tensor in zip(self.positions, result):
            trainable[position] = tensor
        new_state = result[len(params):]
        indices = self._state + list(range(self._state_tail, len(optimizer)))
        for index, tensor in zip(indices, new_state):
            optimizer[index] = tensor
        state.trainable, state.optimizer = trainable, optimizer
        return flags


def _stacked(inputs: List[torch.Tensor],
             positions: List[Tuple[int, int, int]], layout: BatchLayout,
             per_replica: bool) -> Dict[str, torch.Tensor]:
    """The stages' keyword arguments for the micro-batches at (iteration,
    step, replica) ``positions``, stacked along a new first dimension: the
    micro-batch tensors and, when replicas keep their own buffers or
    grouped weights, the replica indices (on the host)."""
    micro = [micro_batch(inputs, iteration, step, layout.data_index(replica))
             for iteration, step, replica in positions]
    stacked = {input_name(i): torch.stack([m[i] for m in micro])
               for i in range(len(inputs))}
    if per_replica:
        stacked[REPLICA_KEY] = torch.tensor([replica for _, _, replica
                                             in positions])
    return stacked
