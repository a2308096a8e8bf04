"""``PoplarExecutor``: the wrapper returned by ``trainingModel`` and
``inferenceModel`` (API reference 11.4).

A call flows one way: the arguments are checked against the compiled
signature, moved to the device and cut into micro-batches, the device loop
runs the captured step(s) for the whole call, and the outputs are shaped per
``OutputMode``. The first call (or ``compile()``) captures the model.
"""
import time
from typing import Any, Dict, List, Optional, Set

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree

from .._version import __version__
from ..enums import ConnectionType
from ..errors import Error
from . import (capture, compile_hooks, device_loop, distributed,
               failed_calls, model_parallel, replica_grouping, replication,
               staged_execution, stages, weight_sync)
from .backends.cuda_graphs import CudaGraphCall, cuda_graph_reason
from .compile_session import compile_session
from .compiled_methods import CompiledExecutionMethods
from .perf_counters import CallTimer
from .batching import BatchLayout
from .automatic_casting import Policy
from .capture import TensorLeaf
from .device_state import DeviceState, updatable_buffers
from .devices import select_device
from .floating_point_checks import StepFlags
from .half_casting import target_dtype
from .lightning_logging import logged_output, model_call_class
from .logger import info_once, logger, warn_once
from .names import mark_parameters
from .optimizers import device_state as optimizer_state_dict
from .optimizers.device_state import OptimizerDeviceState
from .optimizers.global_attributes import GlobalAttributes
from .optimizers.gradient_reduction import GradientReduction
from .optimizers.plan import (OptimizerPlan, plan_optimizer,
                              unexpected_attributes)
from .optimizers.state_location import OptimizerStateLocation
from .outputs import (OutputCollector, as_training_outputs,
                      check_return_period, resolve_output_mode)
from .rng import ModelRng
from .signature import CallArguments, InputSignature
from .training_step import StepSettings, TrainingLayout, step_donation

