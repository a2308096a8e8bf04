"""``PoplarExecutor``: the wrapper returned by ``trainingModel`` and
``inferenceModel`` (API reference 11.4).

It keeps PopTorch's methods and what outlives a compilation: the user's
module, the options, the optimizer, and the module's place among the models
that share its weights (``weight_sync.py``). What a compilation produced
belongs to one ``CompiledModel`` (``compiled_model.py``), which runs the
calls. The first call (or ``compile()``) compiles the model.
"""
import time
from typing import Any, Dict, List, Optional

import torch

from .._version import __version__
from ..enums import ConnectionType
from ..errors import Error
from . import (compile_hooks, derived_weights, failed_calls, profiling,
               weight_sync)
from .replication import grouping
from .compile_session import compile_session
from .compiled_methods import CompiledExecutionMethods
from .compiled_model import CompiledModel, ModelSpec
from .device_state import updatable_buffers
from .devices import select_device
from .frozen_constants import mode_name
from .lightning_logging import logged_output
from .log_files import apply_log_options
from .logger import logger, warn_once
from .options.groups import freeze
from .optimizers import optimizer_state
from .optimizers.global_attributes import GlobalAttributes
from .optimizers.unapplied_changes import GivenHyperParameters
from .optimizers.plan import (OptimizerPlan, check_same_structure,
                              plan_optimizer, report_unexpected_attributes)
from .signature import CallArguments


