"""Models whose blocks form several stages run as separate stage partitions
(``staging/staged_execution.py``): with every execution strategy they train and infer
like plain PyTorch over the same micro-batches, recomputation checkpoints cut
a stage into segments that keep fewer tensors for the backward pass, and what
several stages cannot run yet is an error at compilation."""
import contextlib
import copy
import functools

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from poptorch._impl.staging import staged_execution
from poptorch._impl.staging.pipeline import PipelineSchedule
from poptorch._impl.staging.sequential_stages import SequentialSchedule
from conftest import assert_same_weights, make_data, options

ITERATIONS, ACCUMULATION, BATCH = 2, 7, 4   # G >= 2K - 1 for K = 4 stages
ROWS = ITERATIONS * ACCUMULATION * BATCH

close = functools.partial(torch.testing.assert_close, atol=1e-6, rtol=1e-5)


class FourBlocks(torch.nn.Module):
    """Blocks "A" to "D" on IPUs 0 to 3; block "A" has a BatchNorm, so
    training writes buffers; block "C" applies ``activation``. Without
    labels, forward returns the logits."""

    def __init__(self, activation=torch.tanh):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 8)
        self.fc4 = torch.nn.Linear(8, 3)
        self.activation = activation

    def forward(self, x, y=None):
        with poptorch.Block("A", ipu_id=0):
            h = self.bn(torch.relu(self.fc1(x)))
        with poptorch.Block("B", ipu_id=1):
            h = torch.tanh(self.fc2(h))
        with poptorch.Block("C", ipu_id=2):
            h = self.activation(self.fc3(h))
        with poptorch.Block("D", ipu_id=3):
            out = self.fc4(h)
            if y is None:
                return out
            return out, torch.nn.functional.cross_entropy(out, y)


def serial_phases():
    # Two phases of two stages each, both phases on IPUs 0 and 1.
    strategy = poptorch.SerialPhasedExecution(
        poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")),
        poptorch.Phase(poptorch.Stage("C"), poptorch.Stage("D")))
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0, 1)
    return strategy


STRATEGIES = {
    "pipelined-same-as-ipu": lambda: poptorch.PipelinedExecution(
        poptorch.AutoStage.SameAsIpu),
    "pipelined-stages": lambda: poptorch.PipelinedExecution(
        poptorch.Stage("A"), poptorch.Stage("B"), poptorch.Stage("C"),
        poptorch.Stage("D")),
    "sharded": lambda: poptorch.ShardedExecution("A", "B", "C", "D"),
    "serial-phased": serial_phases,
    # One single-stage phase per block: IPUs 0, 1, 2, 3 from the blocks,
    # even phases on even IPUs and odd phases on odd ones.
    "parallel-phased": lambda: poptorch.ParallelPhasedExecution(
        ["A"], ["B"], ["C"], ["D"]),
}


def partitions(strategy) -> int:
    """The partitions the four blocks run as: one per stage, or per phase
    (the serial strategy's two phases hold two stages each)."""
    return 2 if isinstance(strategy, poptorch.SerialPhasedExecution) else 4


# The pipeline schedule and the stage-after-stage schedule.
TWO_SCHEDULES = {name: STRATEGIES[name]
                 for name in ("pipelined-same-as-ipu", "sharded")}
# The same for models of any blocks (stages from the blocks' IPUs).
ANY_BLOCKS = {"pipelined": poptorch.PipelinedExecution,
              "sharded": poptorch.ShardedExecution}


def parametrize_strategies(strategies):
    return pytest.mark.parametrize("make_strategy", list(strategies.values()),
                                   ids=list(strategies))


def four_blocks_pair():
    torch.manual_seed(0)
    net = FourBlocks()
    return net, copy.deepcopy(net)


def plain_training(net, optimizer, x, y, iterations=ITERATIONS,
                   accumulation=ACCUMULATION, mean=True):
    """What one training call does, in plain PyTorch: per iteration, the
    backward passes of G micro-batches (loss / G for Mean) then one step.
    Returns every micro-batch's outputs (concatenated) and losses."""
    xs = x.unflatten(0, (iterations, accumulation, -1))
    ys = y.unflatten(0, (iterations, accumulation, -1))
    outputs, losses = [], []
    for i in range(iterations):
        optimizer.zero_grad()
        for g in range(accumulation):
            out, loss = net(xs[i, g], ys[i, g])
            (loss / accumulation if mean else loss).backward()
            outputs.append(out.detach())
            losses.append(loss.detach())
        optimizer.step()
    return torch.cat(outputs), torch.stack(losses)


def train_both(model, twin, reference, calls=3, mean=True,
               every_output=False, first_seed=0):
    """``calls`` calls of ``model`` and the same micro-batches in plain
    PyTorch; the returned outputs must be equal: the last micro-batch's
    (OutputMode.Final, the training default) or all of them in order."""
    for call in range(calls):
        x, y = make_data(ROWS, seed=first_seed + call)
        out, loss = model(x, y)
        outputs, losses = plain_training(twin, reference, x, y, mean=mean)
        if every_output:
            assert out.shape == (ROWS, 3)
            assert loss.shape == (ITERATIONS * ACCUMULATION,)
            close(out, outputs)
            close(loss, losses)
        else:
            assert out.shape == (BATCH, 3) and loss.dim() == 0
            close(out, outputs[-BATCH:])
            close(loss, losses[-1])


def assert_trained_like(net, twin, initial):
    assert_same_weights(net, twin)
    assert not torch.equal(net.fc1.weight, initial.fc1.weight)
    assert not torch.equal(net.bn.running_mean, initial.bn.running_mean)
    calls_micro_batches = 3 * ITERATIONS * ACCUMULATION
    assert int(net.bn.num_batches_tracked) == calls_micro_batches


# --- training with each strategy ---------------------------------------------

