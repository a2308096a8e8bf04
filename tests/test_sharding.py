"""Replicated tensor sharding of the optimizer state (ZeRO stages 1 and 2,
``poptorch/_impl/distributed/sharding.py``): the sharded update's
collectives run by two simulated processes (threads) against the whole
update; one-process runs and weight sharding, which have nothing to shard;
and, in real processes (slow), sharded training against unsharded
training, checkpoints and the memory each process keeps."""
import copy
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from poptorch._impl.distributed import gradients, process_group
from poptorch._impl.distributed.sharding import ShardedExchange, Sharding
from poptorch._impl.optimizers.lamb import LAMBRule
from poptorch._impl.optimizers.rule import clip_grad_norm, clip_to_norm
import sharding_program as program
from conftest import free_port

PROGRAM = os.path.join(os.path.dirname(__file__), "sharding_program.py")


# --- rows ----------------------------------------------------------------

def test_a_tensor_is_cut_into_padded_rows_and_put_back_whole():
    sharding = Sharding(parts=3, sharded=(True,), accumulators=False)
    tensor = torch.arange(10.0).view(2, 5)
    rows = [sharding.shard(tensor, rank) for rank in range(3)]
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                          [8, 9, 0, 0]]
    assert torch.equal(sharding.whole(torch.cat(rows), tensor.shape),
                       tensor)


# --- the sharded update, two processes simulated by threads ---------------

class ThreadGroup:
    """The process group of one of ``size`` threads that act as the
    processes of a run: each collective waits for every thread's operand,
    then computes what torch.distributed would return."""

    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, shared.size, shared

    def _exchange(self, key, tensor):
        shared = self.shared
        shared.barrier.wait()
        shared.slots.setdefault(key, [None] * self.size)[self.rank] = \
            tensor.clone()
        shared.barrier.wait()
        values = shared.slots[key]
        shared.barrier.wait()
        if self.rank == 0:
            del shared.slots[key]
        return values

    def start_all_reduce_(self, tensor, key):
        self.shared.started[(self.rank, "ar", key)] = tensor

    def finish_all_reduce_(self, tensor, key, average, what):
        started = self.shared.started.pop((self.rank, "ar", key))
        total = sum(self._exchange(("ar", key), started))
        tensor.copy_(total / self.size if average else total)

    def start_reduce_scatter(self, flat, key):
        self.shared.started[(self.rank, "rs", key)] = flat

    def finish_reduce_scatter(self, flat, key, average, what):
        flat = self.shared.started.pop((self.rank, "rs", key))
        total = sum(self._exchange(("rs", key), flat))
        mine = total.view(self.size, -1)[self.rank].clone()
        return mine / self.size if average else mine

    def all_gather(self, part, what):
        return torch.cat(self._exchange(("ag",), part.reshape(-1)))

    def start_all_gather(self, part, key):
        self.shared.started[(self.rank, "ag", key)] = part.clone()

    def finish_all_gather(self, key, what):
        part = self.shared.started.pop((self.rank, "ag", key))
        return torch.cat(self._exchange(("ag", key), part.reshape(-1)))

    def all_reduce_(self, tensor, what):
        tensor.copy_(sum(self._exchange(("total",), tensor)))


class _Shared:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots, self.started = {}, {}


def _run_as_processes(monkeypatch, size, function):
    """``function(rank)`` in ``size`` threads, each seeing its own
    ``ThreadGroup`` as the current process group; their results."""
    local = threading.local()
    monkeypatch.setattr(process_group, "current", lambda: local.group)
    shared = _Shared(size)
    results, errors = [None] * size, []

    def run(rank):
        local.group = ThreadGroup(rank, shared)
        try:
            results[rank] = function(rank)
        except BaseException as error:
            errors.append(error)
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


SHAPES = [(7, 3), (5,), (2,), (4, 4, 2), (3,)]
HYPER = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6,
         "weight_decay": 0.01}


def _lamb_step(exchange, params, grads, state, max_norm):
    """Gradients averaged over the processes, clipped to the global norm
    ``max_norm``, then LAMB's update: the new params (``exchange`` None:
    the whole update of the averaged ``grads``)."""
    hyper = {name: torch.tensor(value, dtype=torch.float64)
             for name, value in HYPER.items()}
    rule = LAMBRule(bias_correction=True, clamp_weight_norm=False)
    if exchange is None:
        new, _ = rule.update(params, clip_grad_norm(grads, max_norm), state,
                             hyper)
        return new
    exchange.begin(params[0])
    grads = exchange.reduce(grads)
    grads = clip_to_norm(grads, max_norm, exchange.statistics.norm(grads))
    rows, _ = rule.update(exchange.local(params), grads, state, hyper,
                          exchange.norms(range(len(params))))
    return exchange.gather(rows, params)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])