class PoplarExecutor(CompiledExecutionMethods):
    """Wrapper around a ``torch.nn.Module`` compiled for the device.

    Do not create it directly: use ``poptorch.trainingModel`` or
    ``poptorch.inferenceModel``. Attribute access and ``repr`` go to the
    wrapped module.
    """

    def __init__(self, model: torch.nn.Module, options, training: bool,
                 poptorch_version: str,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 user_model: Optional[torch.nn.Module] = None) -> None:
        module = user_model if user_model is not None else model
        if not isinstance(module, torch.nn.Module):
            raise Error(f"The model must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
        _check_mode_options(options, training)
        options._freeze()
        self._options = options.clone()
        self._options._freeze()
        self._module = module
        self._training = training
        self._poptorch_version = poptorch_version
        self._training_flags = {name: m.training
                                for name, m in module.named_modules()}
        self._optimizer = optimizer
        self._plan: Optional[OptimizerPlan] = (
            plan_optimizer(optimizer, _host_params(module))
            if training else None)
        if training:
            optimizer_state_dict.link(optimizer, self)
        self._sync = weight_sync.attach(module)
        self._sync.register(self, training, type(module).__name__)
        self._registered = True
        self._reset_compiled_state()
        self._destroyed = False

    def _reset_compiled_state(self) -> None:
        self._compiled = False
        self._optimizer_state: Optional[OptimizerDeviceState] = None
        self._attached = False
        self._signature: Optional[InputSignature] = None
        self._state: Optional[DeviceState] = None
        self._loaded_version = -1
        self._rng: Optional[ModelRng] = None
        self._session = None
        self._timer: Optional[CallTimer] = None
        self._cuda_graph_call: Optional[CudaGraphCall] = None
        self._all_reduces = False
        self._staged: Optional[staged_execution.StagedExecution] = None
        self._shared: Optional[weight_sync.SharedTensors] = None

    # --- attribute delegation -------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._module, name)

    def __repr__(self) -> str:
        return repr(self._module)

    def __reduce__(self):
        """Pickle as the module, the options and the optimizer: the loaded
        executor compiles again on its first call."""
        self.copyWeightsToHostIfNeeded()
        return (_rebuild_executor, (self._module, self._options.clone(),
                                    self._training, self._optimizer))

    # --- properties -------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The wrapped torch module."""
        return self._module

    @property
    def options(self):
        """The (frozen) options this model was created with."""
        return self._options

    @property
    def rng_state(self) -> List[int]:
        """Seed and state of the model's random number generator."""
        self._require_compiled("rng_state")
        return self._rng.as_list()

    @rng_state.setter
    def rng_state(self, value: List[int]) -> None:
        self._require_compiled("rng_state")
        self._rng.load_list(value)

    @property
    def _executable(self) -> Optional[object]:
        """The compiled steps, or None before compilation and after
        ``destroy()``, as PopTorch's executable handle (Lightning's
        ``IPUStrategy`` attaches and detaches only models where it is not
        None)."""
        if not self._compiled:
            return None
        return self._staged if self._staged is not None else self._steps

    # --- compilation ------------------------------------------------------
    def isCompiled(self) -> bool:
        """True once the model is compiled and until it is destroyed."""
        return self._compiled

    def compile(self, *args, **kwargs) -> None:
        """Capture and compile the model for these arguments, if not done
        yet, without running it."""
        if not self._compiled:
            self._compile(CallArguments(self._module.forward, args, kwargs))

    def _compile(self, call: CallArguments, precompiled=None,
                 precompiled_source: str = "") -> None:
        """Capture and compile for ``call``; ``precompiled`` steps (read
        from an exported file) replace compilation when they match."""
        with compile_hooks.around_compilation(), \
                compile_session(self._options, self._training, precompiled,
                                precompiled_source) as self._session, \
                torch.inference_mode(False):
            self._capture_and_compile(call)

    def _capture_and_compile(self, call: CallArguments) -> None:
        start = time.perf_counter()
        layout = self._batch_layout()
        for position in call.tensor_positions():
            layout.check(call.paths[position], call.leaves[position])
        replication.check_layout(layout)
        mode = resolve_output_mode(self._options.output_mode, self._training)
        check_return_period(mode, self._options.output_return_period,
                            layout.device_iterations *
                            layout.gradient_accumulation)
        if self._destroyed:
            self._sync = weight_sync.attach(self._module)
            self._sync.register(self, self._training,
                                type(self._module).__name__)
            self._registered = True
        device = select_device(self._options.use_ipu_model)
        self._sync.bring_host_up_to_date()
        with weight_sync.host_reads_suspended():
            self._shared = weight_sync.SharedTensors(
                self, [*self._module.parameters(), *self._module.buffers()])
        for source in self._shared.stale_sources(self):
            source.copyWeightsToHostIfNeeded()
        with weight_sync.host_reads_suspended():
            state = DeviceState(self._module, device, self._buffer_sets())
            grouped = replica_grouping.collect(
                self._module, state.param_names, layout.replicas)
        grouped.check_rows(state.params)
        model_call = model_call_class(self._module)(
            self._module, state.param_names, state.buffer_names, call.spec,
            list(call.leaves), call.tensor_positions(),
            target_dtype(self._options.Precision.half_float_casting),
            _autocast_policy(self._options.Precision))
        inputs = [layout.split(t.to(device)) for t in _tensors(call)]
        micro = [(t if t.dim() == 0 else t[0, 0, 0]).clone() for t in inputs]
        analysis = capture.analyse(model_call, grouped.replica_params(
            state.params), state.buffers[0], micro, self._training,
                                   self._training_flags)
        stage_plan = model_parallel.check_execution_strategy(
            self._options, analysis.blocks, self._training, layout)
        self._replicas = replication.ReplicaExecution.choose(
            layout, analysis, self._training, grouped,
            self._buffer_sets() == layout.replicas)
        self._staged = None
        if stage_plan is not None:
            self._build_stages(stage_plan, model_call, analysis, state, micro,
                               layout)
        if self._training:
            self._compile_training(model_call, analysis, state, micro, layout,
                                   inputs)
        elif self._staged is None:
            self._compile_inference(model_call, analysis, state, inputs)
        replica_grouping.mark_compiled(self._module, True)
        self._analysis = analysis
        self._model_call = model_call
        self._output_mode = mode
        self._layout = layout
        self._state = state
        self._signature = InputSignature(call)
        self._rng = ModelRng(device, distributed.process_seed(self._options))
        self._loaded_version = self._sync.version
        self._compiled = True
        self._destroyed = False
        if self._options.connection_type == ConnectionType.Always:
            self._attached = True
        logger.debug("Compiled %s model in %.2f s on %s",
                     "training" if self._training else "inference",
                     time.perf_counter() - start, device)

    def _build_stages(self, plan, model_call, analysis, state, micro,
                      layout: BatchLayout) -> None:
        staged_execution.check_supported(
            layout, distributed.stage_processes(self._options),
            bool(analysis.written_inputs),
            len({p.stage_id for p in plan.placements.values()}),
            self._training)
        grouped = self._replicas.grouped
        graph = stages.trace_forward(model_call, analysis,
                                     grouped.replica_params(state.params),
                                     state.buffers[0], micro, self._training,
                                     self._training_flags)
        graph = self._session.anchors.add_outputs(graph, "forward",
                                                  before=int(self._training))
        staged = stages.cut_into_stages(graph, plan.placements, analysis,
                                        len(state.params),
                                        len(state.buffers[0]), self._training)
        staged_execution.check_recomputation(staged,
                                             bool(analysis.written_inputs))
        self._session.record("forward", graph)
        trainable = (TrainingLayout.build(
            self._plan, analysis.params_reaching_loss,
            len(state.params)).trainable if self._training else [])
        if self._session.backend.name != "graph":
            info_once(f"The {self._session.backend.name!r} backend does not "
                      "apply to multi-stage models: their stage partitions "
                      "run as captured graphs under autograd")
        self._staged = staged_execution.StagedExecution(
            staged, plan.strategy, state.params, trainable, state.buffers,
            grouped, state.device, self._training, analysis.written_inputs)

    def _compile_inference(self, model_call, analysis, state, inputs) -> None:
        graph, example = self._replicas.trace_inference(
            model_call, state.params, state.buffers, inputs,
            self._training_flags)
        graph = self._session.graph(
            "inference", mark_parameters(graph, state.param_names))
        self._steps = device_loop.InferenceSteps(
            self._session.compile("inference", graph),
            analysis.written_buffers)

    def _compile_training(self, model_call, analysis, state, micro,
                          layout: BatchLayout, inputs) -> None:
        data_parallel = self._options.Distributed.numProcesses
        stage_per_process = self._staged is not None and \
            distributed.stage_processes(self._options) > 1
        if stage_per_process:
            data_parallel //= self._staged.stage_count
        _check_broadcast_buffers_unwritten(
            state, analysis.written_buffers,
            self._options.broadcast_buffers and
            layout.replicas * data_parallel > 1,
            _running_statistics(self._module, self._training_flags))
        training = TrainingLayout.build(self._plan, analysis.params_reaching_loss,
                                        len(state.params))
        host_params = _host_params(self._module)
        trainable = [state.params[i] for i in training.trainable]
        settings = self._step_settings(layout)
        self._optimizer_state = OptimizerDeviceState(
            training, [host_params[i] for i in training.trainable], state,
            settings.attributes)
        state.optimizer = self._optimizer_state.initial(self._optimizer,
                                                        self._plan)
        self._hyper = self._optimizer_state.hyper_values(self._plan)
        self._state_location = OptimizerStateLocation(
            self._options.TensorLocations.optimizer_location, state.device)
        example = {"trainable": trainable,
                   "frozen": [state.params[i] for i in training.frozen],
                   "buffers": state.buffers[0], "state": state.optimizer,
                   "hyper": self._hyper, "inputs": micro}
        self._training_layout = training
        processes = distributed.start_training(
            self._options, state, micro, bool(self._replicas.grouped))
        self._all_reduces = processes.group is not None
        if self._staged is not None:
            self._staged.prepare_training(
                training, settings, example,
                layout.gradient_accumulation * layout.replicas,
                (processes.pipelines(self._staged.stage_count)
                 if stage_per_process else None),
                processes.reduce_gradients(settings.reduction))
            return
        try:
            update = self._trace_update(model_call, training, settings,
                                        example, state, inputs, processes)
        except Error as error:
            if self._replicas.path != replication.VECTORISED:
                raise
            self._replicas.fall_back(error)
            settings = self._step_settings(layout)
            update = self._trace_update(model_call, training, settings,
                                        example, state, inputs, processes)
        accumulate = settings.gradients.accumulates
        summed = self._sums_gradients(settings)
        graphs = {"update": update}
        if accumulate:
            graphs["accumulate"] = self._replicas.trace_training(
                model_call, training, settings, example, state.buffers,
                inputs, self._training_flags, update=False, accumulated=True)
        graphs = {name: self._session.graph(name, graph)
                  for name, graph in graphs.items()}
        zeros = settings.gradients.start(trainable) if summed else []
        compiled = {name: self._session.compile(
            name, graph, step_donation(example, len(zeros),
                                       len(analysis.written_buffers),
                                       update=name == "update"))
            for name, graph in graphs.items()}
        self._steps = device_loop.TrainingSteps(
            update=compiled["update"], accumulate=compiled.get("accumulate"),
            written_buffers=analysis.written_buffers, running=zeros,
            finite_checks=settings.finite_checks)

    def _step_settings(self, layout: BatchLayout) -> StepSettings:
        """The training step's reduction of micro-batches (by the replica
        path: a vectorised step is one micro-batch of all replicas) and its
        global optimizer attributes."""
        return StepSettings(
            gradients=GradientReduction.build(
                self._options.Training, layout.gradient_accumulation,
                (self._replicas.step_replicas if self._staged is None
                 else layout.replicas), self._plan.accum_dtype),
            attributes=GlobalAttributes.build(
                self._plan, self._options.Training.auto_loss_scaling),
            finite_checks=self._options.Precision.floating_point_exceptions)

    def _trace_update(self, model_call, training, settings, example, state,
                      inputs, processes) -> torch.fx.GraphModule:
        """The captured step of the last micro-batch of an optimizer step,
        with the update."""
        return self._replicas.trace_training(
            model_call, training, settings, example, state.buffers, inputs,
            self._training_flags, update=True,
            accumulated=self._sums_gradients(settings),
            reduce_gradients=processes.reduce_gradients(settings.reduction))

    def _sums_gradients(self, settings: StepSettings) -> bool:
        """Whether the update step adds its gradients to a running sum: the
        step accumulates micro-batches, or the backend keeps gradients in a
        reused buffer."""
        return (settings.gradients.accumulates or
                self._session.backend.sums_gradients_in_buffer)

    def _batch_layout(self) -> BatchLayout:
        options = self._options
        return BatchLayout(
            device_iterations=options.device_iterations,
            gradient_accumulation=(options.Training.gradient_accumulation
                                   if self._training else 1),
            replicas=options.replication_factor,
            input_group_size=options.input_group_size,
            input_group_type=options.input_group_type)

    def _buffer_sets(self) -> int:
        """One set of buffers, or one per replica: with
        ``broadcastBuffers(False)``, and in training when normalisation
        layers update their running statistics, which each replica keeps
        for itself as on IPUs (the host sees the first replica's)."""
        if self._options.broadcast_buffers and not (
                self._training and _running_statistics(
                    self._module, self._training_flags)):
            return 1
        return self._options.replication_factor

    # --- running ------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the model on one call's worth of data (D x G x R
        micro-batches); the first call captures and compiles it. A training
        model trains also when called under ``torch.inference_mode()`` or
        ``torch.no_grad()``."""
        if self._training and torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return self(*args, **kwargs)
        call = CallArguments(self._module.forward, args, kwargs)
        if not self._compiled:
            self._compile(call)
        else:
            self._signature.check(call)
        self._connect_for_run()
        self._load_weights_trained_elsewhere(
            same_module=not self._training and
            self._loaded_version != self._sync.version)
        return self._run(call)

    def _load_weights_trained_elsewhere(self, same_module: bool = False
                                        ) -> None:
        """Weights that another model trained since this model's last call
        reach this model's device through the host, after this model's own
        trained weights: the training model of the same module
        (``same_module``) or models of modules sharing sub-modules."""
        sources = self._shared.stale_sources(self)
        if not sources and not same_module:
            return
        self._sync.bring_host_up_to_date()
        for source in sources:
            source.copyWeightsToHostIfNeeded()
        self.copyWeightsToDevice()

    def _connect_for_run(self) -> None:
        if self._options.connection_type == ConnectionType.Never:
            raise Error(
                "This model was compiled with "
                "connectionType(ConnectionType.Never): it can be compiled "
                "and exported but not run. Create the model with other "
                "options to run it.")
        if not self._attached:
            self.attachToDevice()

    def _run(self, call: CallArguments):
        layout = self._layout
        host_inputs = _tensors(call)
        timer = CallTimer(len(host_inputs), layout.device_iterations,
                          layout.gradient_accumulation)
        device_inputs = [t.to(self._state.device,
                              non_blocking=True).contiguous()
                         for t in host_inputs]
        split = [layout.split(t) for t in device_inputs]
        timer.inputs_transferred()
        with failed_calls.interrupts_between_steps() as progress:
            outputs = self._rolled_back_on_failure(split, timer, progress)
            with torch.no_grad():
                for index in self._analysis.written_inputs:
                    if device_inputs[index] is not host_inputs[index]:
                        host_inputs[index].copy_(device_inputs[index])
        if self._training:
            self._sync.trained_on_device()
            self._shared.trained()
            self._loaded_version = self._sync.version
            _mark_optimizer_stepped(self._optimizer)
        result = logged_output(self._model_call,
                               self._shape_outputs(outputs))
        timer.outputs_transferred(len(outputs))
        self._timer = timer
        return result

    def _rolled_back_on_failure(self, split: List[torch.Tensor],
                                timer: CallTimer,
                                progress: failed_calls.CallProgress
                                ) -> List[torch.Tensor]:
        """The call's device loop; when it fails, the device state goes
        back to what it was before the call (``failed_calls.py``)."""
        graphed = self._replays_cuda_graph()
        snapshot = (failed_calls.CallSnapshot.of_everything(self._state,
                                                             self._rng)
                    if graphed else self._snapshot())
        flags = None if graphed else self._step_flags()
        try:
            with self._rng.active(), torch.no_grad():
                if graphed:
                    outputs = self._cuda_graph_call(split)
                else:
                    outputs = self._device_loop(split, timer, progress,
                                                flags)
            if flags is not None:
                flags.raise_first(self._layout)
        except BaseException as error:
            snapshot.restore(self._state, self._rng)
            if not isinstance(error, Error):
                failed_calls.explain(
                    error, progress, self._layout,
                    staged=self._staged is not None,
                    replica_known=self._staged is None and
                    self._replicas.step_losses == 1)
            raise
        return outputs

    def _snapshot(self) -> failed_calls.CallSnapshot:
        """What a failed call restores: the parameters and optimizer state
        the update steps overwrite in place are copied (the graph
        backend's, and a multi-stage model's update), the rest kept."""
        overwrites = self._training and (
            self._staged is not None or
            self._session.backend.overwrites_donated_inputs)
        return failed_calls.CallSnapshot(
            self._state, self._rng,
            self._training_layout.trainable if overwrites else [],
            overwrites)

    def _step_flags(self) -> Optional[StepFlags]:
        """Where the steps' floating-point flags go, when
        ``enableFloatingPointExceptions(True)``."""
        if not self._options.Precision.floating_point_exceptions:
            return None
        if not self._training:
            return StepFlags([], 1, outputs=True)
        if self._staged is not None:
            return StepFlags(
                self._staged.updated_names(self._state.param_names), 0)
        return StepFlags([self._state.param_names[i]
                          for i in self._training_layout.trainable],
                         self._replicas.step_losses)

    def _replays_cuda_graph(self) -> bool:
        """Whether this call replays as a CUDA graph (decided on the first
        call)."""
        if self._cuda_graph_call is None and self._staged is None:
            reason = cuda_graph_reason(
                self._state.device, self._options.cuda_graphs,
                bool(self._analysis.written_inputs),
                bool(self._session.anchors),
                self._training and self._state_location.off_chip,
                self._training and self._all_reduces,
                self._options.Precision.floating_point_exceptions)
            if reason is None:
                self._cuda_graph_call = CudaGraphCall(
                    self._device_loop, *self._state_io())
            elif self._options.cuda_graphs:
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
        layout = self._layout
        collector = self._session.anchors.collector(
            OutputCollector(
                self._output_mode, self._options.output_return_period,
                layout.device_iterations * layout.gradient_accumulation,
                layout.replicas),
            self._output_mode, self._training,
            layout.device_iterations * layout.gradient_accumulation,
            layout.replicas)
        if timer is not None:
            collector = timer.collector(collector)
        if self._staged is not None:
            self._run_stages(split, collector, progress, flags)
            return collector.result()
        with self._replicas.loop(split, self._state.buffers,
                                 collector) as loop:
            if self._training:
                self._run_training(loop, progress, flags)
            else:
                device_loop.run_inference(self._steps, self._state.params,
                                          loop.buffer_sets, loop.inputs,
                                          loop.layout, loop.collector,
                                          progress, flags)
        return collector.result()

    def _run_stages(self, split: List[torch.Tensor],
                    collector: OutputCollector,
                    progress: failed_calls.CallProgress,
                    flags: Optional[StepFlags]) -> None:
        """A multi-stage model's call (``staged_execution.py``)."""
        if not self._training:
            self._staged.run_inference(self._state.params,
                                       self._state.buffers, split,
                                       self._layout, collector, progress,
                                       flags)
            return
        self._run_training(replication.LoopArguments(
            self._layout, split, self._state.buffers, collector), progress,
            flags)

    def _run_training(self, loop: replication.LoopArguments,
                      progress: failed_calls.CallProgress,
                      flags: Optional[StepFlags]) -> None:
        state = self._state
        training = self._training_layout
        loop_state = device_loop.TrainingState(
            trainable=[state.params[i] for i in training.trainable],
            frozen=[state.params[i] for i in training.frozen],
            buffer_sets=loop.buffer_sets,
            optimizer=self._state_location.to_device(state.optimizer,
                                                     state.device),
            hyper=self._hyper)
        if self._staged is not None:
            self._staged.run_training(loop_state, loop.inputs, loop.layout,
                                      loop.collector, progress, flags)
        else:
            device_loop.run_training(self._steps, loop_state, loop.inputs,
                                     loop.layout, loop.collector, progress,
                                     flags)
        for index, tensor in zip(training.trainable, loop_state.trainable):
            state.params[index] = tensor
        state.optimizer = self._state_location.to_host(loop_state.optimizer)

    def _shape_outputs(self, tensors: List[torch.Tensor]):
        host = [t.to("cpu") if t.device.type != "cpu" else t
                for t in tensors]
        if self._training:
            host = as_training_outputs(host)
        else:
            host = [t.clone() if _aliases_state(t, self._state) else t
                    for t in host]
        values = iter(host)
        leaves = [next(values) if isinstance(constant, TensorLeaf)
                  else constant
                  for constant in self._analysis.output_constants]
        return pytree.tree_unflatten(leaves, self._analysis.output_spec)

    # --- weights --------------------------------------------------------------
    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and the first replica's buffers) into
        the wrapped module's parameters and buffers (after loading the
        weights another model sharing sub-modules trained since, so that
        no stale copy overwrites them)."""
        self._require_compiled("copyWeightsToHost")
        self._load_weights_trained_elsewhere()
        with weight_sync.host_reads_suspended():
            self._state.store_to_host(self._module)
        if self._sync.trainer is self:
            self._sync.device_newer = False

    def copyWeightsToDevice(self) -> None:
        """Copy the wrapped module's parameters and buffers to the device
        (done implicitly on the first call)."""
        if self._destroyed:
            self._raise_destroyed("copyWeightsToDevice")
        if not self._compiled:
            return
        self._replicas.grouped.check_rows(_host_params(self._module))
        with weight_sync.host_reads_suspended():
            self._state.load_from_host(self._module)
        if self._training:
            self._sync.device_newer = False
            self._sync.version += 1
        self._loaded_version = self._sync.version

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the buffers named by ``options.updatableNamedBuffers`` from
        the wrapped module to the device (to each replica's copy), leaving
        the other parameters and buffers on the device as they are. Before
        compilation there is nothing to copy to: the first call copies all
        the weights."""
        if self._destroyed:
            self._raise_destroyed("copyNamedBuffersToDevice")
        with weight_sync.host_reads_suspended():
            buffers = updatable_buffers(
                self._module, self._options.updatable_named_buffers)
        if self._compiled:
            self._state.load_buffers_from_host(buffers)

    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy trained weights to the host if they changed on the device;
        True if a copy was made."""
        if self._destroyed:
            self._raise_destroyed("copyWeightsToHostIfNeeded")
        if self._sync.trainer is not self:
            return False
        return self._sync.bring_host_up_to_date()

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True):
        """Load ``state_dict`` into the wrapped module and send the weights
        to the device."""
        self.copyWeightsToHostIfNeeded()
        result = self._module.load_state_dict(state_dict, strict)
        self.copyWeightsToDevice()
        return result

    # --- optimizer ------------------------------------------------------------
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer``'s current hyper-parameters from the next call.

        Hyper-parameter values (for example a learning rate changed by a
        scheduler) take effect without recompiling; a change that alters the
        compiled graph raises ``poptorch.Error`` naming the attribute.
        Param-group attributes the optimizer does not use are warned about
        once (logged at DEBUG with ``relaxOptimizerAttributesChecks()``).
        The device's optimizer state carries on; ``optimizer`` becomes the
        one whose ``state_dict()`` reads it.
        """
        if not self._training:
            raise Error("setOptimizer can only be called on a training model")
        _report_unexpected_attributes(
            optimizer, self._options.relax_optimizer_attributes_checks)
        plan = plan_optimizer(optimizer, _host_params(self._module))
        if self._compiled:
            _check_same_structure(self._plan, plan)
            self._hyper = self._optimizer_state.hyper_values(plan)
            self._optimizer_state.apply_loss_scaling_change(self._plan, plan)
        optimizer_state_dict.unlink(self._optimizer, self)
        optimizer_state_dict.link(optimizer, self)
        self._optimizer = optimizer
        self._plan = plan

    @property
    def current_loss_scale(self) -> float:
        """The loss scale of the next optimizer step: with automatic loss
        scaling (``opts.Training.setAutomaticLossScaling(True)``) the
        device's current scale, else the optimizer's ``loss_scaling``."""
        if not self._training:
            raise Error("current_loss_scale: only training models scale "
                        "their loss")
        if self._optimizer_state is not None:
            return self._optimizer_state.current_loss_scale(self._plan)
        return GlobalAttributes.build(
            self._plan, self._options.Training.auto_loss_scaling
        ).initial_loss_scale(self._plan)

    # --- device ------------------------------------------------------------
    def attachToDevice(self) -> None:
        """Attach to the device: the model's state moves onto it."""
        self._require_compiled("attachToDevice")
        if self._attached:
            raise Error("attachToDevice: the model is already attached")
        device = select_device(self._options.use_ipu_model)
        if self._state.device != device:
            self._state.move(device)
            self._rebuild_device_constants()
        self._attached = True

    def detachFromDevice(self) -> None:
        """Detach from the device: trained weights go back to the host and
        the model's state leaves device memory (on a CPU device it stays
        where it is). The next call attaches again."""
        self._require_compiled("detachFromDevice")
        if not self._attached:
            raise Error("detachFromDevice: the model is not attached")
        self.copyWeightsToHostIfNeeded()
        if self._state.device.type != "cpu":
            self._state.move(torch.device("cpu"))
            self._rebuild_device_constants()
        self._attached = False

    def _rebuild_device_constants(self) -> None:
        self._cuda_graph_call = None
        if self._training:
            device = self._state.device
            self._hyper = [h.to(device) for h in self._hyper]
            if self._staged is None:
                self._steps.running = [z.to(device)
                                       for z in self._steps.running]

    def isAttachedToDevice(self) -> bool:
        """True while the model is attached to its device."""
        return self._attached

    def destroy(self) -> None:
        """Release the device state and the compiled graphs. Trained weights
        are copied to the host first, and the optimizer state to the
        optimizer, which the next compilation starts from; calling the model
        compiles it again."""
        if self._compiled:
            self.copyWeightsToHostIfNeeded()
            if self._training:
                self._optimizer_state.keep_on_optimizer(self._optimizer)
            replica_grouping.mark_compiled(self._module, False)
        if self._registered:
            self._sync.unregister(self)
            weight_sync.detach(self._module)
            self._registered = False
        self._reset_compiled_state()
        self._destroyed = True

    # --- cycle counts ----------------------------------------------------------
    def cycleCount(self) -> int:
        """IPU cycle counts do not exist on CPU and GPU devices."""
        raise Error("cycleCount: there is no cycle counter on this device "
                    "(CPU/GPU); use getLatency() style timings or "
                    "torch.profiler instead")

    # --- helpers ------------------------------------------------------------
    def _require_compiled(self, what: str) -> None:
        if self._destroyed:
            self._raise_destroyed(what)
        if not self._compiled:
            raise Error(f"{what}: the model is not compiled yet; call it or "
                        "call compile() first")

    @staticmethod
    def _raise_destroyed(what: str) -> None:
        raise Error(f"{what}: this model has been destroyed; call it or "
                    "call compile() to create a new executable first")


