"""poptorch.Options and its groups: defaults, validation, freezing, copying,
printing, POPTORCH_DEFAULT_OPTIONS, distributed defaults, config files and
the logging of options without effect on CPU/GPU."""
import copy
import inspect
import json
import logging
import pathlib
import pickle

import pytest
import torch

import poptorch
from poptorch.enums import (CommGroupType, ConnectionType,
                            HalfFloatCastingBehavior, MeanReductionStrategy,
                            OutputMode, ReductionType, SyncPattern)
from poptorch.autocasting import Policy
from poptorch.errors import Error
from poptorch._impl.options.effects import IMPLEMENTED, NO_EFFECT, STORED
from poptorch._impl.options.groups import freeze
from poptorch.options import (OPTION_EFFECTS, ConfigFileError, Options,
                              TensorLocationSettings)

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "options.md"

_ENVIRONMENT = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK",
                "WORLD_SIZE", "POPTORCH_IPU_MODEL", "POPTORCH_CACHE_DIR",
                "POPTORCH_BACKEND",
                "POPTORCH_DEFAULT_OPTIONS")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Every test starts without the variables that Options reads."""
    for variable in _ENVIRONMENT:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TEST_NUM_PROCESSES", "4")
    monkeypatch.setenv("TEST_PROCESS_ID", "3")


class _Strategy:
    """Stands in for an execution strategy object."""

    def __repr__(self):
        return "_Strategy()"


#: One valid, non-default call of every option in OPTION_EFFECTS.
EXAMPLE_CALLS = {
    "anchorTensor": ("loss", "Loss:0", OutputMode.All),
    "appendToLocationExcludes": ("site-packages/",),
    "autoRoundNumIPUs": (True,),
    "broadcastBuffers": (False,),
    "connectionType": (ConnectionType.OnDemand,),
    "deviceIterations": (3,),
    "disableModuleNamescope": (),
    "enableExecutableCaching": ("/tmp/cache",),
    "enableProfiling": ("profiles",),
    "enableStableNorm": (True,),
    "enableSyntheticData": (True,),
    "inputReplicaGrouping": (2, CommGroupType.Orthogonal),
    "logCycleCount": (True,),
    "logDir": ("logs",),
    "maxRepeatLogs": (None,),
    "modelName": ("net",),
    "outputMode": (OutputMode.EveryN, 2),
    "randomSeed": (42,),
    "relaxOptimizerAttributesChecks": (),
    "replicationFactor": (2,),
    "setAvailableMemoryProportion": ({"IPU0": 0.3},),
    "setBackend": ("inductor", True),
    "setExecutionStrategy": (_Strategy(),),
    "showCompilationProgressBar": (False,),
    "sourceLocationExcludes": (["mylib/"],),
    "syncPattern": (SyncPattern.SinglePipeline,),
    "updatableNamedBuffers": (["bn.running_mean"],),
    "useIpuId": (1,),
    "useIpuModel": (True,),
    "useOfflineIpuTarget": (21,),
    "Training.gradientAccumulation": (4,),
    "Training.accumulationAndReplicationReductionType": (ReductionType.Sum,),
    "Training.setMeanAccumulationAndReplicationReductionStrategy":
        (MeanReductionStrategy.Running,),
    "Training.setAutomaticLossScaling": (True,),
    "Training.setConvolutionDithering": (True,),
    "Precision.autocastEnabled": (False,),
    "Precision.autocastPolicy": (Policy(fp16=[torch.relu]),),
    "Precision.enableFloatingPointExceptions": (True,),
    "Precision.enableStochasticRounding": (True,),
    "Precision.halfFloatCasting":
        (HalfFloatCastingBehavior.HalfUpcastToFloat,),
    "Precision.runningStatisticsAlwaysFloat": (False,),
    "Precision.setPartialsType": (torch.half,),
    "Jit.traceModel": (True,),
    "TensorLocations.numIOTiles": (32,),
    "TensorLocations.setActivationLocation":
        (TensorLocationSettings(on_chip=False),),
    "TensorLocations.setWeightLocation":
        (TensorLocationSettings(replicated_tensor_sharding=True),),
    "TensorLocations.setOptimizerLocation": (TensorLocationSettings(),),
    "TensorLocations.setAccumulatorLocation": (TensorLocationSettings(),),
    "TensorLocationSettings.useOnChipStorage": (False,),
    "TensorLocationSettings.useReplicatedTensorSharding": (True,),
    "TensorLocationSettings.minElementsForOffChip": (128,),
    "TensorLocationSettings.minElementsForReplicatedTensorSharding": (64,),
    "TensorLocationSettings.useIOTilesToLoad": (True,),
    "TensorLocationSettings.useIOTilesToStore": (True,),
    "Distributed.configureProcessId": (1, 2),
    "Distributed.disable": (),
    "Distributed.setEnvVarNames": ("TEST_NUM_PROCESSES", "TEST_PROCESS_ID"),
    "_Popart.set": ("outlineThreshold", 10.0),
    "_Popart.setEngineOptions": ({"opt.internalExchangeOptimisationTarget":
                                  "balanced"},),
    "_Popart.setPatterns": ({"PreUniRepl": False}, 1),
}

_NOT_SETTERS = {"clone", "toDict", "loadFromFile", "defaultOutputMode"}


def _with_stored_settings():
    """Options holding a weight location to call settings setters on."""
    opts = Options()
    opts.TensorLocations.setWeightLocation(TensorLocationSettings())
    return opts


def _method(opts, path):
    group, _, name = path.rpartition(".")
    if group == "TensorLocationSettings":
        return getattr(opts.TensorLocations.weight_location, name)
    target = getattr(opts, group) if group else opts
    return getattr(target, name)


def _call(opts, path):
    return _method(opts, path)(*EXAMPLE_CALLS[path])


# --- Defaults and chaining ---

def test_defaults_match_the_spec():
    opts = Options()
    assert opts.device_iterations == 1
    assert opts.replication_factor == 1
    assert opts.output_mode is OutputMode.Default and opts.defaultOutputMode()
    assert opts.output_return_period == 1
    assert opts.random_seed is None
    assert opts.connection_type is ConnectionType.Always
    assert opts.use_ipu_model is False
    assert opts.ipu_id is None and opts.offline_ipu_version is None
    assert opts.broadcast_buffers is True
    assert opts.auto_round_num_ipus is False
    assert opts.execution_strategy is None
    assert opts.input_group_size == 1
    assert opts.input_group_type is CommGroupType.Consecutive
    assert opts.executable_cache_dir is None
    assert opts.show_compilation_progress_bar is True
    assert opts.module_namescope is True
    assert "torch/" in opts.source_location_excludes
    assert opts.relax_optimizer_attributes_checks is False
    assert opts.anchored_tensors == {}
    assert opts.max_repeat_logs == 4
    assert opts.profile_dir is None
    assert opts.sync_pattern is SyncPattern.Full
    assert opts.available_memory_proportion == {}
    training = opts.Training
    assert training.gradient_accumulation == 1
    assert (training.accumulation_and_replication_reduction_type
            is ReductionType.Mean)
    assert (training.mean_accumulation_and_replication_reduction_strategy
            is None)
    assert training.auto_loss_scaling is False
    assert training.convolution_dithering is False
    assert opts.Precision.autocast_enabled is True
    assert opts.Precision.partials_type is torch.float32
    assert opts.Jit.trace_model is False
    assert opts.TensorLocations.num_io_tiles == 0
    assert opts.TensorLocations.activation_location is None
    distributed = opts.Distributed
    assert (distributed.processId, distributed.numProcesses) == (0, 1)
    settings = TensorLocationSettings()
    assert settings.on_chip is None
    assert settings.replicated_tensor_sharding is False


def test_setters_chain_on_the_object_and_on_groups():
    opts = Options()
    assert opts.deviceIterations(4).replicationFactor(2) is opts
    assert opts.Training.gradientAccumulation(3).setAutomaticLossScaling(
        True) is opts.Training
    assert opts.Precision.setPartialsType(torch.half) is opts.Precision
    assert opts.TensorLocations.numIOTiles(32) is opts.TensorLocations
    assert opts.Distributed.configureProcessId(1, 2) is opts.Distributed
    settings = TensorLocationSettings()
    assert settings.useOnChipStorage(False).minElementsForOffChip(
        8) is settings
    assert (opts.device_iterations, opts.replication_factor) == (4, 2)
    assert opts.Training.gradient_accumulation == 3
    assert opts.Training.auto_loss_scaling is True
    assert opts.Precision.partials_type is torch.float16
    assert (settings.on_chip, settings.min_elements_for_off_chip) == (False, 8)


@pytest.mark.parametrize("path", sorted(set(EXAMPLE_CALLS) -
                                        {"Distributed.disable"}))
def test_every_setter_changes_what_the_options_report(path):
    opts = _with_stored_settings()
    before = opts.toDict()
    _call(opts, path)
    assert opts.toDict() != before


def test_output_mode_every_n_stores_its_period():
    opts = Options().outputMode(OutputMode.EveryN, 5)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN,
                                                             5)
    assert not opts.defaultOutputMode()
    opts.outputMode(OutputMode.All)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.All, 1)


def test_location_excludes_are_replaced_or_appended():
    opts = Options().sourceLocationExcludes(["a/"])
    opts.appendToLocationExcludes("b/", "c/")
    assert opts.source_location_excludes == ["a/", "b/", "c/"]
    opts.source_location_excludes.append("not stored")
    assert opts.source_location_excludes == ["a/", "b/", "c/"]


def test_anchor_tensor_records_mode_and_period():
    opts = Options().anchorTensor("grad", "Gradient___x")
    opts.anchorTensor("out", "y", OutputMode.EveryN, 2)
    assert opts.anchored_tensors == {
        "grad": ("Gradient___x", None, 1),
        "out": ("y", OutputMode.EveryN, 2)}


def test_offline_target_sets_connection_never():
    opts = Options().useOfflineIpuTarget()
    assert opts.offline_ipu_version == 2
    assert opts.connection_type is ConnectionType.Never


def test_location_setter_stores_a_copy_of_the_settings():
    settings = TensorLocationSettings().useOnChipStorage(False)
    opts = Options()
    opts.TensorLocations.setActivationLocation(settings)
    settings.useOnChipStorage(True)
    assert opts.TensorLocations.activation_location.on_chip is False


def test_ipu_model_follows_explicit_value_then_environment(monkeypatch):
    opts = Options()
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert opts.use_ipu_model is True
    opts.useIpuModel(False)
    assert opts.use_ipu_model is False


def test_cache_dir_follows_explicit_value_then_environment(monkeypatch,
                                                           tmp_path):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "/tmp/from_env")
    opts = Options()
    assert opts.executable_cache_dir == "/tmp/from_env"
    opts.enableExecutableCaching(tmp_path)
    assert opts.executable_cache_dir == str(tmp_path)
    opts.enableExecutableCaching(None)
    assert opts.executable_cache_dir is None


def test_group_constructors_take_initial_values_by_property_name():
    settings = TensorLocationSettings(on_chip=False,
                                      replicated_tensor_sharding=True)
    assert (settings.on_chip, settings.replicated_tensor_sharding) == (False,
                                                                      True)
    with pytest.raises(Error, match="unknown keyword 'onChip'.*on_chip"):
        TensorLocationSettings(onChip=False)


# --- Validation ---

_INVALID_CALLS = [
    (lambda o: o.deviceIterations(0),
     "deviceIterations must be an int >= 1, got 0"),
    (lambda o: o.deviceIterations(True),
     "deviceIterations must be an int >= 1, got True"),
    (lambda o: o.replicationFactor(2.0),
     "replicationFactor must be an int >= 1, got 2.0"),
    (lambda o: o.Training.gradientAccumulation(0),
     "Training.gradientAccumulation must be an int >= 1, got 0"),
    (lambda o: o.outputMode(2),
     "outputMode must be one of poptorch.OutputMode.Final, "
     "poptorch.OutputMode.EveryN"),
    (lambda o: o.outputMode("All"), "got 'All'"),
    (lambda o: o.outputMode(OutputMode.EveryN),
     "output_return_period (with OutputMode.EveryN) must be an int >= 1, "
     "got None"),
    (lambda o: o.outputMode(OutputMode.EveryN, 0), ">= 1, got 0"),
    (lambda o: o.connectionType("Always"),
     "connectionType must be one of poptorch.ConnectionType.Always"),
    (lambda o: o.syncPattern(0), "syncPattern must be one of"),
    (lambda o: o.Training.accumulationAndReplicationReductionType(
        ReductionType.NoReduction),
     "must be one of poptorch.ReductionType.Mean, poptorch.ReductionType.Sum"),
    (lambda o: o.inputReplicaGrouping(2, CommGroupType.All),
     "input_group_type must be one of poptorch.CommGroupType.Consecutive, "
     "poptorch.CommGroupType.Orthogonal, poptorch.CommGroupType.NoGrouping, "
     "got <CommGroupType.All: 0>"),
    (lambda o: o.inputReplicaGrouping(0, CommGroupType.Consecutive),
     "input_group_size must be an int >= 1, got 0"),
    (lambda o: o.useOfflineIpuTarget(3),
     "useOfflineIpuTarget must be an IPU version in (1, 2, 21), got 3"),
    (lambda o: o.useIpuModel(True).useOfflineIpuTarget(),
     "the offline IPU target cannot be used if the IPU model is enabled"),
    (lambda o: o.useOfflineIpuTarget().useIpuModel(True),
     "the offline IPU target cannot be used if the IPU model is enabled"),
    (lambda o: o.useIpuModel(1), "useIpuModel must be a bool"),
    (lambda o: o.enableStableNorm("yes"),
     "enableStableNorm must be a bool (True or False), got 'yes'"),
    (lambda o: o.randomSeed(-1), "randomSeed must be an int >= 0"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 1.5}),
     "setAvailableMemoryProportion value for IPU0 must be a float between 0 "
     "and 1, got 1.5"),
    (lambda o: o.setAvailableMemoryProportion({"GPU0": 0.5}),
     "setAvailableMemoryProportion key must be \"IPU<n>\""),
    (lambda o: o.setAvailableMemoryProportion([0.5]),
     "setAvailableMemoryProportion must be a dict"),
    (lambda o: o.setAvailableMemoryProportion({"IPU1": True}), "got True"),
    (lambda o: o.Precision.setPartialsType(torch.int32),
     "Precision.setPartialsType must be torch.float or torch.half, "
     "got torch.int32"),
    (lambda o: o.Precision.setPartialsType("half"), "got 'half'"),
    (lambda o: o.Distributed.configureProcessId(2, 2),
     "Distributed.configureProcessId process_id must be an int >= 0 and < 2, "
     "got 2"),
    (lambda o: o.Distributed.configureProcessId(0, 0),
     "num_processes must be an int >= 1, got 0"),
    (lambda o: o.enableExecutableCaching(3),
     "enableExecutableCaching must be a path"),
    (lambda o: o.TensorLocations.setActivationLocation("off chip"),
     "TensorLocations.setActivationLocation must be a "
     "poptorch.TensorLocationSettings, got 'off chip'"),
    (lambda o: o.TensorLocations.numIOTiles(-2),
     "TensorLocations.numIOTiles must be an int >= 0, got -2"),
    (lambda o: o.sourceLocationExcludes("torch/"),
     "sourceLocationExcludes must be a list of str"),
    (lambda o: o.appendToLocationExcludes("a", 3),
     "appendToLocationExcludes must be a str, got 3"),
    (lambda o: o.anchorTensor("a", "b", 2),
     "anchorTensor output_mode must be one of"),
    (lambda o: o.maxRepeatLogs(-1), "maxRepeatLogs must be an int >= 0"),
    (lambda o: o.Jit.traceModel(None), "Jit.traceModel must be a bool"),
    (lambda o: TensorLocationSettings().minElementsForOffChip(-1),
     "TensorLocationSettings.minElementsForOffChip must be an int >= 0"),
    (lambda o: TensorLocationSettings().useOnChipStorage("no"),
     "TensorLocationSettings.useOnChipStorage must be a bool"),
    (lambda o: o._Popart.set(3, True), "_Popart.set key must be a str, got 3"),
    (lambda o: o._Popart.set("outlineThreshold", None),
     "_Popart.set value for 'outlineThreshold' must be a bool, int, float, "
     "str, list, tuple, set or dict, got None"),
    (lambda o: o._Popart.setEngineOptions(["debug.instrument"]),
     "_Popart.setEngineOptions must be a dict with str keys"),
    (lambda o: o._Popart.setPatterns({"PreUniRepl": 1}),
     "_Popart.setPatterns must be a dict of str to bool, got {'PreUniRepl': 1}"),
    (lambda o: o._Popart.setPatterns({}, -1),
     "_Popart.setPatterns level must be an int >= 0, got -1"),
]


@pytest.mark.parametrize("call, message", _INVALID_CALLS)
def test_invalid_values_raise_naming_option_value_and_allowed(call, message):
    opts = Options()
    with pytest.raises(Error) as raised:
        call(opts)
    assert message in str(raised.value)


def test_popart_options_accumulate_by_key():
    opts = Options()
    opts._Popart.set("outlineThreshold", 10.0)
    opts._Popart.set("autoRecomputation", 3)
    opts._Popart.set("outlineThreshold", 5.0)
    assert opts._Popart.options == {"outlineThreshold": 5.0,
                                    "autoRecomputation": 3}
    assert "outlineThreshold" in str(opts)


def test_popart_options_take_every_value_type_popart_takes():
    """Numbers, strings, booleans, collections of strings (lists, tuples,
    sets) and string maps, as PopTorch passes them on to PopART."""
    values = {"a": 4, "b": 0.5, "c": "ON", "d": True, "e": ["0", "1"],
              "f": ("0",), "g": {"1", "0"}, "h": frozenset({"0"}),
              "i": {"partialsType": "half"}}
    opts = Options()
    for key, value in values.items():
        opts._Popart.set(key, value)
    assert opts._Popart.options == values
    assert json.loads(json.dumps(opts.toDict()))["_Popart"]["options"][
        "g"] == ["0", "1"]
    assert opts.clone().toDict() == opts.toDict()


def test_enum_setters_accept_members():
    opts = Options().connectionType(ConnectionType.Never)
    opts.syncPattern(SyncPattern.ReplicaAndLadder)
    assert opts.connection_type is ConnectionType.Never
    assert opts.sync_pattern is SyncPattern.ReplicaAndLadder


def test_rejected_value_leaves_options_unchanged():
    opts = Options().deviceIterations(4)
    with pytest.raises(Error):
        opts.deviceIterations(-4)
    with pytest.raises(Error):
        opts.setAvailableMemoryProportion({"IPU0": 0.5, "IPU1": 2.0})
    assert opts.device_iterations == 4
    assert opts.available_memory_proportion == {}


def test_offline_target_rejected_when_ipu_model_env_is_set(monkeypatch):
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    with pytest.raises(Error, match="POPTORCH_IPU_MODEL"):
        Options().useOfflineIpuTarget()


# --- Freezing and copies ---

@pytest.mark.parametrize("path", sorted(EXAMPLE_CALLS))
def test_every_setter_raises_once_frozen(path):
    opts = _with_stored_settings()
    before = opts.toDict()
    freeze(opts)
    with pytest.raises(Error) as raised:
        _call(opts, path)
    message = str(raised.value)
    assert f"{path}()" in message
    assert "frozen" in message
    assert "passed to a model or a DataLoader" in message
    assert "clone()" in message
    assert opts.toDict() == before


def test_load_from_file_raises_once_frozen(tmp_path):
    config = tmp_path / "opts.conf"
    config.write_text("deviceIterations(2)\n")
    opts = Options()
    freeze(opts)
    with pytest.raises(Error, match=r"loadFromFile\(\).*frozen"):
        opts.loadFromFile(config)


@pytest.mark.parametrize("make_copy", [Options.clone, copy.deepcopy,
                                       copy.copy],
                         ids=["clone", "deepcopy", "copy"])
def test_copies_are_unfrozen_and_independent(make_copy):
    opts = _with_stored_settings().deviceIterations(4)
    freeze(opts)
    duplicate = make_copy(opts)
    assert duplicate.toDict() == opts.toDict()
    duplicate.deviceIterations(8).Training.gradientAccumulation(2)
    duplicate.TensorLocations.weight_location.useOnChipStorage(False)
    assert opts.device_iterations == 4
    assert opts.Training.gradient_accumulation == 1
    assert opts.TensorLocations.weight_location.on_chip is None
    with pytest.raises(Error, match="frozen"):
        opts.Training.gradientAccumulation(2)


def test_pickle_round_trip_keeps_values_and_environment_defaults(monkeypatch):
    opts = Options().deviceIterations(4).outputMode(OutputMode.Sum)
    opts.TensorLocations.setActivationLocation(
        TensorLocationSettings().useOnChipStorage(False))
    opts.Precision.setPartialsType(torch.half)
    restored = pickle.loads(pickle.dumps(opts))
    assert restored.toDict() == opts.toDict()
    assert restored.output_mode is OutputMode.Sum
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert restored.use_ipu_model is True


# --- Printing and toDict ---

def test_str_lists_only_non_default_values():
    assert str(Options()) == "Options()"
    opts = Options().deviceIterations(4).outputMode(OutputMode.All)
    opts.Training.gradientAccumulation(2)
    text = str(opts)
    assert text.startswith("Options(")
    assert "device_iterations=4" in text
    assert "output_mode=OutputMode.All" in text
    assert "Training.gradient_accumulation=2" in text
    assert "replication_factor" not in text
    assert repr(opts) == text


def test_to_dict_is_json_and_equal_for_equal_options():
    def build():
        opts = Options().deviceIterations(2).setExecutionStrategy(_Strategy())
        opts.Precision.setPartialsType(torch.half)
        opts.TensorLocations.setWeightLocation(
            TensorLocationSettings().useReplicatedTensorSharding())
        return opts

    first, second = build(), build()
    assert first.toDict() == second.toDict()
    as_json = json.loads(json.dumps(first.toDict()))
    assert as_json == first.toDict()
    assert as_json["output_mode"] == "OutputMode.Default"
    assert as_json["execution_strategy"] == "_Strategy()"
    assert as_json["Precision"]["partials_type"] == "torch.float16"
    assert as_json["TensorLocations"]["weight_location"][
        "replicated_tensor_sharding"] is True
    assert set(as_json) >= {"Training", "Precision", "TensorLocations", "Jit",
                            "Distributed"}
    second.Training.gradientAccumulation(2)
    assert first.toDict() != second.toDict()


# --- POPTORCH_DEFAULT_OPTIONS ---

def test_default_options_env_is_applied_at_construction(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps({
        "deviceIterations": 4,
        "Training.gradientAccumulation": 2,
        "outputMode": ["EveryN", 3],
        "replicationFactor": 2,
        "connectionType": "ConnectionType.OnDemand",
        "syncPattern": 1,
        "Precision.setPartialsType": "torch.half",
        "TensorLocations.setWeightLocation": {"on_chip": False},
        "sourceLocationExcludes": [["a/"]],
        "disableModuleNamescope": [],
    }))
    opts = Options()
    assert opts.device_iterations == 4
    assert opts.Training.gradient_accumulation == 2
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN,
                                                             3)
    assert opts.replication_factor == 2
    assert opts.connection_type is ConnectionType.OnDemand
    assert opts.sync_pattern is SyncPattern.SinglePipeline
    assert opts.Precision.partials_type is torch.float16
    assert opts.TensorLocations.weight_location.on_chip is False
    assert opts.source_location_excludes == ["a/"]
    assert opts.module_namescope is False


@pytest.mark.parametrize("value, message", [
    ('{"deviceIteration": 4}',
     "POPTORCH_DEFAULT_OPTIONS key 'deviceIteration': unknown option"),
    ('{"_freeze": []}', "key '_freeze': unknown option"),
    ('{"deviceIterations": 0}',
     "key 'deviceIterations': deviceIterations must be an int >= 1, got 0"),
    ('{"outputMode": "Everything"}',
     "key 'outputMode': 'Everything' is not a OutputMode member; allowed: "
     "Final (0), EveryN (1)"),
    ('{"outputMode": 9}', "9 is not a OutputMode number"),
    ('{"Precision.setPartialsType": "torch.nn"}',
     "'torch.nn' is not a torch dtype"),
    ('{"deviceIterations": 4', "POPTORCH_DEFAULT_OPTIONS is not valid JSON"),
    ('[4]', "POPTORCH_DEFAULT_OPTIONS must be a JSON object"),
])
def test_bad_default_options_env_raises(monkeypatch, value, message):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", value)
    with pytest.raises(ConfigFileError) as raised:
        Options()
    assert message in str(raised.value)
    assert isinstance(raised.value, Error)


# --- Distributed defaults ---

def test_distributed_defaults_come_from_openmpi(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    distributed = Options().Distributed
    assert (distributed.processId, distributed.numProcesses) == (2, 4)


def test_distributed_defaults_come_from_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    distributed = Options().Distributed
    assert (distributed.processId, distributed.numProcesses) == (1, 3)


def test_configure_process_id_and_disable_override_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    distributed = Options().Distributed.configureProcessId(0, 2)
    assert (distributed.processId, distributed.numProcesses) == (0, 2)
    disabled = Options().Distributed.disable()
    assert (disabled.processId, disabled.numProcesses) == (0, 1)


def test_set_env_var_names_reads_the_named_variables():
    distributed = Options().Distributed.setEnvVarNames("TEST_NUM_PROCESSES",
                                                       "TEST_PROCESS_ID")
    assert (distributed.processId, distributed.numProcesses) == (3, 4)


def test_set_env_var_names_rejects_non_integers(monkeypatch):
    monkeypatch.setenv("MY_RANK", "first")
    with pytest.raises(Error) as raised:
        Options().Distributed.setEnvVarNames("TEST_NUM_PROCESSES", "MY_RANK")
    assert ("Distributed.setEnvVarNames: environment variable MY_RANK must "
            "hold an integer, got 'first'") in str(raised.value)


def test_bad_torchrun_environment_is_reported(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(Error, match="WORLD_SIZE must hold an integer"):
        Options()


# --- Config files ---

def test_load_from_file_applies_each_line(tmp_path):
    config = tmp_path / "poptorch.conf"
    config.write_text(
        "# options for the run\n"
        "deviceIterations(4)\n"
        "\n"
        "Training.gradientAccumulation(2)  # accumulate\n"
        "outputMode(poptorch.OutputMode.EveryN, 2)\n"
        "Precision.setPartialsType(torch.half)\n"
        "TensorLocations.setActivationLocation(\n"
        "    poptorch.TensorLocationSettings().useOnChipStorage(False)\n"
        "    .minElementsForOffChip(16))\n"
        "setAvailableMemoryProportion({'IPU0': 0.5, 'IPU1': 0.25})\n"
        "anchorTensor('x', 'X:0', output_mode=None, output_return_period=1)\n"
        "sourceLocationExcludes(['a/', 'b/'])\n"
        "Distributed.configureProcessId(1, 2)\n")
    opts = Options()
    assert opts.loadFromFile(str(config)) is opts
    assert opts.device_iterations == 4
    assert opts.Training.gradient_accumulation == 2
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN,
                                                             2)
    assert opts.Precision.partials_type is torch.float16
    location = opts.TensorLocations.activation_location
    assert location.on_chip is False
    assert location.min_elements_for_off_chip == 16
    assert opts.available_memory_proportion == {"IPU0": 0.5, "IPU1": 0.25}
    assert opts.anchored_tensors == {"x": ("X:0", None, 1)}
    assert opts.source_location_excludes == ["a/", "b/"]
    assert opts.Distributed.processId == 1


def test_load_from_file_ignores_whitespace_at_the_start_of_lines(tmp_path):
    """PopTorch strips each line of an options file."""
    config = tmp_path / "indented.conf"
    config.write_text("  deviceIterations(4)\n"
                      "\tTraining.gradientAccumulation(2)\n"
                      "    # an indented comment\n"
                      "  outputMode(poptorch.OutputMode.EveryN,\n"
                      "             2)\n")
    opts = Options().loadFromFile(config)
    assert opts.device_iterations == 4
    assert opts.Training.gradient_accumulation == 2
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN,
                                                             2)


@pytest.mark.parametrize("written, expected", [
    ("poptorch.ShardedExecution()", poptorch.ShardedExecution()),
    ("poptorch.PipelinedExecution()", poptorch.PipelinedExecution()),
    ("poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)",
     poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)),
    ("poptorch.ShardedExecution('A', poptorch.Stage('B', 'C').ipu(1))",
     poptorch.ShardedExecution("A", poptorch.Stage("B", "C").ipu(1))),
    ("poptorch.SerialPhasedExecution(['A'], poptorch.Phase('B'))"
     ".useSeparateBackwardPhase()",
     poptorch.SerialPhasedExecution(["A"], poptorch.Phase("B"))
     .useSeparateBackwardPhase()),
    ("poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage('A'), "
     "poptorch.Stage('B')).ipus(0, 2), ['C'])"
     ".setTensorsLiveness(poptorch.Liveness.OffChipAfterFwd)",
     poptorch.ParallelPhasedExecution(
         poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")).ipus(0, 2),
         ["C"]).setTensorsLiveness(poptorch.Liveness.OffChipAfterFwd)),
])
def test_load_from_file_builds_execution_strategies(tmp_path, written,
                                                    expected):
    config = tmp_path / "strategy.conf"
    config.write_text(f"setExecutionStrategy({written})\n")
    strategy = Options().loadFromFile(config).execution_strategy
    assert type(strategy) is type(expected)
    assert repr(strategy) == repr(expected)
    for attribute in ("liveness", "separate_backward_phase"):
        assert getattr(strategy, attribute, None) == \
            getattr(expected, attribute, None)


@pytest.mark.parametrize("line, reason", [
    ('__import__("os").system("touch {marker}")',
     "expected an option method"),
    ('deviceIterations(__import__("os").system("touch {marker}"))',
     "private name '__import__'"),
    ('TensorLocations.setActivationLocation(os.system("touch {marker}"))',
     "unsupported call"),
    ("setExecutionStrategy(poptorch.ShardedExecution().stage('A'))",
     "unknown ShardedExecution method 'stage'"),
    ("setExecutionStrategy(poptorch.Stage())",
     "Stage needs at least one block id"),
    ("setExecutionStrategy(poptorch.PipelinedExecution(mode=1))",
     "unexpected keyword argument 'mode'"),
    ("import os", "expected one option call"),
    ("opts = deviceIterations(4)", "expected one option call"),
    ("deviceIterations(len([1, 2]))", "unsupported call"),
    ("deviceIterations(2 * 2)", "unsupported argument '2 * 2'"),
    ("setDeviceIterations(4)", "unknown option 'setDeviceIterations'"),
    ("loadFromFile('other.conf')", "unknown option 'loadFromFile'"),
    ("_freeze()", "private name '_freeze'"),
    ("Training._store('x')", "private name '_store'"),
    ("Options.deviceIterations(4)",
     "unknown option 'Options.deviceIterations'"),
    ("deviceIterations(4).replicationFactor(2)", "expected an option method"),
    ("deviceIterations(*[4])", "*arguments are not allowed"),
    ("outputMode(poptorch.OutputMode.Bogus)",
     "unsupported name 'poptorch.OutputMode.Bogus'"),
    ("Precision.setPartialsType(torch.nn)", "unsupported name 'torch.nn'"),
    ("Precision.setPartialsType(torch.__class__)",
     "private name '__class__'"),
    ("TensorLocations.setActivationLocation("
     "poptorch.TensorLocationSettings().__init__())",
     "private name '__init__'"),
    ("TensorLocations.setActivationLocation("
     "poptorch.TensorLocationSettings().useOnChipStorage('no'))",
     "TensorLocationSettings.useOnChipStorage must be a bool"),
    ("deviceIterations(4", "invalid syntax"),
    ("deviceIterations()", "missing 1 required positional argument"),
])
def test_load_from_file_rejects_anything_but_option_calls(tmp_path, line,
                                                          reason):
    marker = tmp_path / "executed"
    config = tmp_path / "bad.conf"
    text = line.format(marker=marker)
    config.write_text(f"# first line\n{text}\n")
    opts = Options()
    with pytest.raises(ConfigFileError) as raised:
        opts.loadFromFile(config)
    message = str(raised.value)
    assert f"{config}, line 2" in message
    assert reason in message
    assert text.strip() in message
    assert not marker.exists()
    assert opts.toDict() == Options().toDict()


def test_rejected_setter_in_file_leaves_options_unchanged(tmp_path):
    config = tmp_path / "bad_value.conf"
    config.write_text("replicationFactor(2)\n"
                      "TensorLocations.numIOTiles(32)\n"
                      "deviceIterations(0)\n")
    opts = Options()
    with pytest.raises(ConfigFileError) as raised:
        opts.loadFromFile(config)
    assert (f"{config}, line 3: deviceIterations(0): deviceIterations must be "
            "an int >= 1, got 0") in str(raised.value)
    assert opts.replication_factor == 1
    assert opts.TensorLocations.num_io_tiles == 0


def test_load_from_missing_file_raises(tmp_path):
    with pytest.raises(ConfigFileError, match="Cannot read options file"):
        Options().loadFromFile(tmp_path / "missing.conf")


#: What each setter of EXAMPLE_CALLS makes readable, as attribute paths
#: (from the options, or from the TensorLocationSettings a setter is called
#: on) with the value they read: the snake_case properties and the names
#: PopTorch gives to some values.
READ_AS = {
    "anchorTensor": {"anchored_tensors": {"loss": ("Loss:0", OutputMode.All,
                                                   1)}},
    "appendToLocationExcludes": {"source_location_excludes": [
        "torch/", "poptorch/", "<frozen", "site-packages/"]},
    "autoRoundNumIPUs": {"auto_round_num_ipus": True},
    "broadcastBuffers": {"broadcast_buffers": False},
    "connectionType": {"connection_type": ConnectionType.OnDemand},
    "deviceIterations": {"device_iterations": 3},
    "disableModuleNamescope": {"module_namescope": False},
    "enableExecutableCaching": {"executable_cache_dir": "/tmp/cache"},
    "enableProfiling": {"profile_dir": "profiles"},
    "enableStableNorm": {"stable_norm": True},
    "enableSyntheticData": {"synthetic_data": True},
    "inputReplicaGrouping": {"input_group_size": 2,
                             "input_group_type": CommGroupType.Orthogonal},
    "logCycleCount": {"log_cycle_count": True},
    "logDir": {"log_dir": "logs"},
    "maxRepeatLogs": {"max_repeat_logs": None},
    "modelName": {"model_name": "net"},
    "outputMode": {"output_mode": OutputMode.EveryN,
                   "output_return_period": 2},
    "randomSeed": {"random_seed": 42},
    "relaxOptimizerAttributesChecks": {
        "relax_optimizer_attributes_checks": True},
    "replicationFactor": {"replication_factor": 2},
    "setAvailableMemoryProportion": {
        "available_memory_proportion": {"IPU0": 0.3}},
    "setBackend": {"backend": "inductor", "cuda_graphs": True},
    "setExecutionStrategy": {
        "execution_strategy": EXAMPLE_CALLS["setExecutionStrategy"][0]},
    "showCompilationProgressBar": {"show_compilation_progress_bar": False},
    "sourceLocationExcludes": {"source_location_excludes": ["mylib/"]},
    "syncPattern": {"sync_pattern": SyncPattern.SinglePipeline},
    "updatableNamedBuffers": {"updatable_named_buffers":
                              ["bn.running_mean"]},
    "useIpuId": {"ipu_id": 1},
    "useIpuModel": {"use_ipu_model": True},
    "useOfflineIpuTarget": {"offline_ipu_version": 21,
                            "connection_type": ConnectionType.Never},
    "Training.gradientAccumulation": {"Training.gradient_accumulation": 4},
    "Training.accumulationAndReplicationReductionType": {
        "Training.accumulation_and_replication_reduction_type":
            ReductionType.Sum},
    "Training.setMeanAccumulationAndReplicationReductionStrategy": {
        "Training.mean_accumulation_and_replication_reduction_strategy":
            MeanReductionStrategy.Running,
        "Training.meanAccumulationAndReplicationReductionStrategy":
            MeanReductionStrategy.Running},
    "Training.setAutomaticLossScaling": {"Training.auto_loss_scaling": True},
    "Training.setConvolutionDithering": {
        "Training.convolution_dithering": True},
    "Precision.autocastEnabled": {"Precision.autocast_enabled": False},
    "Precision.autocastPolicy": {
        "Precision.autocast_policy": EXAMPLE_CALLS[
            "Precision.autocastPolicy"][0]},
    "Precision.enableFloatingPointExceptions": {
        "Precision.floating_point_exceptions": True},
    "Precision.enableStochasticRounding": {
        "Precision.stochastic_rounding": True},
    "Precision.halfFloatCasting": {
        "Precision.half_float_casting":
            HalfFloatCastingBehavior.HalfUpcastToFloat},
    "Precision.runningStatisticsAlwaysFloat": {
        "Precision.running_statistics_always_float": False},
    "Precision.setPartialsType": {"Precision.partials_type": torch.half},
    "Jit.traceModel": {"Jit.trace_model": True},
    "TensorLocations.numIOTiles": {"TensorLocations.num_io_tiles": 32},
    "TensorLocations.setActivationLocation": {
        "TensorLocations.activation_location":
            TensorLocationSettings(on_chip=False)},
    "TensorLocations.setWeightLocation": {
        "TensorLocations.weight_location":
            TensorLocationSettings(replicated_tensor_sharding=True)},
    "TensorLocations.setOptimizerLocation": {
        "TensorLocations.optimizer_location": TensorLocationSettings()},
    "TensorLocations.setAccumulatorLocation": {
        "TensorLocations.accumulator_location": TensorLocationSettings()},
    "TensorLocationSettings.useOnChipStorage": {"on_chip": False},
    "TensorLocationSettings.useReplicatedTensorSharding": {
        "replicated_tensor_sharding": True},
    "TensorLocationSettings.minElementsForOffChip": {
        "min_elements_for_off_chip": 128},
    "TensorLocationSettings.minElementsForReplicatedTensorSharding": {
        "min_elements_for_replicated_tensor_sharding": 64},
    "TensorLocationSettings.useIOTilesToLoad": {"io_tiles_to_load": True},
    "TensorLocationSettings.useIOTilesToStore": {"io_tiles_to_store": True},
    "Distributed.configureProcessId": {
        "Distributed.processId": 1, "Distributed.numProcesses": 2,
        "Distributed.distributed_process_id": 1,
        "Distributed.num_distributed_processes": 2},
    "Distributed.disable": {
        "Distributed.processId": 0, "Distributed.numProcesses": 1,
        "Distributed.distributed_process_id": 0,
        "Distributed.num_distributed_processes": 1},
    "Distributed.setEnvVarNames": {
        "Distributed.processId": 3, "Distributed.numProcesses": 4,
        "Distributed.distributed_process_id": 3,
        "Distributed.num_distributed_processes": 4},
    "_Popart.set": {"_Popart.options": {"outlineThreshold": 10.0}},
    "_Popart.setEngineOptions": {"_Popart.engine_options": {
        "opt.internalExchangeOptimisationTarget": "balanced"}},
    "_Popart.setPatterns": {"_Popart.patterns": {"PreUniRepl": False},
                            "_Popart.patterns_level": 1},
}


@pytest.mark.parametrize("path", sorted(EXAMPLE_CALLS))
def test_every_setter_is_readable_as_attributes(path):
    assert set(READ_AS) == set(EXAMPLE_CALLS)
    opts = _with_stored_settings()
    _call(opts, path)
    owner = (opts.TensorLocations.weight_location
             if path.startswith("TensorLocationSettings.") else opts)
    for attribute, expected in READ_AS[path].items():
        value = owner
        for name in attribute.split("."):
            value = getattr(value, name)
        assert value == expected, attribute


# --- Effects table, docs and logging ---

def test_effects_table_classifies_every_public_setter():
    classes = {"": Options, "Training": type(Options().Training),
               "Precision": type(Options().Precision),
               "TensorLocations": type(Options().TensorLocations),
               "Jit": type(Options().Jit),
               "Distributed": type(Options().Distributed),
               "_Popart": type(Options()._Popart),
               "TensorLocationSettings": TensorLocationSettings}
    public_setters = set()
    for prefix, cls in classes.items():
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_") and name not in _NOT_SETTERS:
                public_setters.add(f"{prefix}.{name}" if prefix else name)
    assert public_setters == set(OPTION_EFFECTS) == set(EXAMPLE_CALLS)


def test_docs_describe_every_option_with_its_effect():
    text = DOCS.read_text()
    phrases = {"implemented": "| implemented",
               "no effect on CPU/GPU": "| no effect on CPU/GPU",
               "stored now": "| stored now"}
    for path, effect in OPTION_EFFECTS.items():
        rows = [row for row in text.splitlines()
                if row.startswith(f"| `{path}(")]
        assert len(rows) == 1, path
        assert phrases[effect.kind] in rows[0], path


@pytest.mark.parametrize("path", sorted(
    path for path, effect in OPTION_EFFECTS.items()
    if effect.kind == NO_EFFECT))
def test_knob_without_effect_logs_once_at_info(poptorch_log, path):
    opts = _with_stored_settings()
    _call(opts, path)
    _call(opts, path)
    records = [record for record in poptorch_log.records
               if path in record.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    assert "has no effect on this device" in records[0].getMessage()


def test_options_with_effect_do_not_log(poptorch_log):
    for path, effect in OPTION_EFFECTS.items():
        if effect.kind == IMPLEMENTED:
            opts = _with_stored_settings()
            poptorch_log.clear()
            _call(opts, path)
            assert poptorch_log.records == [], path


def test_options_for_features_not_available_yet_log_once(poptorch_log):
    stored = [path for path, effect in OPTION_EFFECTS.items()
              if effect.kind == STORED]
    assert stored
    for path in stored:
        _call(_with_stored_settings(), path)
        _call(_with_stored_settings(), path)
    messages = poptorch_log.messages
    for path in stored:
        assert sum(m.startswith(f"{path} has no effect yet") for m in
                   messages) == 1, path