@parametrize_strategies(STRATEGIES)
def test_training_with_momentum_matches_plain_pytorch(make_strategy):
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    strategy = make_strategy()
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION,
                     setExecutionStrategy=strategy),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(model, twin, reference)
    staged = compiled_model(model).engine.execution
    assert len(staged.modules) == partitions(strategy)
    expected = (PipelineSchedule
                if isinstance(strategy, poptorch.PipelinedExecution)
                else SequentialSchedule)
    assert isinstance(staged.schedule, expected)
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)


# --- Sum reduction, loss scaling, every output -------------------------------

@parametrize_strategies(TWO_SCHEDULES)
def test_sum_reduction_matches_plain_pytorch_without_division(make_strategy):
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    opts = options(ITERATIONS, ACCUMULATION,
                   setExecutionStrategy=make_strategy())
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Sum)
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.02, momentum=0.9)
    train_both(model, twin, reference, mean=False)
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)


@parametrize_strategies(TWO_SCHEDULES)
def test_loss_scaled_adam_equals_unscaled_torch_adam(make_strategy):
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION,
                     setExecutionStrategy=make_strategy()),
        poptorch.optim.Adam(net.parameters(), lr=0.01, loss_scaling=128.0))
    reference = torch.optim.Adam(twin.parameters(), lr=0.01)
    train_both(model, twin, reference)
    assert model.current_loss_scale == 128.0
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)


@parametrize_strategies(TWO_SCHEDULES)
def test_output_mode_all_returns_every_micro_batch_in_order(make_strategy):
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION,
                     setExecutionStrategy=make_strategy(),
                     outputMode=poptorch.OutputMode.All),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(model, twin, reference, every_output=True)
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)


# --- inference ---------------------------------------------------------------

@parametrize_strategies(STRATEGIES)
def test_inference_equals_the_plain_model(make_strategy):
    net, twin = four_blocks_pair()
    net.eval()
    twin.eval()
    strategy = make_strategy()
    model = poptorch.inferenceModel(
        net, options(4, setExecutionStrategy=strategy))
    for seed in range(2):
        x, _ = make_data(4 * BATCH, seed=seed)
        out = model(x)
        with torch.no_grad():
            expected = twin(x)
        assert out.shape == (4 * BATCH, 3)
        close(out, expected)
    staged = compiled_model(model).engine.execution
    assert len(staged.modules) == partitions(strategy)
    assert isinstance(staged.schedule, SequentialSchedule)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


# --- recomputation -----------------------------------------------------------

class Recomputed(torch.nn.Module):
    """Two blocks; block "first" widens its activations to 4 x 1024 for a
    few elementwise operations (each keeps a wide tensor for the backward
    pass) before narrowing them again, then, with ``checkpoint``, marks the
    narrow result as a recomputation checkpoint."""

    def __init__(self, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("first", ipu_id=0):
            wide = self.fc1(x).repeat(1, 128)
            for _ in range(4):
                wide = torch.sin(wide) * wide
            h = wide.unflatten(1, (128, 8)).mean(1)
            if self.checkpoint:
                h = poptorch.recomputationCheckpoint(h)
            h = torch.tanh(h)
        with poptorch.Block("second", ipu_id=1):
            out = self.fc2(h)
        return out, torch.nn.functional.cross_entropy(out, y)


def saved_bytes(function, *args):
    """Bytes of the tensors autograd saves for backward while ``function``
    runs, and its result."""
    total = [0]

    def pack(tensor):
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = function(*args)
    return total[0], result


def recomputation_run(checkpoint, make_strategy):
    """One training call (after compilation) of ``Recomputed``, checked
    against plain PyTorch on the same micro-batches; returns the model and
    the bytes the call saved for backward."""
    torch.manual_seed(0)
    net = Recomputed(checkpoint)
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(1, 3, setExecutionStrategy=make_strategy()),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    x, y = make_data(3 * BATCH)
    model.compile(x, y)
    saved, (out, loss) = saved_bytes(model, x, y)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    outputs, losses = plain_training(twin, reference, x, y, 1, 3)
    close(out, outputs[-BATCH:])
    close(loss, losses[-1])
    model.copyWeightsToHost()
    assert_same_weights(net, twin)
    return model, saved


@parametrize_strategies(ANY_BLOCKS)
def test_checkpoints_cut_the_stage_into_recomputed_segments(make_strategy):
    model, with_checkpoint = recomputation_run(True, make_strategy)
    first, second = compiled_model(model).engine.execution.modules
    assert len(first.segments) == 2
    assert second.segments == []
    plain_model, without = recomputation_run(False, make_strategy)
    plain_modules = compiled_model(plain_model).engine.execution.modules
    assert [m.segments for m in plain_modules] == [[], []]
    # Without the checkpoint, the wide tensors of 3 micro-batches are kept
    # (about 16 KiB each); with it, only the segment's inputs are.
    assert without > 100_000
    assert with_checkpoint * 10 < without


class RecomputedBatchNorm(torch.nn.Module):
    """A BatchNorm after a recomputation checkpoint: its segment is
    recomputed in the backward pass."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("first", ipu_id=0):
            h = poptorch.recomputationCheckpoint(self.fc1(x) * 3 + 2)
            h = torch.relu(self.norm(h))
        with poptorch.Block("second", ipu_id=1):
            out = self.fc2(h)
        return out, torch.nn.functional.cross_entropy(out, y)


@parametrize_strategies(ANY_BLOCKS)
def test_recomputed_segments_update_buffers_once(make_strategy):
    """The recomputation writes a copy of the running statistics: they are
    updated once per micro-batch, as in PyTorch (twice before)."""
    torch.manual_seed(0)
    net = RecomputedBatchNorm()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(1, 4, setExecutionStrategy=make_strategy()),
        torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(4 * BATCH)
    model(x, y)
    plain_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1), x, y,
                   1, 4)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


# --- activations between stages ----------------------------------------------

class Crossing(torch.nn.Module):
    """Three blocks: block "c" adds a value of block "a" (so it passes
    through "b"); ``fc2`` is used in blocks "b" and "c" (shared weights);
    with ``mask``, "b" multiplies by a 0/1 mask made by "a", which needs no
    gradient; with ``index``, "b" gathers at indices made by "a"."""

    def __init__(self, mask=False, index=False):
        super().__init__()
        self.mask = mask
        self.index = index
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            skip = torch.tanh(self.fc1(x))
            mask = (skip > 0).float()
            picked = skip.argmax(1, keepdim=True)
        with poptorch.Block("b", ipu_id=1):
            h = torch.tanh(self.fc2(skip))
            if self.mask:
                h = h * mask
            if self.index:
                h = h + torch.gather(h, 1, picked)
        with poptorch.Block("c", ipu_id=2):
            out = self.fc3(torch.tanh(self.fc2(h)) + skip)
        return out, torch.nn.functional.cross_entropy(out, y)


def train_crossing(net, make_strategy, running_mean=False):
    twin = copy.deepcopy(net)
    opts = options(2, 5, setExecutionStrategy=make_strategy(),
                   autoRoundNumIPUs=True)
    if running_mean:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running)
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for seed in range(2):
        x, y = make_data(2 * 5 * BATCH, seed=seed)
        out, loss = model(x, y)
        outputs, losses = plain_training(twin, reference, x, y, 2, 5)
        close(out, outputs[-BATCH:])
        close(loss, losses[-1])
    assert len(compiled_model(model).engine.execution.modules) == 3
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


@parametrize_strategies(ANY_BLOCKS)
def test_values_skipping_a_stage_and_weights_of_two_stages(make_strategy):
    torch.manual_seed(0)
    train_crossing(Crossing(), make_strategy)


@parametrize_strategies(ANY_BLOCKS)
def test_the_running_mean_of_a_weight_two_stages_share(make_strategy):
    """fc2's gradient arrives in two parts per micro-batch (interleaved with
    other micro-batches' in the pipeline); its running mean still equals
    the mean of the micro-batches' gradients."""
    torch.manual_seed(0)
    train_crossing(Crossing(), make_strategy, running_mean=True)


@pytest.mark.parametrize("make_strategy", [
    poptorch.PipelinedExecution, poptorch.ShardedExecution],
    ids=["pipelined", "sharded"])
def test_activations_that_need_no_gradient_pass_between_stages(
        make_strategy):
    torch.manual_seed(0)
    train_crossing(Crossing(mask=True), make_strategy)


class NoGradBlocks(torch.nn.Module):
    """Three blocks: "a" runs a teacher under ``torch.no_grad()`` (its
    weights must not train); "c" updates an EMA buffer of the loss under
    ``torch.no_grad()``; with ``shared_norm``, one BatchNorm layer runs in
    blocks "a" and "b", its running statistics passing between them."""

    def __init__(self, shared_norm=False):
        super().__init__()
        self.shared_norm = shared_norm
        self.fc1 = torch.nn.Linear(4, 8)
        self.teacher = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 3)
        self.register_buffer("ema", torch.ones(()))

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            with torch.no_grad():
                target = self.teacher(x)
            h = torch.tanh(self.fc1(x))
            if self.shared_norm:
                h = self.bn(h)
        with poptorch.Block("b", ipu_id=1):
            h = self.bn(torch.tanh(self.fc2(h)))
        with poptorch.Block("c", ipu_id=2):
            out = self.fc3(h)
            loss = (torch.nn.functional.cross_entropy(out, y) +
                    torch.nn.functional.mse_loss(h, target) * self.ema.clone())
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * loss)
        return out, loss


