"""Execution strategies (API reference 11.5): ``Stage``, ``Phase``,
``ShardedExecution``, ``PipelinedExecution``, ``SerialPhasedExecution`` and
``ParallelPhasedExecution``.

These classes hold configuration. Given the blocks a capture met (see
``blocks.end_capture``), ``resolve_blocks`` places each block: its stage, its
IPU and, for phased strategies, its forward and backward phases, following
the rules of the guide ("Multi-IPU execution strategies"):

* with an ``AutoStage``, each block is a stage: ``SameAsIpu`` uses the
  block's ``ipu_id`` as stage id, ``AutoIncrement`` numbers the blocks in
  order of appearance; both need every block's ``ipu_id``;
* with explicit stages, a stage runs on the IPU given by ``Stage.ipu`` (or
  ``Phase.ipus``), else on the IPU its blocks agree on, else (sharded and
  pipelined) on the IPU numbered like the stage;
* in a pipeline, stage ids must not decrease in the order the model runs
  its blocks;
* serial phases all run on one group of IPUs (stage ``j`` of a phase on IPU
  ``j`` by default); parallel phases alternate between two groups, even
  phases on even IPUs and odd phases on odd IPUs (stage ``j`` of phase ``i``
  on IPU ``2 * j + i % 2`` by default). The stages of one phase run in
  parallel and may exchange values in both directions, so a phase runs
  as one partition here: its placements share the phase's number as their
  stage id.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence

from ...enums import AutoStage, Liveness
from ...errors import Error
from ..blocks import BEFORE_FIRST_BLOCK, BlockRecord
from ..logger import info_once


class BlockPlacement(NamedTuple):
    """Where a block runs: stage, IPU and, for phased strategies, the phase
    of its forward pass and the phase of its backward pass."""
    stage_id: int
    ipu_id: int
    phase_id: Optional[int] = None
    backward_phase_id: Optional[int] = None


def _check_ipu(what: str, ipu) -> int:
    if isinstance(ipu, int) and not isinstance(ipu, bool) and ipu >= 0:
        return ipu
    raise Error(f"{what}: an IPU must be a non-negative integer, not {ipu!r}")


def _unpack_one_sequence(args: tuple) -> tuple:
    """Accept the items either as separate arguments or as one list."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return tuple(args[0])
    return args


class Stage:
    """One or more blocks, identified by their ``user_id``, running on one
    IPU."""

    def __init__(self, *block_ids: str) -> None:
        if not block_ids:
            raise Error("Stage needs at least one block id")
        for block_id in block_ids:
            if not isinstance(block_id, str):
                raise Error("Stage: block ids must be strings (the user_id "
                            f"of a block), not {type(block_id).__name__} "
                            f"{block_id!r}")
        if len(set(block_ids)) != len(block_ids):
            raise Error(f"Stage{block_ids!r} names a block more than once")
        self._blocks = list(block_ids)
        self._ipu: Optional[int] = None

    @property
    def blocks(self) -> List[str]:
        """List of blocks this stage is made of."""
        return list(self._blocks)

    @property
    def ipu_id(self) -> Optional[int]:
        """The IPU set with ``ipu()``, or ``None``."""
        return self._ipu

    def ipu(self, ipu: int) -> "Stage":
        """Set the IPU on which this stage will run."""
        self._ipu = _check_ipu(f"{self!r}.ipu", ipu)
        return self

    def __repr__(self) -> str:
        blocks = ", ".join(repr(b) for b in self._blocks)
        ipu = "" if self._ipu is None else f".ipu({self._ipu})"
        return f"Stage({blocks}){ipu}"


def _check_distinct(stages: Sequence[Stage], owner: str) -> None:
    """A block, and a Stage object, may appear only once in a strategy."""
    if len({id(stage) for stage in stages}) != len(stages):
        raise Error(f"{owner}: the same Stage object is used twice")
    seen: Dict[str, Stage] = {}
    for stage in stages:
        for block_id in stage.blocks:
            if block_id in seen:
                raise Error(f"{owner}: block '{block_id}' is in both "
                            f"{seen[block_id]!r} and {stage!r}")
            seen[block_id] = stage


