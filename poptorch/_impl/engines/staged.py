"""The staged engine: a model whose blocks form several stages, each stage a
separate partition of the captured forward graph run in the execution
strategy's order, with one captured optimizer step per G x R micro-batches
(``staging/staged_execution.py``; ``docs/model_parallel.md``).

The forward graph is captured once more (``stages.trace_forward``), with the
anchored tensors as extra outputs, and cut by stage
(``stages.cut_into_stages``) when the engine is built, before the training
setup, which needs the number of stages to know the run's processes.
"""
from typing import List, Optional

import torch

from .. import distributed
from ..staging import stages
from ..batching import BatchLayout
from ..device_loop import TrainingState
from ..failed_calls import CallProgress
from ..floating_point_checks import StepFlags
from ..logger import info_once
from ..outputs import OutputCollector
from ..profiling.ranges import profile_range
from ..staging.staged_execution import (
    StagedExecution, check_buffers_across_processes, check_recomputation,
    check_supported)
from ..training_step import TrainingLayout
from .engine import CompileInputs, Engine, TrainingSetup


class StagedEngine(Engine):
    """The stages of a model, run by ``StagedExecution``."""

    overwrites_training_state = True
    steps_name_replicas = False
    runs_stages = True

    def __init__(self, execution: StagedExecution) -> None:
        self.execution = execution
        self.stage_count = execution.stage_count

    @staticmethod
    def build(plan, inputs: CompileInputs, options, training: bool,
              trainable: List[int]) -> "StagedEngine":
        """Capture the forward graph and cut it into the stages of
        ``plan`` (``model_parallel.StagePlan``); ``trainable``: the indices
        of the parameters the optimizer updates."""
        analysis, state, session = inputs.analysis, inputs.state, \
            inputs.session
        check_supported(inputs.layout, distributed.stage_processes(options),
                        bool(analysis.written_inputs),
                        len({p.stage_id for p in plan.placements.values()}),
                        training)
        grouped = inputs.replicas.grouped
        graph = stages.trace_forward(inputs.model_call, analysis,
                                     grouped.replica_params(state.params),
                                     state.buffers[0], inputs.micro, training,
                                     inputs.training_flags)
        graph = session.anchors.add_outputs(graph, "forward",
                                            before=int(training))
        with profile_range("partition into stages"):
            staged = stages.cut_into_stages(graph, plan.placements, analysis,
                                            len(state.params),
                                            len(state.buffers[0]), training)
        check_recomputation(staged, bool(analysis.written_inputs))
        check_buffers_across_processes(
            staged, state.buffer_names, distributed.stage_processes(options),
            training)
        session.record("forward", graph)
        if session.backend.name != "graph":
            info_once(f"The {session.backend.name!r} backend does not "
                      "apply to multi-stage models: their stage partitions "
                      "run as captured graphs under autograd")
        return StagedEngine(StagedExecution(
            staged, plan.strategy, state.params, trainable, state.buffers,
            grouped, state.device, training, analysis.written_inputs))

    def step_replicas(self, layout: BatchLayout) -> int:
        return layout.replicas

    @property
    def executable(self) -> object:
        return self.execution

    def compile_inference(self, inputs: CompileInputs) -> None:
        """The stages were compiled when the engine was built."""

    def compile_training(self, inputs: CompileInputs,
                         setup: TrainingSetup) -> None:
        layout = inputs.layout
        self.execution.prepare_training(
            setup.layout, setup.settings, setup.example,
            layout.gradient_accumulation * layout.replicas,
            (setup.processes.pipelines(self.stage_count)
             if setup.stage_per_process else None),
            setup.processes.exchange(setup.settings.reduction))

    def run_inference(self, params: List[torch.Tensor],
                      buffer_sets: List[List[torch.Tensor]],
                      split: List[torch.Tensor], layout: BatchLayout,
                      collector: OutputCollector, progress: CallProgress,
                      flags: Optional[StepFlags]) -> None:
        self.execution.run_inference(params, buffer_sets, split, layout,
                                     collector, progress, flags)

    def run_training(self, state: TrainingState,
                     split: List[torch.Tensor], layout: BatchLayout,
                     collector: OutputCollector, progress: CallProgress,
                     flags: Optional[StepFlags]) -> None:
        self.execution.run_training(state, split, layout, collector,
                                    progress, flags)

    def step_flags(self, param_names: List[str],
                   training: Optional[TrainingLayout]) -> StepFlags:
        if training is None:
            return StepFlags([], 1, outputs=True)
        return StepFlags(self.execution.updated_names(param_names), 0)

    def tensor_names_graph(self, session) -> torch.fx.GraphModule:
        return self.execution.forward_graph

    def cuda_graphs_allowed(self) -> Optional[str]:
        return "the model's blocks form several stages"
