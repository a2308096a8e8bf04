"""Enumerations of the PopTorch API (API reference 11.8 and the enums used by
the annotation, replication and optimizer sections).

Each enum is an ``IntEnum`` so that values can be written in config files and
in ``POPTORCH_DEFAULT_OPTIONS`` either by name or by number.
"""
import enum


class SharingStrategy(enum.IntEnum):
    """How the dataset reaches the worker process of an
    ``AsynchronousDataAccessor``."""
    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class OverlapMode(enum.IntEnum):
    """Host I/O overlap for inputs and outputs (an IPU tuning knob)."""
    NoOverlap = 0
    OverlapAccumulationLoop = 1
    OverlapDeviceIterationLoop = 2


class MatMulSerializationMode(enum.IntEnum):
    """Which dimension of a matrix multiplication ``serializedMatMul`` splits."""
    InputChannels = 0
    ReducingDim = 1
    OutputChannels = 2
    Disabled = 3


class SyncPattern(enum.IntEnum):
    """Synchronisation between IPUs and the host (an IPU tuning knob)."""
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class ReductionType(enum.IntEnum):
    """How gradients are reduced over accumulation steps and replicas."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class ConnectionType(enum.IntEnum):
    """When the model attaches to its device."""
    Always = 0
    OnDemand = 1
    Never = 2


class OutputMode(enum.IntEnum):
    """Which outputs a call of a wrapped model returns."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class MeanReductionStrategy(enum.IntEnum):
    """When the mean reduction of gradients divides by its factor."""
    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    """Whether ``poptorch.DataLoader`` loads data synchronously or through an
    ``AsynchronousDataAccessor``."""
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """Casting rule for operations mixing float16 and float32 inputs."""
    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class AutoStage(enum.IntEnum):
    """How stage ids are derived from blocks when no stages are given."""
    SameAsIpu = 0
    AutoIncrement = 1


class Liveness(enum.IntEnum):
    """Where tensors live between the phases of phased execution."""
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class CommGroupType(enum.IntEnum):
    """Arrangement of replicas into groups for inputs and grouped weights."""
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """Which replicas' values of a grouped weight are read back."""
    OnePerGroup = 0
    AllReplicas = 1


class MultiConvPlanType(enum.IntEnum):
    """Execution plan of a ``poptorch.MultiConv``."""
    Parallel = 0
    Serial = 1
