"""The device loop: one call of a wrapped model runs all its D x G x R
micro-batch steps here without returning to the user (docs/semantics.md,
"One call of a wrapped model").

Each replica step reads its own slice of the data; on the vectorised replica
path (``replication/replicas.py``) one step covers all the replicas. Training sums
the gradients of the G x R micro-batches of a step in a running sum, the
same tensors every step, zeroed at its start (with one micro-batch per
step, which some backends also give a buffer, the step writes it), and
applies one optimizer update on the last micro-batch; buffers change on
every micro-batch.
"""
import dataclasses
from typing import List, Optional

import torch

from .backends.backend import CompiledStep
from .batching import BatchLayout, micro_batch
from .failed_calls import CallProgress
from .floating_point_checks import StepFlags
from .outputs import OutputCollector
from .profiling.ranges import profile_range

#: Range names on the timeline (docs/profiling.md): a device iteration, a
#: micro-batch step, and the step of an optimizer step's last micro-batch,
#: which applies the update in the same graph.
ITERATION = "device iteration"
STEP = "step"
UPDATE_STEP = "step + optimizer update"


@dataclasses.dataclass
class InferenceSteps:
    step: CompiledStep
    written_buffers: List[int]
    written_params: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TrainingSteps:
    update: CompiledStep                # the last micro-batch of a step
    accumulate: Optional[CompiledStep]  # the others (None when G x R == 1)
    written_buffers: List[int]
    running: List[torch.Tensor]         # the running gradient buffer, if
                                        # the steps keep one
    finite_checks: bool = False         # steps return floating-point flags
                                        # before the model's outputs
    #: The frozen parameters (positions among them) ``forward`` writes in
    #: place, a teacher's EMA update (``ReplicaWrites``).
    written_frozen: List[int] = dataclasses.field(default_factory=list)


class ReplicaWrites:
    """Parameters that ``forward`` writes in place (a teacher updated as an
    EMA of the student) are one tensor for all the replicas that run in
    turn (the sequential replica path), where each replica would write on
    top of the one before, R updates per step. As each replica writes its
    own copy in PopTorch and the host sees the first replica's, every
    replica of a step starts from the values the step started from, and
    the first replica's result is kept."""

    def __init__(self, tensors: List[torch.Tensor], replicas: int) -> None:
        self._tensors = tensors if replicas > 1 else []
        self._last = replicas - 1
        self._start: List[torch.Tensor] = []
        self._first: List[torch.Tensor] = []

    def before(self, replica: int) -> None:
        if not self._tensors:
            return
        if replica == 0:
            self._start = [t.clone() for t in self._tensors]
        else:
            torch._foreach_copy_(self._tensors, self._start)

    def after(self, replica: int) -> None:
        if not self._tensors:
            return
        if replica == 0:
            self._first = [t.clone() for t in self._tensors]
        elif replica == self._last:
            torch._foreach_copy_(self._tensors, self._first)


def _store_buffers(buffers: List[torch.Tensor], written: List[int],
                   values) -> None:
    for index, value in zip(written, values):
        buffers[index] = value


def run_inference(steps: InferenceSteps, params: List[torch.Tensor],
                  buffer_sets: List[List[torch.Tensor]],
                  inputs: List[torch.Tensor], layout: BatchLayout,
                  collector: OutputCollector, progress: CallProgress,
                  flags: Optional[StepFlags] = None) -> None:
    written = len(steps.written_buffers)
    writes = ReplicaWrites([params[i] for i in steps.written_params],
                           layout.replicas)
    for iteration in range(layout.device_iterations):
        with profile_range(ITERATION):
            for replica in range(layout.replicas):
                progress.step(iteration, 0, replica)
                buffers = buffer_sets[replica % len(buffer_sets)]
                micro = micro_batch(inputs, iteration, 0,
                                    layout.data_index(replica))
                writes.before(replica)
                with profile_range(STEP):
                    result = steps.step(*params, *buffers, *micro)
                writes.after(replica)
                _store_buffers(buffers, steps.written_buffers,
                               result[:written])
                if flags is not None:
                    flags.add_outputs(progress.position, result[written:])
                collector.add(iteration, replica, result[written:])


@dataclasses.dataclass
class TrainingState:
    """What a training call reads and replaces, as flat lists."""
    trainable: List[torch.Tensor]
    frozen: List[torch.Tensor]
    buffer_sets: List[List[torch.Tensor]]
    optimizer: List[torch.Tensor]
    hyper: List[torch.Tensor]


def run_training(steps: TrainingSteps, state: TrainingState,
                 inputs: List[torch.Tensor], layout: BatchLayout,
                 collector: OutputCollector, progress: CallProgress,
                 flags: Optional[StepFlags] = None) -> None:
    for iteration in range(layout.device_iterations):
        with profile_range(ITERATION):
            _training_iteration(steps, state, inputs, layout, collector,
                                progress, flags, iteration)


def _training_iteration(steps: TrainingSteps, state: TrainingState,
                        inputs: List[torch.Tensor], layout: BatchLayout,
                        collector: OutputCollector, progress: CallProgress,
                        flags: Optional[StepFlags], iteration: int) -> None:
    """One device iteration: the G x R micro-batch steps of one optimizer
    step."""
    accumulation = layout.gradient_accumulation
    replicas = layout.replicas
    written = len(steps.written_buffers)
    trained = len(state.trainable)
    flagged = int(steps.finite_checks)
    running = steps.running
    if steps.accumulate is not None and running:
        torch._foreach_zero_(running)
    writes = ReplicaWrites([state.frozen[i] for i in steps.written_frozen],
                           replicas)
    for step in range(accumulation):
        for replica in range(replicas):
            progress.step(iteration, step, replica)
            writes.before(replica)
            buffers = state.buffer_sets[replica % len(state.buffer_sets)]
            micro = micro_batch(inputs, iteration, step,
                                layout.data_index(replica))
            head = state.trainable + state.frozen + buffers
            last = step == accumulation - 1 and replica == replicas - 1
            if not last:
                with profile_range(STEP):
                    result = steps.accumulate(*head, *state.optimizer,
                                              *state.hyper, *running, *micro)
                _store_buffers(buffers, steps.written_buffers,
                               result[:written])
                end = written + len(steps.running)
                running = result[written:end]
            else:
                with profile_range(UPDATE_STEP):
                    result = steps.update(*head, *state.optimizer,
                                          *state.hyper, *running, *micro)
                state.trainable = list(result[:trained])
                _store_buffers(buffers, steps.written_buffers,
                               result[trained:trained + written])
                end = trained + written + len(state.optimizer)
                state.optimizer = list(result[trained + written:end])
            writes.after(replica)
            if flagged:
                flags.add(progress.position, result[end])
            collector.add(iteration * accumulation + step, replica,
                          result[end + flagged:])