@pytest.mark.parametrize("shared_norm", [False, True])
@parametrize_strategies(ANY_BLOCKS)
def test_no_grad_code_in_forward_is_not_differentiated(make_strategy,
                                                       shared_norm):
    """Operations under torch.no_grad() stay out of the backward pass (the
    teacher trained; the EMA update failed), and a BatchNorm layer runs in
    two stages (its running statistics could not be differentiated)."""
    torch.manual_seed(0)
    net = NoGradBlocks(shared_norm)
    teacher = copy.deepcopy(net.teacher)
    train_crossing(net, make_strategy)
    assert_same_weights(net.teacher, teacher)


class WrittenAcrossStages(torch.nn.Module):
    """Block "b" starts with an in-place ReLU of block "a"'s activation;
    block "c" updates the frozen key encoder that block "a" reads, in
    place under ``torch.no_grad()`` (a momentum encoder)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.key = torch.nn.Linear(4, 8).requires_grad_(False)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = self.fc1(x) + self.key(x)
        with poptorch.Block("b", ipu_id=1):
            h = self.fc2(h.relu_())
        with poptorch.Block("c", ipu_id=2):
            out = self.fc3(h)
            with torch.no_grad():
                self.key.weight.mul_(0.5).add_(0.5 * self.fc1.weight)
        return out, torch.nn.functional.cross_entropy(out, y)


@parametrize_strategies(ANY_BLOCKS)
def test_in_place_writes_of_activations_and_weights_of_other_stages(
        make_strategy):
    """The pipeline's dry run for shapes wrote the key encoder once more
    (every later micro-batch read a weight one update ahead), and the
    in-place ReLU of a received activation failed."""
    torch.manual_seed(0)
    train_crossing(WrittenAcrossStages(), make_strategy)


@parametrize_strategies(ANY_BLOCKS)
def test_integer_activations_pass_between_stages(make_strategy):
    """Indices made by one stage and used by the next (the pipeline's shape
    inference must not run the stage on uninitialised indices)."""
    torch.manual_seed(0)
    train_crossing(Crossing(index=True), make_strategy)


@parametrize_strategies(ANY_BLOCKS)
def test_replicas_of_a_multi_stage_model_train_one_model(make_strategy):
    """R replicas in one process: the G x R micro-batches of a step sum
    their gradients (Mean: divided by G x R) into one update, and every
    micro-batch's outputs come back in [D, G, R] order."""
    torch.manual_seed(0)
    net = Crossing()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(2, 5, replicas=2, setExecutionStrategy=make_strategy(),
                     autoRoundNumIPUs=True,
                     outputMode=poptorch.OutputMode.All),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for seed in range(2):
        x, y = make_data(2 * 5 * 2 * BATCH, seed=seed)
        out, loss = model(x, y)
        outputs, losses = plain_training(twin, reference, x, y, 2, 10)
        close(out.reshape(outputs.shape), outputs)
        close(loss.reshape(losses.shape), losses)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


