"""The profiling report (issue 18): facts of captured steps, the report's
JSON, Markdown and SVG from hand-built trace events, and the summary of a
directory (``python -m poptorch.profiling DIR``)."""
import contextlib
import io
import json
import runpy
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

import poptorch
from poptorch._impl.compile_session import CompileSession
from poptorch._impl.profiling.facts import StepFacts, step_facts
from poptorch._impl.profiling.report import format_seconds, write_report

SVG = "{http://www.w3.org/2000/svg}"
MAIN, STAGE0, STAGE1, CHANNEL = 7, 1 << 30, (1 << 30) + 1, 1 << 31


# --- facts of captured steps ---------------------------------------------

class LinearNet(torch.nn.Module):
    def __init__(self, features, outputs):
        super().__init__()
        self.fc = torch.nn.Linear(features, outputs)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


class TwoLayerNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def captured_steps(monkeypatch, model, x, y):
    """The graphs the session compiles, by step name, for one training call
    with 2 device iterations."""
    graphs = {}
    compile_step = CompileSession.compile

    def grab(self, name, graph, donation=None):
        graphs[name] = graph
        return compile_step(self, name, graph, donation)

    monkeypatch.setattr(CompileSession, "compile", grab)
    opts = poptorch.Options().deviceIterations(2)
    training = poptorch.trainingModel(
        model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    training(x, y)
    return graphs


def test_flops_and_operators_of_an_update_step(monkeypatch):
    features, outputs, micro_batch = 3, 2, 4
    graphs = captured_steps(monkeypatch, LinearNet(features, outputs),
                            torch.randn(2 * micro_batch, features),
                            torch.randn(2 * micro_batch, outputs))
    facts = step_facts(graphs["update"])
    # Forward: addmm of [S, in] x [in, out], 2*S*in*out. Backward: the
    # weight gradient mm of [out, S] x [S, in], 2*S*in*out again. The input
    # needs no gradient (a placeholder without requires_grad), so there is
    # no input-gradient mm; the bias gradient (a sum), the loss and SGD's
    # _foreach updates count no FLOPs in FlopCounterMode.
    assert facts.flops == 2 * (2 * micro_batch * features * outputs)
    assert facts.operators["aten.addmm.default"] == 1
    assert facts.operators["aten.mm.default"] == 1
    assert not any(name.endswith("getitem") for name in facts.operators)


def test_saved_activation_bytes_of_a_two_layer_model(monkeypatch):
    micro_batch = 5
    graphs = captured_steps(monkeypatch, TwoLayerNet(),
                            torch.randn(2 * micro_batch, 4),
                            torch.randn(2 * micro_batch, 3))
    facts = step_facts(graphs["update"])
    # Forward tensors the backward pass reads (float32, 4 bytes each):
    # - relu's output [S, 8]: fc2's weight gradient and relu's backward
    #   (threshold_backward) read it;
    # - fc2's output [S, 3]: mse_loss_backward reads it;
    # - the loss (a scalar): the backward pass starts from ones_like(loss).
    # fc1's output is not read (relu's backward reads relu's output), the
    # input x is a placeholder (not an activation) and fc2's transposed
    # weight is a view of a parameter: none of them count.
    expected = 4 * (micro_batch * 8 + micro_batch * 3 + 1)
    assert facts.saved_activation_bytes == expected
    assert facts.flops > 0


def test_inference_steps_save_no_activations():
    def forward(x, weight):
        return torch.relu(x @ weight)

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    with FakeTensorMode() as mode:
        graph = make_fx(forward)(torch.empty(2, 3), torch.empty(3, 4))
    assert mode is not None
    facts = step_facts(graph)
    assert facts.saved_activation_bytes == 0
    assert facts.flops == 2 * 2 * 3 * 4
    assert facts.operators == {"aten.mm.default": 1,
                               "aten.relu.default": 1}


def test_flops_unknown_without_fake_values():
    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    assert step_facts(graph).flops is None


# --- the report from hand-built events -------------------------------------

def complete(name, start, end, tid=MAIN, cat="poptorch"):
    return {"ph": "X", "name": name, "cat": cat, "ts": float(start),
            "dur": float(end - start), "pid": 11, "tid": tid, "args": {}}


def thread_name(tid, name):
    return {"ph": "M", "name": "thread_name", "pid": 11, "tid": tid,
            "args": {"name": name}}


def call_events(start):
    """One call of 1000 µs: 100 host to device, two steps (300 + 350),
    an all-reduce overlapping the second step by 50, 50 device to host."""
    return [complete("call", start, start + 1000),
            complete("host to device", start, start + 100),
            complete("device iteration", start + 100, start + 800),
            complete("step", start + 100, start + 400),
            complete("step + optimizer update", start + 400, start + 750),
            complete("all-reduce", start + 700, start + 850),
            complete("device to host", start + 850, start + 900),
            complete("aten::mm", start + 150, start + 160, cat="cpu_op")]


def training_events(calls=2):
    events = [thread_name(MAIN, "main thread"),
              thread_name(CHANNEL, "channel MyApp"),
              complete("compile", 0, 1000),
              complete("capture", 0, 300),
              complete("backend compile", 300, 500),
              complete("executable cache miss", 300, 350),
              complete("backend compile", 500, 800),
              complete("executable cache hit", 500, 510),
              complete("weight upload", 800, 900),
              complete("MyApp.load", 1000, 1050, CHANNEL, "channel")]
    for index in range(calls):
        start = 1100 + 1200 * index
        events.append(complete("wait for data", start - 100, start))
        events += call_events(start)
    events.append(complete("wait for data", 1110, 1120))  # inside a call
    return events


def model_info(training=True, micro_batch=4):
    return {"name": "net", "training": training, "backend": "graph",
            "device": "cpu",
            "layout": {"device_iterations": 2, "gradient_accumulation": 1,
                       "replicas": 1, "micro_batch_size": micro_batch},
            "process": {"rank": 0, "world_size": 1, "pid": 11}}


MEMORY = [{"stage": 0, "parameter_bytes": 1000, "optimizer_state_bytes": 0,
           "saved_activation_bytes": 300},
          {"stage": 1, "parameter_bytes": 2000, "optimizer_state_bytes": 24,
           "saved_activation_bytes": 100}]


def steps_facts():
    return {"update": StepFacts({"aten.addmm.default": 2, "aten.t.default":
                                 3}, 100, 64),
            "accumulate": StepFacts({"aten.addmm.default": 2}, 40, 64)}


def write(tmp_path, events, model=None, steps=None, stem="net"):
    paths = write_report(str(tmp_path), stem, model or model_info(),
                         steps or steps_facts(), MEMORY, events)
    with open(paths["report"], encoding="utf-8") as file:
        return paths, json.load(file)


def test_report_numbers(tmp_path):
    paths, report = write(tmp_path, training_events())
    assert sorted(paths) == ["report", "summary", "timeline"]
    compiled = report["compile"]
    assert compiled["count"] == 1
    assert compiled["seconds"] == pytest.approx(1000e-6)
    assert compiled["phases_seconds"] == pytest.approx({
        "capture": 300e-6, "backend compile": 500e-6,
        "executable cache miss": 50e-6, "executable cache hit": 10e-6,
        "weight upload": 100e-6})
    assert (compiled["cache_hits"], compiled["cache_misses"]) == (1, 1)
    calls = report["calls"]
    assert calls["count"] == 2
    assert calls["seconds"] == pytest.approx(2000e-6)
    assert calls["mean_seconds"] == pytest.approx(1000e-6)
    assert report["samples_per_call"] == 8  # D=2 × G=1 × R=1 × S=4
    assert calls["samples"] == 16
    assert calls["samples_per_second"] == pytest.approx(16 / 2000e-6)
    # Per call: all-reduce 700..850 first (150), host to device 100,
    # device to host 50, steps 100..700 (the all-reduce took 700..750),
    # other: 1000 - 900.
    assert calls["breakdown_seconds"] == pytest.approx({
        "all_reduce": 300e-6, "host_to_device": 200e-6,
        "device_to_host": 100e-6, "optimizer_update": 0.0,
        "steps": 1200e-6, "other": 200e-6})
    # The waits before each call (100 µs); the one inside a call is not.
    assert calls["wait_for_data_seconds"] == pytest.approx(200e-6)


def test_report_flops_and_memory(tmp_path):
    _, report = write(tmp_path, training_events())
    assert report["flops_per_step"] == {"update": 100, "accumulate": 40}
    # One "step" (accumulate) and one "step + optimizer update" per call.
    assert report["flops_per_call"] == 140
    assert report["flops_per_second"] == pytest.approx(280 / 2000e-6)
    assert report["operators"]["update"]["aten.t.default"] == 3
    assert report["memory"]["total"] == {
        "parameter_bytes": 3000, "optimizer_state_bytes": 24,
        "saved_activation_bytes": 400, "total_bytes": 3424}
    assert report["memory"]["stages"][1]["total_bytes"] == 2124


def test_staged_calls_count_overlapping_stages_once(tmp_path):
    events = [complete("call", 0, 1000),
              complete("stage 0 forward", 100, 400, STAGE0),
              complete("stage 1 forward", 300, 600, STAGE1),
              complete("stage 1 backward", 600, 800, STAGE1),
              complete("stage 0 backward", 800, 900, STAGE0),
              complete("optimizer update", 900, 950)]
    steps = {"stage 0 forward": StepFacts({}, 10, 0),
             "stage 1 forward": StepFacts({}, 20, 0)}
    _, report = write(tmp_path, events, steps=steps)
    breakdown = report["calls"]["breakdown_seconds"]
    assert breakdown["steps"] == pytest.approx(800e-6)
    assert breakdown["optimizer_update"] == pytest.approx(50e-6)
    assert breakdown["other"] == pytest.approx(150e-6)
    # The backward stages run no captured step: FLOPs per call unknown.
    assert report["flops_per_call"] is None


def test_report_round_trips_and_files_are_complete(tmp_path):
    paths, report = write(tmp_path, training_events())
    with open(paths["report"], encoding="utf-8") as file:
        assert file.read() == json.dumps(report, indent=2) + "\n"
    assert report["model"] == model_info()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] \
        == []  # no temporary file left
    with open(paths["summary"], encoding="utf-8") as file:
        summary = file.read()
    for section in ("# Profile of `net`", "## Compilation",
                    "## Where a call's time went", "## Throughput",
                    "## Memory per stage", "## FLOPs",
                    "## Top 10 operators", "(net.timeline.svg)",
                    "`aten.addmm.default`"):
        assert section in summary


