"""Timings of the last call (getPerfCounters and the latency getters) and
the compilation progress bar."""
import time

import pytest
import torch

import poptorch
from conftest import ClassifierMLP, make_data, options


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def _model(device_iterations=3, **option_calls):
    torch.manual_seed(0)
    opts = options(device_iterations, **option_calls)
    return poptorch.inferenceModel(Linear(), opts)


def test_perf_counters_describe_the_last_call():
    model = _model()
    x = torch.randn(6, 4)
    before = time.perf_counter()
    model(x)
    after = time.perf_counter()
    counters = model.getPerfCounters()
    assert set(counters) == {"input", "input_complete", "output",
                             "output_complete"}
    assert len(counters["input"]) == 1 and len(counters["output"]) == 1
    for values in counters.values():
        assert all(len(per_tensor) == 3 for per_tensor in values)
    inputs, inputs_done = counters["input"][0], counters["input_complete"][0]
    outputs, outputs_done = counters["output"][0], counters["output_complete"][0]
    for i in range(3):
        assert before <= inputs[i] <= inputs_done[i] <= outputs[i] \
            <= outputs_done[i] <= after
    assert outputs[0] <= outputs[1] <= outputs[2]


def test_latencies_are_min_max_average_of_the_counters():
    model = _model()
    model(torch.randn(6, 4))
    counters = model.getPerfCounters()
    compute = [out - counters["input_complete"][0][i]
               for i, out in enumerate(counters["output"][0])]
    low, high, mean = model.getComputeLatency()
    assert low == pytest.approx(min(compute))
    assert high == pytest.approx(max(compute))
    assert mean == pytest.approx(sum(compute) / 3)
    for getter in (model.getLatency, model.getHostIpuLatency,
                   model.getIpuHostLatency):
        low, high, mean = getter()
        assert 0 <= low <= mean <= high
    round_trip = model.getLatency()[0]
    assert round_trip == pytest.approx(counters["output_complete"][0][0] -
                                       counters["input"][0][0])


def test_training_counters_have_one_value_per_device_iteration():
    torch.manual_seed(0)
    model = poptorch.trainingModel(ClassifierMLP(), options(2, 3))
    model(*make_data(12))
    counters = model.getPerfCounters()
    assert len(counters["input"]) == 2      # x and y
    assert all(len(values) == 2 for values in counters["output"])


def test_timings_need_a_call():
    model = _model()
    for getter in (model.getPerfCounters, model.getLatency,
                   model.getComputeLatency):
        with pytest.raises(poptorch.Error, match="has not run yet"):
            getter()


def test_cycle_count_does_not_exist():
    model = _model()
    model(torch.randn(6, 4))
    with pytest.raises(poptorch.Error, match="no cycle counter"):
        model.cycleCount()


@pytest.mark.parametrize("show", [True, False])
def test_progress_bar_shows_while_compiling(capsys, show):
    model = _model(showCompilationProgressBar=show)
    model(torch.randn(6, 4))
    stderr = capsys.readouterr().err
    assert ("Graph compilation" in stderr) is show
    assert "0stage" not in stderr, "the bar appeared before its total"