@pytest.mark.parametrize("make_strategy", [poptorch.PipelinedExecution,
                                           poptorch.ShardedExecution],
                         ids=["pipelined", "sharded"])
def test_replicated_inference_of_a_multi_stage_model(make_strategy):
    torch.manual_seed(0)
    net = FourBlocks().eval()
    model = poptorch.inferenceModel(
        net, options(4, replicas=2, setExecutionStrategy=make_strategy(
            poptorch.AutoStage.SameAsIpu)))
    x = torch.randn(4 * 2 * BATCH, 4)
    close(model(x), net(x))


def _per_replica_buffers_reference(twin, x, y, replicas, calls):
    """Plain PyTorch: each replica with its own BatchNorm buffers
    (functional_call), one SGD step per iteration on the mean gradient of
    the G x R micro-batches, taken in [D, G, R] order; per call, the loss
    of each micro-batch."""
    params = dict(twin.named_parameters())
    buffer_sets = [{name: b.clone() for name, b in twin.named_buffers()}
                   for _ in range(replicas)]
    optimizer = _sgd(twin)
    per_call = []
    for call in range(calls):
        losses = []
        blocks = zip(x[call].split(BATCH), y[call].split(BATCH))
        for _ in range(ITERATIONS):
            optimizer.zero_grad()
            for _ in range(ACCUMULATION):
                for replica in range(replicas):
                    _, loss = torch.func.functional_call(
                        twin, (params, buffer_sets[replica]), next(blocks))
                    (loss / (ACCUMULATION * replicas)).backward()
                    losses.append(loss.detach())
            optimizer.step()
        per_call.append(torch.stack(losses))
    return per_call, buffer_sets


@pytest.mark.parametrize("broadcast", [False, True])
@parametrize_strategies(TWO_SCHEDULES)
def test_replicas_keep_their_own_buffers_across_the_stages(make_strategy,
                                                           broadcast):
    """Each replica's micro-batches read and update its own BatchNorm
    statistics in the stage that holds them, whether buffers are broadcast
    (PopTorch's default) or not."""
    net, twin = four_blocks_pair()
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION, replicas=2,
                     broadcastBuffers=broadcast,
                     setExecutionStrategy=make_strategy(),
                     outputMode=poptorch.OutputMode.All), _sgd(net))
    data = [make_data(2 * ROWS, seed=call) for call in range(2)]
    losses = [model(x, y)[1] for x, y in data]
    expected, buffer_sets = _per_replica_buffers_reference(
        twin, [x for x, _ in data], [y for _, y in data], 2, 2)
    for got, want in zip(losses, expected):
        close(got.reshape(want.shape), want)
    model.copyWeightsToHost()
    for (name, value), (_, expected) in zip(net.named_parameters(),
                                            twin.named_parameters()):
        close(value, expected, msg=name)
    for name, value in net.named_buffers():
        close(value, buffer_sets[0][name])
    state = compiled_model(model).state
    for name, value in zip(state.buffer_names, state.buffers[1]):
        close(value, buffer_sets[1][name])
    assert not torch.equal(buffer_sets[0]["bn.running_mean"],
                           buffer_sets[1]["bn.running_mean"])


# --- export ------------------------------------------------------------------

def test_a_saved_pipelined_training_model_loads_and_trains_on(tmp_path):
    net, _ = four_blocks_pair()
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION,
                     setExecutionStrategy=STRATEGIES["pipelined-stages"]()),
        _sgd(net))
    model(*make_data(ROWS))
    path = tmp_path / "pipelined.poptorch"
    model.save(path)
    loaded = poptorch.load(path)
    assert compiled_model(loaded).engine.runs_stages
    for call in range(1, 3):
        data = make_data(ROWS, seed=call)
        for expected, got in zip(model(*data), loaded(*data)):
            close(got, expected)
    model.copyWeightsToHost()
    loaded.copyWeightsToHost()
    assert_same_weights(loaded.model, net)


def test_load_executable_of_a_multi_stage_model_checks_its_forward_pass(
        tmp_path):
    def sharded(net):
        return poptorch.inferenceModel(net.eval(), options(
            4, setExecutionStrategy=STRATEGIES["sharded"]()))

    net, twin = four_blocks_pair()
    path = tmp_path / "sharded.poptorch"
    x, _ = make_data(4 * BATCH)
    model = sharded(net)
    model.compileAndExport(path, x, export_model=False)
    fresh = sharded(twin)
    fresh.loadExecutable(path)
    close(fresh(x), model(x))
    torch.manual_seed(0)
    other = sharded(FourBlocks(activation=torch.relu))
    with pytest.raises(poptorch.Error, match="its forward step differs from "
                                             "the exported one"):
        other.loadExecutable(path)


# --- errors ------------------------------------------------------------------

