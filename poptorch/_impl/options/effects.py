"""What each option does on this implementation (CPU/GPU):
implemented, no effect (an IPU tuning knob, logged once at INFO when set),
or stored now for a feature that reads it. ``OPTION_EFFECTS`` is the one
table of them; ``docs/options.md`` lists it for users."""
from typing import Dict, NamedTuple

from ..logger import info_once

IMPLEMENTED = "implemented"
NO_EFFECT = "no effect on CPU/GPU"
STORED = "stored now"


class Effect(NamedTuple):
    """What an option does here: ``kind`` is ``IMPLEMENTED``, ``NO_EFFECT``
    or ``STORED``; ``note`` says how, why not, or which feature reads it."""
    kind: str
    note: str


_TENSOR_LOCATIONS = Effect(
    STORED, "takes effect with off-chip storage of weights, activations and "
    "gradient accumulators on GPUs; on a CPU device host and device memory "
    "are the same, so off-chip storage would change nothing there")
_SHARDING = (
    "on the optimizer location (docs/replicated_tensor_sharding.md), the "
    "optimizer state of each parameter is split over the processes of a "
    "multi-process run (ZeRO stage 1), with the accumulator location's "
    "too the gradient accumulation buffer (stage 2), and on the weight "
    "location the trained weights as well, gathered in the step just "
    "before use (stage 3); one-process runs and pipelines with one stage "
    "per process log why it has no effect")
_IO_TILES = Effect(NO_EFFECT, "IPU I/O tiles do not exist on CPU/GPU")
_SOURCE_LOCATIONS = Effect(
    IMPLEMENTED, "frames of these files are skipped when capture errors "
    "name the user's source line")
_DISTRIBUTED = Effect(
    IMPLEMENTED, "training models of an n-process run join a "
    "torch.distributed process group and all-reduce their gradients; the "
    "DataLoader gives each process its part of the data")

