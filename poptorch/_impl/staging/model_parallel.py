"""Checks of a model's blocks against its execution strategy (features
chapter "Multi-IPU execution strategies", API reference 11.5).

The blocks met while the model is captured are placed by the strategy
(``Options.setExecutionStrategy``; ``PipelinedExecution(AutoStage.SameAsIpu)``
when blocks are used without one) and the configurations PopTorch rejects are
rejected here too, when the model is compiled. Several stages run as
separate partitions (``staged_execution.py``).
"""
from typing import Dict, NamedTuple, Optional, Sequence

from ...enums import AutoStage, ConnectionType
from ...errors import Error
from ..batching import BatchLayout
from ..blocks import BlockRecord
from ..logger import info_once
from .strategies import BlockPlacement, PipelinedExecution


class StagePlan(NamedTuple):
    """How a model's blocks are placed, when they form several stages."""
    strategy: object
    placements: Dict[str, BlockPlacement]


def check_execution_strategy(options, records: Sequence[BlockRecord],
                             training: bool, layout: BatchLayout
                             ) -> Optional[StagePlan]:
    """Raise ``poptorch.Error`` for block placements PopTorch rejects; the
    strategy and its placements when the blocks form several stages."""
    if not records:
        return None
    strategy = (options.execution_strategy or
                PipelinedExecution(AutoStage.SameAsIpu))
    placements = strategy.resolve_blocks(records)
    stages = len({p.stage_id for p in placements.values()})
    ipus_per_replica = max(p.ipu_id for p in placements.values()) + 1
    if _reserves_ipus_by_count(options):
        _check_device_count(ipus_per_replica, layout.replicas,
                            options.auto_round_num_ipus)
    if isinstance(strategy, PipelinedExecution) and stages > 1:
        _check_pipeline_depth(stages, training, layout)
    if stages == 1:
        return None
    return StagePlan(strategy, placements)


def _reserves_ipus_by_count(options) -> bool:
    """Whether PopTorch would acquire IPU hardware for the model, whose
    number of IPUs must then be a power of 2: not on the IPU Model
    (``useIpuModel``), nor when it never attaches (``connectionType(Never)``,
    ``useOfflineIpuTarget``: compilation only)."""
    return not (options.use_ipu_model
                or options.connection_type == ConnectionType.Never)


def _check_device_count(ipus_per_replica: int, replicas: int,
                        auto_round: bool) -> None:
    devices = ipus_per_replica * replicas
    if devices & (devices - 1) == 0:
        return
    if not auto_round:
        raise Error(
            f"The model uses {ipus_per_replica} IPU(s) per replica x "
            f"replicationFactor {replicas} = {devices} IPUs, which is not a "
            "power of 2. Place the blocks on a power-of-2 number of IPUs or "
            "call options.autoRoundNumIPUs(True) to round the count up.")
    rounded = 1 << (devices - 1).bit_length()
    info_once(f"autoRoundNumIPUs: {devices} IPUs rounded up to {rounded}")


def _check_pipeline_depth(stages: int, training: bool,
                          layout: BatchLayout) -> None:
    if training and layout.gradient_accumulation < 2 * stages - 1:
        raise Error(
            f"A training pipeline of {stages} stages has {2 * stages - 1} "
            "forward and backward stages, so Training.gradientAccumulation "
            f"must be at least {2 * stages - 1}; it is "
            f"{layout.gradient_accumulation}.")
    if not training and layout.device_iterations < stages:
        raise Error(
            f"An inference pipeline of {stages} stages needs "
            f"deviceIterations of at least {stages}; it is "
            f"{layout.device_iterations}.")
