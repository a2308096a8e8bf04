"""PopTorch API on ordinary PyTorch devices (CPU and CUDA).

This module is the index of the public API; everything is implemented in the
modules it imports from.
"""
from ._version import __version__
from .enums import (AutoStage, CommGroupType, ConnectionType, DataLoaderMode,
                    HalfFloatCastingBehavior, Liveness, MatMulSerializationMode,
                    MeanReductionStrategy, MultiConvPlanType, OutputMode,
                    OverlapMode, ReductionType, SharingStrategy, SyncPattern,
                    VariableRetrievalMode)
from .errors import Error, RecoverableError, UnrecoverableError
from .options import Options, TensorLocationSettings
from ._impl.capture import isRunningOnIpu
from ._impl.devices import ipuHardwareIsAvailable, ipuHardwareVersion
from ._impl.executor import PoplarExecutor
from ._impl.logger import setLogLevel
from ._impl.losses import identity_loss
from ._impl.model_wrapping import inferenceModel, trainingModel
