"""When an "auto" model tiers up (tiering/threshold.py): a fixed
POPTORCH_TIER_UP_AFTER, or a probe of the model's first calls that runs
every other call on one intra-op thread fewer and waits in proportion to
what the loop loses without that thread."""
import pytest
import torch

import poptorch
from poptorch._impl import intra_op_threads
from poptorch._impl.backends import get_backend
from poptorch._impl.backends.inductor import kernel_threads
from poptorch._impl.executor import compiled_model
from poptorch._impl.tiering import threshold


class _Threads:
    """torch's intra-op thread setting, recorded."""

    def __init__(self, monkeypatch, threads=2):
        self.value = threads
        self.set = []
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.value)
        monkeypatch.setattr(torch, "set_num_threads", self._set)

    def _set(self, value):
        self.set.append(value)
        self.value = value


@pytest.fixture(name="probing")
def _probing(monkeypatch):
    monkeypatch.delenv(threshold.TIER_UP_VARIABLE, raising=False)
    monkeypatch.setattr(threshold, "lends_a_thread", lambda: True)
    return _Threads(monkeypatch)


def _run(rule, durations):
    """Calls of the given durations: the threads each one ran on."""
    seen = []
    for seconds in durations:
        rule.before_call()
        seen.append(torch.get_num_threads())
        rule.after_call(seconds, True)
        assert torch.get_num_threads() == 2      # given back between calls
    return seen


def test_the_probe_alternates_threads_and_waits_for_the_compile_cost(
        probing):
    rule = threshold.TierUpThreshold()
    assert rule.seconds is None and not rule.reached(1e9)
    # The first call (capture) is not measured; then one thread fewer is
    # 40 % slower: 0.7 s against 0.5 s.
    seen = _run(rule, [5.0, 0.7, 0.5, 0.7, 0.5, 0.7])
    assert seen == [2, 1, 2, 1, 2, 1]
    assert rule.seconds is None                   # two calls on all threads
    seen = _run(rule, [0.5, 0.6])
    assert seen == [2, 2]                         # the probe has ended
    loss = 0.7 / 0.5 - 1
    assert rule.seconds == pytest.approx(
        loss * threshold.EXPECTED_COMPILE_SECONDS)
    assert not rule.reached(rule.seconds - 0.01) and rule.reached(rule.seconds)


def test_a_loop_that_loses_nothing_tiers_up_after_the_minimum(probing):
    rule = threshold.TierUpThreshold()
    _run(rule, [3.0] + [0.2, 0.21] * 5)
    assert rule.seconds == threshold.MINIMUM_SECONDS


def test_the_probe_lasts_its_shortest_length(probing):
    rule = threshold.TierUpThreshold()
    _run(rule, [1.0] + [0.01] * 20)
    assert rule.seconds is None                   # 0.2 s of calls so far
    _run(rule, [0.01] * 180)
    assert rule.seconds == threshold.MINIMUM_SECONDS


def test_an_outlier_cannot_postpone_the_tier_up_for_long(probing):
    rule = threshold.TierUpThreshold()
    _run(rule, [1.0] + [30.0, 0.1] * 3)
    assert rule.seconds == 2.0 * threshold.EXPECTED_COMPILE_SECONDS


def test_a_failed_call_gives_the_thread_back_and_is_not_measured(probing):
    rule = threshold.TierUpThreshold()
    _run(rule, [1.0])
    rule.before_call()
    assert torch.get_num_threads() == 1
    rule.after_call(100.0, False)                 # the call raised
    assert torch.get_num_threads() == 2
    _run(rule, [0.5, 0.5] * 3)
    assert rule.seconds == threshold.MINIMUM_SECONDS


def test_a_fixed_threshold_runs_no_probe(probing, monkeypatch):
    monkeypatch.setenv(threshold.TIER_UP_VARIABLE, "7.5")
    rule = threshold.TierUpThreshold()
    assert _run(rule, [1.0] * 6) == [2] * 6 and probing.set == []
    assert rule.seconds == 7.5


def test_a_process_that_lends_no_thread_waits_the_fallback(probing,
                                                           monkeypatch):
    monkeypatch.setattr(threshold, "lends_a_thread", lambda: False)
    rule = threshold.TierUpThreshold()
    assert _run(rule, [1.0] * 6) == [2] * 6 and probing.set == []
    assert rule.seconds == threshold.FALLBACK_SECONDS


def test_a_model_probes_its_calls_and_trains_like_the_graph_backend(
        monkeypatch):
    """A real auto model with the probe (and a threshold it does not
    reach): every other call on one thread fewer, the threads given back
    between calls, the results a graph-backend model's."""
    monkeypatch.delenv(threshold.TIER_UP_VARIABLE, raising=False)
    monkeypatch.setattr(threshold, "lends_a_thread", lambda: True)
    monkeypatch.setattr(threshold, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(threshold, "MINIMUM_SECONDS", 3600.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        _probe_a_model(monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _probe_a_model(monkeypatch):
    seen = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads",
                        lambda value: (seen.append(value), original(value)))
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    models = []
    for net, backend in zip(nets, ["auto", "graph"]):
        options = poptorch.Options().setBackend(backend)
        models.append(poptorch.trainingModel(
            _WithLoss(net), options, optimizer=poptorch.optim.SGD(
                net.parameters(), lr=0.1)))
    base = torch.get_num_threads()
    for seed in range(8):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 4, generator=generator)
        torch.testing.assert_close(models[0](x), models[1](x))
    assert seen[:4] == [base - 1, base, base - 1, base]
    rule = compiled_model(models[0]).session.tiers._threshold
    assert rule.seconds == 3600.0
    assert len(seen) == 6                         # three calls on one fewer
    torch.testing.assert_close(nets[0].weight, nets[1].weight)


class _WithLoss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return poptorch.identity_loss(self.net(x).square().mean(),
                                      reduction="none")


def test_lent_threads_change_neither_the_kernels_nor_their_cache_keys():
    """Inductor's kernels, and the executable cache keys, are for the
    process's own threads, those lent to a worker or a probe call
    included; a thread count the user sets is a new key."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inductor = get_backend("inductor")
        before = inductor.settings_fingerprint()
        assert kernel_threads() == 2
        assert intra_op_threads.lend_one()
        assert torch.get_num_threads() == 1
        assert kernel_threads() == 2
        assert inductor.settings_fingerprint() == before
        assert not intra_op_threads.lend_one()      # the last one stays
        intra_op_threads.give_back_one()
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert kernel_threads() == 1
        assert inductor.settings_fingerprint() != before
    finally:
        torch.set_num_threads(threads)