#: Every option setter (qualified as written in a config file), with its
#: effect on this implementation. Config files and POPTORCH_DEFAULT_OPTIONS
#: may call exactly these (TensorLocationSettings.* inside a settings chain).
OPTION_EFFECTS: Dict[str, Effect] = {
    "anchorTensor": Effect(
        IMPLEMENTED, "the named tensor is returned by getAnchoredTensor "
        "after each call"),
    "appendToLocationExcludes": _SOURCE_LOCATIONS,
    "autoRoundNumIPUs": Effect(
        IMPLEMENTED, "blocks placed on a number of IPUs that is not a power "
        "of 2 are accepted (the count is rounded up) instead of rejected; "
        "the IPU Model and connectionType(Never) accept any count"),
    "broadcastBuffers": Effect(
        IMPLEMENTED, "with False each replica keeps its own buffers"),
    "connectionType": Effect(
        IMPLEMENTED, "Never allows compiling but running raises; Always and "
        "OnDemand behave alike because the device is always available"),
    "deviceIterations": Effect(
        IMPLEMENTED, "each call runs this many steps (docs/semantics.md)"),
    "disableModuleNamescope": Effect(
        IMPLEMENTED, "tensor names (getTensorNames, anchorTensor) leave out "
        "module paths"),
    "enableExecutableCaching": Effect(
        IMPLEMENTED, "compiled executables (inductor backend) are kept in "
        "and loaded from this directory"),
    "enableProfiling": Effect(
        IMPLEMENTED, "writes the model's timeline (a Chrome trace, for "
        "Perfetto or TensorBoard) and its report in the directory "
        "(docs/profiling.md)"),
    "enableStableNorm": Effect(
        NO_EFFECT, "PyTorch's CPU/GPU normalisation kernels already compute "
        "statistics in a numerically stable way"),
    "enableSyntheticData": Effect(
        NO_EFFECT, "there is no host-to-IPU data stream to replace; the "
        "model always reads the data it is given"),
    "inputReplicaGrouping": Effect(
        IMPLEMENTED, "the replicas of an input group read the same slice "
        "of each call's data"),
    "logCycleCount": Effect(
        NO_EFFECT, "IPU cycle counts do not exist on CPU/GPU"),
    "logDir": Effect(
        IMPLEMENTED, "the poptorch logger also writes its messages, with "
        "timestamps, to poptorch.log (poptorch.rank<R>.log in a "
        "multi-process run) in this directory, from the model's creation"),
    "maxRepeatLogs": Effect(
        IMPLEMENTED, "from the model's creation, at most this many "
        "consecutive messages of one template are logged (console and log "
        "file), then one line says how many were suppressed"),
    "modelName": Effect(
        IMPLEMENTED, "names the executable-cache entries and the profiling "
        "timeline and report files (default: 'training' or 'inference')"),
    "outputMode": Effect(
        IMPLEMENTED, "selects which iterations' outputs a call returns"),
    "randomSeed": Effect(
        IMPLEMENTED, "seeds the random number generator of the model's "
        "random operations"),
    "relaxOptimizerAttributesChecks": Effect(
        IMPLEMENTED, "unexpected param-group attributes given to "
        "setOptimizer() are logged at DEBUG instead of warned about once"),
    "replicationFactor": Effect(
        IMPLEMENTED, "each replica processes its slice of every call's data "
        "(docs/semantics.md); the replicas of a step run as one vectorised "
        "computation"),
    "setAvailableMemoryProportion": Effect(
        NO_EFFECT, "IPU tile memory budgets do not exist; PyTorch chooses "
        "its own kernels"),
    "setBackend": Effect(
        IMPLEMENTED, "chooses how captured steps run (graph, inductor, "
        "aot_eager) and whether CUDA devices replay each call as a CUDA "
        "graph; not in PopTorch's API"),
    "setExecutionStrategy": Effect(
        IMPLEMENTED, "places the model's blocks and rejects what PopTorch "
        "rejects (stage order, pipeline depth, unknown blocks); several "
        "stages run as separate partitions on the one device of the process: "
        "PipelinedExecution training as a 1F1B schedule of "
        "torch.distributed.pipelining, the other strategies and inference "
        "stage after stage, with unchanged numerics (docs/model_parallel.md)"),
    "showCompilationProgressBar": Effect(
        IMPLEMENTED, "a tqdm progress bar is shown on stderr while "
        "compiling"),
    "sourceLocationExcludes": _SOURCE_LOCATIONS,
    "syncPattern": Effect(
        NO_EFFECT, "IPU/host synchronisation patterns do not exist"),
    "useIpuId": Effect(
        NO_EFFECT, "there are no IPU devices to select; the model runs on "
        "its PyTorch device"),
    "useIpuModel": Effect(
        NO_EFFECT, "there is no IPU to simulate; the model runs on its "
        "PyTorch device"),
    "updatableNamedBuffers": Effect(
        IMPLEMENTED, "copyNamedBuffersToDevice() copies these buffers of the "
        "host module to the device, leaving the other weights there as they "
        "are"),
    "useOfflineIpuTarget": Effect(
        IMPLEMENTED, "sets connectionType(Never): models compile and export "
        "(compileAndExport) but do not run; poptorch.load runs them"),
    "Training.gradientAccumulation": Effect(
        IMPLEMENTED, "each optimizer step accumulates this many "
        "micro-batches"),
    "Training.accumulationAndReplicationReductionType": Effect(
        IMPLEMENTED, "Mean averages, Sum adds the gradients of accumulated "
        "micro-batches and replicas"),
    "Training.setMeanAccumulationAndReplicationReductionStrategy": Effect(
        IMPLEMENTED, "Running keeps the gradient buffer as the running mean, "
        "Post divides the sum at the end, PostAndLoss (deprecated) divides "
        "the loss by the replicas and the sum by the accumulation; the "
        "default is Running for a float16 accum_type, else Post"),
    "Training.setAutomaticLossScaling": Effect(
        IMPLEMENTED, "a dynamic loss scale kept on the device: a step whose "
        "gradients overflow is skipped and halves it, 2000 finite steps in a "
        "row double it; read it as model.current_loss_scale"),
    "Training.setConvolutionDithering": Effect(
        NO_EFFECT, "convolution tile placement is specific to the IPU"),
    "Precision.autocastEnabled": Effect(
        IMPLEMENTED, "with False, automatic mixed-precision casting "
        "(model.autocast(), poptorch.autocast) casts nothing in this model"),
    "Precision.autocastPolicy": Effect(
        IMPLEMENTED, "the casting policy of automatic mixed-precision "
        "casting (poptorch.autocasting.Policy)"),
    "Precision.enableFloatingPointExceptions": Effect(
        IMPLEMENTED, "a call stops at the first step whose loss, gradients "
        "or updated weights (an inference model's outputs) are not finite, "
        "is rolled back and raises poptorch.Error naming the step and the "
        "value (docs/failed_calls.md)"),
    "Precision.enableStochasticRounding": Effect(
        NO_EFFECT, "CPU/GPU arithmetic rounds to nearest; PyTorch has no "
        "stochastic rounding mode"),
    "Precision.halfFloatCasting": Effect(
        IMPLEMENTED, "operations mixing float16 and float32 tensors compute "
        "in float16 (Default, FloatDowncastToHalf) or float32 "
        "(HalfUpcastToFloat); the spec marks this option as about to be "
        "removed"),
    "Precision.runningStatisticsAlwaysFloat": Effect(
        NO_EFFECT, "running statistics keep the dtype of the module's "
        "buffers as in PyTorch; the spec marks this option as about to be "
        "removed"),
    "Precision.setPartialsType": Effect(
        NO_EFFECT, "the PyTorch backend chooses the accumulation precision "
        "of matrix multiplications and convolutions"),
    "Jit.traceModel": Effect(
        NO_EFFECT, "models are captured by PopTorch's own capture, not by a "
        "choice of JIT tracing; the spec marks this option as about to be "
        "removed"),
    "TensorLocations.numIOTiles": _IO_TILES,
    "TensorLocations.setActivationLocation": _TENSOR_LOCATIONS,
    "TensorLocations.setWeightLocation": Effect(
        IMPLEMENTED, "useReplicatedTensorSharding(True) shards the trained "
        "weights over the processes of a multi-process run, each gathered "
        "inside the step just before it is used (single-graph models); "
        "off-chip storage of weights has no effect yet"),
    "TensorLocations.setOptimizerLocation": Effect(
        IMPLEMENTED, "on CUDA, useOnChipStorage(False) keeps optimizer state "
        "in pinned host memory between calls (no effect on a CPU device, "
        "logged once); useReplicatedTensorSharding(True) shards it over the "
        "processes of a multi-process run"),
    "TensorLocations.setAccumulatorLocation": Effect(
        IMPLEMENTED, "with useReplicatedTensorSharding(True) here and on the "
        "optimizer (or weight) location, the gradient accumulation buffer "
        "is sharded over the processes of a multi-process run; its "
        "off-chip storage has no effect yet"),
    "TensorLocationSettings.useOnChipStorage": Effect(
        IMPLEMENTED, "False on the optimizer location keeps optimizer state "
        "in host memory between calls on CUDA; on the other locations it "
        "has no effect yet"),
    "TensorLocationSettings.useReplicatedTensorSharding": Effect(
        IMPLEMENTED, _SHARDING),
    "TensorLocationSettings.minElementsForOffChip": Effect(
        IMPLEMENTED, "optimizer state tensors with fewer elements stay on "
        "the GPU between calls when the optimizer location is off chip"),
    "TensorLocationSettings.minElementsForReplicatedTensorSharding": Effect(
        IMPLEMENTED, "parameters with at most this many elements keep their "
        "optimizer state (and, on the weight location, their weights) whole "
        "on every process"),
    "TensorLocationSettings.useIOTilesToLoad": _IO_TILES,
    "TensorLocationSettings.useIOTilesToStore": _IO_TILES,
    "Distributed.configureProcessId": _DISTRIBUTED,
    "_Popart.set": Effect(
        NO_EFFECT, "PopART session options (every key) configure PopART's "
        "IPU compiler, which is not used here"),
    "_Popart.setEngineOptions": Effect(
        NO_EFFECT, "Poplar engine options configure the IPU runtime, which "
        "is not used here"),
    "_Popart.setPatterns": Effect(
        NO_EFFECT, "PopART graph transformation patterns do not exist; "
        "PyTorch's own compilers transform the captured graph"),
    "Distributed.disable": _DISTRIBUTED,
    "Distributed.setEnvVarNames": _DISTRIBUTED,
}