class Phase:
    """A phase of phased execution: stages that run in parallel.

    ``Phase(Stage("A").ipu(0), Stage("B").ipu(1))`` has two stages;
    ``Phase("A", "B")`` has one stage made of blocks "A" and "B".
    """

    def __init__(self, *arg) -> None:
        items = _unpack_one_sequence(arg)
        if not items:
            raise Error("Phase needs one or more Stages or block ids")
        if all(isinstance(item, str) for item in items):
            self._stages = [Stage(*items)]
        elif all(isinstance(item, Stage) for item in items):
            self._stages = list(items)
        else:
            kinds = ", ".join(type(item).__name__ for item in items)
            raise Error("Phase takes either Stages or block ids (strings), "
                        f"not a mix or other types: got {kinds}")
        _check_distinct(self._stages, "Phase")

    @property
    def stages(self) -> List[Stage]:
        """The stages of this phase."""
        return list(self._stages)

    def ipus(self, *ipus: int) -> "Phase":
        """Assign one IPU to each stage of this phase, in order."""
        if len(ipus) != len(self._stages):
            raise Error(f"Phase.ipus: this phase has {len(self._stages)} "
                        f"stage(s) but {len(ipus)} IPU(s) were given "
                        f"({', '.join(map(repr, ipus))}); give one per stage")
        checked = [_check_ipu("Phase.ipus", ipu) for ipu in ipus]
        for stage, ipu in zip(self._stages, checked):
            stage.ipu(ipu)
        return self

    def __repr__(self) -> str:
        return f"Phase({', '.join(map(repr, self._stages))})"


class ExecutionStrategy:
    """Base of the execution strategies accepted by
    ``Options.setExecutionStrategy``."""

    def _all_stages(self) -> List[Stage]:
        raise NotImplementedError

    def stage(self, block_id: str) -> Stage:
        """Return the Stage the given block belongs to."""
        for stage in self._all_stages():
            if block_id in stage.blocks:
                return stage
        known = sorted(b for s in self._all_stages() for b in s.blocks)
        raise Error(f"{self!r}: no stage contains block {block_id!r}; the "
                    f"blocks in its stages are {known}")

    def resolve_blocks(self, records: Sequence[BlockRecord]
                       ) -> Dict[str, BlockPlacement]:
        """Place each block met during the capture."""
        raise NotImplementedError

    @property
    def liveness(self) -> Optional[Liveness]:
        """How long the phases' tensors stay in memory: None for the
        strategies without phases."""
        return None


def _named(records: Sequence[BlockRecord]) -> List[BlockRecord]:
    """The blocks the model names: explicit stages cannot list the layers
    before the first block, which then join the first stage that uses
    them."""
    return [record for record in records
            if record.user_id != BEFORE_FIRST_BLOCK]


def _check_stages_cover(strategy: ExecutionStrategy, stages: List[Stage],
                        records: Sequence[BlockRecord]) -> None:
    """Each stage's blocks exist in the model and each block has a stage."""
    known = {record.user_id for record in records}
    staged = {block_id for stage in stages for block_id in stage.blocks}
    for stage in stages:
        for block_id in stage.blocks:
            if block_id not in known:
                raise Error(f"{strategy!r}: {stage!r} refers to block "
                            f"{block_id!r}, which the model does not define; "
                            f"its blocks are {sorted(known)}")
    for record in records:
        if record.user_id not in staged:
            raise Error(f"{strategy!r}: block {record.user_id!r} of the model "
                        f"is in none of its stages")


def _agreed_ipu(strategy: ExecutionStrategy, stage: Stage,
                records: Dict[str, BlockRecord]) -> Optional[int]:
    """The IPU set on the stage, else the one its blocks agree on."""
    if stage.ipu_id is not None:
        return stage.ipu_id
    ipus = {records[b].ipu_id for b in stage.blocks} - {None}
    if len(ipus) > 1:
        raise Error(f"{strategy!r}: the blocks of {stage!r} were given "
                    f"different IPUs {sorted(ipus)}; set the stage's IPU with "
                    "Stage(...).ipu(n)")
    return ipus.pop() if ipus else None


