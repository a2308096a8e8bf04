"""Tiered compilation (issue 20, the "auto" backend): the graph tier at
once, Inductor's steps compiled in another process once a model has run
POPTORCH_TIER_UP_AFTER seconds of calls, switched between calls with the
device state carried over; warm caches start fast; failures fall back."""
import gc
import os
import subprocess
import sys
import time

import pytest
import torch

import poptorch
from poptorch._impl.backends.inductor import InductorStep
from poptorch._impl.executor import compiled_model
from poptorch._impl.tiering import background, threshold, tier_up


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before the BatchNorm: its gradient is zero up to rounding,
        # which Adam would scale up into backend-dependent updates.
        self.fc1 = torch.nn.Linear(6, 16, bias=False)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x, y=None):
        out = self.fc2(torch.relu(self.bn(self.fc1(x))))
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def _data(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 6, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def _pair(backend_options, replicas=1):
    """An "auto" training model and a "graph" one from the same weights,
    D = 2, G = 2."""
    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    models = []
    for net, backend in zip(nets, backend_options):
        options = poptorch.Options().deviceIterations(2)
        options.Training.gradientAccumulation(2)
        options.replicationFactor(replicas)
        options.setBackend(backend)
        models.append(poptorch.trainingModel(
            net, options, optimizer=poptorch.optim.SGD(
                net.parameters(), lr=0.01, momentum=0.9)))
    return nets, models


def _tiers(model):
    return compiled_model(model).session.tiers


def _wait_for_fast_tier(model, x, y, reference, timeout=240):
    """Call both models until ``model``'s worker compiles, wait for it
    without calls, then call them once more (the switch)."""
    start = time.monotonic()
    torch.testing.assert_close(model(x, y), reference(x, y))
    calls = 1
    while not _tiers(model).on_fast_tier:
        assert time.monotonic() - start < timeout, "no tier-up"
        if _compiling(model):
            time.sleep(0.2)
            continue
        # Rounding differences (the probe's calls on one thread fewer,
        # Inductor's kernels after the switch) grow with the calls made,
        # quickly once training on one batch has fitted it: BatchNorm over
        # 4 rows divides by small variances. No calls are made while the
        # worker compiles, so with a threshold of (nearly) no time how many
        # there are does not depend on the machine's load. The tolerance of
        # the weights' comparison below.
        torch.testing.assert_close(model(x, y), reference(x, y), atol=1e-4,
                                   rtol=1e-3)
        calls += 1
    return calls


def _compiling(model):
    worker = _tiers(model)._compile
    return worker is not None and worker.poll() == background.RUNNING


def test_auto_is_the_default_and_starts_on_the_graph_tier(monkeypatch):
    monkeypatch.delenv("POPTORCH_BACKEND", raising=False)
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "3600")
    net = Net()
    model = poptorch.trainingModel(
        net, poptorch.Options(),
        optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    model(*_data(4, 0))
    session = compiled_model(model).session
    assert session.backend.name == "auto"
    tiers = session.tiers
    assert not tiers.on_fast_tier
    assert not isinstance(tiers._steps["update"].current, InductorStep)
    assert tiers._compile is None        # below the threshold: no worker


def test_a_bad_threshold_is_refused(monkeypatch):
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "soon")
    model = poptorch.inferenceModel(Net().eval())
    with pytest.raises(poptorch.Error, match="POPTORCH_TIER_UP_AFTER must "
                       "be a number of seconds"):
        model(torch.randn(2, 6))


def test_a_failed_background_compile_warns_and_stays_on_the_graph_tier(
        tmp_path, monkeypatch, poptorch_log):
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    nets, (auto, graph) = _pair(["auto", "graph"])
    x, y = _data(8, 1)
    torch.testing.assert_close(auto(x, y), graph(x, y))
    worker = _tiers(auto)._compile._process
    worker.kill()                     # the worker dies before finishing
    worker.wait()
    for seed in range(3):
        x, y = _data(8, seed)
        torch.testing.assert_close(auto(x, y), graph(x, y))
    assert "Background compilation with inductor failed" in poptorch_log.text
    assert poptorch_log.text.count("Background compilation") == 1
    assert not _tiers(auto).on_fast_tier and _tiers(auto)._compile is None
    assert not list(tmp_path.glob("*.pexe"))
    assert not list(tmp_path.glob("*.compiling"))
    for name, value in nets[0].state_dict().items():
        torch.testing.assert_close(value, nets[1].state_dict()[name])