def test_sharded_lamb_step_equals_the_whole_step(monkeypatch, parts,
                                                 bucket_bytes):
    """Each simulated process reduce-scatters its gradients (buckets of
    several parameters, odd sizes padded), updates its rows with LAMB
    (per-tensor trust ratios from norms totalled over the processes) after
    clipping by the global norm, and all-gathers the weights: every process
    ends with the weights the whole update computes from the mean gradient
    (atol 1e-6). The 2-element parameter is below the sharding threshold
    and is all-reduced whole. With buckets of 64 bytes, parameters of that
    size or more are gathered one by one. One traced graph serves every
    process."""
    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", bucket_bytes)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", bucket_bytes)
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    grads = [[torch.randn(s, generator=generator) for s in SHAPES]
             for _ in range(parts)]
    sharded = tuple(p.numel() > 2 for p in params)
    sharding = Sharding(parts, sharded, accumulators=False)
    rule = LAMBRule(bias_correction=True, clamp_weight_norm=False)
    whole = rule.init_state(params, [{"exp_avg": torch.rand(s),
                                      "exp_avg_sq": torch.rand(s),
                                      "step": 3.0} for s in SHAPES])
    mean = [sum(g[i] for g in grads) / parts for i in range(len(SHAPES))]
    expected = _lamb_step(None, params, mean, whole, 0.5)

    def rows(rank):
        return {name: [sharding.shard(t, rank) if s and t.dim() else t
                       for t, s in zip(tensors, sharded)]
                for name, tensors in whole.items()}

    exchange = ShardedExchange(sharding, average=True)
    graph = make_fx(lambda p, g, s: _lamb_step(exchange, p, g, s, 0.5),
                    tracing_mode="fake")(params, grads[0], rows(0))
    results = _run_as_processes(
        monkeypatch, parts, lambda rank: graph(params, grads[rank],
                                               rows(rank)))
    for new in results:
        for got, want in zip(new, expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_overflow_on_one_process_is_seen_by_every_process(monkeypatch):
    """Automatic loss scaling skips a step everywhere when any process's
    rows overflowed."""
    exchange = ShardedExchange(Sharding(2, (True, True), accumulators=False),
                               average=True)

    def finite(*rows):
        exchange.begin(rows[0])
        return exchange.statistics.all_finite(list(rows))

    rows = [[torch.ones(4), torch.ones(3)] for _ in range(2)]
    rows[1][1][2] = float("inf")
    graph = make_fx(finite, tracing_mode="fake")(*rows[0])
    assert _run_as_processes(monkeypatch, 2, lambda rank: bool(
        graph(*rows[rank]))) == [False, False]


# --- nothing to shard -------------------------------------------------------

def _rts():
    return poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)


