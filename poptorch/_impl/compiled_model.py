"""``CompiledModel``: what compiling a wrapped model produced, and the calls
that run it.

Compiling captures the model for one call (``capture.py``), builds its
device state (``DeviceState``: weights, buffers, optimizer state) and hands
the captured pieces to an engine (``engines/``): the single-graph engine, or
the staged engine when the model's blocks form several stages. A call then
flows one way: inputs to the device and cut into micro-batches
(``batching.py``), the engine's loop over them, outputs combined per
``OutputMode`` (``outputs.py``) and shaped as ``forward`` returned them. A
call that fails half way is rolled back whole (``failed_calls.py``).

The compiled model owns the compiled state; ``PoplarExecutor`` holds one
and keeps PopTorch's methods, and the modules that save, load or link that
state (``export.py``, ``optimizers/optimizer_state.py``) use the public
attributes and methods here.
"""
import dataclasses
import time
from typing import Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

from ..errors import Error
from . import (capture, distributed, failed_calls, tracing_context,
               weight_sync)
from .staging import model_parallel
from .replication import grouping
from .replication.replicas import (ReplicaExecution, buffer_sets,
                                   check_buffers_unwritten, check_layout)
from .precision.automatic_casting import Policy
from .backends.cuda_graphs import CudaGraphCall, cuda_graph_reason
from .batching import BatchLayout
from .capture import TensorLeaf
from .device_loop import TrainingState
from .device_state import DeviceState
from .engines import (CompileInputs, Engine, SingleGraphEngine,
                      StagedEngine, TrainingSetup)
from .floating_point_checks import StepFlags
from .frozen_constants import FrozenConstants
from .precision.half_casting import target_dtype
from .lightning_logging import model_call_class
from .logger import info_once
from .optimizers.optimizer_state import OptimizerDeviceState
from .optimizers.plan import OptimizerPlan
from .optimizers.state_location import OptimizerStateLocation
from .parameter_hooks import (gradient_hooks_of_model, hooked_parameters,
                              refuse_post_accumulate_grad_hooks)
from .outputs import (OutputCollector, as_training_outputs,
                      check_return_period, resolve_output_mode)
from .perf_counters import CallTimer
from .profiling.ranges import profile_range
from .rng import ModelRng
from .signature import CallArguments, InputSignature
from .training_step import StepSettings, TrainingLayout


@dataclasses.dataclass
class ModelSpec:
    """What a wrapped model is compiled from, besides a call."""
    module: torch.nn.Module
    options: object                    # the frozen poptorch.Options
    training: bool
    training_flags: Dict[str, bool]    # module path -> train() flag
    plan: Optional[OptimizerPlan]      # training models only
    optimizer: Optional[torch.optim.Optimizer]
    host_params: List[torch.nn.Parameter]

    def batch_layout(self) -> BatchLayout:
        return BatchLayout.from_options(self.options, self.training)


@dataclasses.dataclass
class CompiledTraining:
    """A training model's compiled parts besides the device state: which
    parameters train, the optimizer's device state, hyper-parameters and
    where the optimizer state lives between calls."""
    layout: TrainingLayout
    optimizer_state: OptimizerDeviceState
    hyper: List[torch.Tensor]
    location: OptimizerStateLocation
    all_reduces: bool


