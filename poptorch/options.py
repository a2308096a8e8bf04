"""``poptorch.Options`` and its option groups (API reference section 11.1).

An ``Options`` object collects every setting that controls how a model is
compiled and run. Setters validate their arguments, store them and return
the object (or group) so that calls can be chained; the runtime reads the
values back through read-only snake_case properties
(``opts.device_iterations``, ``opts.Training.gradient_accumulation``, ...).

Options handed to a model or a ``DataLoader`` are frozen: setting anything
afterwards raises, and ``clone()`` or ``copy.deepcopy`` gives an unfrozen
copy.

``OPTION_EFFECTS`` is the one table saying what each option does on this
implementation (CPU/GPU): implemented, no effect (an IPU tuning knob, logged
once at INFO when set), or stored now for a feature that reads it. The
machinery behind the options (that table, the argument checks, the shared
group behaviour, options files) is in ``_impl/options/``.
"""
import copy
import os
import re
from typing import Any, Dict, List, Optional

import torch

from .enums import (CommGroupType, ConnectionType, HalfFloatCastingBehavior,
                    MeanReductionStrategy, OutputMode, ReductionType,
                    SyncPattern)
from .errors import Error
from ._impl.options import config_file
from ._impl.staging import strategies
from ._impl.precision.automatic_casting import DEFAULT_POLICY, Policy
from ._impl.options.config_file import ConfigFileError
from ._impl.logger import info_once
from ._impl.options.effects import OPTION_EFFECTS, Effect, announce_off_chip
from ._impl.options.groups import UNSET, OptionsGroup, read_only, readable
from ._impl.options.validation import (check_bool, check_enum, check_int,
                                       check_str, frozen_error, invalid,
                                       path_or_none)

__all__ = ["Options", "TensorLocationSettings", "ConfigFileError",
           "OPTION_EFFECTS", "Effect"]

# Pickled Options from earlier versions name the unset marker here.
_UNSET = UNSET


# --- Groups ---

class TensorLocationSettings(OptionsGroup):
    """Where a kind of tensor is stored: on or off chip, with or without
    replicated tensor sharding (RTS), through I/O tiles or compute tiles.

    Keywords set initial values by property name, for example
    ``TensorLocationSettings(on_chip=False)``.

    >>> opts.TensorLocations.setActivationLocation(
    ...     poptorch.TensorLocationSettings().useOnChipStorage(False))
    """
    _DISPLAY_NAME = "TensorLocationSettings"
    _DEFAULTS = {
        "on_chip": None,
        "replicated_tensor_sharding": False,
        "min_elements_for_off_chip": 0,
        "min_elements_for_replicated_tensor_sharding": 0,
        "io_tiles_to_load": False,
        "io_tiles_to_store": False,
    }
    _SETTER_OF = {
        "on_chip": "useOnChipStorage",
        "replicated_tensor_sharding": "useReplicatedTensorSharding",
        "min_elements_for_off_chip": "minElementsForOffChip",
        "min_elements_for_replicated_tensor_sharding":
            "minElementsForReplicatedTensorSharding",
        "io_tiles_to_load": "useIOTilesToLoad",
        "io_tiles_to_store": "useIOTilesToStore",
    }

    def __init__(self, **default_values: Any) -> None:
        super().__init__()
        self._apply_keywords(default_values)

    on_chip = read_only(
        "on_chip", "True: on-chip memory, False: off-chip memory, None: "
        "undefined (the default).")
    replicated_tensor_sharding = read_only(
        "replicated_tensor_sharding", "Whether replicated tensor sharding is "
        "enabled (default False).")
    min_elements_for_off_chip = read_only(
        "min_elements_for_off_chip", "Tensors with fewer elements are not "
        "considered for off-chip storage (default 0).")
    min_elements_for_replicated_tensor_sharding = read_only(
        "min_elements_for_replicated_tensor_sharding", "Only tensors with "
        "more elements use replicated tensor sharding (default 0).")
    io_tiles_to_load = read_only(
        "io_tiles_to_load", "Whether tensors are loaded through I/O tiles "
        "(default False).")
    io_tiles_to_store = read_only(
        "io_tiles_to_store", "Whether tensors are stored through I/O tiles "
        "(default False).")

    def useOnChipStorage(self, use: Optional[bool] = True
                         ) -> "TensorLocationSettings":
        """Permanent storage: True on chip, False off chip, None
        undefined."""
        option = "TensorLocationSettings.useOnChipStorage"
        if use is not None:
            check_bool(option, use)
        return self._store(option, on_chip=use)

    def useReplicatedTensorSharding(self, use: bool = True
                                    ) -> "TensorLocationSettings":
        """Enable replicated tensor sharding (relevant for weights and
        optimiser states)."""
        option = "TensorLocationSettings.useReplicatedTensorSharding"
        check_bool(option, use)
        return self._store(option, replicated_tensor_sharding=use)

    def minElementsForOffChip(self, min_elements: int
                              ) -> "TensorLocationSettings":
        """Tensors with fewer than ``min_elements`` elements are not
        considered for offloading."""
        option = "TensorLocationSettings.minElementsForOffChip"
        check_int(option, min_elements, minimum=0)
        return self._store(option, min_elements_for_off_chip=min_elements)

    def minElementsForReplicatedTensorSharding(self, min_elements: int
                                               ) -> "TensorLocationSettings":
        """Only use replicated tensor sharding for tensors with more than
        ``min_elements`` elements."""
        option = ("TensorLocationSettings."
                  "minElementsForReplicatedTensorSharding")
        check_int(option, min_elements, minimum=0)
        return self._store(
            option, min_elements_for_replicated_tensor_sharding=min_elements)

    def useIOTilesToLoad(self, use: bool = True) -> "TensorLocationSettings":
        """Load tensors through I/O tiles (True) or compute tiles (False)."""
        option = "TensorLocationSettings.useIOTilesToLoad"
        check_bool(option, use)
        return self._store(option, io_tiles_to_load=use)

    def useIOTilesToStore(self, use: bool = True) -> "TensorLocationSettings":
        """Store tensors through I/O tiles (True) or compute tiles (False);
        relevant for replicated tensor sharded tensors."""
        option = "TensorLocationSettings.useIOTilesToStore"
        check_bool(option, use)
        return self._store(option, io_tiles_to_store=use)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, TensorLocationSettings):
            return NotImplemented
        return self._values == other._values

    __hash__ = None


