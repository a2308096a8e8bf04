"""Stages, phases and the four execution strategies (API reference 11.5;
guide "Multi-IPU execution strategies"), with the examples of the spec."""

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from poptorch._impl import blocks
from poptorch._impl.blocks import Block, BlockRecord
from poptorch._impl.staging.strategies import (BlockPlacement,
                                               ExecutionStrategy,
                                               ParallelPhasedExecution, Phase,
                                               PipelinedExecution,
                                               SerialPhasedExecution,
                                               ShardedExecution, Stage)
from poptorch.enums import AutoStage, Liveness
from poptorch.errors import Error


def records(*blocks_and_ipus):
    """Block records in order of appearance from (user_id, ipu_id) pairs."""
    return [BlockRecord(user_id, ipu, order)
            for order, (user_id, ipu) in enumerate(blocks_and_ipus)]


def placed(strategy, recorded):
    """{block: (stage, ipu)} or, for phased strategies, with phases too."""
    return {block: tuple(v for v in placement if v is not None)
            for block, placement in strategy.resolve_blocks(recorded).items()}


def test_stage_lists_its_blocks_and_takes_an_ipu():
    stage = Stage("A", "B")
    assert stage.blocks == ["A", "B"]
    assert stage.ipu_id is None
    assert stage.ipu(3) is stage
    assert stage.ipu_id == 3


@pytest.mark.parametrize("make, message", [
    (lambda: Stage(), "Stage needs at least one block id"),
    (lambda: Stage("A", 1), "block ids must be strings"),
    (lambda: Stage("A", "A"), "names a block more than once"),
    (lambda: Stage("A").ipu(-1), "non-negative integer"),
    (lambda: Stage("A").ipu(True), "non-negative integer"),
])
def test_bad_stage_arguments_raise(make, message):
    with pytest.raises(Error, match=message):
        make()


def test_phase_of_strings_is_one_stage_and_of_stages_keeps_them():
    assert [s.blocks for s in Phase("A", "B").stages] == [["A", "B"]]
    a, b = Stage("A").ipu(0), Stage("B").ipu(1)
    assert Phase(a, b).stages == [a, b]
    assert Phase(a).stages == [a]


def test_phase_ipus_assigns_one_ipu_per_stage():
    a, b = Stage("A"), Stage("B")
    phase = Phase(a, b)
    assert phase.ipus(2, 5) is phase
    assert (a.ipu_id, b.ipu_id) == (2, 5)


@pytest.mark.parametrize("make, message", [
    (lambda: Phase(), "needs one or more Stages"),
    (lambda: Phase("A", Stage("B")), "not a mix"),
    (lambda: Phase(3), "got int"),
    (lambda: Phase(Stage("A"), Stage("B")).ipus(0),
     "has 2 stage\\(s\\) but 1 IPU\\(s\\) were given"),
    (lambda: Phase("A", "B").ipus(0, 1), "has 1 stage"),
    (lambda: Phase(Stage("A", "B"), Stage("B")), "block 'B' is in both"),
])
def test_bad_phase_arguments_raise(make, message):
    with pytest.raises(Error, match=message):
        make()


def test_phase_ipus_changes_nothing_when_one_ipu_is_invalid():
    a, b = Stage("A"), Stage("B")
    with pytest.raises(Error):
        Phase(a, b).ipus(1, -1)
    assert (a.ipu_id, b.ipu_id) == (None, None)


# Example of poptorch.AutoStage: blocks "0", "1", "2" on IPUs 0, 1, 0.
AUTO_STAGE_EXAMPLE = records(("0", 0), ("1", 1), ("2", 0))


def test_same_as_ipu_sets_the_stage_to_the_ipu():
    assert placed(ShardedExecution(AutoStage.SameAsIpu), AUTO_STAGE_EXAMPLE) \
        == {"0": (0, 0), "1": (1, 1), "2": (0, 0)}


def test_auto_increment_gives_each_new_block_the_next_stage():
    strategy = PipelinedExecution(AutoStage.AutoIncrement)
    assert placed(strategy, AUTO_STAGE_EXAMPLE) == {
        "0": (0, 0), "1": (1, 1), "2": (2, 0)}