class PoplarExecutor(CompiledExecutionMethods):
    """Wrapper around a ``torch.nn.Module`` compiled for the device.

    Do not create it directly: use ``poptorch.trainingModel`` or
    ``poptorch.inferenceModel``. Attribute access and ``repr`` go to the
    wrapped module.
    """

    def __init__(self, model: torch.nn.Module, options, training: bool,
                 poptorch_version: str,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 user_model: Optional[torch.nn.Module] = None,
                 modes_at_first_call: bool = False,
                 training_flags: Optional[Dict[str, bool]] = None) -> None:
        module = user_model if user_model is not None else model
        if not isinstance(module, torch.nn.Module):
            raise Error(f"The model must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
        _check_mode_options(options, training)
        freeze(options)
        self._options = options.clone()
        freeze(self._options)
        apply_log_options(self._options)
        self._profile = profiling.for_model(self._options, training)
        self._module = module
        self._training = training
        self._poptorch_version = poptorch_version
        # The train/eval flags the model runs with (``_modes``): given (a
        # model saved and loaded again), else read when it compiles.
        self._given_flags = training_flags
        self._own_mode: Optional[bool] = (None if modes_at_first_call
                                          else module.training)
        self._flags_at_wrap = _training_flags(module)
        self._training_flags: Optional[Dict[str, bool]] = training_flags
        self._optimizer = optimizer
        self._plan: Optional[OptimizerPlan] = (
            plan_optimizer(optimizer, _host_params(module))
            if training else None)
        self._given_hyper: Optional[GivenHyperParameters] = (
            GivenHyperParameters(optimizer) if training else None)
        self._sync = weight_sync.attach(module)
        # Refuses a module another training model trains: before the
        # optimizer is linked, so that the refusal leaves it to that model.
        self._sync.register(self, training, type(module).__name__)
        self._registered = True
        self._link = optimizer_state.ModelLink(self)
        if training:
            optimizer_state.link(optimizer, self._link)
        self._reset_compiled_state()
        self._destroyed = False

    def _reset_compiled_state(self) -> None:
        self._compiled: Optional[CompiledModel] = None
        self._link.device_state = None
        self._attached = False
        self._loaded_version = -1
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
                                    self._training, self._optimizer,
                                    self._training_flags))

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
        return self._require_compiled("rng_state").rng.as_list()

    @rng_state.setter
    def rng_state(self, value: List[int]) -> None:
        self._require_compiled("rng_state").rng.load_list(value)

    @property
    def _executable(self) -> Optional[object]:
        """The compiled steps, or None before compilation and after
        ``destroy()``, as PopTorch's executable handle (Lightning's
        ``IPUStrategy`` attaches and detaches only models where it is not
        None)."""
        if self._compiled is None:
            return None
        return self._compiled.engine.executable

    # --- compilation ------------------------------------------------------
    def isCompiled(self) -> bool:
        """True once the model is compiled and until it is destroyed."""
        return self._compiled is not None

    def compile(self, *args, **kwargs) -> None:
        """Capture and compile the model for these arguments, if not done
        yet, without running it."""
        if self._compiled is None:
            self._compile(CallArguments(self._module.forward, args, kwargs))

    def _compile(self, call: CallArguments, precompiled=None,
                 precompiled_source: str = "") -> None:
        """Capture and compile for ``call``; ``precompiled`` steps (read
        from an exported file) replace compilation when they match."""
        start = time.perf_counter()
        with self._profile.top_range("compile"), \
                compile_hooks.around_compilation(), \
                compile_session(self._options, self._training, precompiled,
                                precompiled_source) as session, \
                torch.inference_mode(False):
            self._prepare_host_weights()
            self._plan_trainable_parameters()
            self._training_flags = self._modes()
            compiled = CompiledModel.build(self._spec(), call, session)
            self._use_compiled(compiled)
        self._profile.compiled(compiled)
        logger.debug("Compiled %s model in %.2f s on %s",
                     "training" if self._training else "inference",
                     time.perf_counter() - start, compiled.state.device)

    def _modes(self) -> Dict[str, bool]:
        """The train/eval flags the model compiles with: a loaded model's
        own; else those of PopTorch's shallow copy of the module: the
        module's own ``training`` flag as it was when wrapped (a primitive
        the copy does not share), its sub-modules' flags as they are now
        (the copy shares the sub-modules). A change since wrapping is
        reported, since the guide asks for ``model.train()`` or
        ``model.eval()`` before wrapping."""
        if self._given_flags is not None:
            return self._given_flags
        flags = _training_flags(self._module)
        if self._own_mode is None:
            return flags
        changed = [name for name, flag in flags.items()
                   if self._flags_at_wrap.get(name, flag) != flag]
        flags[""] = self._own_mode
        if changed:
            warn_once(_modes_changed(self._module, self._training, changed,
                                     flags))
        return flags

    def train(self, mode: bool = True) -> "PoplarExecutor":
        """``torch.nn.Module.train`` of the wrapped model, as PopTorch runs
        it on its shallow copy of the module: the copy's own flag and its
        sub-modules' (which the module shares) take ``mode``. The model
        runs in it from its next compilation: its first call, or the first
        after ``destroy()``. Returns the wrapper."""
        self._given_flags = None
        self._own_mode = mode
        for child in self._module.children():
            child.train(mode)
        self._flags_at_wrap = _training_flags(self._module)
        if self._compiled is not None and \
                set(self._training_flags.values()) != {mode}:
            warn_once(f"{type(self).__name__}.train({mode}) was called on a "
                      "compiled model, which keeps the modes it was compiled "
                      "with: call destroy() on it, and the next call "
                      "compiles it in the new mode")
        return self

    def eval(self) -> "PoplarExecutor":
        """``train(False)``."""
        return self.train(False)

    def _use_compiled(self, compiled: CompiledModel) -> None:
        """``compiled`` is this model's from now on (before the
        post-compilation hooks run)."""
        self._compiled = compiled
        if self._training:
            self._link.device_state = compiled.training.optimizer_state
            self._trainable = _trainable(self._module)
        with weight_sync.host_reads_suspended():
            self._derived = derived_weights.derived_weights(self._module)
        self._param_dtypes = [param.dtype
                              for param in _host_params(self._module)]
        self._structure = self._sync.structure
        self._loaded_version = self._sync.version
        self._destroyed = False
        if self._options.connection_type == ConnectionType.Always:
            self._attached = True

    def _plan_trainable_parameters(self) -> None:
        """Read the optimizer again as the compilation starts: which
        parameters it trains follows their ``requires_grad`` now, as
        PopTorch, which compiles on the first call, reads it then (a layer
        frozen between wrapping and the first call stays frozen)."""
        if self._training:
            self._plan = plan_optimizer(self._optimizer,
                                        _host_params(self._module))
            self._given_hyper = GivenHyperParameters(self._optimizer)

    def _prepare_host_weights(self) -> None:
        """Before a compilation reads the module's weights: register with
        the module again after ``destroy()``, and bring the host copy up to
        date with what this model and any model sharing weights with it
        trained."""
        if self._destroyed:
            self._sync = weight_sync.attach(self._module)
            self._sync.register(self, self._training,
                                type(self._module).__name__)
            self._registered = True
        self._sync.bring_host_up_to_date()
        with weight_sync.host_reads_suspended():
            self._shared = weight_sync.SharedTensors(
                self, [*self._module.parameters(), *self._module.buffers()])
        for source in self._shared.stale_sources():
            source.copyWeightsToHostIfNeeded()

    def _spec(self) -> ModelSpec:
        return ModelSpec(self._module, self._options, self._training,
                         self._training_flags, self._plan, self._optimizer,
                         _host_params(self._module))

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
        if self._compiled is None:
            self._compile(call)
        else:
            self._check_still_valid(call)
        with self._profile.top_range("call"):
            self._connect_for_run()
            self._load_weights_trained_elsewhere(
                same_module=self._loaded_version != self._sync.version)
            self._report_host_edits()
            return self._run(call)

    def _report_host_edits(self) -> None:
        """Weights or buffers edited in place on the host since the last
        copy between them and the device are not seen by the device (as in
        PopTorch): logged once, naming them."""
        edited = self._compiled.state.host_edited()
        if edited:
            warn_once(
                f"{edited} changed in place on the host since this "
                f"{'training' if self._training else 'inference'} model "
                "last copied its weights to or from the device, so it runs "
                "without the change (as PopTorch does): call "
                "copyWeightsToDevice() after changing weights or buffers in "
                "place (a host-side EMA of the weights, an edit through "
                "torch.no_grad()).")

    def _check_still_valid(self, call: CallArguments) -> None:
        """Before a call of a compiled model: the same argument structure,
        parameters and sub-modules as compiled; a change of
        ``requires_grad`` is reported once. Rows that do not fill the
        call's micro-batches are reported as such (an incomplete last
        batch of a data loader), with a hint saying so."""
        layout, signature = self._compiled.layout, self._compiled.signature
        try:
            for position in call.tensor_positions():
                layout.check(call.paths[position], call.leaves[position])
            signature.check(call)
        except Error as error:
            short = signature.fewer_rows(call)
            if short is None:
                raise
            raise Error(f"{error} Argument '{short}' has fewer rows than "
                        "the compiled call, as the incomplete last batch "
                        "of a data loader has: poptorch.DataLoader leaves "
                        "it out by default (drop_last=True), "
                        "torch.utils.data.DataLoader does with "
                        "drop_last=True.") from None
        with weight_sync.host_reads_suspended():
            params = list(self._module.named_parameters())
        if (self._sync.structure != self._structure or
                [name for name, _ in params] !=
                self._compiled.state.param_names):
            raise Error(
                "A parameter, buffer or sub-module of the wrapped "
                f"{type(self._module).__name__} was replaced, added or "
                "removed (torch.nn.utils.prune and parametrizations move "
                "weights) after this model was compiled, which the compiled "
                "model cannot follow: call destroy() on it, and the next "
                "call compiles the module as it is now (the trained weights "
                "are on the host)")
        changed = [(name, then, param.dtype) for (name, param), then
                   in zip(params, self._param_dtypes) if param.dtype != then]
        if changed:
            name, then, now = changed[0]
            raise Error(
                f"The parameters of the wrapped {type(self._module).__name__}"
                f" changed dtype after this model was compiled ('{name}' is "
                f"{now}, compiled as {then}: module.half() or .float()), "
                "which the compiled model cannot follow: call destroy() on "
                "it, and the next call compiles the module as it is now.")
        if self._given_hyper is not None:
            self._given_hyper.report_changes(self._optimizer)
        if self._training and self._trainable != [
                param.requires_grad for _, param in params]:
            warn_once(
                f"requires_grad of parameters of the wrapped "
                f"{type(self._module).__name__} changed after the training "
                "model was compiled: the compiled step keeps training the "
                "parameters that required gradients at its first call. Call "
                "destroy() on the model to compile it with the new flags "
                "(the optimizer state is kept).")

    def _load_weights_trained_elsewhere(self, same_module: bool = False
                                        ) -> None:
        """Weights that another model trained since this model's last call
        reach this model's device through the host, after this model's own
        trained weights: the training model of the same module
        (``same_module``) or models of modules sharing sub-modules."""
        sources = self._shared.stale_sources()
        if not sources and not same_module:
            return
        self._sync.bring_host_up_to_date()
        for source in sources:
            source.copyWeightsToHostIfNeeded()
        self.copyWeightsToDevice()

    def _connect_for_run(self) -> None:
        if self._options.connection_type == ConnectionType.Never:
            offline = self._options.offline_ipu_version is not None
            cause = ("useOfflineIpuTarget(), which sets "
                     "connectionType(ConnectionType.Never)" if offline
                     else "connectionType(ConnectionType.Never)")
            raise Error(
                f"This model was created with {cause}: it can be compiled "
                "and exported but not run. Create the model with other "
                "options to run it, or poptorch.load() its exported file.")
        if not self._attached:
            self.attachToDevice()

    def _run(self, call: CallArguments):
        """One call, rolled back whole if it fails (``failed_calls.py``)."""
        compiled = self._compiled
        self._profile.called(call.tensors(), compiled.layout)
        with failed_calls.interrupts_between_steps() as progress:
            outputs = compiled.run(call.tensors(), progress)
        if self._training:
            self._sync.trained_on_device()
            derived_weights.forget(self._derived)
            self._shared.trained()
            self._loaded_version = self._sync.version
            _mark_optimizer_stepped(self._optimizer)
        elif compiled.analysis.written_buffers:
            self._sync.inference_wrote_buffers(self)
        return logged_output(compiled.model_call,
                             compiled.shape_outputs(outputs))

    # --- weights --------------------------------------------------------------
    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and the first replica's buffers) into
        the wrapped module's parameters and buffers (after loading the
        weights another model sharing sub-modules trained since, so that
        no stale copy overwrites them)."""
        compiled = self._require_compiled("copyWeightsToHost")
        self._load_weights_trained_elsewhere()
        with self._profile.top_range("weight download"), \
                weight_sync.host_reads_suspended():
            compiled.state.store_to_host(self._module)
            derived_weights.refresh(self._derived)
        self._sync.buffers_seen(self)
        if self._sync.trainer is self:
            self._sync.device_newer = False

    def copyWeightsToDevice(self) -> None:
        """Copy the wrapped module's parameters and buffers to the device
        (done implicitly on the first call). With several replicas, every
        replica gets the host's values (replicas that kept their own
        buffers, ``broadcastBuffers(False)`` or batch normalisation
        statistics, all restart from them)."""
        if self._destroyed:
            self._raise_destroyed("copyWeightsToDevice")
        if self._compiled is None:
            return
        self._compiled.grouped.check_rows(_host_params(self._module))
        self._sync.before_upload()
        with self._profile.top_range("weight upload"), \
                weight_sync.host_reads_suspended():
            self._compiled.state.load_from_host(self._module)
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
        if self._compiled is not None:
            self._compiled.state.load_buffers_from_host(buffers)

    def refuse_host_edits_of_stale_weights(self) -> None:
        """``poptorch.Error`` when the host's parameters or buffers were
        written in place while this training model's device held newer
        weights: the program changed the weights from before training
        through references it kept (``opt.param_groups``, a list of
        parameters), which module reads would have brought up to date."""
        with weight_sync.host_reads_suspended():
            changed = self._compiled.state.host_changed(self._module)
        if changed:
            raise Error(
                f"copyWeightsToDevice(): {changed} changed on the host "
                "through references the program kept while the trained "
                "weights were on the device, so the change was made to the "
                "weights from before training. Read the weights through "
                "the model (model.parameters(), model.state_dict(), "
                "model.layer.weight), which first copies the trained "
                "weights to the host, or call copyWeightsToHost(), before "
                "changing them.")

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
        to the device (after ``destroy()``, only into the module, which the
        next call compiles from)."""
        if self._destroyed:
            return self._module.load_state_dict(state_dict, strict)
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
        The device's optimizer state carries on, unless ``optimizer``
        brings a state of its own, which replaces it: a state dict loaded
        into it (rolling back to a checkpoint with a new optimizer), or the
        state of a torch.optim optimizer not used by poptorch before.
        ``optimizer`` becomes the one whose ``state_dict()`` reads it.
        """
        if not self._training:
            raise Error("setOptimizer can only be called on a training model")
        report_unexpected_attributes(
            optimizer, self._options.relax_optimizer_attributes_checks)
        plan = plan_optimizer(
            optimizer, _host_params(self._module),
            None if self._compiled is None else self._trainable)
        brought = None
        if self._compiled is not None:
            check_same_structure(self._plan, plan)
            device = self._compiled.training.optimizer_state
            if optimizer is not self._optimizer:
                brought = device.brought_by(optimizer, plan)
            self._compiled.use_optimizer(self._plan, plan)
            if brought is not None:
                device.take(optimizer, brought)
        optimizer_state.unlink(self._optimizer, self._link)
        optimizer_state.link(optimizer, self._link)
        self._optimizer = optimizer
        self._plan = plan
        self._given_hyper = GivenHyperParameters(optimizer)

    @property
    def current_loss_scale(self) -> float:
        """The loss scale of the next optimizer step: with automatic loss
        scaling (``opts.Training.setAutomaticLossScaling(True)``) the
        device's current scale, else the optimizer's ``loss_scaling``."""
        if not self._training:
            raise Error("current_loss_scale: only training models scale "
                        "their loss")
        if self._compiled is not None:
            return self._compiled.training.optimizer_state.current_loss_scale(
                self._plan)
        return GlobalAttributes.build(
            self._plan, self._options.Training.auto_loss_scaling
        ).initial_loss_scale(self._plan)

    # --- device ------------------------------------------------------------
    def attachToDevice(self) -> None:
        """Attach to the device: the model's state moves onto it, and the
        host's weights are copied to it, as PopTorch does on attaching
        (changes made to them while detached take effect)."""
        compiled = self._require_compiled("attachToDevice")
        if self._attached:
            raise Error("attachToDevice: the model is already attached")
        compiled.move(select_device(self._options.use_ipu_model))
        self._attached = True
        self.copyWeightsToDevice()

    def detachFromDevice(self) -> None:
        """Detach from the device: trained weights go back to the host and
        the model's state leaves device memory (on a CPU device it stays
        where it is). The next call attaches again."""
        compiled = self._require_compiled("detachFromDevice")
        if not self._attached:
            raise Error("detachFromDevice: the model is not attached")
        self.copyWeightsToHostIfNeeded()
        compiled.move(torch.device("cpu"))
        self._attached = False

    def isAttachedToDevice(self) -> bool:
        """True while the model is attached to its device."""
        return self._attached

    def destroy(self) -> None:
        """Release the device state and the compiled graphs. Trained weights
        are copied to the host first, and the optimizer state to the
        optimizer, which the next compilation starts from; calling the model
        compiles it again."""
        if self._compiled is not None:
            self._compiled.close()
            self.copyWeightsToHostIfNeeded()
            if self._training:
                self._compiled.training.optimizer_state.keep_on_optimizer(
                    self._optimizer)
                weight_sync.written_for_sharing_modules(self._module,
                                                        self._sync)
            grouping.mark_compiled(self._module, False)
        if self._registered:
            self._sync.unregister(self)
            weight_sync.detach(self._module)
            self._registered = False
        self._reset_compiled_state()
        self._destroyed = True
        self._profile.close()

    # --- cycle counts ----------------------------------------------------------
    def cycleCount(self) -> int:
        """IPU cycle counts do not exist on CPU and GPU devices."""
        raise Error("cycleCount: there is no cycle counter on this device "
                    "(CPU/GPU); use getLatency() style timings or "
                    "torch.profiler instead")

    # --- helpers ------------------------------------------------------------
    def _require_compiled(self, what: str) -> CompiledModel:
        """The compiled model, or ``poptorch.Error`` saying why there is
        none."""
        if self._destroyed:
            self._raise_destroyed(what)
        if self._compiled is None:
            raise Error(f"{what}: the model is not compiled yet; call it or "
                        "call compile() first")
        return self._compiled

    @staticmethod
    def _raise_destroyed(what: str) -> None:
        raise Error(f"{what}: this model has been destroyed; call it or "
                    "call compile() to create a new executable first")


def compiled_model(executor: PoplarExecutor) -> Optional[CompiledModel]:
    """The compiled state of ``executor``, None before compilation: the
    window into it for tools and tests (programs use PopTorch's methods)."""
    return executor._compiled


def _trainable(module: torch.nn.Module) -> List[bool]:
    """Each parameter's ``requires_grad``."""
    return [param.requires_grad for param in _host_params(module)]


def _host_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    with weight_sync.host_reads_suspended():
        return [p for _, p in module.named_parameters()]


def _check_mode_options(options, training: bool) -> None:
    if not training and options.Training.gradient_accumulation != 1:
        raise Error(
            "Training.gradientAccumulation is "
            f"{options.Training.gradient_accumulation} but an inference model "
            "requires gradientAccumulation(1): gradient accumulation only "
            "applies to training models")


def _training_flags(module: torch.nn.Module) -> Dict[str, bool]:
    """The ``training`` flag of ``module`` (name "") and each of its
    sub-modules."""
    return {name: m.training for name, m in module.named_modules()}


def _modes_changed(module: torch.nn.Module, training: bool,
                   changed: List[str], flags: Dict[str, bool]) -> str:
    """The warning for modes ``changed`` after wrapping, ``flags`` those
    the model compiles with."""
    names = [name for name in changed if name]
    layers = [name for name in names
              if not any(module.get_submodule(name).children())] or names
    shown = ", ".join(
        f"{name} ({type(module.get_submodule(name)).__name__}): "
        f"{mode_name(flags[name])}" for name in layers[:3])
    if len(layers) > 3:
        shown += f" and {len(layers) - 3} more"
    parts = []
    if names:
        parts.append(f"its sub-modules in the modes they have now ({shown})")
    if "" in changed:
        parts.append(f"the module's own flag as it was when wrapped "
                     f"({mode_name(flags[''])})")
    wrapper = "trainingModel" if training else "inferenceModel"
    return (f"The train/eval modes of the wrapped {type(module).__name__} "
            f"changed after {wrapper}() wrapped it. The model compiles with "
            f"{', and '.join(parts)}: PopTorch wraps a shallow copy of the "
            "module, which shares the sub-modules but not the module's own "
            "training flag. If that is not what you meant, call "
            "model.train() or model.eval() as required before wrapping, or "
            "poptorch_model.train()/eval() before the model compiles")


def _rebuild_executor(module, options, training, optimizer,
                      training_flags=None):
    return PoplarExecutor(module, options, training,
                          poptorch_version=__version__, optimizer=optimizer,
                          user_model=module, training_flags=training_flags)


def _mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer`` has stepped, as its own ``step()`` does
    under a learning-rate scheduler: a training call applies optimizer
    steps on the device, so ``scheduler.step()`` after it must not warn
    that it came before ``optimizer.step()``."""
    optimizer._opt_called = True