class Backwards(torch.nn.Module):
    """Block "a" (IPU 1) computes what block "b" (IPU 0) uses."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=1):
            h = torch.tanh(self.fc1(x))
        with poptorch.Block("b", ipu_id=0):
            out = self.fc2(h)
        return out, torch.nn.functional.cross_entropy(out, y)


def _sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _running_mean_options(**extra):
    opts = options(1, ACCUMULATION, **extra)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Running)
    return opts


ERRORS = {
    # Block "b" is stage 0 (IPU 0) but reads the output of "a" (stage 1).
    "backwards-sharded-same-as-ipu": (
        Backwards, lambda: options(1, 3, setExecutionStrategy=(
            poptorch.ShardedExecution())), _sgd, 3 * BATCH,
        r"stage 0 \(block\(s\) b\) uses a value computed in stage 1 "
        r"\(block\(s\) a\), which runs after it"),
    "backwards-serial-phases": (
        Backwards, lambda: options(1, 3, setExecutionStrategy=(
            poptorch.SerialPhasedExecution(["b"], ["a"]))), _sgd, 3 * BATCH,
        r"stage 0 \(block\(s\) b\) uses a value computed in stage 1 "
        r"\(block\(s\) a\), which runs after it"),
}


@pytest.mark.parametrize("make_net, make_options, make_optimizer, rows, "
                         "message", list(ERRORS.values()), ids=list(ERRORS))
def test_unsupported_configurations_fail_to_compile_leaving_weights(
        make_net, make_options, make_optimizer, rows, message):
    torch.manual_seed(0)
    net = make_net()
    before = copy.deepcopy(net.state_dict())
    model = poptorch.trainingModel(net, make_options(), make_optimizer(net))
    with pytest.raises(poptorch.Error, match=message):
        model(*make_data(rows))
    assert not model.isCompiled()
    after = net.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_the_pipeline_rejects_backwards_blocks_before_partitioning():
    model = poptorch.trainingModel(Backwards(), options(1, 3))
    with pytest.raises(poptorch.Error, match="block 'b' \\(stage 0\\) runs "
                                             "after block 'a' \\(stage 1\\)"):
        model(*make_data(3 * BATCH))


# --- anchored tensors --------------------------------------------------------

def _recording(module: torch.nn.Module) -> list:
    """The outputs of ``module``'s calls from now on."""
    recorded = []
    module.register_forward_hook(
        lambda _, args, output: recorded.append(output.detach()))
    return recorded


@parametrize_strategies(TWO_SCHEDULES)
def test_anchored_tensor_of_an_inner_stage_in_inference(make_strategy):
    net, twin = four_blocks_pair()
    net.eval()
    twin.eval()
    model = poptorch.inferenceModel(net, options(
        4, setExecutionStrategy=make_strategy(),
        anchorTensor=("hidden", "fc2/addmm")))
    recorded = _recording(twin.fc2)
    x, _ = make_data(4 * BATCH)
    with torch.no_grad():
        close(model(x), twin(x))
    close(model.getAnchoredTensor("hidden"), recorded[0])


@parametrize_strategies(TWO_SCHEDULES)
def test_anchored_tensor_of_an_inner_stage_in_training(make_strategy):
    """Every micro-batch's value (OutputMode.All), computed with the
    weights of its step."""
    net, twin = four_blocks_pair()
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION,
                     setExecutionStrategy=make_strategy(),
                     anchorTensor=("hidden", "fc2/addmm",
                                   poptorch.OutputMode.All)),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    recorded = _recording(twin.fc2)
    for call in range(2):
        recorded.clear()
        x, y = make_data(ROWS, seed=call)
        model(x, y)
        plain_training(twin, reference, x, y)
        anchored = model.getAnchoredTensor("hidden")
        assert anchored.shape == (ROWS, 8)
        close(anchored, torch.cat(recorded))


def test_stages_of_one_phase_exchange_values_both_ways():
    """The guide's phased example: the stages of a phase run in parallel,
    each using the other's values (IPU 0 -> 1 -> 0 within phase 0)."""
    class Swapping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a1 = torch.nn.Linear(4, 4)
            self.b1 = torch.nn.Linear(4, 4)
            self.a2 = torch.nn.Linear(4, 4)
            self.c = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            with poptorch.Block("p0_ipu0"):
                h = self.a1(x)
            with poptorch.Block("p0_ipu1"):
                h = self.b1(h)
            with poptorch.Block("p0_ipu0"):
                h = self.a2(h)
            with poptorch.Block("p1_ipu0"):
                h = self.c(h)
            return h, torch.nn.functional.mse_loss(h, y)

    torch.manual_seed(0)
    net = Swapping()
    twin = copy.deepcopy(net)
    strategy = poptorch.SerialPhasedExecution(
        poptorch.Phase(poptorch.Stage("p0_ipu0"), poptorch.Stage("p0_ipu1")),
        poptorch.Phase(poptorch.Stage("p1_ipu0")))
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0)
    model = poptorch.trainingModel(
        net, options(setExecutionStrategy=strategy),
        torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(2, 4, generator=generator), \
            torch.randn(2, 4, generator=generator)
        _, loss = model(x, y)
        reference.zero_grad()
        expected = twin(x, y)[1]
        expected.backward()
        reference.step()
        close(loss, expected.detach())
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


# --- liveness on the CPU -----------------------------------------------------

LIVENESS_MESSAGE = "host and device memory are the same"


@pytest.mark.parametrize("make_strategy", [
    serial_phases,
    lambda: poptorch.ParallelPhasedExecution(["A"], ["B"], ["C"], ["D"])],
    ids=["serial-phased", "parallel-phased"])
def test_off_chip_liveness_on_the_cpu_is_logged_once_and_changes_nothing(
        poptorch_log, make_strategy):
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    strategy = make_strategy()
    strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterFwd)
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION, setExecutionStrategy=strategy),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(model, twin, reference)
    said = [m for m in poptorch_log.messages if LIVENESS_MESSAGE in m]
    assert len(said) == 1
    assert "OffChipAfterFwd" in said[0]
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)


def test_always_live_phases_log_nothing_about_liveness(poptorch_log):
    net, _ = four_blocks_pair()
    model = poptorch.trainingModel(
        net, options(1, 3, setExecutionStrategy=serial_phases()),
        torch.optim.SGD(net.parameters(), lr=0.1))
    model(*make_data(3 * BATCH))
    assert not any(LIVENESS_MESSAGE in m for m in poptorch_log.messages)


# --- weights on the host, other models, setOptimizer -------------------------

def test_trained_weights_reach_the_host_and_inference_models():
    net, twin = four_blocks_pair()
    x, _ = make_data(4 * BATCH, seed=10)
    net.eval()
    inference = poptorch.inferenceModel(net, options(4))
    with torch.no_grad():
        close(inference(x), twin.eval()(x))
    assert compiled_model(inference).engine.runs_stages
    net.train()
    twin.train()
    training = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(training, twin, reference, calls=1)
    assert compiled_model(training).engine.runs_stages
    twin.eval()
    with torch.no_grad():
        expected = twin(x)
    # The inference model compiled before training sees the new weights.
    close(inference(x), expected)
    # So does one created afterwards on the same module.
    net.eval()
    later = poptorch.inferenceModel(net, options(4))
    close(later(x), expected)
    training.copyWeightsToHost()
    assert_same_weights(net, twin)