class CompiledModel:
    """The compiled state of one wrapped model and its calls."""

    def __init__(self, spec: ModelSpec, session, state: DeviceState,
                 layout: BatchLayout, analysis: capture.ModelAnalysis,
                 model_call: capture.ModelCall, engine: Engine,
                 grouped: grouping.GroupedWeights,
                 training: Optional[CompiledTraining],
                 signature: InputSignature) -> None:
        self.spec = spec
        self.session = session
        self.state = state
        self.layout = layout
        self.analysis = analysis
        self.model_call = model_call
        self.engine = engine
        self.grouped = grouped
        self.training = training
        self.signature = signature
        self.output_mode = resolve_output_mode(spec.options.output_mode,
                                               spec.training)
        self.rng = ModelRng(state.device,
                            distributed.process_seed(spec.options))
        self.timer: Optional[CallTimer] = None
        self._cuda_graph_call: Optional[CudaGraphCall] = None
        self._buffer_shapes = [buffer.shape for buffer in state.buffers[0]]
        self.constants = FrozenConstants(spec.module, [])

    # --- compilation ------------------------------------------------------
    @staticmethod
    def build(spec: ModelSpec, call: CallArguments,
              session) -> "CompiledModel":
        """Capture ``spec``'s model for ``call`` and compile it in
        ``session``; it watches the tensors captured as constants."""
        with tracing_context.read_constants() as constants:
            compiled = CompiledModel._build(spec, call, session)
        compiled.constants = FrozenConstants(spec.module,
                                             list(constants.values()))
        return compiled

    @staticmethod
    def _build(spec: ModelSpec, call: CallArguments,
               session) -> "CompiledModel":
        layout = spec.batch_layout()
        for position in call.tensor_positions():
            layout.check(call.paths[position], call.leaves[position])
        check_layout(layout)
        check_return_period(
            resolve_output_mode(spec.options.output_mode, spec.training),
            spec.options.output_return_period, layout.device_iterations)
        module, device = spec.module, session.device
        with weight_sync.host_reads_suspended():
            sets = buffer_sets(spec.options, module, spec.training_flags)
            with profile_range("weight upload"):
                state = DeviceState(module, device, sets)
            grouped = grouping.collect(module, state.param_names,
                                               layout.replicas)
        grouped.check_rows(state.params)
        model_call = model_call_class(module)(
            module, state.param_names, state.buffer_names, call.spec,
            list(call.leaves), call.tensor_positions(),
            target_dtype(spec.options.Precision.half_float_casting),
            _autocast_policy(spec.options.Precision))
        # Contiguous, as every call's inputs are (``_call``).
        inputs = [layout.split(t.to(device).contiguous())
                  for t in call.tensors()]
        micro = [(t if t.dim() == 0 else t[0, 0, 0]).clone() for t in inputs]
        analysis = capture.analyse(
            model_call, grouped.replica_params(state.params),
            state.buffers[0], micro, spec.training, spec.training_flags)
        if not spec.training:
            check_buffers_unwritten(
                module, spec.training_flags, state.buffer_names,
                analysis.written_buffers,
                spec.options.broadcast_buffers and layout.replicas > 1)
        if spec.training:
            refuse_post_accumulate_grad_hooks(module)
        replicas = ReplicaExecution.choose(layout, analysis, spec.training,
                                           grouped, hooked_parameters(module))
        compile_inputs = CompileInputs(model_call, analysis, state, micro,
                                       inputs, layout, replicas, session,
                                       spec.training_flags)
        trainable = (TrainingLayout.build(
            spec.plan, analysis.params_reaching_loss, len(state.params))
            if spec.training else None)
        engine = _engine(spec, compile_inputs, trainable)
        training = None
        if spec.training:
            training = _compile_training(spec, compile_inputs, engine,
                                         trainable)
        else:
            engine.compile_inference(compile_inputs)
        grouping.mark_compiled(module, True)
        return CompiledModel(spec, session, state, layout, analysis,
                             model_call, engine, grouped, training,
                             InputSignature(call))

    # --- calls ------------------------------------------------------------
    def run(self, host_inputs: List[torch.Tensor],
            progress: failed_calls.CallProgress) -> List[torch.Tensor]:
        """One call on ``host_inputs``: the combined output tensors. Inputs
        that ``forward`` writes in place are written back. Between calls,
        an ``auto`` model's steps may move to their compiled tier."""
        self.constants.report_changes()
        tiers = self.session.tiers
        if tiers is None:
            outputs = self._call(host_inputs, progress)
        else:
            tiers.before_call()
            start = time.perf_counter()
            completed = False
            try:
                outputs = self._call(host_inputs, progress)
                completed = True
            finally:
                tiers.after_call(time.perf_counter() - start, completed)
        self.constants.remember_values()
        return outputs

    def _call(self, host_inputs: List[torch.Tensor],
              progress: failed_calls.CallProgress) -> List[torch.Tensor]:
        layout = self.layout
        timer = CallTimer(len(host_inputs), layout.device_iterations,
                          layout.gradient_accumulation)
        with profile_range("host to device"):
            device_inputs = [t.to(self.state.device,
                                  non_blocking=True).contiguous()
                             for t in host_inputs]
            if self.analysis.written_inputs:
                device_inputs = _without_shared_memory(device_inputs)
            split = [layout.split(t) for t in device_inputs]
        timer.inputs_transferred()
        completed = False
        try:
            outputs = self._rolled_back_on_failure(split, timer, progress)
            completed = True
        finally:
            if self.training is not None:
                self.training.optimizer_state.after_call(completed)
                self.state.after_call(completed)
        with torch.no_grad():
            for index in self.analysis.written_inputs:
                if device_inputs[index] is not host_inputs[index]:
                    host_inputs[index].copy_(device_inputs[index])
        timer.outputs_transferred(len(outputs))
        self.timer = timer
        return outputs

    def close(self) -> None:
        """The model is destroyed: stop what its compilation still runs
        (an ``auto`` model's background compilation)."""
        if self.session.tiers is not None:
            self.session.tiers.close()

    def _rolled_back_on_failure(self, split: List[torch.Tensor],
                                timer: CallTimer,
                                progress: failed_calls.CallProgress
                                ) -> List[torch.Tensor]:
        """The call's device loop; when it fails, the device state goes
        back to what it was before the call (``failed_calls.py``)."""
        graphed = self._replays_cuda_graph()
        snapshot = (failed_calls.CallSnapshot.of_everything(self.state,
                                                             self.rng)
                    if graphed else self._snapshot())
        flags = None if graphed else self._step_flags()
        try:
            with self.rng.active(), torch.no_grad():
                if graphed:
                    outputs = self._cuda_graph_call(split)
                else:
                    outputs = self._device_loop(split, timer, progress,
                                                flags)
            if flags is not None:
                flags.raise_first(self.layout)
            self._check_buffer_shapes()
        except BaseException as error:
            snapshot.restore(self.state, self.rng)
            if not isinstance(error, Error):
                failed_calls.explain(
                    error, progress, self.layout,
                    staged=self.engine.runs_stages,
                    replica_known=self.engine.steps_name_replicas)
            raise
        return outputs

    def _check_buffer_shapes(self) -> None:
        """``poptorch.Error`` when the call gave a buffer another shape than
        the one compiled: an op whose shape rule in the capture (its fake
        kernel) differs from what it does (torch.ao's fused observers)."""
        for index in self.analysis.written_buffers:
            compiled = self._buffer_shapes[index]
            for buffers in self.state.buffers:
                if buffers[index].shape != compiled:
                    raise capture.resized_buffer(
                        self.state.buffer_names[index], compiled,
                        buffers[index].shape)

    def _snapshot(self) -> failed_calls.CallSnapshot:
        """What a failed call restores: the parameters and optimizer state
        the update steps overwrite in place are copied, and so are the
        parameters ``forward`` writes in place; the rest is kept."""
        overwrites = (self.training is not None and
                      self.engine.overwrites_training_state)
        return failed_calls.CallSnapshot(
            self.state, self.rng,
            (self.training.layout.trainable if overwrites else []) +
            self.analysis.written_params,
            overwrites)

    def _step_flags(self) -> Optional[StepFlags]:
        """Where the steps' floating-point flags go, when
        ``enableFloatingPointExceptions(True)``."""
        if not self.spec.options.Precision.floating_point_exceptions:
            return None
        return self.engine.step_flags(
            self.state.param_names,
            self.training.layout if self.training is not None else None)

    def _replays_cuda_graph(self) -> bool:
        """Whether this call replays as a CUDA graph (decided on the first
        call)."""
        if self._cuda_graph_call is None:
            options, training = self.spec.options, self.training
            reason = self.engine.cuda_graphs_allowed() or cuda_graph_reason(
                self.state.device, options.cuda_graphs,
                bool(self.analysis.written_inputs),
                bool(self.session.anchors),
                training is not None and training.location.off_chip,
                training is not None and training.all_reduces,
                options.Precision.floating_point_exceptions)
            if reason is None:
                self._cuda_graph_call = CudaGraphCall(
                    self._device_loop, *self.state_io())
            elif options.cuda_graphs:
                info_once(f"setBackend(cuda_graphs=True): calls run without "
                          f"a CUDA graph, because {reason}")
        return self._cuda_graph_call is not None

    def _device_loop(self, split: List[torch.Tensor],
                     timer: Optional[CallTimer] = None,
                     progress: Optional[failed_calls.CallProgress] = None,
                     flags: Optional[StepFlags] = None
                     ) -> List[torch.Tensor]:
        """Run one call's loop; return the combined output tensors. A CUDA
        graph records it without ``progress`` (a replay is one step)."""
        progress = progress or failed_calls.CallProgress([False])
        layout, training = self.layout, self.spec.training
        iterations = layout.device_iterations * layout.gradient_accumulation
        collector = self.session.anchors.collector(
            OutputCollector(self.output_mode,
                            self.spec.options.output_return_period,
                            iterations, layout.replicas,
                            layout.gradient_accumulation,
                            stored=self.analysis.stored_outputs),
            self.output_mode, training, iterations, layout.replicas)
        if timer is not None:
            collector = timer.collector(collector)
        if self.training is None:
            self.engine.run_inference(self.state.params, self.state.buffers,
                                      split, layout, collector, progress,
                                      flags)
        else:
            self._run_training(split, collector, progress, flags)
        return collector.result()

    def _run_training(self, split: List[torch.Tensor], collector,
                      progress: failed_calls.CallProgress,
                      flags: Optional[StepFlags]) -> None:
        state, training = self.state, self.training
        loop_state = TrainingState(
            trainable=[state.params[i] for i in training.layout.trainable],
            frozen=[state.params[i] for i in training.layout.frozen],
            buffer_sets=state.buffers,
            optimizer=training.location.to_device(state.optimizer,
                                                  state.device),
            hyper=training.hyper)
        self.engine.run_training(loop_state, split, self.layout, collector,
                                 progress, flags)
        for index, tensor in zip(training.layout.trainable,
                                 loop_state.trainable):
            state.params[index] = tensor
        state.optimizer = training.location.to_host(loop_state.optimizer)

    def shape_outputs(self, tensors: List[torch.Tensor]):
        """The call's output tensors on the host, in the structure
        ``forward`` returned. Each is a tensor of its own, as the copies
        an IPU sends back are: an output that hands back an input (an id
        passed through, which a data loader's ring buffer overwrites with
        later batches), a weight or a constant is copied."""
        stored = self.analysis.stored_outputs
        with profile_range("device to host"):
            host = [t.to("cpu") if t.device.type != "cpu"
                    else t.clone() if index in stored else t
                    for index, t in enumerate(tensors)]
        if self.spec.training:
            host = as_training_outputs(host)
        values = iter(host)
        leaves = [next(values) if isinstance(constant, TensorLeaf)
                  else constant
                  for constant in self.analysis.output_constants]
        return pytree.tree_unflatten(leaves, self.analysis.output_spec)

    @property
    def cuda_graph_call(self) -> Optional[CudaGraphCall]:
        """The CUDA graph the calls replay, once recorded."""
        return self._cuda_graph_call

    # --- state ------------------------------------------------------------
    def move(self, device: torch.device) -> None:
        """Move the device state, and what the calls keep with it, to
        ``device`` (attach / detach)."""
        if self.state.device == device:
            return
        self.state.move(device)
        self._cuda_graph_call = None
        if self.training is not None:
            self.training.hyper = [h.to(device) for h in self.training.hyper]
            self.engine.moved(device)

    def use_optimizer(self, old: OptimizerPlan, new: OptimizerPlan) -> None:
        """Take ``new``'s hyper-parameter values (same structure as
        ``old``'s) from the next call."""
        self.training.hyper = self.training.optimizer_state.hyper_values(new)
        self.training.optimizer_state.apply_loss_scaling_change(old, new)

    def state_io(self):
        """(read, write) the flat device state a call reads and replaces:
        parameters, buffers of every set, optimizer state and
        hyper-parameters (CUDA-graph replays)."""
        state, training = self.state, self.training
        sizes = [len(state.params)] + [len(b) for b in state.buffers]

        def read() -> List[torch.Tensor]:
            tensors = list(state.params)
            for buffers in state.buffers:
                tensors += buffers
            if training is not None:
                tensors += list(state.optimizer) + list(training.hyper)
            return tensors

        def write(tensors: List[torch.Tensor]) -> None:
            start = 0
            for index, size in enumerate(sizes):
                part = tensors[start:start + size]
                if index == 0:
                    state.params[:] = part
                else:
                    state.buffers[index - 1][:] = part
                start += size
            if training is not None:
                count = len(state.optimizer)
                state.optimizer = list(tensors[start:start + count])
                training.hyper = list(tensors[start + count:])

        return read, write