def svg_panels(path):
    """The picture's panels (``<g class="panel">``) by id."""
    root = ElementTree.parse(path).getroot()
    return {group.get("id"): group for group in root.iter(f"{SVG}g")
            if group.get("class") == "panel"}


def svg_ranges(path, panel="overview"):
    return [rect for rect in svg_panels(path)[panel].iter(f"{SVG}rect")
            if rect.get("class") == "range"]


def svg_texts(element):
    return [text.text for text in element.iter(f"{SVG}text")]


def test_timeline_has_one_rect_per_range(tmp_path):
    events = training_events()
    paths, _ = write(tmp_path, events)
    shown = [e for e in events if e["ph"] == "X" and e["cat"] != "cpu_op"]
    assert len(svg_ranges(paths["timeline"])) == len(shown)
    labels = svg_texts(svg_panels(paths["timeline"])["overview"])
    assert "main thread" in labels and "channel MyApp" in labels
    assert "0 ms" in labels


def test_timeline_window_ends_after_the_third_call(tmp_path):
    events = training_events(calls=5)
    paths, report = write(tmp_path, events)
    assert report["calls"]["count"] == 5
    third_call_end = 1100 + 1200 * 2 + 1000
    shown = [e for e in events if e["ph"] == "X" and e["cat"] != "cpu_op"
             and e["ts"] < third_call_end]
    assert len(svg_ranges(paths["timeline"])) == len(shown)