class _TrainingOptions(OptionsGroup):
    """Options specific to training (``opts.Training``). They must not be
    set for inference models."""
    _DISPLAY_NAME = "_TrainingOptions"
    _DEFAULTS = {
        "gradient_accumulation": 1,
        "accumulation_and_replication_reduction_type": ReductionType.Mean,
        "mean_accumulation_and_replication_reduction_strategy": None,
        "auto_loss_scaling": False,
        "convolution_dithering": False,
    }

    gradient_accumulation = read_only(
        "gradient_accumulation", "Micro-batches accumulated per optimizer "
        "step (default 1).")
    accumulation_and_replication_reduction_type = read_only(
        "accumulation_and_replication_reduction_type", "How gradients are "
        "reduced over accumulation and replicas (default ReductionType.Mean).")
    mean_accumulation_and_replication_reduction_strategy = read_only(
        "mean_accumulation_and_replication_reduction_strategy",
        "A MeanReductionStrategy, or None (the default): chosen from the "
        "optimizer (Running for a float16 accum_type, else Post).")
    auto_loss_scaling = read_only(
        "auto_loss_scaling", "Whether automatic loss scaling is enabled "
        "(default False).")
    convolution_dithering = read_only(
        "convolution_dithering", "Whether convolution dithering is enabled "
        "(default False).")
    meanAccumulationAndReplicationReductionStrategy = read_only(
        "mean_accumulation_and_replication_reduction_strategy",
        "PopTorch's name of mean_accumulation_and_replication_reduction_"
        "strategy.")

    def gradientAccumulation(self, gradient_accumulation: int
                             ) -> "_TrainingOptions":
        """Number of micro-batches whose gradients are accumulated before
        each optimizer update (scales the global batch size)."""
        option = "Training.gradientAccumulation"
        check_int(option, gradient_accumulation, minimum=1)
        return self._store(option, gradient_accumulation=gradient_accumulation)

    def accumulationAndReplicationReductionType(
            self, reduction_type: ReductionType) -> "_TrainingOptions":
        """Reduction of gradients over accumulated micro-batches and
        replicas: ``ReductionType.Mean`` (default) or ``ReductionType.Sum``."""
        option = "Training.accumulationAndReplicationReductionType"
        check_enum(option, reduction_type, ReductionType,
                   (ReductionType.Mean, ReductionType.Sum))
        return self._store(
            option, accumulation_and_replication_reduction_type=reduction_type)

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: MeanReductionStrategy
    ) -> "_TrainingOptions":
        """When a ``Mean`` reduction divides by its factor: ``Running``,
        ``Post`` or (deprecated) ``PostAndLoss``."""
        option = "Training.setMeanAccumulationAndReplicationReductionStrategy"
        check_enum(option, mean_reduction_strategy, MeanReductionStrategy)
        return self._store(
            option, mean_accumulation_and_replication_reduction_strategy=(
                mean_reduction_strategy))

    def setAutomaticLossScaling(self, enabled: bool) -> "_TrainingOptions":
        """Enable or disable automatic loss scaling."""
        option = "Training.setAutomaticLossScaling"
        check_bool(option, enabled)
        return self._store(option, auto_loss_scaling=enabled)

    def setConvolutionDithering(self, enabled: bool) -> "_TrainingOptions":
        """Enable or disable convolution dithering for all convolutions."""
        option = "Training.setConvolutionDithering"
        check_bool(option, enabled)
        return self._store(option, convolution_dithering=enabled)


