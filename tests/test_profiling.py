"""Profiling (issue 18, docs/profiling.md): the switches, the timeline as
Chrome trace events, the report's memory, Channel tracepoints, several
processes, and nothing recorded when profiling is off."""
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

import poptorch
from distributed_program import Net
from poptorch._impl.profiling import ranges
from poptorch._impl.replication import replicas as replica_paths

PROGRAM = os.path.join(os.path.dirname(__file__), "distributed_program.py")


class TwoStages(Net):
    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            h = torch.relu(self.fc1(x))
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(h)
            return out, torch.nn.functional.cross_entropy(out, y)


def _data(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def _train(options, calls=2, net=None, rows=None):
    """Train ``net`` for ``calls`` calls and destroy the model (which
    writes its files)."""
    net = net or Net()
    model = poptorch.trainingModel(
        net, options, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    layout = (options.device_iterations *
              options.Training.gradient_accumulation *
              options.replication_factor)
    for call in range(calls):
        model(*_data(rows or 2 * layout, seed=call))
    model.destroy()
    return net


def _trace(path):
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def _ranges(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def trace_calls(path):
    return sum(1 for e in _ranges(_trace(path)) if e["name"] == "call")


def _inside(outer, events):
    end = outer["ts"] + outer["dur"]
    return [e for e in events if e["tid"] == outer["tid"] and e is not outer
            and outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end]


def _assert_nested(events):
    """On each track, two ranges are disjoint or one holds the other."""
    tracks = {}
    for event in events:
        tracks.setdefault((event["pid"], event["tid"]), []).append(event)
    for track in tracks.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends = []
        for event in track:
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            end = event["ts"] + event["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, event
            open_ends.append(end)


def test_the_timeline_is_a_chrome_trace_of_nested_ranges(tmp_path):
    options = poptorch.Options().deviceIterations(2).enableProfiling(
        str(tmp_path))
    options.Training.gradientAccumulation(3)
    _train(options, calls=2)
    trace = _trace(tmp_path / "training.trace.json")
    events = _ranges(trace)
    for event in trace["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= set(event)
    for event in events:
        assert event["dur"] >= 0 and event["ts"] > 0
    _assert_nested(events)
    names = Counter(e["name"] for e in events)
    assert names["compile"] == 1 and names["call"] == 2
    compile_range = next(e for e in events if e["name"] == "compile")
    inside = Counter(e["name"] for e in _inside(compile_range, events))
    assert inside["capture"] >= 2 and inside["backend compile"] == 2
    assert inside["weight upload"] == 1
    for call in (e for e in events if e["name"] == "call"):
        inside = Counter(e["name"] for e in _inside(call, events))
        assert inside["host to device"] == 1
        assert inside["device to host"] == 1
        assert inside["device iteration"] == 2
        # D x G micro-batch steps, the last of each iteration's with the
        # optimizer update.
        assert inside["step"] == 2 * 2
        assert inside["step + optimizer update"] == 2
    thread_names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert any(e["args"]["name"] == "main thread" for e in thread_names)


@pytest.mark.parametrize("sequential", [True, False])
def test_step_ranges_count_the_replicas_steps(tmp_path, monkeypatch,
                                              sequential):
    """D x G x R steps per call when replicas run one after another; on the
    vectorised path one step runs the R replicas' micro-batches at once."""
    if sequential:
        monkeypatch.setattr(replica_paths, "_path_for",
                            lambda *args: (replica_paths.SEQUENTIAL, "test"))
    options = poptorch.Options().deviceIterations(2).replicationFactor(2)
    options.Training.gradientAccumulation(2)
    options.enableProfiling(str(tmp_path))
    _train(options, calls=1)
    events = _ranges(_trace(tmp_path / "training.trace.json"))
    call = next(e for e in events if e["name"] == "call")
    steps = [e for e in _inside(call, events) if e["name"].startswith("step")]
    assert len(steps) == 2 * 2 * (2 if sequential else 1)


def test_a_pipeline_shows_each_stage_on_its_track_in_1f1b_order(tmp_path):
    options = poptorch.Options().enableProfiling(str(tmp_path))
    options.Training.gradientAccumulation(4)
    options.setExecutionStrategy(poptorch.PipelinedExecution("A", "B"))
    _train(options, calls=2, net=TwoStages())
    trace = _trace(tmp_path / "training.trace.json")
    events = _ranges(trace)
    _assert_nested(events)
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"]
              if e["ph"] == "M"}
    last_call = [e for e in events if e["name"] == "call"][-1]
    end = last_call["ts"] + last_call["dur"]
    order = {}
    for stage in (0, 1):
        passes = sorted((e for e in events
                         if e["tid"] == tracks[f"stage {stage}"]
                         and last_call["ts"] <= e["ts"] <= end),
                        key=lambda e: e["ts"])
        order[stage] = "".join(e["name"].split()[-1][0].upper()
                               for e in passes)
    # 1F1B over 4 micro-batches: the last stage alternates from the start;
    # the first runs one forward ahead (the pipeline fill), then
    # alternates, then drains.
    assert order[1] == "FBFBFBFB"
    assert order[0] == "FFBFBFBB"
    forwards = sorted((e for e in events if e["name"].endswith("forward")
                       and last_call["ts"] <= e["ts"] <= end),
                      key=lambda e: e["ts"])
    backwards = [e for e in events if e["name"] == "stage 1 backward"
                 and last_call["ts"] <= e["ts"] <= end]
    # Stage 1's first backward runs before stage 0's second forward.
    second_forward_stage0 = [e for e in forwards
                             if e["name"] == "stage 0 forward"][1]
    assert min(e["ts"] for e in backwards) < second_forward_stage0["ts"]
    assert any(e["name"] == "optimizer update" for e in events)


def test_channel_tracepoints_go_on_the_channels_track(tmp_path):
    options = poptorch.Options().enableProfiling(str(tmp_path))
    channel = poptorch.profiling.Channel("loader")
    net = Net()
    model = poptorch.trainingModel(
        net, options, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))

    class Data:
        def batch(self, seed):
            return _data(2, seed)

    data = Data()
    channel.instrument(data, "batch")
    for seed in range(3):
        with channel.tracepoint("prepare"):
            batch = data.batch(seed)
        model(*batch)
    model.destroy()
    trace = _trace(tmp_path / "training.trace.json")
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"]
              if e["ph"] == "M"}
    events = _ranges(trace)
    names = Counter(e["name"] for e in events
                    if e["tid"] == tracks["channel loader"])
    assert names == {"loader.prepare": 3, "loader.batch": 3}
    assert all(e["cat"] == "channel" for e in events
               if e["name"].startswith("loader."))


def test_the_reports_parameter_memory_is_the_parameters_size(tmp_path):
    options = poptorch.Options().enableProfiling(str(tmp_path))
    net = _train(options, calls=2, net=Net())
    with open(tmp_path / "training.report.json", encoding="utf-8") as stream:
        report = json.load(stream)
    parameter_bytes = sum(p.numel() * p.element_size()
                          for p in net.parameters())
    stages = report["memory"]["stages"]
    assert sum(s["parameter_bytes"] for s in stages) == parameter_bytes
    # SGD without momentum keeps no state.
    assert sum(s["optimizer_state_bytes"] for s in stages) == 0
    assert (tmp_path / "training.summary.md").exists()


def test_profiling_off_records_nothing_and_a_users_profiler_sees_the_ranges(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for variable in ("POPLAR_ENGINE_OPTIONS", "PVTI_OPTIONS"):
        monkeypatch.delenv(variable, raising=False)
    net = Net()
    model = poptorch.trainingModel(
        net, poptorch.Options(),
        optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    model(*_data(2))
    assert ranges.profile_range("call") is ranges.profile_range("step")
    with torch.profiler.profile() as profiler:
        model(*_data(2, seed=1))
    names = {event.name for event in profiler.events()}
    assert {"call", "step + optimizer update"} <= names
    model.destroy()
    assert os.listdir(tmp_path) == []


def test_the_environment_switches_choose_the_files(tmp_path, monkeypatch,
                                                   poptorch_log):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps(
        {"autoReport.all": "true", "autoReport.directory": str(tmp_path),
         "opt.internalExchangeOptimisationTarget": "cycles"}))
    _train(poptorch.Options().modelName("report_only"), calls=1)
    assert (tmp_path / "report_only.report.json").exists()
    assert not (tmp_path / "report_only.trace.json").exists()
    assert "opt.internalExchangeOptimisationTarget have no effect" in \
        poptorch_log.text
    monkeypatch.delenv("POPLAR_ENGINE_OPTIONS")
    monkeypatch.setenv("PVTI_OPTIONS", json.dumps(
        {"enable": "true", "directory": str(tmp_path)}))
    _train(poptorch.Options().modelName("timeline_only"), calls=1)
    assert (tmp_path / "timeline_only.trace.json").exists()
    assert not (tmp_path / "timeline_only.report.json").exists()
    monkeypatch.setenv("PVTI_OPTIONS", "{not json")
    _train(poptorch.Options().modelName("neither"), calls=1)
    assert "PVTI_OPTIONS is not valid JSON" in poptorch_log.text
    assert not list(tmp_path.glob("neither*"))


@pytest.mark.slow
def test_two_processes_write_two_files_that_the_summary_merges(tmp_path):
    profile = tmp_path / "profile"
    environment = dict(os.environ, PVTI_OPTIONS=json.dumps(
        {"enable": "true", "directory": str(profile)}),
        POPLAR_ENGINE_OPTIONS=json.dumps({"autoReport.all": "true"}))
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "2", PROGRAM, str(tmp_path), "--popdist"],
        capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        trace = _trace(profile / f"training.rank{rank}.trace.json")
        names = Counter(e["name"] for e in _ranges(trace))
        assert names["call"] == names["step + optimizer update"] > 0
        assert names["all-reduce"] > 0 and names["all-reduce wait"] > 0
    summary = subprocess.run(
        [sys.executable, "-m", "poptorch.profiling", str(profile)],
        capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "Model 'training'" in summary.stdout
    assert "rank 0 (pid" in summary.stdout and "rank 1 (pid" in summary.stdout
    calls = [trace_calls(profile / f"training.rank{rank}.trace.json")
             for rank in (0, 1)]
    assert re.search(rf"calls:\s+{sum(calls)}\n", summary.stdout)


@pytest.mark.slow
def test_compilation_shows_the_executable_cache_miss_then_hit(tmp_path):
    for attempt in ("first", "second"):
        options = poptorch.Options().enableProfiling(str(tmp_path))
        options.enableExecutableCaching(str(tmp_path / "cache"))
        options.setBackend("inductor").modelName(attempt)
        _train(options, calls=1)
    first = Counter(e["name"] for e in _ranges(
        _trace(tmp_path / "first.trace.json")))
    second = Counter(e["name"] for e in _ranges(
        _trace(tmp_path / "second.trace.json")))
    # One compiled step (the update step: no gradient accumulation).
    assert first["backend compile"] == second["backend compile"] == 1
    assert first["executable cache miss"] == 1
    assert first["executable cache hit"] == 0
    assert second["executable cache hit"] == 1
    assert second["executable cache miss"] == 0


def test_a_model_that_is_not_profiled_stays_out_of_the_timeline(tmp_path):
    net = Net()
    profiled = poptorch.trainingModel(
        net, poptorch.Options().enableProfiling(str(tmp_path)),
        optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    validation = poptorch.inferenceModel(Net())
    x, y = _data(2)
    for _ in range(2):
        profiled(x, y)
        validation(x, y)
        validation(x, y)
    profiled.destroy()
    events = _ranges(_trace(tmp_path / "training.trace.json"))
    names = Counter(e["name"] for e in events)
    assert names["call"] == 2 and names["compile"] == 1
    assert names["step"] == 0


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync,
                                  poptorch.DataLoaderMode.Async])
def test_waits_for_data_are_ranges_between_calls(tmp_path, mode):
    options = poptorch.Options().deviceIterations(2).enableProfiling(
        str(tmp_path))
    loader = poptorch.DataLoader(
        options, torch.utils.data.TensorDataset(*_data(16)), batch_size=2,
        mode=mode)
    net = Net()
    model = poptorch.trainingModel(
        net, options, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in loader:
        model(x, y)
    model.destroy()
    if mode == poptorch.DataLoaderMode.Async:
        loader.terminate()
    events = _ranges(_trace(tmp_path / "training.trace.json"))
    waits = [e for e in events if e["name"] == "wait for data"]
    calls = [e for e in events if e["name"] == "call"]
    assert len(calls) == 4 and len(waits) >= 4
    assert not any(_inside(call, waits) for call in calls)