def staged_last_call_events(calls=5):
    """``training_events`` with pipeline stages in the last call (the last
    one ending after the call), one in the call before it and a channel
    range around the last call; the last call's start."""
    last = 1100 + 1200 * (calls - 1)
    events = training_events(calls) + [
        complete("stage 0 forward", last - 1100, last - 1000, STAGE0),
        complete("MyApp.epoch", last - 50, last + 1050, CHANNEL, "channel"),
        complete("stage 0 forward", last + 100, last + 400, STAGE0),
        complete("stage 1 forward", last + 300, last + 600, STAGE1),
        complete("stage 1 backward", last + 600, last + 800, STAGE1),
        complete("stage 0 backward", last + 800, last + 1100, STAGE0),
        thread_name(STAGE0, "stage 0"), thread_name(STAGE1, "stage 1")]
    return events, last


def test_timeline_zooms_in_on_the_last_call(tmp_path):
    events, last = staged_last_call_events(calls=5)
    paths, _ = write(tmp_path, events)
    # The call and the ranges that start in it, on every track, clipped
    # to it; not the channel range that starts before it.
    expected = {e["name"]: (e["ts"] - last,
                            min(e["ts"] + e["dur"], last + 1000) - last)
                for e in events if e["ph"] == "X" and e["cat"] != "cpu_op"
                and last <= e["ts"] < last + 1000}
    assert len(expected) == 11
    rects = svg_ranges(paths["timeline"], "last-call")
    assert len(rects) == len(expected)
    # The call (1000 µs) spans the 1000 px plot right of the 160 px labels:
    # one pixel per µs from the call's start.
    for rect in rects:
        name = rect.find(f"{SVG}title").text.split(": ")[0]
        start, end = expected.pop(name)
        assert float(rect.get("x")) == pytest.approx(160 + start)
        assert float(rect.get("width")) == pytest.approx(end - start)
    assert expected == {}
    by_name = {rect.find(f"{SVG}title").text.split(": ")[0]: rect
               for rect in rects}
    assert float(by_name["call"].get("x")) == 160
    assert float(by_name["call"].get("width")) == 1000
    assert float(by_name["host to device"].get("x")) == 160
    # Nested ranges on sub-rows, stage tracks under the main thread.
    assert (float(by_name["step"].get("y"))
            == float(by_name["device iteration"].get("y")) + 14
            == float(by_name["call"].get("y")) + 28)
    assert (float(by_name["call"].get("y"))
            < float(by_name["stage 0 forward"].get("y"))
            < float(by_name["stage 1 forward"].get("y")))
    labels = svg_texts(svg_panels(paths["timeline"])["last-call"])
    assert labels[0] == "last call (5 of 5), 1 ms"
    assert {"main thread", "stage 0", "stage 1", "0 ms", "1 ms"} <= set(
        labels)
    assert "channel MyApp" not in labels


