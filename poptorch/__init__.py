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
from ._impl.compile_hooks import (registerPostCompileHook,
                                  registerPreCompileHook)
from ._impl.custom_args import ICustomArgParser, registerCustomArgParser
from ._impl.devices import ipuHardwareIsAvailable, ipuHardwareVersion
from ._impl.executor import PoplarExecutor
from ._impl.logger import setLogLevel
from ._impl.losses import identity_loss
from ._impl.model_wrapping import inferenceModel, trainingModel
from ._impl.loading import load
from . import autocasting, optim, profiling
from .autocasting import autocast
from ._impl.blocks import BeginBlock, Block, BlockFunction, NameScope, removeBlocks
from ._impl.ops import (CPU, MultiConv, cond, ctc_beam_search_decoder,
                        custom_op, dynamic_slice, dynamic_update, for_loop,
                        ipu_print_tensor, nop, recomputationCheckpoint,
                        serializedMatMul, set_available_memory,
                        set_overlap_for_input, set_overlap_for_output)
from ._impl.staging.strategies import (ParallelPhasedExecution, Phase,
                                       PipelinedExecution,
                                       SerialPhasedExecution, ShardedExecution,
                                       Stage)
from ._impl.data import AsynchronousDataAccessor, DataLoader