class _PrecisionOptions(OptionsGroup):
    """Options related to numerical precision (``opts.Precision``)."""
    _DISPLAY_NAME = "_PrecisionOptions"
    _DEFAULTS = {
        "half_float_casting": HalfFloatCastingBehavior.Default,
        "running_statistics_always_float": True,
        "partials_type": torch.float32,
        "stochastic_rounding": False,
        "floating_point_exceptions": False,
        "autocast_enabled": True,
        "autocast_policy": DEFAULT_POLICY,
    }

    half_float_casting = read_only(
        "half_float_casting", "A HalfFloatCastingBehavior (default "
        "HalfFloatCastingBehavior.Default).")
    running_statistics_always_float = read_only(
        "running_statistics_always_float", "Default True.")
    partials_type = read_only(
        "partials_type", "dtype of matmul/convolution partials (default "
        "torch.float32).")
    stochastic_rounding = read_only(
        "stochastic_rounding", "Whether stochastic rounding is enabled "
        "(default False).")
    floating_point_exceptions = read_only(
        "floating_point_exceptions", "Whether floating point exceptions are "
        "enabled (default False).")
    autocast_enabled = read_only(
        "autocast_enabled", "Whether automatic casting is allowed to act "
        "(default True).")
    autocast_policy = read_only(
        "autocast_policy", "The casting policy of automatic casting "
        "(default poptorch.autocasting.default).")

    def halfFloatCasting(self, half_float_casting: HalfFloatCastingBehavior
                         ) -> "_PrecisionOptions":
        """Casting rule for operations mixing float16 and float32 (the spec
        marks it as about to be removed)."""
        option = "Precision.halfFloatCasting"
        check_enum(option, half_float_casting, HalfFloatCastingBehavior)
        return self._store(option, half_float_casting=half_float_casting)

    def runningStatisticsAlwaysFloat(self, value: bool) -> "_PrecisionOptions":
        """Keep batch-norm running statistics in float32 (the spec marks it as
        about to be removed)."""
        option = "Precision.runningStatisticsAlwaysFloat"
        check_bool(option, value)
        return self._store(option, running_statistics_always_float=value)

    def setPartialsType(self, dtype: torch.dtype) -> "_PrecisionOptions":
        """dtype of partial results of matrix multiplications and
        convolutions: ``torch.float`` or ``torch.half``."""
        option = "Precision.setPartialsType"
        if dtype not in (torch.float32, torch.float16):
            raise invalid(option, "torch.float or torch.half", dtype)
        return self._store(option, partials_type=dtype)

    def enableStochasticRounding(self, enabled: bool) -> "_PrecisionOptions":
        """Enable or disable stochastic rounding."""
        option = "Precision.enableStochasticRounding"
        check_bool(option, enabled)
        return self._store(option, stochastic_rounding=enabled)

    def enableFloatingPointExceptions(self, enabled: bool
                                      ) -> "_PrecisionOptions":
        """Raise on invalid floating point operations (infinities subtracted,
        division by zero, ...) when True.

        Here (CPU/GPU arithmetic gives inf and NaN instead of trapping) each
        training step checks its loss, gradients and updated weights (an
        inference step its outputs); the call stops at the first non-finite
        value, is rolled back, and raises ``poptorch.Error`` naming the step
        and the value (``docs/failed_calls.md``)."""
        option = "Precision.enableFloatingPointExceptions"
        check_bool(option, enabled)
        return self._store(option, floating_point_exceptions=enabled)

    def autocastEnabled(self, enabled: bool) -> "_PrecisionOptions":
        """Turn automatic mixed-precision casting (``poptorch.autocast``) on
        or off for the whole application."""
        option = "Precision.autocastEnabled"
        check_bool(option, enabled)
        return self._store(option, autocast_enabled=enabled)

    def autocastPolicy(self, policy: Policy) -> "_PrecisionOptions":
        """The casting policy (a ``poptorch.autocasting.Policy``) that
        automatic casting follows."""
        option = "Precision.autocastPolicy"
        if not isinstance(policy, Policy):
            raise invalid(option, "a poptorch.autocasting.Policy", policy)
        return self._store(option, autocast_policy=policy)


class _JitOptions(OptionsGroup):
    """Options related to PyTorch's JIT compiler (``opts.Jit``)."""
    _DISPLAY_NAME = "_JitOptions"
    _DEFAULTS = {"trace_model": False}
    _SETTER_OF = {"trace_model": "traceModel"}

    def __init__(self, **default_values: Any) -> None:
        super().__init__()
        self._apply_keywords(default_values)

    trace_model = read_only(
        "trace_model", "Whether the model is traced with torch.jit (default "
        "False).")

    def traceModel(self, trace_model: bool) -> "_JitOptions":
        """Use torch.jit tracing (the spec marks it as about to be
        removed)."""
        option = "Jit.traceModel"
        check_bool(option, trace_model)
        return self._store(option, trace_model=trace_model)


class _TensorLocationOptions(OptionsGroup):
    """Where tensors are stored (``opts.TensorLocations``)."""
    _DISPLAY_NAME = "_TensorLocationOptions"
    _DEFAULTS = {
        "activation_location": None,
        "weight_location": None,
        "optimizer_location": None,
        "accumulator_location": None,
        "num_io_tiles": 0,
    }
    _SETTER_OF = {
        "activation_location": "setActivationLocation",
        "weight_location": "setWeightLocation",
        "optimizer_location": "setOptimizerLocation",
        "accumulator_location": "setAccumulatorLocation",
        "num_io_tiles": "numIOTiles",
    }

    def __init__(self, **default_values: Any) -> None:
        super().__init__()
        self._apply_keywords(default_values)

    activation_location = read_only(
        "activation_location", "TensorLocationSettings for activations, or "
        "None (default).")
    weight_location = read_only(
        "weight_location", "TensorLocationSettings for weights, or None "
        "(default).")
    optimizer_location = read_only(
        "optimizer_location", "TensorLocationSettings for optimizer states, "
        "or None (default).")
    accumulator_location = read_only(
        "accumulator_location", "TensorLocationSettings for accumulators, "
        "or None (default).")
    num_io_tiles = read_only(
        "num_io_tiles", "Number of IPU tiles used for I/O (default 0).")

    def numIOTiles(self, num_tiles: int) -> "_TensorLocationOptions":
        """Number of IPU tiles reserved for I/O rather than compute."""
        option = "TensorLocations.numIOTiles"
        check_int(option, num_tiles, minimum=0)
        return self._store(option, num_io_tiles=num_tiles)

    def _store_location(self, option: str, name: str,
                        location: TensorLocationSettings
                        ) -> "_TensorLocationOptions":
        if not isinstance(location, TensorLocationSettings):
            raise invalid(option, "a poptorch.TensorLocationSettings",
                          location)
        announce_off_chip(option, location.on_chip)
        return self._store(option, **{name: copy.deepcopy(location)})

    def setActivationLocation(self, location: TensorLocationSettings
                              ) -> "_TensorLocationOptions":
        """Tensor location settings for activations (a copy is stored)."""
        return self._store_location("TensorLocations.setActivationLocation",
                                    "activation_location", location)

    def setWeightLocation(self, location: TensorLocationSettings
                          ) -> "_TensorLocationOptions":
        """Tensor location settings for weights (a copy is stored)."""
        return self._store_location("TensorLocations.setWeightLocation",
                                    "weight_location", location)

    def setOptimizerLocation(self, location: TensorLocationSettings
                             ) -> "_TensorLocationOptions":
        """Tensor location settings for optimizer states (a copy is
        stored)."""
        return self._store_location("TensorLocations.setOptimizerLocation",
                                    "optimizer_location", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings
                               ) -> "_TensorLocationOptions":
        """Tensor location settings for accumulators (a copy is stored)."""
        return self._store_location("TensorLocations.setAccumulatorLocation",
                                    "accumulator_location", location)