def model_name(options, training: bool) -> str:
    """The model's name: ``modelName``, by default ``"training"`` or
    ``"inference"`` as in PopTorch."""
    return options.model_name or ("training" if training else "inference")


def announce_effect(option: str) -> None:
    """Log once at INFO when an option without effect here is set: a knob
    that has none on CPU/GPU, or one whose feature is not available yet."""
    effect = OPTION_EFFECTS[option]
    if effect.kind == NO_EFFECT:
        info_once(f"{option} has no effect on this device (CPU/GPU): "
                  f"{effect.note}. The value is validated and stored.")
    elif effect.kind == STORED:
        info_once(f"{option} has no effect yet: it {effect.note}, which is "
                  "not available in this version. The value is validated "
                  "and stored.")


#: The tensor locations whose off-chip storage (``useOnChipStorage(False)``)
#: has no effect yet, though their other settings do.
_OFF_CHIP_WITHOUT_EFFECT = ("TensorLocations.setWeightLocation",
                            "TensorLocations.setAccumulatorLocation")


def announce_off_chip(option: str, on_chip) -> None:
    """Log once at INFO when ``option`` sets off-chip storage
    (``on_chip`` False) for a location that cannot have it yet."""
    if on_chip is False and option in _OFF_CHIP_WITHOUT_EFFECT:
        info_once(f"{option} with useOnChipStorage(False) has no effect "
                  "yet: off-chip storage of these tensors is not available "
                  "in this version (the tensors stay in device memory)")