def test_pipeline_with_stage_ids_going_back_is_an_error():
    with pytest.raises(Error, match="block '2' \\(stage 0\\) runs after "
                                    "block '1' \\(stage 1\\).*AutoIncrement"):
        PipelinedExecution().resolve_blocks(AUTO_STAGE_EXAMPLE)


def test_the_default_pipeline_follows_the_block_ipus():
    # PipelinedExecution example 2 and ShardedExecution's example.
    recorded = records(("0", 0), ("1", 1), ("2", 2), ("3", 3))
    expected = {str(i): (i, i) for i in range(4)}
    assert placed(PipelinedExecution(), recorded) == expected
    assert placed(ShardedExecution(), recorded) == expected


def test_pipeline_of_block_ids_uses_one_stage_and_ipu_per_id():
    # PipelinedExecution example 1: user ids known, IPUs inferred.
    recorded = records(("A", None), ("B", None), ("C", None), ("D", None))
    assert placed(PipelinedExecution("A", "B", "C", "D"), recorded) == {
        "A": (0, 0), "B": (1, 1), "C": (2, 2), "D": (3, 3)}
    strategy = PipelinedExecution(Stage("A", "B"), Stage("C", "D"))
    assert placed(strategy, recorded) == {
        "A": (0, 0), "B": (0, 0), "C": (1, 1), "D": (1, 1)}


def test_a_stage_runs_on_its_ipu_else_on_the_ipu_of_its_blocks():
    recorded = records(("A", 3), ("B", None), ("C", 1))
    strategy = ShardedExecution(Stage("A"), Stage("B"), Stage("C").ipu(0))
    assert placed(strategy, recorded) == {
        "A": (0, 3), "B": (1, 1), "C": (2, 0)}


def test_a_stage_whose_blocks_disagree_on_the_ipu_needs_one():
    recorded = records(("A", 0), ("B", 1))
    with pytest.raises(Error, match="different IPUs \\[0, 1\\].*"
                                    "Stage\\(...\\).ipu\\(n\\)"):
        ShardedExecution(Stage("A", "B")).resolve_blocks(recorded)
    strategy = ShardedExecution(Stage("A", "B").ipu(1))
    assert placed(strategy, recorded) == {"A": (0, 1), "B": (0, 1)}


def test_auto_stage_needs_the_ipu_of_every_block():
    with pytest.raises(Error, match="block 'A' has no ipu_id"):
        PipelinedExecution().resolve_blocks(records(("A", None)))


def test_stages_naming_unknown_blocks_are_an_error():
    with pytest.raises(Error, match="refers to block 'Z', which the model "
                                    "does not define; its blocks are "
                                    "\\['A'\\]"):
        PipelinedExecution("A", "Z").resolve_blocks(records(("A", 0)))


def test_a_block_in_no_stage_is_an_error():
    with pytest.raises(Error, match="block 'B' of the model is in none"):
        ShardedExecution("A").resolve_blocks(records(("A", 0), ("B", 1)))


def test_stage_looks_up_the_stage_of_a_block():
    ab, c = Stage("A", "B"), Stage("C")
    strategy = PipelinedExecution(ab, c)
    assert strategy.stage("B") is ab
    assert strategy.stage("C") is c
    assert PipelinedExecution("A", "B").stage("B").blocks == ["B"]
    with pytest.raises(Error, match="no stage contains block 'X'"):
        strategy.stage("X")


def test_stage_lookup_needs_explicit_stages():
    with pytest.raises(Error, match="creates its stages from the blocks"):
        ShardedExecution().stage("0")


@pytest.mark.parametrize("make, message", [
    (lambda: PipelinedExecution(AutoStage.SameAsIpu, "A"),
     "either one poptorch.AutoStage, or Stages and block ids"),
    (lambda: ShardedExecution(0), "got int 0"),
    (lambda: PipelinedExecution(Stage("A"), "A"), "block 'A' is in both"),
])
def test_bad_staged_strategy_arguments_raise(make, message):
    with pytest.raises(Error, match=message):
        make()