def _without_shared_memory(inputs: List[torch.Tensor]
                           ) -> List[torch.Tensor]:
    """The inputs, each argument sharing memory with an earlier one (the
    same tensor passed twice, a view of another) copied: as an IPU's input
    streams do, and as every backend then does, a ``forward`` writing to
    one argument does not change another (each is written back to the
    caller's tensor in turn)."""
    seen = set()
    separate = []
    for tensor in inputs:
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        separate.append(tensor)
    return separate


def _engine(spec: ModelSpec, inputs: CompileInputs,
            training: Optional[TrainingLayout]) -> Engine:
    """The staged engine when the model's blocks form several stages under
    its execution strategy, else the single-graph engine."""
    plan = model_parallel.check_execution_strategy(
        spec.options, inputs.analysis.blocks, spec.training, inputs.layout)
    if plan is None:
        return SingleGraphEngine(
            inputs.replicas, inputs.session.backend.overwrites_donated_inputs)
    hooks = gradient_hooks_of_model(
        spec.module, inputs.analysis.gradient_hook_places) \
        if spec.training else []
    if hooks:
        raise Error(
            f"The model runs as several stages "
            f"({type(plan.strategy).__name__}), which do not apply "
            "gradient hooks: found "
            f"{'; '.join(hooks)}. Its stages would train without them. "
            "Remove the hooks (or apply their change in the loss), or run "
            "the model as one stage.")
    return StagedEngine.build(plan, inputs, spec.options, spec.training,
                              training.trainable if training else [])