def test_set_optimizer_changes_the_learning_rate_from_the_next_call():
    net, twin = four_blocks_pair()
    initial = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(
        net, options(ITERATIONS, ACCUMULATION), optimizer)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(model, twin, reference, calls=1)
    staged = compiled_model(model).engine.execution
    optimizer.param_groups[0]["lr"] = 0.5
    model.setOptimizer(optimizer)
    reference.param_groups[0]["lr"] = 0.5
    train_both(model, twin, reference, calls=2, first_seed=1)
    assert compiled_model(model).engine.execution is staged
    model.copyWeightsToHost()
    assert_trained_like(net, twin, initial)
    # Had the new rate been ignored, the weights would differ.
    _, unchanged_twin = four_blocks_pair()
    slow = torch.optim.SGD(unchanged_twin.parameters(), lr=0.1,
                           momentum=0.9)
    for call in range(3):
        plain_training(unchanged_twin, slow, *make_data(ROWS, seed=call))
    assert not torch.allclose(unchanged_twin.fc1.weight, twin.fc1.weight)


class ReturnsItsWeight(torch.nn.Module):
    """Two blocks; the last one returns a view of a weight that the
    optimizer updates in place after each step."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            h = torch.relu(self.fc1(x))
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(h)
            loss = torch.nn.functional.cross_entropy(out, y)
            return self.fc2.weight.t(), loss


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_outputs_keep_the_weights_of_their_step(strategy):
    torch.manual_seed(0)
    net = ReturnsItsWeight()
    twin = copy.deepcopy(net)
    opts = options(ITERATIONS, 3)
    opts.setExecutionStrategy(ANY_BLOCKS[strategy]())
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(ITERATIONS * 3 * 2, seed=1)
    weights, _ = model(x, y)
    for step in range(ITERATIONS):
        expected = twin.fc2.weight.detach().t().clone()
        for micro in range(3):
            index = step * 3 + micro
            close(weights[index * 8:(index + 1) * 8], expected)
        reference.zero_grad()
        for micro in range(3):
            rows = slice((step * 3 + micro) * 2, (step * 3 + micro + 1) * 2)
            (twin(x[rows], y[rows])[1] / 3).backward()
        reference.step()
    model.copyWeightsToHost()
    assert_same_weights(net, twin, atol=1e-6)


def _state_copy(state):
    from poptorch._impl.device_loop import TrainingState
    return TrainingState([t.clone() for t in state.trainable], [], [[]],
                         [t.clone() for t in state.optimizer],
                         list(state.hyper))


def test_a_partial_update_equals_the_full_one_on_its_weights():
    """A pipeline process updates only its stage's weights: with two param
    groups of Adam, the update of some positions gives them what the
    update of all gives them and leaves the others alone."""
    from poptorch._impl.device_loop import TrainingState
    torch.manual_seed(0)
    net = FourBlocks()
    optimizer = torch.optim.Adam(
        [{"params": list(net.fc1.parameters()) + list(net.fc3.parameters()),
          "lr": 0.01},
         {"params": list(net.fc2.parameters()) + list(net.fc4.parameters()),
          "lr": 0.002}])
    opts = options(ITERATIONS, ACCUMULATION)
    opts.setExecutionStrategy(poptorch.ShardedExecution("A", "B", "C", "D"))
    model = poptorch.trainingModel(net, opts, optimizer)
    model(*make_data(ROWS))
    compiled = compiled_model(model)
    staged = compiled.engine.execution
    layout = staged.training_layout
    state = TrainingState(
        [compiled.state.params[i] for i in layout.trainable], [], [[]],
        list(compiled.state.optimizer), list(compiled.training.hyper))
    example = {"trainable": state.trainable, "state": state.optimizer,
               "hyper": state.hyper}
    grads = [torch.randn_like(t) for t in state.trainable]
    everything = list(range(len(state.trainable)))
    some = [1, 2, 5]
    full, part = _state_copy(state), _state_copy(state)
    staged_execution.PartialUpdate(layout, staged.settings, example,
                                    everything)(full, [g.clone() for g in grads])
    staged_execution.PartialUpdate(layout, staged.settings, example,
                                    some)(part, [g.clone() for g in grads])
    state_of = layout.state_indices()
    for position in everything:
        expected = full if position in some else state
        close(part.trainable[position], expected.trainable[position])
        for index in state_of[position]:
            close(part.optimizer[index], expected.optimizer[index])
    changed = [p for p in everything
               if not torch.equal(full.trainable[p], state.trainable[p])]
    assert changed == everything


# --- gradients combined per micro-batch ----------------------------------------

class MaybeBlocks(torch.nn.Module):
    """Two blocks, or with ``annotate=False`` the same model without blocks
    (one captured graph)."""

    def __init__(self, annotate=True):
        super().__init__()
        self.annotate = annotate
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0) if self.annotate else \
                contextlib.nullcontext():
            h = torch.tanh(self.fc1(x))
        with poptorch.Block("B", ipu_id=1) if self.annotate else \
                contextlib.nullcontext():
            out = self.fc2(h)
            return out, torch.nn.functional.cross_entropy(out, y)


def _stages_and_one_graph(make_options, make_optimizer, strategy):
    torch.manual_seed(0)
    net = MaybeBlocks()
    twin = copy.deepcopy(net)
    twin.annotate = False
    opts = make_options()
    opts.setExecutionStrategy(ANY_BLOCKS[strategy]())
    staged = poptorch.trainingModel(net, opts, make_optimizer(net))
    single = poptorch.trainingModel(twin, make_options(), make_optimizer(twin))
    for call in range(2):
        data = make_data(ITERATIONS * ACCUMULATION * BATCH, seed=call)
        staged(*data)
        single(*data)
    assert compiled_model(staged).engine.runs_stages
    assert not compiled_model(single).engine.runs_stages
    staged.copyWeightsToHost()
    single.copyWeightsToHost()
    return net, twin, staged


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_the_running_mean_reduction_matches_the_single_graph(strategy):
    net, twin, _ = _stages_and_one_graph(
        lambda: _running_mean_options(deviceIterations=ITERATIONS),
        _sgd, strategy)
    assert_same_weights(net, twin, atol=1e-6)


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_a_float16_accum_type_matches_the_single_graph(strategy):
    def optimizer(net):
        return poptorch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9,
                                  accum_type=torch.float16)

    net, twin, staged = _stages_and_one_graph(
        lambda: options(ITERATIONS, ACCUMULATION), optimizer, strategy)
    assert_same_weights(net, twin, atol=1e-6)
    combined = compiled_model(staged).engine.execution.gradient_buffers
    assert combined and all(buffers[0].dtype == torch.float16
                            for buffers in combined.values())


class NormInSecondStage(torch.nn.Module):
    """Layers before the first block (stage 0, by the guide's rule for
    ``BeginBlock(layer, ipu_id=1)``), then a block that starts with a
    BatchNorm: stage 1 writes buffers that stage 0 never reads."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.bn = poptorch.BeginBlock(torch.nn.BatchNorm1d(8), ipu_id=1)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(self.bn(torch.relu(self.fc1(x))))
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_buffers_of_a_later_stage_are_not_passed_as_activations(strategy):
    torch.manual_seed(0)
    net = NormInSecondStage()
    twin = copy.deepcopy(net)
    opts = options(ITERATIONS, ACCUMULATION)
    opts.setExecutionStrategy(ANY_BLOCKS[strategy]())
    model = poptorch.trainingModel(net, opts, _sgd(net))
    x, y = make_data(ROWS)
    out, _ = model(x, y)
    outputs, _ = plain_training(twin, _sgd(twin), x, y)
    assert compiled_model(model).engine.execution.stage_count == 2
    close(out, outputs[-BATCH:])
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("annotate", [True, False],
                         ids=["two-stages", "one-graph"])