#: The value types PopART session options take: numbers, strings, booleans,
#: collections of strings (lists, tuples, sets) and string maps.
_POPART_VALUE_TYPES = (bool, int, float, str, list, tuple, set, frozenset,
                       dict)


class _PopartOptions(OptionsGroup):
    """Options of PopART, PopTorch's IPU compiler (``opts._Popart``). They
    are accepted so that programs setting them run; none has an effect
    here."""
    _DISPLAY_NAME = "_PopartOptions"
    _DEFAULTS = {"options": {}, "engine_options": {}, "patterns": {},
                 "patterns_level": 2}

    options = read_only("options", "PopART session options set by key.")
    engine_options = read_only(
        "engine_options", "Poplar engine options (default empty).")
    patterns = read_only("patterns", "PopART pattern name -> enabled.")
    patterns_level = read_only(
        "patterns_level", "PopART patterns level (default 2).")

    def set(self, key: str, value: Any) -> "_PopartOptions":
        """Set the PopART session option ``key`` to ``value``."""
        option = "_Popart.set"
        check_str(f"{option} key", key)
        if not isinstance(value, _POPART_VALUE_TYPES):
            raise invalid(f"{option} value for {key!r}",
                          "a bool, int, float, str, list, tuple, set or "
                          "dict", value)
        return self._store(option, options={**self.options, key: value})

    def setEngineOptions(self, engine_options: Dict[str, str]
                         ) -> "_PopartOptions":
        """Set Poplar engine options (a dict of str to str)."""
        option = "_Popart.setEngineOptions"
        if not isinstance(engine_options, dict) or not all(
                isinstance(key, str) for key in engine_options):
            raise invalid(option, "a dict with str keys", engine_options)
        return self._store(option, engine_options=dict(engine_options))

    def setPatterns(self, patterns: Dict[str, bool],
                    level: int = 2) -> "_PopartOptions":
        """Enable or disable PopART patterns by name on top of ``level``."""
        option = "_Popart.setPatterns"
        if not isinstance(patterns, dict) or not all(
                isinstance(key, str) and isinstance(value, bool)
                for key, value in patterns.items()):
            raise invalid(option, "a dict of str to bool", patterns)
        check_int(f"{option} level", level, minimum=0)
        return self._store(option, patterns=dict(patterns),
                           patterns_level=level)


_PROCESS_ENVIRONMENTS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                         ("WORLD_SIZE", "RANK"))


class _DistributedOptions(OptionsGroup):
    """Options of distributed execution (``opts.Distributed``).

    By default the process id and count come from OpenMPI's
    ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``, else from torchrun's
    ``RANK``/``WORLD_SIZE``, else 0 and 1.
    """
    _DISPLAY_NAME = "_DistributedOptions"
    _DEFAULTS = {"processId": 0, "numProcesses": 1}

    processId = read_only("processId", "Id of the current process.")
    numProcesses = read_only(
        "numProcesses", "Total number of processes the execution is "
        "distributed over.")
    distributed_process_id = read_only(
        "processId", "PopTorch's other name of processId.")
    num_distributed_processes = read_only(
        "numProcesses", "PopTorch's other name of numProcesses.")

    def _read_environment(self) -> None:
        for size_variable, rank_variable in _PROCESS_ENVIRONMENTS:
            if size_variable in os.environ or rank_variable in os.environ:
                self.setEnvVarNames(size_variable, rank_variable)
                return

    def configureProcessId(self, process_id: int, num_processes: int
                           ) -> "_DistributedOptions":
        """Set this process's id and the total number of processes."""
        return self._set_process("Distributed.configureProcessId",
                                 process_id, num_processes)

    def _set_process(self, option: str, process_id: int,
                     num_processes: int) -> "_DistributedOptions":
        check_int(f"{option} num_processes", num_processes, minimum=1)
        check_int(f"{option} process_id", process_id, minimum=0,
                  below=num_processes)
        return self._store(option, processId=process_id,
                           numProcesses=num_processes)

    def disable(self) -> "_DistributedOptions":
        """Disable distributed execution: process 0 of 1, whatever the
        environment says."""
        return self._store("Distributed.disable", processId=0, numProcesses=1)

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str
                       ) -> "_DistributedOptions":
        """Read the number of processes and this process's id from the
        named environment variables (1 and 0 when a variable is unset)."""
        option = "Distributed.setEnvVarNames"
        check_str(f"{option} var_num_processes", var_num_processes)
        check_str(f"{option} var_process_id", var_process_id)
        num_processes = _integer_from_environment(option, var_num_processes, 1)
        process_id = _integer_from_environment(option, var_process_id, 0)
        return self._set_process(option, process_id, num_processes)


def _integer_from_environment(option: str, variable: str, default: int) -> int:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise Error(f"{option}: environment variable {variable} must hold an "
                    f"integer, got {text!r}") from None


# --- Options ---