def _host_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    with weight_sync.host_reads_suspended():
        return [p for _, p in module.named_parameters()]


def _running_statistics(module: torch.nn.Module,
                        training_flags: Dict[str, bool]) -> Set[str]:
    """The names of the running-statistics buffers that the module's
    normalisation layers (BatchNorm, InstanceNorm with
    ``track_running_stats``) update in training mode."""
    with weight_sync.host_reads_suspended():
        return {f"{path}{'.' if path else ''}{name}"
                for path, layer in module.named_modules()
                if isinstance(layer, _NormBase) and layer.track_running_stats
                and training_flags.get(path, True)
                for name, _ in layer.named_buffers(recurse=False)}


def _check_broadcast_buffers_unwritten(state: DeviceState,
                                       written: List[int], broadcast: bool,
                                       statistics: Set[str]) -> None:
    """Buffers broadcast to several replicas cannot be written by the
    model's own code (PopTorch refuses them too); normalisation statistics
    are kept per replica instead."""
    names = [state.buffer_names[i] for i in written
             if state.buffer_names[i] not in statistics]
    if broadcast and names:
        raise Error(
            f"The model writes to its buffers during training "
            f"({', '.join(names)}) and buffers are broadcast to several "
            "replicas: a broadcast buffer cannot be written by the model. "
            "Set options.broadcastBuffers(False) so that each replica "
            "keeps its own buffers.")