def test_training_calls_under_inference_mode_or_no_grad_still_train(
        context, annotate):
    """Validation loops often wrap everything in torch.inference_mode()
    or torch.no_grad(); a training model called there (even its first,
    compiling call) trains as usual."""
    torch.manual_seed(0)
    net = MaybeBlocks(annotate)
    twin = copy.deepcopy(net)
    twin.annotate = False
    opts = options(ITERATIONS, 3)
    if annotate:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    model = poptorch.trainingModel(net, opts, _sgd(net))
    optimizer = _sgd(twin)
    for call in range(2):
        x, y = make_data(ITERATIONS * 3 * BATCH, seed=call)
        with context():
            model(x, y)
        plain_training(twin, optimizer, x, y, accumulation=3)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


# --- in-place writes to inputs ----------------------------------------------

class WritesItsInput(torch.nn.Module):
    """Block "A" doubles its input in place; block "B" reads it again."""

    def __init__(self, checkpoint=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8 + 4, 3)
        self.checkpoint = checkpoint

    def forward(self, x, y=None):
        with poptorch.Block("A", ipu_id=0):
            x.mul_(2.0)
            h = torch.tanh(self.fc1(x))
            if self.checkpoint:
                h = poptorch.recomputationCheckpoint(h)
            h = torch.relu(h)
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(torch.cat([h, x], dim=1))
            if y is None:
                return out
            return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_inference_writes_to_inputs_reach_the_caller(strategy):
    torch.manual_seed(0)
    net = WritesItsInput()
    model = poptorch.inferenceModel(net, options(
        4, setExecutionStrategy=ANY_BLOCKS[strategy]()))
    x, _ = make_data(4 * BATCH)
    expected_x = x.clone()
    with torch.no_grad():
        expected = net(expected_x)
    close(model(x), expected)
    close(x, expected_x)


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_training_writes_to_inputs_reach_the_caller(strategy):
    """Each micro-batch is written once (the pipeline's shape inference
    writes a copy) and training equals plain PyTorch."""
    torch.manual_seed(0)
    net = WritesItsInput()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(ITERATIONS, 3, setExecutionStrategy=(
            ANY_BLOCKS[strategy]()), outputMode=poptorch.OutputMode.All),
        _sgd(net))
    reference = _sgd(twin)
    rows = ITERATIONS * 3 * BATCH
    for call in range(2):
        x, y = make_data(rows, seed=call)
        expected_x = x.clone()
        outputs, _ = plain_training(twin, reference, expected_x, y,
                                    accumulation=3)
        out, _ = model(x, y)
        close(x, expected_x)
        close(out, outputs)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


def test_input_writes_and_recomputation_are_an_error():
    net = WritesItsInput(checkpoint=True)
    model = poptorch.trainingModel(net, options(
        1, 3, setExecutionStrategy=poptorch.ShardedExecution("A", "B")),
        _sgd(net))
    with pytest.raises(poptorch.Error, match="writes to its input tensors in "
                       "place while recomputationCheckpoint"):
        model(*make_data(3 * BATCH))


# --- several processes (checked before joining a run) -----------------------

def _as_process_0_of_2(opts: poptorch.Options) -> poptorch.Options:
    opts.Distributed.configureProcessId(0, 2)
    return opts


def test_replicas_of_a_stage_per_process_training_are_an_error():
    net = FourBlocks()
    model = poptorch.trainingModel(net, _as_process_0_of_2(options(
        1, ACCUMULATION, replicas=2, broadcastBuffers=False)), _sgd(net))
    with pytest.raises(poptorch.Error, match="replicationFactor is 2 in a "
                       "multi-process run, which places one stage per "
                       "process"):
        model.compile(*make_data(2 * ACCUMULATION * BATCH))


def test_replicated_inference_runs_every_stage_in_each_process():
    net, twin = four_blocks_pair()
    model = poptorch.inferenceModel(net.eval(), _as_process_0_of_2(
        options(4, replicas=2)))
    x, _ = make_data(8 * BATCH)
    with torch.no_grad():
        close(model(x), twin.eval()(x))