def test_the_same_stage_object_twice_is_an_error():
    stage = Stage("A")
    with pytest.raises(Error, match="same Stage object is used twice"):
        PipelinedExecution(stage, stage)


def serial_example():
    strategy = SerialPhasedExecution([
        Phase(Stage("A"), Stage("A2")),
        Phase(Stage("B"), Stage("B2")),
        Phase(Stage("C"), Stage("C2"))])
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0, 1)
    strategy.phase(2).ipus(0, 1)
    return strategy


SERIAL_BLOCKS = records(("A", None), ("A2", None), ("B", None),
                        ("B2", None), ("C", None), ("C2", None))


def test_serial_phases_run_on_one_group_of_ipus():
    # (stage, ipu, forward phase, backward phase): a phase's stages run
    # as one partition, numbered like the phase.
    assert placed(serial_example(), SERIAL_BLOCKS) == {
        "A": (0, 0, 0, 4), "A2": (0, 1, 0, 4),
        "B": (1, 0, 1, 3), "B2": (1, 1, 1, 3),
        "C": (2, 0, 2, 2), "C2": (2, 1, 2, 2)}


def test_a_separate_backward_phase_shares_no_phase_with_the_forward():
    strategy = serial_example()
    assert strategy.useSeparateBackwardPhase() is strategy
    backward = {block: p.backward_phase_id for block, p in
                strategy.resolve_blocks(SERIAL_BLOCKS).items()}
    assert backward == {"A": 6, "A2": 6, "B": 5, "B2": 5, "C": 4, "C2": 4}


@pytest.mark.parametrize("phases", [
    (["A", "A2"], ["B", "B2"], ["C", "C2"]),
    ([["A", "A2"], ["B", "B2"], ["C", "C2"]],),
    (Phase("A", "A2"), Phase("B", "B2"), Phase("C", "C2")),
], ids=["lists-of-ids", "one-list-of-lists", "phases"])
def test_lists_of_block_ids_are_single_stage_phases(phases):
    strategy = SerialPhasedExecution(*phases)
    placement = strategy.resolve_blocks(SERIAL_BLOCKS)
    assert [p.phase_id for p in placement.values()] == [0, 0, 1, 1, 2, 2]
    assert {p.ipu_id for p in placement.values()} == {0}
    assert strategy.stage("B2").blocks == ["B", "B2"]


def test_lists_of_stages_are_phases():
    strategy = SerialPhasedExecution([[Stage("A"), Stage("A2")],
                                      [Stage("B"), Stage("B2")],
                                      [Stage("C"), Stage("C2")]])
    assert placed(strategy, SERIAL_BLOCKS)["B2"] == (1, 1, 1, 3)


def captured_blocks(function, *args):
    """The block records of a capture of ``function``."""
    blocks.begin_capture()
    try:
        with fx_traceback.preserve_node_meta():
            make_fx(function, tracing_mode="fake")(*args)
    finally:
        recorded = blocks.end_capture()
    return recorded


def capture_parallel_example():
    """The blocks of the ParallelPhasedExecution example, traced."""
    def function(x):
        Block.useAutoId()
        for _ in range(6):
            with Block():
                x = torch.sin(x)
        return x

    return captured_blocks(function, torch.randn(2))


def test_parallel_phases_alternate_between_two_groups_of_ipus():
    strategy = ParallelPhasedExecution([
        Phase(Stage("0"), Stage("1")),
        Phase(Stage("2"), Stage("3")),
        Phase(Stage("4"), Stage("5"))])
    strategy.phase(0).ipus(0, 2)
    strategy.phase(1).ipus(1, 3)
    strategy.phase(2).ipus(0, 2)
    assert placed(strategy, capture_parallel_example()) == {
        "0": (0, 0, 0, 4), "1": (0, 2, 0, 4),
        "2": (1, 1, 1, 3), "3": (1, 3, 1, 3),
        "4": (2, 0, 2, 2), "5": (2, 2, 2, 2)}