def _compile_training(spec: ModelSpec, inputs: CompileInputs,
                      engine: Engine,
                      training: TrainingLayout) -> CompiledTraining:
    """The training setup every engine shares (optimizer state, the run's
    processes, the step's settings), then the engine's compilation."""
    options, state, layout = spec.options, inputs.state, inputs.layout
    stage_per_process = (engine.runs_stages and
                         distributed.stage_processes(options) > 1)
    data_parallel = options.Distributed.numProcesses
    if stage_per_process:
        data_parallel //= engine.stage_count
    check_buffers_unwritten(
        spec.module, spec.training_flags, state.buffer_names,
        inputs.analysis.written_buffers,
        options.broadcast_buffers and layout.replicas * data_parallel > 1)

    def settings_for(step_replicas: int) -> StepSettings:
        return StepSettings.build(options, spec.plan, layout, step_replicas)

    settings = settings_for(engine.step_replicas(layout))
    processes = distributed.start_training(options, state, inputs.micro,
                                           bool(inputs.replicas.grouped),
                                           spec.plan)
    host_params = [spec.host_params[i] for i in training.trainable]
    placement = processes.shard(options, host_params, stage_per_process,
                                engine.runs_stages)
    optimizer_state = OptimizerDeviceState(
        training, host_params, state, settings.attributes, placement)
    state.optimizer = optimizer_state.initial(spec.optimizer, spec.plan)
    if placement is not None:
        rows = placement.weight_rows(training.trainable)
        if rows is not None:
            state.keep_rows(rows)
    hyper = optimizer_state.hyper_values(spec.plan)
    location = OptimizerStateLocation(
        options.TensorLocations.optimizer_location, state.device)
    example = {"trainable": [state.params[i] for i in training.trainable],
               "frozen": [state.params[i] for i in training.frozen],
               "buffers": state.buffers[0], "state": state.optimizer,
               "hyper": hyper, "inputs": inputs.micro}
    engine.compile_training(inputs, TrainingSetup(
        training, settings, settings_for, example, processes,
        stage_per_process))
    return CompiledTraining(training, optimizer_state, hyper, location,
                          processes.group is not None)


def _autocast_policy(precision) -> Optional[Policy]:
    """The casting policy of automatic casting, None when the options turn
    it off for the whole model."""
    if not precision.autocast_enabled:
        return None
    return precision.autocast_policy