# --- grouped weights ---------------------------------------------------------

class GroupedBlocks(torch.nn.Module):
    """Block "A" applies ``weight``, which may be grouped; block "B" a
    linear layer shared by all replicas. Without ``annotate``, no blocks."""

    def __init__(self, rows, annotate=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, 4, 5))
        self.fc = torch.nn.Linear(5, 3)
        self.annotate = annotate

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0) if self.annotate else \
                contextlib.nullcontext():
            h = torch.tanh(x @ self.weight)
        with poptorch.Block("B", ipu_id=1) if self.annotate else \
                contextlib.nullcontext():
            out = self.fc(h)
            return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean,
                                       poptorch.ReductionType.Sum])
def test_grouped_weights_train_like_the_single_graph(strategy, reduction):
    """Each replica's micro-batches use its group's row, and each row is
    trained on its group's gradients, as in the vectorised single graph."""
    torch.manual_seed(0)
    net = GroupedBlocks(2)
    twin = copy.deepcopy(net)
    twin.annotate = False
    models = []
    for module, staged in ((net, True), (twin, False)):
        opts = options(2, 3, replicas=4, outputMode=poptorch.OutputMode.All)
        opts.Training.accumulationAndReplicationReductionType(reduction)
        if staged:
            opts.setExecutionStrategy(ANY_BLOCKS[strategy]())
        model = poptorch.trainingModel(module, opts, _sgd(module))
        model.weight.replicaGrouping(
            poptorch.CommGroupType.Consecutive, 2,
            poptorch.VariableRetrievalMode.OnePerGroup)
        models.append(model)
    for call in range(2):
        data = make_data(2 * 3 * 4 * BATCH, seed=call)
        got, expected = models[0](*data), models[1](*data)
        close(got[1], expected[1])
    assert compiled_model(models[0]).engine.runs_stages
    assert not compiled_model(models[1]).engine.runs_stages
    for model in models:
        model.copyWeightsToHost()
    assert_same_weights(net, twin)
    assert not torch.allclose(net.weight[0], net.weight[1])


@pytest.mark.parametrize("strategy", sorted(ANY_BLOCKS))
def test_grouped_weights_in_inference_give_each_replica_its_row(strategy):
    torch.manual_seed(0)
    net = GroupedBlocks(2)
    opts = options(4, replicas=4)
    opts.setExecutionStrategy(ANY_BLOCKS[strategy]())
    model = poptorch.inferenceModel(net, opts)
    model.weight.replicaGrouping(poptorch.CommGroupType.Orthogonal, 2,
                                 poptorch.VariableRetrievalMode.OnePerGroup)
    x, y = make_data(4 * 4 * BATCH)
    out, _ = model(x, y)
    rows = x.unflatten(0, (4, 4, BATCH))
    with torch.no_grad():
        expected = torch.stack([torch.stack([
            net.fc(torch.tanh(rows[d, r] @ net.weight[r % 2]))
            for r in range(4)]) for d in range(4)])
    close(out, expected.flatten(0, 2))


# --- layers before the first block ---------------------------------------------

class LaterBlocks(torch.nn.Module):
    """``fc1`` carries no annotation; BeginBlock puts ``fc2`` on
    ``first_ipu`` and, with ``two_blocks``, ``fc3`` on the IPU after it."""

    def __init__(self, first_ipu, two_blocks=True):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = poptorch.BeginBlock(torch.nn.Linear(8, 8), "B",
                                       ipu_id=first_ipu)
        self.fc3 = torch.nn.Linear(8, 3)
        if two_blocks:
            self.fc3 = poptorch.BeginBlock(self.fc3, "C",
                                           ipu_id=first_ipu + 1)

    def forward(self, x, y):
        out = self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))
        return out, torch.nn.functional.cross_entropy(out, y)


def _stage_parameters(model):
    """The model's parameter indices each stage reads."""
    stages = compiled_model(model).engine.execution.graph.stages
    return [part.sources for part in stages]


@pytest.mark.parametrize("make_strategy, first_ipu, stages", [
    (poptorch.PipelinedExecution, 1, [[0, 1], [2, 3], [4, 5]]),
    (lambda: poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement),
     1, [[0, 1], [2, 3], [4, 5]]),
    (poptorch.PipelinedExecution, 0, [[0, 1, 2, 3], [4, 5]]),
    (lambda: poptorch.PipelinedExecution("B", "C"), 1,
     [[0, 1, 2, 3], [4, 5]]),
], ids=["same-as-ipu", "auto-increment", "first-block-on-ipu-0",
        "explicit-stages"])
def test_layers_before_the_first_block_go_on_the_ipu_before_it(
        make_strategy, first_ipu, stages):
    """BeginBlock(layer_n, ipu_id=m) places the layers before layer_n on
    IPU m - 1 (guide, "Model partitioning using blocks"): their own stage,
    unless the first block is on IPU 0 or the stages are listed by block
    id (they then join the first stage). Training equals plain PyTorch
    (atol 1e-6)."""
    torch.manual_seed(0)
    net = LaterBlocks(first_ipu)
    twin = copy.deepcopy(net)
    opts = options(device_iterations=ITERATIONS, accumulation=ACCUMULATION)
    opts.setExecutionStrategy(make_strategy()).autoRoundNumIPUs(True)
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = make_data(ROWS)
    model(x, y)
    plain_training(twin, reference, x, y)
    assert [[i for i in part if i < 6] for part in _stage_parameters(model)] \
        == stages
    assert_same_weights(net, twin)


def test_two_ipus_from_one_begin_block_need_a_pipeline_depth():
    """BeginBlock(fc2, ipu_id=1) alone makes two stages (fc1 on IPU 0), so
    training needs gradientAccumulation >= 3, as for any 2-stage
    pipeline."""
    model = poptorch.trainingModel(LaterBlocks(1, two_blocks=False),
                                   options(accumulation=2))
    with pytest.raises(poptorch.Error, match="A training pipeline of 2 "
                       "stages .*gradientAccumulation must be at least 3"):
        model(*make_data(2 * BATCH))