def test_timeline_panels_and_legend_stack_in_the_picture(tmp_path):
    events, _ = staged_last_call_events(calls=5)
    paths, _ = write(tmp_path, events)
    root = ElementTree.parse(paths["timeline"]).getroot()

    def heights(rects):
        return [float(r.get("y")) for r in rects], [
            float(r.get("y")) + float(r.get("height")) for r in rects]

    overview_tops, overview_bottoms = heights(svg_ranges(paths["timeline"]))
    zoom_tops, zoom_bottoms = heights(
        svg_ranges(paths["timeline"], "last-call"))
    legend = [rect for rect in root.iter(f"{SVG}rect")
              if rect.get("class") == "legend"]
    legend_tops, legend_bottoms = heights(legend)
    assert max(overview_bottoms) < min(zoom_tops)
    assert max(zoom_bottoms) < min(legend_tops)
    assert max(legend_bottoms) < float(root.get("height"))
    # The legend names the kinds of both panels (the stages are only in
    # the last call).
    assert {"stage forward", "stage backward", "compile"} <= set(
        svg_texts(root))


def test_timeline_without_calls_has_one_panel(tmp_path):
    paths, _ = write(tmp_path, training_events(calls=0))
    assert list(svg_panels(paths["timeline"])) == ["overview"]


def test_report_before_the_micro_batch_size_is_known(tmp_path):
    _, report = write(tmp_path, training_events(calls=0),
                      model=model_info(micro_batch=None))
    assert report["samples_per_call"] is None
    assert report["calls"]["count"] == 0
    assert report["calls"]["samples_per_second"] is None
    assert report["flops_per_call"] is None


# --- python -m poptorch.profiling DIR --------------------------------------

def two_process_reports(tmp_path):
    for rank, pid in ((0, 101), (1, 102)):
        model = model_info()
        model["process"] = {"rank": rank, "world_size": 2, "pid": pid}
        events = training_events(calls=2 + rank)
        if rank == 1:  # a slower compilation
            events.append(complete("compile", 10000, 13000))
        write(tmp_path, events, model=model, stem=f"net.rank{rank}")


def run_module(directory):
    """``python -m poptorch.profiling DIR`` in this process: (exit status,
    stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["poptorch.profiling", str(directory)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_module("poptorch.profiling", run_name="__main__",
                                 alter_sys=True)
    finally:
        sys.argv = argv
    return exit_info.value.code, out.getvalue(), err.getvalue()


def test_summary_merges_processes(tmp_path):
    two_process_reports(tmp_path)
    code, out, _ = run_module(tmp_path)
    assert code == 0
    assert "2 report(s), 1 model(s)" in out
    assert "Model 'net' (training, backend graph, device cpu)" in out
    assert "rank 0 (pid 101), rank 1 (pid 102) of 2" in out
    assert "calls:       5" in out          # 2 + 3
    assert "samples:     40" in out         # 8 per call × 5
    # Each process: 8 samples per call over 1 ms calls, 8000 samples/s.
    assert "samples/s:   16000.0 (summed over processes)" in out
    assert "compile:     4 ms (slowest process)" in out   # 1 ms + 3 ms
    assert "steps 60.0%" in out
    assert out.count("3.34 KiB (parameters") == 2


def test_summary_of_a_directory_without_reports(tmp_path):
    code, out, err = run_module(tmp_path)
    assert code == 2
    assert out == ""
    assert "No profiling reports" in err and str(tmp_path) in err


@pytest.mark.slow
def test_summary_command_in_a_subprocess(tmp_path):
    two_process_reports(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "poptorch.profiling", str(tmp_path)],
        capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "rank 0 (pid 101), rank 1 (pid 102) of 2" in done.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "poptorch.profiling", str(empty)],
        capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "No profiling reports" in done.stderr


def test_durations_round_into_the_next_unit():
    assert format_seconds(0.9995) == "1 s"
    assert format_seconds(0.0009996) == "1 ms"
    assert format_seconds(0.25) == "250 ms"
    assert format_seconds(2e-7) == "0.2 µs"
