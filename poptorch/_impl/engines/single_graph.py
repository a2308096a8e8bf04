"""The single-graph engine: the whole model as one captured step per
micro-batch (``training_step.py``, ``capture.trace_inference_step``), run
by the device loop over a call's micro-batches (``device_loop.py``), the
replicas vectorised or one after another (``replication/replicas.py``).

A training model has an update step (the last micro-batch of an optimizer
step, with the optimizer update) and, when an optimizer step has several
micro-batches, an accumulate step; both sum their gradients into the
running buffer the loop keeps when the backend asks for one
(``Backend.sums_gradients_in_buffer``). When vmap cannot trace the
vectorised update step, the replicas fall back to the sequential path and
the step is traced again with that path's reduction settings.
"""
import dataclasses
from typing import List, Optional

import torch

from ...errors import Error
from .. import device_loop
from ..replication.replicas import VECTORISED, ReplicaExecution
from ..batching import BatchLayout
from ..device_loop import TrainingState
from ..failed_calls import CallProgress
from ..floating_point_checks import StepFlags
from ..names import mark_parameters
from ..outputs import OutputCollector
from ..training_step import (StepSettings, TrainingLayout, accumulated_like,
                             step_donation)
from .engine import CompileInputs, Engine, TrainingSetup


class SingleGraphEngine(Engine):
    """One captured step per micro-batch, looped over on the device."""

    def __init__(self, replicas: ReplicaExecution,
                 overwrites: bool) -> None:
        self.replicas = replicas
        self.overwrites_training_state = overwrites
        self._steps = None

    @property
    def steps_name_replicas(self) -> bool:
        return self.replicas.step_losses == 1

    def step_replicas(self, layout: BatchLayout) -> int:
        return self.replicas.step_replicas

    @property
    def executable(self) -> object:
        return self._steps

    # --- compilation ------------------------------------------------------
    def compile_inference(self, inputs: CompileInputs) -> None:
        state, session = inputs.state, inputs.session
        graph, _ = self.replicas.trace_inference(
            inputs.model_call, state.params, state.buffers, inputs.inputs,
            inputs.training_flags)
        graph = session.graph("inference",
                              mark_parameters(graph, state.param_names))
        self._steps = device_loop.InferenceSteps(
            session.compile("inference", graph),
            inputs.analysis.written_buffers,
            written_params=inputs.analysis.written_params)

    def compile_training(self, inputs: CompileInputs,
                         setup: TrainingSetup) -> None:
        session, settings = inputs.session, setup.settings
        try:
            update = self._trace(inputs, setup, settings, update=True)
        except Error as error:
            if self.replicas.path != VECTORISED:
                raise
            self.replicas.fall_back(error)
            settings = setup.settings_for(self.replicas.step_replicas)
            update = self._trace(inputs, setup, settings, update=True)
        graphs = {"update": update}
        if settings.gradients.accumulates:
            graphs["accumulate"] = self._trace(inputs, setup, settings,
                                               update=False)
        graphs = {name: session.graph(name, graph)
                  for name, graph in graphs.items()}
        trainable = accumulated_like(
            setup.example["trainable"],
            setup.processes.exchange(settings.reduction))
        zeros = (settings.gradients.start(trainable)
                 if self._sums_gradients(settings, session) else [])
        written = len(inputs.analysis.written_buffers)
        compiled = {name: session.compile(
            name, graph, step_donation(setup.example, len(zeros), written,
                                       update=name == "update"))
            for name, graph in graphs.items()}
        self._steps = device_loop.TrainingSteps(
            update=compiled["update"], accumulate=compiled.get("accumulate"),
            written_buffers=inputs.analysis.written_buffers, running=zeros,
            finite_checks=settings.finite_checks,
            written_frozen=[setup.layout.frozen.index(i)
                            for i in inputs.analysis.written_params
                            if i in setup.layout.frozen])

    def _trace(self, inputs: CompileInputs, setup: TrainingSetup,
               settings: StepSettings, update: bool) -> torch.fx.GraphModule:
        """The captured update step (the last micro-batch of an optimizer
        step) or accumulate step."""
        return self.replicas.trace_training(
            inputs.model_call, setup.layout, settings, setup.example,
            inputs.state.buffers, inputs.inputs, inputs.training_flags,
            update=update,
            accumulated=(self._sums_gradients(settings, inputs.session)
                         if update else True),
            exchange=setup.processes.exchange(settings.reduction))

    @staticmethod
    def _sums_gradients(settings: StepSettings, session) -> bool:
        """Whether the update step adds its gradients to a running sum: the
        step accumulates micro-batches, or the backend keeps gradients in a
        reused buffer."""
        return (settings.gradients.accumulates or
                session.backend.sums_gradients_in_buffer)

    # --- calls ------------------------------------------------------------
    def run_inference(self, params: List[torch.Tensor],
                      buffer_sets: List[List[torch.Tensor]],
                      split: List[torch.Tensor], layout: BatchLayout,
                      collector: OutputCollector, progress: CallProgress,
                      flags: Optional[StepFlags]) -> None:
        with self.replicas.loop(split, buffer_sets, collector) as loop:
            device_loop.run_inference(self._steps, params, loop.buffer_sets,
                                      loop.inputs, loop.layout,
                                      loop.collector, progress, flags)

    def run_training(self, state: TrainingState,
                     split: List[torch.Tensor], layout: BatchLayout,
                     collector: OutputCollector, progress: CallProgress,
                     flags: Optional[StepFlags]) -> None:
        with self.replicas.loop(split, state.buffer_sets,
                                collector) as loop:
            looped = dataclasses.replace(state, buffer_sets=loop.buffer_sets)
            device_loop.run_training(self._steps, looped, loop.inputs,
                                     loop.layout, loop.collector, progress,
                                     flags)
        state.trainable, state.optimizer = looped.trainable, looped.optimizer

    def step_flags(self, param_names: List[str],
                   training: Optional[TrainingLayout]) -> StepFlags:
        if training is None:
            return StepFlags([], 1, outputs=True)
        return StepFlags([param_names[i] for i in training.trainable],
                         self.replicas.step_losses)

    def tensor_names_graph(self, session) -> torch.fx.GraphModule:
        graphs = session.graphs
        return graphs.get("inference", graphs.get("update"))

    def moved(self, device: torch.device) -> None:
        if isinstance(self._steps, device_loop.TrainingSteps):
            self._steps.running = [z.to(device)
                                   for z in self._steps.running]