def _tensors(call: CallArguments) -> List[torch.Tensor]:
    return [call.leaves[i] for i in call.tensor_positions()]


def _aliases_state(tensor: torch.Tensor, state: DeviceState) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return any(pointer == t.untyped_storage().data_ptr()
               for t in state.params + state.buffers[0])


def _autocast_policy(precision) -> Optional[Policy]:
    """The casting policy of automatic casting, None when the options turn
    it off for the whole model."""
    if not precision.autocast_enabled:
        return None
    return precision.autocast_policy


def _check_mode_options(options, training: bool) -> None:
    if not training and options.Training.gradient_accumulation != 1:
        raise Error(
            "Training.gradientAccumulation is "
            f"{options.Training.gradient_accumulation} but an inference model "
            "requires gradientAccumulation(1): gradient accumulation only "
            "applies to training models")


def _families(plan: OptimizerPlan) -> str:
    """The optimizer families of a plan's groups (SGD, Adam, RMSprop,
    LAMB)."""
    return ", ".join(sorted({type(group.rule).__name__.replace("Rule", "")
                             for group in plan.groups}))


def _check_same_structure(old: OptimizerPlan, new: OptimizerPlan) -> None:
    """Raise unless ``new`` differs from ``old`` in variable values only."""
    old_families, new_families = _families(old), _families(new)
    if old_families != new_families:
        raise Error(f"setOptimizer: the optimizer family changed after the "
                    f"model was compiled ({old_families} at compilation, "
                    f"now {new_families}); call destroy() and compile again "
                    "to use another type of optimizer.")
    old_groups = [group.indices for group in old.groups]
    new_groups = [group.indices for group in new.groups]
    if old_groups != new_groups:
        raise Error(f"setOptimizer: the parameter groups changed after the "
                    f"model was compiled (parameter indices per group "
                    f"{old_groups} at compilation, now {new_groups}); use "
                    f"an optimizer with the same param groups, or call "
                    f"destroy() and compile again.")
    changed = sorted(name for name in set(old.constant_attrs) |
                     set(new.constant_attrs)
                     if old.constant_attrs.get(name) !=
                     new.constant_attrs.get(name))
    changed += [name for name in ("loss_scaling", "max_grad_norm")
                if name not in old.variable_globals | new.variable_globals
                and getattr(old, name) != getattr(new, name)]
    if changed:
        detail = f"the compile-time constant(s) {', '.join(changed)}"
    elif old.variable_globals != new.variable_globals:
        detail = ("which of loss_scaling / max_grad_norm are variable "
                  f"({sorted(old.variable_globals)} at compilation, now "
                  f"{sorted(new.variable_globals)})")
    elif old.structure() != new.structure():
        detail = "the optimizer type or its parameter groups"
    else:
        return
    raise Error(f"setOptimizer: {detail} changed after the model was "
                "compiled. Only variable attributes (such as lr) can change "
                "after compilation; call destroy() and compile again to "
                "change the others.")


def _report_unexpected_attributes(optimizer: torch.optim.Optimizer,
                                  relax: bool) -> None:
    unexpected = unexpected_attributes(optimizer)
    if not unexpected:
        return
    message = (f"Ignoring unexpected attribute(s) in the param groups of "
               f"{type(optimizer).__name__} given to setOptimizer: "
               f"{', '.join(unexpected)}")
    if relax:
        logger.debug(message)
    else:
        warn_once(message)


def _rebuild_executor(module, options, training, optimizer):
    return PoplarExecutor(module, options, training,
                          poptorch_version=__version__, optimizer=optimizer,
                          user_model=module)


def _mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer`` has stepped, as its own ``step()`` does
    under a learning-rate scheduler: a training call applies optimizer
    steps on the device, so ``scheduler.step()`` after it must not warn
    that it came before ``optimizer.step()``."""
    optimizer._opt_called = True