def test_only_one_live_process_holds_the_compile_lock(tmp_path):
    lock = str(tmp_path / "key.compiling")
    assert tier_up._claim(lock)
    assert not tier_up._claim(lock)          # held by this live process
    with open(lock, "w", encoding="utf-8") as stream:
        stream.write("999999999")            # a process that is gone
    assert tier_up._claim(lock)
    background.release(lock)
    assert not os.path.exists(lock)


@pytest.mark.slow
def test_training_switches_to_inductor_between_calls_and_trains_the_same(
        tmp_path, monkeypatch):
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    nets, (auto, graph) = _pair(["auto", "graph"], replicas=2)
    x, y = _data(16, 0)
    calls = _wait_for_fast_tier(auto, x, y, graph)
    assert calls >= 1
    steps = _tiers(auto)._steps
    assert set(steps) == {"update", "accumulate"}
    assert all(isinstance(step.current, InductorStep)
               for step in steps.values())
    for seed in range(1, 4):
        x, y = _data(16, seed)
        out_auto, loss_auto = auto(x, y)
        out_graph, loss_graph = graph(x, y)
        torch.testing.assert_close(out_auto, out_graph, atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(loss_auto, loss_graph, atol=1e-5,
                                   rtol=1e-4)
    # The weights after a hundred or more steps (the calls made while the
    # worker compiled), the last 16 of them on different kernels.
    for name, value in nets[0].state_dict().items():
        torch.testing.assert_close(value, nets[1].state_dict()[name],
                                   atol=1e-4, rtol=1e-3)
    assert not list(tmp_path.glob("*.compiling"))
    # A new model of the same graphs starts on the fast tier.
    _, (warm, _) = _pair(["auto", "graph"], replicas=2)
    warm(x, y)
    assert _tiers(warm).on_fast_tier


@pytest.mark.slow
def test_the_probed_threshold_tiers_up_and_trains_the_same(tmp_path,
                                                          monkeypatch):
    """The default rule (no POPTORCH_TIER_UP_AFTER): the probe's calls on
    one thread fewer, then the tier-up, with the results of a model that
    ran on the graph backend throughout."""
    monkeypatch.delenv(threshold.TIER_UP_VARIABLE, raising=False)
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(threshold, "lends_a_thread", lambda: True)
    monkeypatch.setattr(threshold, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(threshold, "MINIMUM_SECONDS", 0.0)
    # The probed threshold is the measured loss (up to 2) times this: at
    # most a tenth of a second of calls, so that the calls made on one
    # batch before the tier-up (whose rounding differences grow once the
    # model has fitted it) do not depend on the machine's load.
    monkeypatch.setattr(threshold, "EXPECTED_COMPILE_SECONDS", 0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        nets, (auto, graph) = _pair(["auto", "graph"])
        x, y = _data(16, 0)
        calls = _wait_for_fast_tier(auto, x, y, graph)
        assert calls > 2 * threshold.PROBE_CALLS
        assert 0.0 <= _tiers(auto)._threshold.seconds <= 0.1
        assert torch.get_num_threads() == max(threads, 2)
        for seed in range(1, 3):
            x, y = _data(16, seed)
            for got, want in zip(auto(x, y), graph(x, y)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
        for name, value in nets[0].state_dict().items():
            torch.testing.assert_close(value, nets[1].state_dict()[name],
                                       atol=1e-4, rtol=1e-3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_inference_switches_to_inductor_compiling_once_for_two_models(
        tmp_path, monkeypatch):
    """Two models of the same graphs (as the processes of a poprun run):
    one compiles, the other waits for its cache entries."""
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    net = Net().eval()
    first, second = (poptorch.inferenceModel(net, poptorch.Options()
                                             .deviceIterations(4))
                     for _ in range(2))
    x = torch.randn(8, 6)
    start = time.monotonic()
    for model in (first, second):
        torch.testing.assert_close(model(x), net(x))
        torch.testing.assert_close(model(x), net(x))
    assert _tiers(first)._compile is not None
    assert _tiers(second)._compile is None and _tiers(second)._waiting
    while not (_tiers(first).on_fast_tier and _tiers(second).on_fast_tier):
        assert time.monotonic() - start < 240
        for model in (first, second):
            torch.testing.assert_close(model(x), net(x))
        time.sleep(0.2)
    for model in (first, second):
        torch.testing.assert_close(model(x), net(x), atol=1e-5, rtol=1e-4)


class _Noisy(torch.nn.Module):
    """Dropout (the module is in training mode) and Gaussian noise."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x)) + torch.randn_like(x)


@pytest.mark.slow
def test_a_seeded_model_draws_the_graph_tiers_random_numbers_on_both_tiers(
        tmp_path, monkeypatch):
    """With randomSeed, the Inductor tier draws what the graph tier draws
    from the same generator state, so the run does not depend on when it
    tiers up (Inductor's own random algorithm differs)."""
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    net = _Noisy()
    auto, graph = (poptorch.inferenceModel(
        net, poptorch.Options().deviceIterations(2).randomSeed(7)
        .setBackend(backend)) for backend in ("auto", "graph"))
    x = torch.randn(8, 6)
    torch.testing.assert_close(auto(x), graph(x), atol=1e-5, rtol=1e-4)
    start = time.monotonic()
    calls = 0
    while not _tiers(auto).on_fast_tier or calls < 3:
        assert time.monotonic() - start < 240, "no tier-up"
        if _compiling(auto):
            time.sleep(0.2)
            continue
        torch.testing.assert_close(auto(x), graph(x), atol=1e-5, rtol=1e-4)
        calls = calls + 1 if _tiers(auto).on_fast_tier else 0
    assert isinstance(_tiers(auto)._steps["inference"].current,
                      InductorStep)


class _Elementwise(torch.nn.Module):
    def forward(self, x):
        return (x.sin() * 2 + 1).relu()


@pytest.mark.slow
def test_background_kernels_are_generated_for_the_processs_threads(
        tmp_path, monkeypatch):
    """The worker runs on one thread, but the kernels it generates run in
    this process: their parallel loops are for this process's threads."""
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = poptorch.inferenceModel(_Elementwise())
        x = torch.randn(512, 1024)
        torch.testing.assert_close(model(x), _Elementwise()(x))
        start = time.monotonic()
        while not _tiers(model).on_fast_tier:
            assert time.monotonic() - start < 240, "no tier-up"
            torch.testing.assert_close(model(x), _Elementwise()(x))
            time.sleep(0.2)
        torch.testing.assert_close(model(x), _Elementwise()(x))
        assert torch.get_num_threads() == 2      # the lent thread is back
    finally:
        torch.set_num_threads(threads)
    kernels = [path.read_text() for path in tmp_path.rglob("*.cpp")]
    assert any("#pragma omp parallel num_threads(2)" in text
               for text in kernels)
    assert not any("num_threads(1)" in text for text in kernels)


def test_a_model_dropped_while_compiling_stops_its_worker(tmp_path,
                                                          monkeypatch):
    """Without destroy(): the worker ends and the lent thread comes
    back."""
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "0")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tier_up, "lends_a_thread", lambda: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = poptorch.inferenceModel(torch.nn.Linear(6, 3))
        model(torch.randn(2, 6))
        worker = _tiers(model)._compile._process
        assert torch.get_num_threads() == 1
        del model
        gc.collect()
        assert torch.get_num_threads() == 2
        assert worker.poll() is not None
        assert not list(tmp_path.glob("*.compiling"))
    finally:
        torch.set_num_threads(threads)


_EXITING_PROGRAM = """
import sys, time, torch, poptorch
from poptorch._impl.executor import compiled_model
net = torch.nn.Linear(6, 3)
model = poptorch.inferenceModel(net)
for _ in range(3):
    model(torch.randn(2, 6))
worker = compiled_model(model).session.tiers._compile._process
print(worker.pid, flush=True)
time.sleep(2)       # the worker is importing or compiling: exit now
"""


@pytest.mark.slow
def test_exiting_during_a_background_compile_leaves_nothing_behind(
        tmp_path):
    environment = dict(os.environ, POPTORCH_TIER_UP_AFTER="0",
                       POPTORCH_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", _EXITING_PROGRAM],
                            capture_output=True, text=True, timeout=120,
                            env=environment)
    assert result.returncode == 0, result.stderr
    worker = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
    assert not list(tmp_path.glob("*.pexe"))
    assert not list(tmp_path.glob("*.compiling"))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stream:
        return stream.read().split()[2] != "Z"


def test_a_file_exported_by_the_graph_backend_loads_into_an_auto_model(
        tmp_path, monkeypatch):
    """Files of earlier versions, whose default was "graph", still load."""
    monkeypatch.delenv("POPTORCH_BACKEND", raising=False)
    path = tmp_path / "graph.poptorch"
    torch.manual_seed(0)
    net = Net().eval()
    exported = poptorch.inferenceModel(
        net, poptorch.Options().setBackend("graph"))
    x = torch.randn(4, 6)
    exported.compileAndExport(path, x, export_model=False)
    fresh = poptorch.inferenceModel(net)
    fresh.loadExecutable(path)
    assert compiled_model(fresh).session.backend.name == "auto"
    torch.testing.assert_close(fresh(x), net(x))