class _StagedExecution(ExecutionStrategy):
    """Sharded and pipelined execution: an AutoStage, or stages given as
    Stage objects or block ids (one stage per id)."""

    def __init__(self, *args) -> None:
        items = _unpack_one_sequence(args)
        self._auto_stage: Optional[AutoStage] = None
        self._stages: List[Stage] = []
        if not items:
            self._auto_stage = AutoStage.SameAsIpu
        elif len(items) == 1 and isinstance(items[0], AutoStage):
            self._auto_stage = items[0]
        else:
            self._stages = [self._to_stage(item) for item in items]
            _check_distinct(self._stages, type(self).__name__)

    def _to_stage(self, item) -> Stage:
        if isinstance(item, str):
            return Stage(item)
        if isinstance(item, Stage):
            return item
        raise Error(f"{type(self).__name__} takes either one "
                    "poptorch.AutoStage, or Stages and block ids (strings); "
                    f"got {type(item).__name__} {item!r}")

    def _all_stages(self) -> List[Stage]:
        return list(self._stages)

    def stage(self, block_id: str) -> Stage:
        if self._auto_stage is not None:
            raise Error(f"{self!r} creates its stages from the blocks found "
                        "when the model is compiled: stage() only looks up "
                        "stages given to the constructor")
        return super().stage(block_id)

    def resolve_blocks(self, records: Sequence[BlockRecord]
                       ) -> Dict[str, BlockPlacement]:
        if self._auto_stage is not None:
            return self._auto_placements(records)
        return self._explicit_placements(records)

    def _auto_placements(self, records: Sequence[BlockRecord]
                         ) -> Dict[str, BlockPlacement]:
        placements = {}
        for rank, record in enumerate(sorted(records, key=lambda r: r.order)):
            if record.ipu_id is None:
                raise Error(f"{self!r}: block {record.user_id!r} has no "
                            "ipu_id; with an AutoStage every Block or "
                            "BeginBlock needs one. Give ipu_id=..., or list "
                            "the stages explicitly")
            stage_id = (record.ipu_id
                        if self._auto_stage == AutoStage.SameAsIpu else rank)
            placements[record.user_id] = BlockPlacement(stage_id,
                                                        record.ipu_id)
        return placements

    def _explicit_placements(self, records: Sequence[BlockRecord]
                             ) -> Dict[str, BlockPlacement]:
        records = _named(records)
        _check_stages_cover(self, self._stages, records)
        by_id = {record.user_id: record for record in records}
        placements = {}
        for stage_id, stage in enumerate(self._stages):
            ipu = _agreed_ipu(self, stage, by_id)
            for block_id in stage.blocks:
                placements[block_id] = BlockPlacement(
                    stage_id, stage_id if ipu is None else ipu)
        return placements

    def __repr__(self) -> str:
        if self._auto_stage is not None:
            return (f"{type(self).__name__}"
                    f"(AutoStage.{self._auto_stage.name})")
        return f"{type(self).__name__}({', '.join(map(repr, self._stages))})"


class ShardedExecution(_StagedExecution):
    """Run the stages one after the other, each on its IPU.

    Takes an AutoStage (default ``AutoStage.SameAsIpu``: each distinct block
    ``ipu_id`` is a stage) or an explicit list of Stages or block ids.
    """


class PipelinedExecution(_StagedExecution):
    """Pipeline the stages over their IPUs.

    Takes an AutoStage (default ``AutoStage.SameAsIpu``; use
    ``AutoStage.AutoIncrement`` when non-consecutive blocks share an IPU) or
    an explicit list of Stages or block ids (one stage per id).
    """

    def resolve_blocks(self, records: Sequence[BlockRecord]
                       ) -> Dict[str, BlockPlacement]:
        placements = super().resolve_blocks(records)
        previous: Optional[BlockRecord] = None
        placed = [record for record in records
                  if record.user_id in placements]
        for record in sorted(placed, key=lambda r: r.order):
            if previous is not None and placements[record.user_id].stage_id \
                    < placements[previous.user_id].stage_id:
                raise Error(
                    f"{self!r}: block {record.user_id!r} (stage "
                    f"{placements[record.user_id].stage_id}) runs after block "
                    f"{previous.user_id!r} (stage "
                    f"{placements[previous.user_id].stage_id}), but pipeline "
                    "stage ids must follow the order of the model. Use "
                    "AutoStage.AutoIncrement or reorder the stages")
            previous = record
        return placements


def _to_phase(item) -> Phase:
    if isinstance(item, Phase):
        return item
    if isinstance(item, (list, tuple)):
        return Phase(*item)
    if isinstance(item, (str, Stage)):
        return Phase(item)
    raise Error("A phased execution takes Phases, lists of Stages or lists "
                f"of block ids, not {type(item).__name__} {item!r}")