def ipus_of(strategy, recorded):
    return {block: placement.ipu_id
            for block, placement in strategy.resolve_blocks(recorded).items()}


def test_parallel_phases_default_to_even_and_odd_ipus():
    recorded = records(("0", None), ("1", None), ("2", None), ("3", None))
    strategy = ParallelPhasedExecution(["0", "1"], ["2", "3"])
    assert ipus_of(strategy, recorded) == {"0": 0, "1": 0, "2": 1, "3": 1}
    strategy = ParallelPhasedExecution(Phase(Stage("0"), Stage("1")),
                                       Phase(Stage("2"), Stage("3")))
    assert ipus_of(strategy, recorded) == {"0": 0, "1": 2, "2": 1, "3": 3}


def test_an_odd_parallel_phase_on_an_even_ipu_is_an_error():
    strategy = ParallelPhasedExecution(Phase(Stage("0")), Phase(Stage("1")))
    strategy.phase(1).ipus(2)
    with pytest.raises(Error, match="phase 1 is placed on IPU 2, but odd "
                                    "phases must run on odd IPUs"):
        strategy.resolve_blocks(records(("0", None), ("1", None)))


@pytest.mark.parametrize("index", [3, -1, "0", True])
def test_an_unknown_phase_index_is_an_error(index):
    strategy = SerialPhasedExecution(["A"], ["B"], ["C"])
    with pytest.raises(Error, match="unknown phase index .*has 3 phase"):
        strategy.phase(index)


@pytest.mark.parametrize("make, message", [
    (lambda: SerialPhasedExecution(), "needs at least one phase"),
    (lambda: SerialPhasedExecution([]), "needs at least one phase"),
    (lambda: ParallelPhasedExecution(3), "not int 3"),
    (lambda: SerialPhasedExecution(["A"], ["A"]), "block 'A' is in both"),
])
def test_bad_phased_strategy_arguments_raise(make, message):
    with pytest.raises(Error, match=message):
        make()


def test_phased_strategies_report_unknown_blocks():
    with pytest.raises(Error, match="refers to block 'Q'"):
        SerialPhasedExecution(["A"], ["Q"]).resolve_blocks(records(("A", 0)))


def test_liveness_is_validated():
    strategy = SerialPhasedExecution(["A"])
    assert strategy.liveness == Liveness.AlwaysLive
    assert strategy.setTensorsLiveness(Liveness.OffChipAfterFwd) is strategy
    assert strategy.liveness == Liveness.OffChipAfterFwd
    with pytest.raises(Error, match="liveness must be a poptorch.Liveness"):
        strategy.setTensorsLiveness(1)
    assert strategy.liveness == Liveness.OffChipAfterFwd


def test_use_separate_backward_phase_takes_a_bool(poptorch_log):
    strategy = ParallelPhasedExecution(["A"])
    assert not strategy.separate_backward_phase
    strategy.useSeparateBackwardPhase()
    assert strategy.separate_backward_phase
    assert any("useSeparateBackwardPhase" in m for m in poptorch_log.messages)
    with pytest.raises(Error, match="use must be a bool"):
        strategy.useSeparateBackwardPhase(1)


def test_all_strategies_share_a_base_class():
    for strategy in (ShardedExecution(), PipelinedExecution(),
                     SerialPhasedExecution(["A"]),
                     ParallelPhasedExecution(["A"])):
        assert isinstance(strategy, ExecutionStrategy)


def test_a_captured_model_resolves_to_pipeline_stages():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                [torch.nn.Linear(2, 2) for _ in range(3)])
            for layer, ipu in zip(self.layers, (0, 1, 0)):
                blocks.BeginBlock(layer, ipu_id=ipu)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    recorded = captured_blocks(
        lambda p, x: torch.func.functional_call(model, p, (x,)),
        dict(model.named_parameters()), torch.randn(1, 2))
    strategy = PipelinedExecution(AutoStage.AutoIncrement)
    assert strategy.resolve_blocks(recorded) == {
        "0": BlockPlacement(0, 0), "1": BlockPlacement(1, 1),
        "2": BlockPlacement(2, 0)}