_IPU_NAME = re.compile(r"IPU\d+")
_IPU_VERSIONS = (1, 2, 21)


class Options(OptionsGroup):
    """Set of all options controlling how a model is compiled and run.

    Pass an instance to ``poptorch.inferenceModel`` or
    ``poptorch.trainingModel``. General options are methods of this class;
    categories of options are groups: ``Training``, ``Precision``,
    ``TensorLocations``, ``Jit`` and ``Distributed``.

    ``POPTORCH_DEFAULT_OPTIONS`` (a JSON object of option paths to values) is
    applied on construction.

    >>> opts = poptorch.Options()
    >>> opts.deviceIterations(10)
    >>> opts.Training.gradientAccumulation(4)
    """
    _DISPLAY_NAME = "Options"
    _GROUPS = ("Training", "Precision", "TensorLocations", "Jit",
               "Distributed", "_Popart")
    _DEFAULTS = {
        "device_iterations": 1,
        "replication_factor": 1,
        "output_mode": OutputMode.Default,
        "output_return_period": 1,
        "random_seed": None,
        "connection_type": ConnectionType.Always,
        "use_ipu_model": UNSET,
        "ipu_id": None,
        "offline_ipu_version": None,
        "broadcast_buffers": True,
        "auto_round_num_ipus": False,
        "execution_strategy": None,
        "input_group_size": 1,
        "input_group_type": CommGroupType.Consecutive,
        "executable_cache_dir": UNSET,
        "backend": UNSET,
        "cuda_graphs": False,
        "show_compilation_progress_bar": True,
        "module_namescope": True,
        "source_location_excludes": ["torch/", "poptorch/", "<frozen"],
        "relax_optimizer_attributes_checks": False,
        "anchored_tensors": {},
        "model_name": None,
        "log_dir": None,
        "max_repeat_logs": 4,
        "profile_dir": None,
        "log_cycle_count": False,
        "stable_norm": False,
        "synthetic_data": False,
        "sync_pattern": SyncPattern.Full,
        "available_memory_proportion": {},
        "updatable_named_buffers": [],
    }

    def __init__(self) -> None:
        self._init_builtin_defaults()
        self._distributed._read_environment()
        self._apply_atomically(
            config_file.read_default_options(self, _VOCABULARY))

    def _init_builtin_defaults(self) -> None:
        super().__init__()
        self._training = _TrainingOptions()
        self._precision = _PrecisionOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._jit = _JitOptions()
        self._distributed = _DistributedOptions()
        self._popart = _PopartOptions()

    def _reference(self) -> "Options":
        reference = Options.__new__(Options)
        reference._init_builtin_defaults()
        return reference

    # Groups -----------------------------------------------------------------

    @property
    def Training(self) -> _TrainingOptions:
        """Options specific to training."""
        return self._training

    @property
    def Precision(self) -> _PrecisionOptions:
        """Options related to numerical precision."""
        return self._precision

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Options related to tensor locations."""
        return self._tensor_locations

    @property
    def Jit(self) -> _JitOptions:
        """Options related to upstream PyTorch's JIT compiler."""
        return self._jit

    @property
    def Distributed(self) -> _DistributedOptions:
        """Options of distributed execution over several processes."""
        return self._distributed

    @property
    def _Popart(self) -> _PopartOptions:
        """Options of PopART, PopTorch's IPU compiler: accepted, without
        effect here."""
        return self._popart

    # Read-side properties ---------------------------------------------------

    device_iterations = read_only(
        "device_iterations", "Iterations run per call (default 1).")
    replication_factor = read_only(
        "replication_factor", "Number of replicas of the model (default 1).")
    output_mode = read_only(
        "output_mode", "Which outputs a call returns (default "
        "OutputMode.Default).")
    output_return_period = read_only(
        "output_return_period", "N of OutputMode.EveryN (default 1).")
    random_seed = read_only(
        "random_seed", "Seed of the random number generator, or None "
        "(default).")
    connection_type = read_only(
        "connection_type", "When to attach to the device (default "
        "ConnectionType.Always).")
    ipu_id = read_only("ipu_id", "IPU device id to use, or None (default).")
    offline_ipu_version = read_only(
        "offline_ipu_version", "IPU version of the offline target, or None "
        "(default: no offline target).")
    broadcast_buffers = read_only(
        "broadcast_buffers", "Whether buffers are broadcast to all replicas "
        "(default True).")
    auto_round_num_ipus = read_only(
        "auto_round_num_ipus", "Whether the number of IPUs is rounded up to a "
        "power of 2 (default False).")
    execution_strategy = read_only(
        "execution_strategy", "The execution strategy object, or None "
        "(default).")
    input_group_size = read_only(
        "input_group_size", "Replicas per input replica group (default 1).")
    input_group_type = read_only(
        "input_group_type", "Arrangement of input replica groups (default "
        "CommGroupType.Consecutive).")
    show_compilation_progress_bar = read_only(
        "show_compilation_progress_bar", "Whether a progress bar is shown "
        "while compiling (default True).")
    module_namescope = read_only(
        "module_namescope", "Whether operator names are prefixed by module "
        "names (default True).")
    source_location_excludes = read_only(
        "source_location_excludes", "Frames whose file name contains one of "
        "these strings are skipped when reporting source locations.")
    relax_optimizer_attributes_checks = read_only(
        "relax_optimizer_attributes_checks", "Whether unexpected optimizer "
        "attributes give debug messages instead of warnings (default False).")
    anchored_tensors = read_only(
        "anchored_tensors", "short name -> (long name, OutputMode or None, "
        "output return period) of each anchored tensor.")
    model_name = read_only(
        "model_name", "Name of the model, or None (default: 'inference' or "
        "'training').")
    log_dir = read_only(
        "log_dir", "Directory of the poptorch log file, or None: no log "
        "file, messages go to the console only (default).")
    max_repeat_logs = read_only(
        "max_repeat_logs", "Repeated log lines shown before suppression, or "
        "None for all (default 4).")
    profile_dir = read_only(
        "profile_dir", "Directory of profiling reports, or None when "
        "profiling is off (default).")
    log_cycle_count = read_only(
        "log_cycle_count", "Whether IPU cycle counts are logged (default "
        "False).")
    stable_norm = read_only(
        "stable_norm", "Whether stable norm operators are used (default "
        "False).")
    synthetic_data = read_only(
        "synthetic_data", "Whether synthetic data replaces host I/O (default "
        "False).")
    sync_pattern = read_only(
        "sync_pattern", "IPU synchronisation pattern (default "
        "SyncPattern.Full).")
    available_memory_proportion = read_only(
        "available_memory_proportion", "'IPU<n>' -> proportion of temporary "
        "memory (default empty).")
    updatable_named_buffers = read_only(
        "updatable_named_buffers", "Names of the buffers "
        "copyNamedBuffersToDevice() copies (default empty).")

    @property
    def use_ipu_model(self) -> bool:
        """The value given to ``useIpuModel``, else whether
        ``POPTORCH_IPU_MODEL=1`` is set now."""
        explicit = self._values["use_ipu_model"]
        if explicit is not UNSET:
            return explicit
        return os.environ.get("POPTORCH_IPU_MODEL") == "1"

    @property
    def executable_cache_dir(self) -> Optional[str]:
        """The path given to ``enableExecutableCaching`` (None disables
        caching), else ``POPTORCH_CACHE_DIR`` when it is set now, else
        None."""
        explicit = self._values["executable_cache_dir"]
        if explicit is not UNSET:
            return explicit
        return os.environ.get("POPTORCH_CACHE_DIR") or None

    @property
    def backend(self) -> str:
        """The backend given to ``setBackend``, else ``POPTORCH_BACKEND``
        when it is set now, else ``"auto"``."""
        from ._impl.backends.selection import requested_backend
        explicit = self._values["backend"]
        return requested_backend(None if explicit is UNSET else explicit)

    cuda_graphs = read_only(
        "cuda_graphs", "Whether calls on CUDA devices replay as one CUDA "
        "graph (default False).")

    # Setters ----------------------------------------------------------------

    def deviceIterations(self, device_iterations: int) -> "Options":
        """Number of iterations the device runs over the data before returning
        to the user (default 1)."""
        check_int("deviceIterations", device_iterations, minimum=1)
        return self._store("deviceIterations",
                           device_iterations=device_iterations)

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Number of times the model is replicated (default 1)."""
        check_int("replicationFactor", replication_factor, minimum=1)
        return self._store("replicationFactor",
                           replication_factor=replication_factor)

    def outputMode(self, output_mode: OutputMode,
                   output_return_period: Optional[int] = None) -> "Options":
        """Which data a call returns: ``All``, ``Sum``, ``Final``, ``EveryN``
        (every ``output_return_period`` iterations) or ``Default`` (``All``
        for inference, ``Final`` for training). As in PopTorch, a period
        given with another mode than ``EveryN`` is ignored (logged once)."""
        check_enum("outputMode", output_mode, OutputMode)
        period = 1
        if output_mode == OutputMode.EveryN:
            check_int("outputMode output_return_period (with "
                      "OutputMode.EveryN)", output_return_period, minimum=1)
            period = output_return_period
        elif output_return_period is not None:
            info_once(f"outputMode: output_return_period="
                      f"{output_return_period!r} is ignored with "
                      f"{readable(output_mode)}; only OutputMode.EveryN "
                      "uses a return period")
        return self._store("outputMode", output_mode=output_mode,
                           output_return_period=period)

    def defaultOutputMode(self) -> bool:
        """True while the output mode is ``OutputMode.Default``."""
        return self.output_mode == OutputMode.Default

    def randomSeed(self, random_seed: int) -> "Options":
        """Seed of the random number generator of the model."""
        check_int("randomSeed", random_seed, minimum=0, below=2**64)
        return self._store("randomSeed", random_seed=random_seed)

    def connectionType(self, connection_type: ConnectionType) -> "Options":
        """When to attach to the device: ``Always`` (default), ``OnDemand``
        or ``Never`` (compile only; running raises)."""
        check_enum("connectionType", connection_type, ConnectionType)
        return self._store("connectionType", connection_type=connection_type)

    def useIpuModel(self, use_model: bool) -> "Options":
        """Use the IPU Model instead of IPU hardware; takes precedence over
        ``POPTORCH_IPU_MODEL``."""
        check_bool("useIpuModel", use_model)
        if use_model and self.offline_ipu_version is not None:
            raise Error("useIpuModel(True): the offline IPU target cannot be "
                        "used if the IPU model is enabled, and "
                        "useOfflineIpuTarget was called")
        return self._store("useIpuModel", use_ipu_model=use_model)

    def useIpuId(self, ipu_id: int) -> "Options":
        """Use the IPU device with this id (as given by gc-info)."""
        check_int("useIpuId", ipu_id, minimum=0)
        return self._store("useIpuId", ipu_id=ipu_id)

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> "Options":
        """Target an offline IPU (1: Mk1, 2: Mk2, 21: Mk2 with FP8) for
        offline compilation only; sets ``connectionType(Never)``."""
        if isinstance(ipu_version, bool) or ipu_version not in _IPU_VERSIONS:
            raise invalid("useOfflineIpuTarget",
                          "an IPU version in (1, 2, 21)", ipu_version)
        if self.use_ipu_model:
            raise Error("useOfflineIpuTarget: the offline IPU target cannot "
                        "be used if the IPU model is enabled (useIpuModel or "
                        "POPTORCH_IPU_MODEL=1)")
        return self._store("useOfflineIpuTarget",
                           offline_ipu_version=ipu_version,
                           connection_type=ConnectionType.Never)

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> "Options":
        """Broadcast buffers to all replicas; with False each replica keeps
        its own buffers."""
        check_bool("broadcastBuffers", broadcast_buffers)
        return self._store("broadcastBuffers",
                           broadcast_buffers=broadcast_buffers)

    def updatableNamedBuffers(self, buffers: List[str]) -> "Options":
        """Named buffers of the model that ``copyNamedBuffersToDevice()``
        copies from the host to the device: a subset of the weights can be
        updated instead of all of them, as ``copyWeightsToDevice()``
        does."""
        if not isinstance(buffers, (list, tuple)) or not all(
                isinstance(name, str) for name in buffers):
            raise invalid("updatableNamedBuffers", "a list of buffer names "
                          "(str)", buffers)
        return self._store("updatableNamedBuffers",
                           updatable_named_buffers=list(buffers))

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> "Options":
        """Round the number of IPUs up to a power of 2 instead of raising."""
        check_bool("autoRoundNumIPUs", auto_round_num_ipus)
        return self._store("autoRoundNumIPUs",
                           auto_round_num_ipus=auto_round_num_ipus)

    def setExecutionStrategy(self, strategy: Any) -> "Options":
        """The execution strategy partitioning the graph (an instance of one
        of the execution strategy classes)."""
        return self._store("setExecutionStrategy", execution_strategy=strategy)

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: CommGroupType) -> "Options":
        """Split input batches between groups of ``input_group_size``
        replicas arranged as ``input_group_type`` (not
        ``CommGroupType.All``)."""
        check_int("inputReplicaGrouping input_group_size", input_group_size,
                  minimum=1)
        allowed = tuple(member for member in CommGroupType
                        if member != CommGroupType.All)
        check_enum("inputReplicaGrouping input_group_type", input_group_type,
                   CommGroupType, allowed)
        return self._store("inputReplicaGrouping",
                           input_group_size=input_group_size,
                           input_group_type=input_group_type)

    def enableExecutableCaching(self, path: Optional[str]) -> "Options":
        """Directory used as a cache of compiled executables; None disables
        caching (also when ``POPTORCH_CACHE_DIR`` is set)."""
        cache_dir = path_or_none("enableExecutableCaching", path)
        return self._store("enableExecutableCaching",
                           executable_cache_dir=cache_dir)

    def setBackend(self, backend: str = "auto",
                   cuda_graphs: bool = False) -> "Options":
        """How the captured steps run (an extension of PopTorch's API):
        ``"graph"`` runs the captured graph, ``"inductor"`` compiles it with
        TorchInductor, ``"aot_eager"`` runs AOTAutograd's functionalized
        graph (for debugging) and ``"auto"`` (the default) starts on
        ``"graph"`` and moves to Inductor's steps, compiled in the
        background, once the model has spent long enough in calls to repay
        the compilation (2 s or more, measured on its first calls; fixed by
        ``POPTORCH_TIER_UP_AFTER``). Takes precedence over
        ``POPTORCH_BACKEND``. With
        ``cuda_graphs=True`` a model on a CUDA device replays each call's
        whole loop as one CUDA graph (no effect on the CPU)."""
        from ._impl.backends.selection import backend_choices
        if backend not in backend_choices():
            raise invalid("setBackend backend", "one of " + ", ".join(
                repr(choice) for choice in backend_choices()), backend)
        check_bool("setBackend cuda_graphs", cuda_graphs)
        return self._store("setBackend", backend=backend,
                           cuda_graphs=cuda_graphs)

    def showCompilationProgressBar(self, show: bool = True) -> "Options":
        """Show or hide a progress bar while compiling (shown by default)."""
        check_bool("showCompilationProgressBar", show)
        return self._store("showCompilationProgressBar",
                           show_compilation_progress_bar=show)

    def disableModuleNamescope(self) -> "Options":
        """Do not prefix operator names with the names of their modules."""
        return self._store("disableModuleNamescope", module_namescope=False)

    def sourceLocationExcludes(self, excludes: List[str]) -> "Options":
        """Replace the strings that exclude frames from source locations."""
        if not isinstance(excludes, (list, tuple)) or not all(
                isinstance(item, str) for item in excludes):
            raise invalid("sourceLocationExcludes", "a list of str", excludes)
        return self._store("sourceLocationExcludes",
                           source_location_excludes=list(excludes))

    def appendToLocationExcludes(self, *excludes: str) -> "Options":
        """Append strings that exclude frames from source locations."""
        for exclude in excludes:
            check_str("appendToLocationExcludes", exclude)
        return self._store(
            "appendToLocationExcludes",
            source_location_excludes=self.source_location_excludes +
            list(excludes))

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> "Options":
        """Report unexpected optimizer attributes in setOptimizer() as debug
        messages (True) instead of warnings."""
        check_bool("relaxOptimizerAttributesChecks", relax)
        return self._store("relaxOptimizerAttributesChecks",
                           relax_optimizer_attributes_checks=relax)

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[OutputMode] = None,
                     output_return_period: int = 1) -> "Options":
        """Anchor the tensor ``long_name`` so that it can be read back as
        ``short_name`` after a run; ``output_mode`` None uses the model's
        output mode."""
        check_str("anchorTensor short_name", short_name)
        check_str("anchorTensor long_name", long_name)
        if output_mode is not None:
            check_enum("anchorTensor output_mode", output_mode, OutputMode)
        check_int("anchorTensor output_return_period", output_return_period,
                  minimum=1)
        anchors = self.anchored_tensors
        anchors[short_name] = (long_name, output_mode, output_return_period)
        return self._store("anchorTensor", anchored_tensors=anchors)

    def modelName(self, name: str) -> "Options":
        """Name of the model (default 'inference' or 'training'): names the
        model's executable-cache entries (the cache's ``index.json``)."""
        check_str("modelName", name)
        return self._store("modelName", model_name=name)

    def logDir(self, log_dir: str) -> "Options":
        """Directory where PopTorch saves its log file (created if missing):
        from the creation of a model with these options, the ``poptorch``
        logger also writes to ``log_dir/poptorch.log``
        (``poptorch.rank<R>.log`` in process R of a multi-process run).
        Without logDir, messages go to the console only."""
        directory = path_or_none("logDir", log_dir)
        if directory is None:
            raise invalid("logDir", "a path (str or os.PathLike)", log_dir)
        return self._store("logDir", log_dir=directory)

    def maxRepeatLogs(self, max_lines: Optional[int]) -> "Options":
        """For often-repeated log lines, the number of repeats logged before
        they are suppressed (default 4); None shows them all. From the
        creation of a model with these options, at most ``max_lines``
        consecutive messages of one template are logged, then one line says
        how many were suppressed."""
        if max_lines is not None:
            check_int("maxRepeatLogs", max_lines, minimum=0)
        return self._store("maxRepeatLogs", max_repeat_logs=max_lines)

    def enableProfiling(self, profile_dir: Optional[str] = None) -> "Options":
        """Generate profiling reports in ``profile_dir`` (default: the
        current directory)."""
        directory = path_or_none("enableProfiling", profile_dir)
        return self._store("enableProfiling", profile_dir=directory or ".")

    def logCycleCount(self, log_cycle_count: bool) -> "Options":
        """Log the number of IPU cycles used by the main graph."""
        check_bool("logCycleCount", log_cycle_count)
        return self._store("logCycleCount", log_cycle_count=log_cycle_count)

    def enableStableNorm(self, enabled: bool) -> "Options":
        """Use the slower but more accurate stable norm operators."""
        check_bool("enableStableNorm", enabled)
        return self._store("enableStableNorm", stable_norm=enabled)

    def enableSyntheticData(self, enabled: bool) -> "Options":
        """Disable host I/O and generate random input data on the device."""
        check_bool("enableSyntheticData", enabled)
        return self._store("enableSyntheticData", synthetic_data=enabled)

    def syncPattern(self, sync_pattern: SyncPattern) -> "Options":
        """Synchronisation between IPUs and the host."""
        check_enum("syncPattern", sync_pattern, SyncPattern)
        return self._store("syncPattern", sync_pattern=sync_pattern)

    def setAvailableMemoryProportion(
            self, available_memory_proportion: Dict[str, float]) -> "Options":
        """Temporary memory available per IPU, as ``{"IPU<n>": proportion}``
        with proportions between 0 and 1."""
        option = "setAvailableMemoryProportion"
        if not isinstance(available_memory_proportion, dict):
            raise invalid(option, 'a dict such as {"IPU0": 0.5}',
                          available_memory_proportion)
        for ipu, proportion in available_memory_proportion.items():
            if not isinstance(ipu, str) or not _IPU_NAME.fullmatch(ipu):
                raise invalid(f"{option} key", '"IPU<n>" such as "IPU0"', ipu)
            if (isinstance(proportion, bool)
                    or not isinstance(proportion, (int, float))
                    or not 0.0 <= proportion <= 1.0):
                raise invalid(f"{option} value for {ipu}",
                              "a float between 0 and 1", proportion)
        return self._store(option, available_memory_proportion={
            ipu: float(proportion)
            for ipu, proportion in available_memory_proportion.items()})

    # Whole-object operations -----------------------------------------------

    def loadFromFile(self, filepath: str) -> "Options":
        """Apply a config file with one option call per line, written as in
        Python without the ``options.`` prefix (``deviceIterations(4)``).
        The file is parsed, never executed; if any line is rejected the
        options are left unchanged."""
        if self._frozen:
            raise frozen_error("loadFromFile")
        self._apply_atomically(
            config_file.read_config_file(filepath, _VOCABULARY))
        return self

    def _apply_atomically(self, calls: List[config_file.OptionCall]) -> None:
        components = [self, *self._children()]
        saved = [dict(component._values) for component in components]
        try:
            config_file.apply_calls(self, calls)
        except Error:
            for component, values in zip(components, saved):
                component._values = values
            raise

    def clone(self) -> "Options":
        """An unfrozen deep copy of these options."""
        return copy.deepcopy(self)


_PHASED_METHODS = frozenset({"setTensorsLiveness",
                             "useSeparateBackwardPhase"})

_VOCABULARY = config_file.Vocabulary(
    option_paths=frozenset(
        path for path in OPTION_EFFECTS
        if not path.startswith(("TensorLocationSettings.", "_"))),
    constructors={
        TensorLocationSettings: frozenset(
            path.split(".", 1)[1] for path in OPTION_EFFECTS
            if path.startswith("TensorLocationSettings.")),
        strategies.Stage: frozenset({"ipu"}),
        strategies.Phase: frozenset({"ipus"}),
        strategies.ShardedExecution: frozenset(),
        strategies.PipelinedExecution: frozenset(),
        strategies.SerialPhasedExecution: _PHASED_METHODS,
        strategies.ParallelPhasedExecution: _PHASED_METHODS,
    },
    settings_class=TensorLocationSettings)