class _PhasedExecution(ExecutionStrategy):
    """Shared part of serial and parallel phased execution."""

    def __init__(self, *phases) -> None:
        if len(phases) == 1 and isinstance(phases[0], (list, tuple)) and all(
                isinstance(p, (Phase, list, tuple)) for p in phases[0]):
            phases = tuple(phases[0])
        if not phases:
            raise Error(f"{type(self).__name__} needs at least one phase")
        self._phases = [_to_phase(phase) for phase in phases]
        _check_distinct(self._all_stages(), type(self).__name__)
        self._liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False

    def _all_stages(self) -> List[Stage]:
        return [stage for phase in self._phases for stage in phase.stages]

    @property
    def phases(self) -> List[Phase]:
        """The phases, in order."""
        return list(self._phases)

    @property
    def liveness(self) -> Liveness:
        """The Liveness set with ``setTensorsLiveness``."""
        return self._liveness

    @property
    def separate_backward_phase(self) -> bool:
        """Whether the backward pass shares no phase with the forward."""
        return self._separate_backward_phase

    def phase(self, phase: int) -> Phase:
        """Return the requested Phase."""
        count = len(self._phases)
        if isinstance(phase, bool) or not isinstance(phase, int) \
                or not 0 <= phase < count:
            raise Error(f"{type(self).__name__}.phase: unknown phase index "
                        f"{phase!r}; this strategy has {count} phase(s), "
                        f"indices 0 to {count - 1}")
        return self._phases[phase]

    def setTensorsLiveness(self, liveness: Liveness) -> "_PhasedExecution":
        """Where tensors live between phases (see ``Liveness``)."""
        if not isinstance(liveness, Liveness):
            allowed = ", ".join(Liveness.__members__)
            raise Error("setTensorsLiveness: liveness must be a "
                        f"poptorch.Liveness ({allowed}), not {liveness!r}")
        self._liveness = liveness
        return self

    def useSeparateBackwardPhase(self, use: bool = True
                                 ) -> "_PhasedExecution":
        """With ``True`` the backward pass shares no phase with the forward
        pass: forward phases 0, 1, 2 have backward phases 6, 5, 4 instead of
        4, 3, 2."""
        if not isinstance(use, bool):
            raise Error("useSeparateBackwardPhase: use must be a bool, not "
                        f"{use!r}")
        info_once("useSeparateBackwardPhase is accepted but has no effect on "
                  "this device beyond the backward phase numbers it reports")
        self._separate_backward_phase = use
        return self

    def _backward_phase(self, phase_id: int) -> int:
        last = 2 * len(self._phases) - (0 if self._separate_backward_phase
                                         else 2)
        return last - phase_id

    def _default_ipu(self, phase_id: int, stage_index: int) -> int:
        raise NotImplementedError

    def _check_phase_ipu(self, phase_id: int, ipu: int) -> None:
        """Refuse an IPU on which the phase cannot run."""

    def resolve_blocks(self, records: Sequence[BlockRecord]
                       ) -> Dict[str, BlockPlacement]:
        records = _named(records)
        _check_stages_cover(self, self._all_stages(), records)
        by_id = {record.user_id: record for record in records}
        placements: Dict[str, BlockPlacement] = {}
        for phase_id, phase in enumerate(self._phases):
            for index, stage in enumerate(phase.stages):
                ipu = _agreed_ipu(self, stage, by_id)
                ipu = self._default_ipu(phase_id, index) if ipu is None \
                    else ipu
                self._check_phase_ipu(phase_id, ipu)
                for block_id in stage.blocks:
                    placements[block_id] = BlockPlacement(
                        phase_id, ipu, phase_id,
                        self._backward_phase(phase_id))
        return placements

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._phases))})"


class SerialPhasedExecution(_PhasedExecution):
    """All the phases run one after the other on a single group of IPUs.

    Phases are given as Phases, lists of Stages, or lists of block ids (each
    list of block ids being one stage), as separate arguments or one list.
    """

    def _default_ipu(self, phase_id: int, stage_index: int) -> int:
        return stage_index


class ParallelPhasedExecution(_PhasedExecution):
    """Phases alternate between two groups of IPUs: even phases on even
    IPUs, odd phases on odd IPUs.

    Phases are given as Phases, lists of Stages, or lists of block ids (each
    list of block ids being one stage), as separate arguments or one list.
    """

    def _default_ipu(self, phase_id: int, stage_index: int) -> int:
        return 2 * stage_index + phase_id % 2

    def _check_phase_ipu(self, phase_id: int, ipu: int) -> None:
        if ipu % 2 != phase_id % 2:
            parity = "even" if phase_id % 2 == 0 else "odd"
            raise Error(f"{self!r}: phase {phase_id} is placed on IPU {ipu}, "
                        f"but {parity} phases must run on {parity} IPUs")
