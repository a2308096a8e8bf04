"""Running a model whose blocks form several stages, each stage a separate
partition (``stages.py``) run in the execution strategy's order:
``PipelinedExecution`` training by ``torch.distributed.pipelining``
(``pipeline.py``); ``ShardedExecution``, the phased strategies and
inference stage after stage (``sequential_stages.py``): a forward-only
pipeline in one process would only reorder independent work.

Training runs, for each of the call's D iterations, the forward and backward
passes of the G micro-batches (autograd sums their gradients into the
parameters' ``.grad``), then one optimizer step: the same pure update as the
single-graph path (``training_step.trace_update_step``), so optimizers,
loss scaling, clipping and the Sum/Mean reductions mean the same here. The
results equal those of the unannotated model within float tolerance.

Not available yet with several stages (each raises ``poptorch.Error`` at
compilation): replication and multi-process runs, anchored tensors, models
writing to their input tensors, a float16 ``accum_type`` or the ``Running``
mean reduction. The stage graphs run as captured graphs under autograd, with
every backend.
"""
from typing import Callable, Dict, List, Optional

import torch

from ..errors import Error
from .batching import BatchLayout, micro_batch
from .device_loop import TrainingState
from .logger import info_once
from .outputs import OutputCollector
from .pipeline import PipelineSchedule
from .sequential_stages import SequentialSchedule
from .stages import StagedGraph, StageModule, StageState
from .strategies import PipelinedExecution, _PhasedExecution
from .training_step import (StepSettings, TrainingLayout, trace_update_step)


def _what(stages: int) -> str:
    return f"The model's blocks form {stages} stages, and"


def check_supported(layout: BatchLayout, processes: int, anchors: bool,
                    written_inputs: bool, stages: int) -> None:
    """Raise ``poptorch.Error`` for what several stages cannot run yet."""
    what = _what(stages)
    if layout.replicas > 1 or processes > 1:
        raise Error(f"{what} replicationFactor is {layout.replicas} with "
                    f"{processes} process(es): replicating a multi-stage "
                    "model is not available yet; use replicationFactor(1) "
                    "in one process, or place all blocks in one stage.")
    if anchors:
        raise Error(f"{what} tensors are anchored: anchorTensor is not "
                    "available for multi-stage models yet.")
    if written_inputs:
        raise Error(f"{what} forward writes to its input tensors: in-place "
                    "writes to inputs are not available for multi-stage "
                    "models yet.")


def _check_training(settings: StepSettings, params: List[torch.Tensor],
                    stages: int) -> None:
    what = _what(stages)
    gradients = settings.gradients
    if gradients.accum_dtype is not None and any(
            p.dtype != gradients.accum_dtype for p in params):
        raise Error(f"{what} the optimizer's accum_type is "
                    f"{gradients.accum_dtype}: multi-stage models accumulate "
                    "gradients in the parameters' dtype; leave accum_type "
                    "unset or equal to the parameters' dtype.")
    if gradients.keeps_running_mean:
        raise Error(f"{what} the gradient reduction is MeanReductionStrategy."
                    "Running: multi-stage models sum gradients over the "
                    "step's micro-batches; use MeanReductionStrategy.Post.")


class StagedExecution:
    """The stages of a model and the schedule that runs them."""

    def __init__(self, staged: StagedGraph, strategy, params, trainable,
                 buffers, device: torch.device, training: bool,
                 layout: BatchLayout) -> None:
        self._view = StageState(params, trainable, buffers)
        self._modules = [StageModule(staged, index, self._view, training)
                         for index in range(len(staged.stages))]
        self._last = self._modules[-1]
        micro_batches = (layout.gradient_accumulation if training
                         else layout.device_iterations)
        if isinstance(strategy, PipelinedExecution) and training:
            self._schedule = PipelineSchedule(self._modules, device,
                                              micro_batches, training)
        else:
            liveness = (strategy.liveness
                        if isinstance(strategy, _PhasedExecution) else None)
            self._schedule = SequentialSchedule(self._modules, device,
                                                liveness)
        info_once(f"{type(strategy).__name__}: the model runs as "
                  f"{len(self._modules)} stage partitions on {device}")
        self._update: Optional[Callable] = None
        self._training_layout: Optional[TrainingLayout] = None
        self._settings: Optional[StepSettings] = None

    def graphs(self) -> List[torch.fx.GraphModule]:
        """The stages' forward graphs, in order."""
        return [module.part.module for module in self._modules]

    def prepare_training(self, layout: TrainingLayout,
                         settings: StepSettings,
                         example: Dict[str, List[torch.Tensor]]) -> None:
        """Check the step's settings and capture the optimizer step."""
        _check_training(settings, example["trainable"], len(self._modules))
        self._update = trace_update_step(layout, settings, example)
        self._training_layout = layout
        self._settings = settings

    def _collect(self, collector: OutputCollector, first: int) -> None:
        for offset, outputs in enumerate(self._last.recorded):
            collector.add(first + offset, 0, outputs)
        self._last.recorded.clear()

    def run_inference(self, params: List[torch.Tensor],
                      buffers: List[torch.Tensor],
                      inputs: List[torch.Tensor], layout: BatchLayout,
                      collector: OutputCollector) -> None:
        """One inference call: the D micro-batches through the stages."""
        self._view.rebind(params, buffers)
        count = layout.device_iterations
        self._schedule.run(_stacked(inputs, [(d, 0) for d in range(count)]),
                           count)
        self._collect(collector, 0)

    def run_training(self, state: TrainingState, inputs: List[torch.Tensor],
                     layout: BatchLayout, collector: OutputCollector) -> None:
        """One training call: D optimizer steps of G micro-batches each."""
        training = self._training_layout
        accumulation = layout.gradient_accumulation
        for iteration in range(layout.device_iterations):
            self._view.rebind(_merged(training, state), state.buffer_sets[0])
            scaling = self._settings.attributes.bind(
                state.hyper[training.hyper_size():],
                state.optimizer[training.state_size():])
            factor = self._settings.gradients.loss_factor()
            with torch.enable_grad():
                self._schedule.run(
                    _stacked(inputs, [(iteration, g)
                                      for g in range(accumulation)]),
                    accumulation,
                    lambda loss: scaling.scale_loss(loss, factor))
            grads = self._view.gradients(training.trainable)
            result = self._update(*state.trainable, *grads, *state.optimizer,
                                  *state.hyper)
            state.trainable = list(result[:len(state.trainable)])
            state.optimizer = list(result[len(state.trainable):])
            self._collect(collector, iteration * accumulation)
        self._view.rebind(_merged(training, state), state.buffer_sets[0])


def _merged(training: TrainingLayout,
            state: TrainingState) -> List[torch.Tensor]:
    params = [None] * (len(training.trainable) + len(training.frozen))
    for index, tensor in zip(training.trainable, state.trainable):
        params[index] = tensor
    for index, tensor in zip(training.frozen, state.frozen):
        params[index] = tensor
    return params


def _stacked(inputs: List[torch.Tensor], positions) -> List[torch.Tensor]:
    """The micro-batches at (iteration, step) ``positions``, stacked along a
    new first dimension."""
    micro = [micro_batch(inputs, iteration, step, 0)
             for iteration, step in positions]
    return [torch.stack([m[i] for m in micro]) for i in range(len(inputs))]