def _train(opts, steps=3):
    torch.manual_seed(0)
    net = program.Net()
    model = poptorch.trainingModel(
        net, opts, torch.optim.Adam(net.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1)
    rows = 4 * opts.replication_factor
    for _ in range(steps):
        model(torch.randn(rows, 5, generator=generator),
              torch.randint(0, 3, (rows,), generator=generator))
    return net.state_dict()


def _messages(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "poptorch" and r.levelno == logging.INFO]


@pytest.mark.parametrize("location", ["setOptimizerLocation",
                                      "setWeightLocation"])
def test_one_process_run_has_nothing_to_shard(poptorch_log, location):
    """Two replicas of one process share one copy of the weights and
    optimizer state: sharding either is logged once as having no effect
    and training is the same as without it (exactly)."""
    plain = _train(poptorch.Options().replicationFactor(2))
    opts = poptorch.Options().replicationFactor(2)
    getattr(opts.TensorLocations, location)(_rts())
    sharded = _train(opts)
    for name, value in plain.items():
        assert torch.equal(sharded[name], value), name
    said = [m for m in _messages(poptorch_log)
            if "has no effect in a one-process run: its replicas already "
               "share one copy of the weights and optimizer state" in m]
    assert len(said) == 1


def test_accumulator_sharding_alone_says_why_it_has_no_effect(poptorch_log):
    opts = poptorch.Options()
    opts.TensorLocations.setAccumulatorLocation(_rts())
    _train(opts, steps=1)
    assert any("setAccumulatorLocation with useReplicatedTensorSharding("
               "True) has no effect without it on the optimizer location"
               in m for m in _messages(poptorch_log))


def test_small_parameters_keep_whole_state():
    """Parameters of at most minElementsForReplicatedTensorSharding
    elements, or fewer elements than processes, stay whole."""
    opts = poptorch.Options()
    opts.TensorLocations.setOptimizerLocation(
        _rts().minElementsForReplicatedTensorSharding(4))
    params = [torch.zeros(5), torch.zeros(4), torch.zeros(2, 3),
              torch.zeros(1)]
    sharding = Sharding.build(opts, params, processes=6,
                              stage_per_process=False, staged=False)
    assert sharding.sharded == (False, False, True, False)


# --- real processes ---------------------------------------------------------

def _run_two_processes(output, *arguments):
    """sharding_program.py run as 2 processes (gloo) writing to
    ``output``; each process's results, when it saved any."""
    port = str(free_port())
    processes = []
    for rank in range(2):
        environment = dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS="1", POPTORCH_BACKEND="graph",
                           POPTORCH_DISTRIBUTED_TIMEOUT="60")
        processes.append(subprocess.Popen(
            [sys.executable, PROGRAM, str(output), *arguments],
            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    for process in processes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
    return [torch.load(output / f"process{i}.pt", weights_only=False)
            if (output / f"process{i}.pt").exists() else None
            for i in range(2)]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every configuration, sharded and not, and the checkpoint round
    trips, over 2 processes."""
    return _run_two_processes(tmp_path_factory.mktemp("sharding"))


def _assert_state_dicts_close(got, want):
    """Optimizer state dicts with the same keys, values within rtol 1e-5
    and an atol of 1e-6 times the tensor's largest magnitude (at least 1):
    a reduce-scatter sums in another order than an all-reduce, and a small
    entry of a state whose entries reach 10 (RMSprop's momentum buffer)
    differs by that order's rounding of the large ones (torch's part, and
    the "poptorch" entry of poptorch.optim optimizers)."""
    assert got["param_groups"] == want["param_groups"]
    assert got.keys() == want.keys()
    pairs = [(got["state"], want["state"])]
    if "poptorch" in want:
        for key in ("loss_scale", "good_steps"):
            assert got["poptorch"][key] == want["poptorch"][key]
        pairs.append((got["poptorch"]["device_state"],
                      want["poptorch"]["device_state"]))
    for mine, theirs in pairs:
        assert mine.keys() == theirs.keys()
        for index, entry in mine.items():
            assert entry.keys() == theirs[index].keys()
            for name, value in entry.items():
                scale = max(1.0, theirs[index][name].abs().max().item()) \
                    if theirs[index][name].is_floating_point() else 1.0
                torch.testing.assert_close(value, theirs[index][name],
                                           atol=1e-6 * scale, rtol=1e-5)


def _assert_same_training(sharded, unsharded, weights=False):
    """A sharded run's weights and optimizer state dict equal the unsharded
    run's (atol 1e-6, rtol 1e-5), and it kept less than 60 % of the
    optimizer state bytes (half, and the tensors left whole); with sharded
    ``weights``, less than 60 % of the weight bytes too."""
    for name, value in unsharded["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], value,
                                   atol=1e-6, rtol=1e-5)
    _assert_state_dicts_close(sharded["state_dict"], unsharded["state_dict"])
    assert sharded["state_bytes"] < 0.6 * unsharded["state_bytes"]
    if weights:
        assert sharded["weight_bytes"] < 0.6 * unsharded["weight_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(program.CONFIGS))
def test_sharded_training_equals_unsharded_training(two_processes, config):
    """Each configuration (SGD with momentum and its combined variant,
    Adam, AdamW, LAMB, RMSprop; gradient accumulation, replicas, a sharded
    gradient buffer with and without accumulation, Sum reduction and the
    running mean, fixed and automatic loss scaling with a skipped step,
    clipping) trained over 2 processes with sharded optimizer state, and
    the ``zero3`` ones with sharded weights too: the processes end with
    equal weights, and the weights, losses, anchored weights, gradients
    and optimizer state (its state_dict(), gathered) equal the unsharded
    run's (atol 1e-6, rtol 1e-5, as the replication tests). The state each
    process keeps falls to about half, and so do the weights when they
    are sharded."""
    for process in two_processes:
        result = process[config]
        sharded, unsharded = result["sharded"], result["unsharded"]
        _assert_same_training(sharded, unsharded,
                              weights=program.CONFIGS[config].weights)
        for name, value in sharded["weights"].items():
            assert torch.equal(value, two_processes[0][config]["sharded"]
                               ["weights"][name])
        for got, want in zip(sharded["losses"], unsharded["losses"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        for short, value in unsharded["anchored"].items():
            torch.testing.assert_close(sharded["anchored"][short], value,
                                       atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_the_skipped_step_is_skipped_on_both_processes(two_processes):
    """The lamb auto_scale runs' second call has a NaN on process 0 only:
    the loss scale halved once on both processes, as without sharding."""
    for process in two_processes:
        for config in ("lamb_auto_scale", "lamb_zero3_auto_scale"):
            state = process[config]["sharded"]["state_dict"]
            assert state["poptorch"]["loss_scale"] == 2.0 ** 15


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_interchange(two_processes):
    """A sharded run resumed from its checkpoint (weights and gathered
    optimizer state) ends bit for bit where the uninterrupted run ends; an
    unsharded run's checkpoint loads into a sharded model, which then
    trains as an unsharded model loading it (atol 1e-6)."""
    for process in two_processes:
        result = process["resume"]
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), name
        uninterrupted = result["uninterrupted_state"]["state"]
        for index, entry in uninterrupted.items():
            for name, value in entry.items():
                assert torch.equal(result["resumed_state"]["state"][index]
                                   [name], value)
        sharded, unsharded = (result["loaded_sharded"],
                              result["loaded_unsharded"])
        for name, value in unsharded["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], value,
                                       atol=1e-6, rtol=1e-5)
        _assert_state_dicts_close(sharded["state_dict"],
                                  unsharded["state_dict"])


@pytest.mark.slow
def test_a_sharded_checkpoint_loads_into_one_process(two_processes):
    """The state dict of the 2-process sharded Adam run is the unsharded
    format: a one-process model with 2 replicas loads it and keeps it."""
    saved = two_processes[0]["adam_zero2"]["sharded"]
    net = program.Net()
    net.load_state_dict(saved["weights"])
    optimizer = program._adam(net)
    optimizer.load_state_dict(copy.deepcopy(saved["state_dict"]))
    model = poptorch.trainingModel(
        net, poptorch.Options().replicationFactor(2), optimizer)
    model.compile(torch.zeros(8, 5), torch.zeros(8, dtype=torch.long))
    _assert_state_dicts_close(optimizer.state_dict(), saved["state_dict"])


@pytest.mark.slow
def test_a_multi_stage_model_shards_its_optimizer_state(tmp_path):
    """poprun --num-instances 2 with a two-stage model per instance
    (sharded execution, gradient accumulation, Adam with clipping): the
    captured optimizer step updates each process's rows, as the unsharded
    run updates the whole weights (atol 1e-6), keeping about half the
    state."""
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "2", "--ipus-per-replica", "2", PROGRAM,
         str(tmp_path), "--staged"], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, POPTORCH_BACKEND="graph"))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        run = torch.load(tmp_path / f"process{rank}.pt",
                         weights_only=False)["staged"]
        _assert_same_training(run["sharded"], run["unsharded"])


@pytest.mark.slow
def test_process_0_alone_reads_the_sharded_state(tmp_path):
    """With sharded weights and optimizer state, only process 0 reads the
    module's weights and optimizer.state_dict() (as PopTorch programs save
    checkpoints): after the first call, while process 1 goes on to its
    next call, and after the last, when process 1 has left its training
    loop and waits at exit; then it validates the module with an
    inference model. The weights, state dicts and validation outputs equal
    the unsharded run's (atol 1e-6), and both processes end normally."""
    first, second = _run_two_processes(tmp_path, "--process-0-saves")
    assert second is None
    for moment in ("first", "last"):
        sharded, unsharded = first[True, moment], first[False, moment]
        _assert_state_dicts_close(sharded["state_dict"],
                                  unsharded["state_dict"])
        for name, value in unsharded["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], value,
                                       atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(first[True, "validation"],
                               first[False, "validation"], atol=1e-6,
                               rtol=1e-5)
