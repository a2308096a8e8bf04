"""A profiled model's report: ``<stem>.report.json`` (the numbers),
``<stem>.summary.md`` (one page to read) and ``<stem>.timeline.svg`` (a
picture of the start of the timeline and of the last call), written from
the model's Chrome trace events and the facts of its captured steps
(``facts.py``).

The JSON object's keys: ``schema`` (``SCHEMA``), ``model`` (as given),
``samples_per_call``, ``compile``, ``calls``, ``flops_per_step``,
``flops_per_call``, ``flops_per_second``, ``operators`` (per step, the
operator counts of ``facts.py``), ``saved_activation_bytes_per_step`` and
``memory``. Times come from the trace's complete events (``"ph": "X"``),
in seconds; torch operator events (``"cat": "cpu_op"``) are left out.

* ``samples_per_call``: D × G × R × S of the model's layout (null, and so
  are the numbers of samples, before a call has shown S).
* ``compile``: ``count`` and ``seconds``, the number and summed durations
  of the ``"compile"`` ranges; ``phases_seconds``: per range name, the
  summed durations of the ranges inside a ``"compile"`` range (on its
  thread, at any depth). Phases may nest, so they need not add up to the
  total; ``capture``, ``partition into stages``, ``backend compile``, the
  cache's and ``weight upload`` come first, other names after them.
  ``cache_hits`` / ``cache_misses``: the ``"executable cache hit"`` /
  ``"executable cache miss"`` ranges inside compilations.
* ``calls``: the ``"call"`` ranges. ``seconds``: their summed durations;
  ``mean_seconds``: seconds / count; ``samples``: samples per call × count;
  ``samples_per_second``: samples / seconds.
* ``calls.breakdown_seconds``: each call's time, cut into parts summed
  over the calls. A range belongs to the call it starts in (whatever its
  track: a pipeline stage's ranges have tracks of their own), clipped to
  the call. Parts, in order: ``all_reduce`` (``"all-reduce"``,
  ``"all-reduce wait"``), ``host_to_device``, ``device_to_host``,
  ``optimizer_update`` (``"optimizer update"``), ``steps`` (``"step"``,
  ``"step + optimizer update"``, ``"stage k forward"``, ``"stage k
  backward"``); a part is the time covered by its ranges and by no range of
  an earlier part (overlapping ranges, such as stages running at once on
  their tracks, count once), ``other`` the rest of the call. The parts add
  up to the calls' seconds.
* ``calls.wait_for_data_seconds``: the ``"wait for data"`` ranges that do
  not start inside a call (the host waiting for its next batch).
* ``flops_per_step``: each captured step's FLOPs (``facts.py``; null when
  unknown). A step range runs one step: ``"step + optimizer update"`` the
  ``update`` step, ``"step"`` the ``accumulate`` step in training and the
  ``inference`` step otherwise, ``"stage k forward"`` the step of that
  name, ``"optimizer update"`` the ``optimizer`` step. ``flops_per_call``:
  the FLOPs of the step ranges inside calls over the number of calls; null
  when there are none or when one of them runs a step of unknown FLOPs (a
  ``"stage k backward"`` runs no captured step, so staged training has
  none). ``flops_per_second``: those FLOPs over the calls' seconds.
* ``memory``: per pipeline stage, bytes of parameters, optimizer state and
  saved activations, with their ``total_bytes``; ``memory.total`` sums the
  stages.

The timeline picture has two panels, one above the other, and a legend
under them. Each spreads its window over the full width, with one row
per track (thread, pipeline stage, profiling channel) that has ranges in
it and a time axis in ms from the window's start; nested ranges go on
sub-rows by depth, coloured by kind; torch operators are left out (the
Chrome trace has them). The first panel's window runs
from the start of the trace to the end of the third call, or to the end
of the trace when it has three calls or fewer. The second, drawn only
when there are calls, zooms in on the last call: the call and the ranges
that start in it, on any track (its micro-batch steps, its pipeline
stages), clipped to it; its title gives the call's number and duration.
"""
import bisect
import dataclasses
import json
import math
import os
import re
import tempfile
from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence,
                    Tuple)
from xml.sax.saxutils import escape

from .facts import StepFacts

#: The version of the report's JSON layout.
SCHEMA = 1

_STAGE = re.compile(r"stage \d+ (forward|backward)$")
_STEP_NAMES = ("step", "step + optimizer update")
_COMPILE = "compile"
_CALL = "call"
_WAIT_FOR_DATA = "wait for data"
_CACHE = {"cache_hits": "executable cache hit",
          "cache_misses": "executable cache miss"}
_PHASES = ("capture", "partition into stages", "backend compile",
           "executable cache hit", "executable cache miss", "weight upload")
_CALLS_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class _Range:
    """A complete event: times in microseconds."""
    name: str
    category: str
    start: float
    end: float
    track: int

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6


def _is_step(name: str) -> bool:
    return name in _STEP_NAMES or bool(_STAGE.match(name))


#: The parts of a call, earliest first (see the module's docstring).
_PARTS: Tuple[Tuple[str, Callable[[str], bool]], ...] = (
    ("all_reduce", lambda name: name in ("all-reduce", "all-reduce wait")),
    ("host_to_device", lambda name: name == "host to device"),
    ("device_to_host", lambda name: name == "device to host"),
    ("optimizer_update", lambda name: name == "optimizer update"),
    ("steps", _is_step),
)
PART_LABELS = {"all_reduce": "all-reduce", "host_to_device": "host to device",
               "device_to_host": "device to host",
               "optimizer_update": "optimizer update", "steps": "steps",
               "other": "other"}


def write_report(directory: str, stem: str, model: Dict[str, Any],
                 steps: Dict[str, StepFacts], memory: List[Dict[str, Any]],
                 events: List[Dict[str, Any]]) -> Dict[str, str]:
    """Write the model's report, summary and timeline picture into
    ``directory``; their paths by kind (``report``, ``summary``,
    ``timeline``)."""
    os.makedirs(directory, exist_ok=True)
    paths = {kind: os.path.join(directory, f"{stem}.{kind}.{suffix}")
             for kind, suffix in (("report", "json"), ("summary", "md"),
                                  ("timeline", "svg"))}
    ranges = _ranges(events)
    report = build_report(model, steps, memory, ranges)
    write_atomically(paths["report"], json.dumps(report, indent=2) + "\n")
    write_atomically(paths["summary"], markdown_summary(
        report, os.path.basename(paths["timeline"])))
    write_atomically(paths["timeline"], timeline_svg(
        ranges, _track_names(events), report["model"]["name"]))
    return paths


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so that a reader
    never sees half a file; the file is readable by all (0644), as
    profiles are meant to be shared."""
    handle, temporary = tempfile.mkstemp(
        dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _ranges(events: Iterable[Dict[str, Any]]) -> List[_Range]:
    """The complete events other than torch operators, by start time."""
    ranges = [_Range(event["name"], event.get("cat", ""), float(event["ts"]),
                     float(event["ts"]) + float(event["dur"]),
                     event.get("tid", 0))
              for event in events
              if event.get("ph") == "X" and event.get("cat") != "cpu_op"]
    return sorted(ranges, key=lambda r: (r.start, -r.end))


def _track_names(events: Iterable[Dict[str, Any]]) -> Dict[int, str]:
    return {event.get("tid", 0): str(event.get("args", {}).get("name"))
            for event in events
            if event.get("ph") == "M" and event.get("name") == "thread_name"}


# The report's numbers

def build_report(model: Dict[str, Any], steps: Dict[str, StepFacts],
                 memory: List[Dict[str, Any]], ranges: Sequence[_Range]
                 ) -> Dict[str, Any]:
    """The report's JSON object (``ranges`` by start time)."""
    calls = [r for r in ranges if r.name == _CALL]
    in_calls = _inside(calls, ranges, same_track=False)
    samples = samples_per_call(model["layout"])
    flops_per_step = {name: facts.flops for name, facts in steps.items()}
    call_flops = _call_flops(in_calls, flops_per_step, model["training"])
    call_report = _calls(calls, in_calls, ranges, samples)
    return {
        "schema": SCHEMA,
        "model": model,
        "samples_per_call": samples,
        "compile": _compile(ranges),
        "calls": call_report,
        "flops_per_step": flops_per_step,
        "flops_per_call": (None if call_flops is None
                           else call_flops / len(calls)),
        "flops_per_second": _rate(call_flops, call_report["seconds"]),
        "operators": {name: facts.operators for name, facts in steps.items()},
        "saved_activation_bytes_per_step": {
            name: facts.saved_activation_bytes
            for name, facts in steps.items()},
        "memory": _memory(memory),
    }


def samples_per_call(layout: Dict[str, Optional[int]]) -> Optional[int]:
    """D × G × R × S; None before a call has shown S."""
    values = [layout[key] for key in ("device_iterations",
                                      "gradient_accumulation", "replicas",
                                      "micro_batch_size")]
    return None if None in values else math.prod(values)


def _inside(outer: Sequence[_Range], ranges: Sequence[_Range],
            same_track: bool, clip: bool = True) -> List[List[_Range]]:
    """Per range of ``outer`` (by start time), the other ranges that start
    inside it (on its track when ``same_track``), clipped to it when
    ``clip``."""
    starts = [r.start for r in outer]
    inside: List[List[_Range]] = [[] for _ in outer]
    for candidate in ranges:
        index = bisect.bisect_right(starts, candidate.start) - 1
        if index < 0 or candidate is outer[index]:
            continue
        container = outer[index]
        if candidate.start < container.end and (
                not same_track or candidate.track == container.track):
            inside[index].append(dataclasses.replace(
                candidate, end=min(candidate.end, container.end))
                if clip else candidate)
    return inside


def _compile(ranges: Sequence[_Range]) -> Dict[str, Any]:
    compiles = [r for r in ranges if r.name == _COMPILE]
    children = _flatten(_inside(compiles, ranges, same_track=True))
    phases = dict.fromkeys(
        sorted({r.name for r in children}, key=_phase_order), 0.0)
    for child in children:
        phases[child.name] += child.seconds
    counts = {key: sum(1 for r in children if r.name == name)
              for key, name in _CACHE.items()}
    return {"count": len(compiles),
            "seconds": sum(r.seconds for r in compiles),
            "phases_seconds": phases, **counts}


def _phase_order(name: str) -> Tuple[int, str]:
    """The documented phases in their order, then the others by name."""
    return (_PHASES.index(name) if name in _PHASES else len(_PHASES), name)


def _flatten(groups: Iterable[List[_Range]]) -> List[_Range]:
    return [r for group in groups for r in group]


def _calls(calls: Sequence[_Range], in_calls: Sequence[List[_Range]],
           ranges: Sequence[_Range], samples: Optional[int]
           ) -> Dict[str, Any]:
    seconds = sum(call.seconds for call in calls)
    breakdown = dict.fromkeys(PART_LABELS, 0.0)
    for call, inside in zip(calls, in_calls):
        for part, part_seconds in _breakdown(call, inside).items():
            breakdown[part] += part_seconds
    waits = [r for r in ranges if r.name == _WAIT_FOR_DATA]
    waits_in_calls = _flatten(_inside(calls, waits, same_track=False,
                                      clip=False))
    total = None if samples is None else samples * len(calls)
    waiting = (sum(r.seconds for r in waits)
               - sum(r.seconds for r in waits_in_calls))
    return {"count": len(calls), "seconds": seconds,
            "mean_seconds": seconds / len(calls) if calls else None,
            "samples": total,
            "samples_per_second": _rate(total, seconds),
            "breakdown_seconds": breakdown,
            "wait_for_data_seconds": waiting}


def _breakdown(call: _Range, inside: Sequence[_Range]) -> Dict[str, float]:
    """Seconds of each part of one call (see the module's docstring)."""
    covered: List[Tuple[float, float]] = []
    parts: Dict[str, float] = {}
    previous = 0.0
    for part, matches in _PARTS:
        covered += [(r.start, r.end) for r in inside if matches(r.name)]
        length = _union_length(covered)
        parts[part] = (length - previous) / 1e6
        previous = length
    parts["other"] = max(0.0, call.seconds - previous / 1e6)
    return parts


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    """The length covered by ``intervals``."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _step_of_range(name: str, training: bool) -> Optional[str]:
    """The name of the step a range runs (a ``"stage k backward"`` runs
    none: no step has its name); None for ranges that are no step."""
    if name == "step + optimizer update":
        return "update"
    if name == "step":
        return "accumulate" if training else "inference"
    if name == "optimizer update":
        return "optimizer"
    return name if _STAGE.match(name) else None


def _call_flops(in_calls: Sequence[List[_Range]],
                flops: Dict[str, Optional[int]],
                training: bool) -> Optional[int]:
    """FLOPs of the step ranges inside calls; None when unknown."""
    names = [_step_of_range(r.name, training) for r in _flatten(in_calls)]
    names = [name for name in names if name is not None]
    if not names or any(flops.get(name) is None for name in names):
        return None
    return sum(flops[name] for name in names)


def _rate(amount: Optional[float], seconds: float) -> Optional[float]:
    if amount is None or seconds <= 0:
        return None
    return amount / seconds


def _memory(stages: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    keys = ("parameter_bytes", "optimizer_state_bytes",
            "saved_activation_bytes")
    rows = [{**stage, "total_bytes": sum(stage[key] for key in keys)}
            for stage in stages]
    total = {key: sum(row[key] for row in rows)
             for key in keys + ("total_bytes",)}
    return {"stages": rows, "total": total}


# Units

def format_seconds(seconds: Optional[float]) -> str:
    """``seconds`` in s, ms or µs."""
    if seconds is None:
        return "n/a"
    for scale, unit in ((1.0, "s"), (1e-3, "ms")):
        if _rounded(abs(seconds)) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} µs"


def _rounded(value: float) -> float:
    """``value`` to the 3 significant digits the formats show."""
    return float(f"{value:.3g}")


def format_bytes(count: Optional[float]) -> str:
    """``count`` bytes in B, KiB, MiB or GiB."""
    if count is None:
        return "n/a"
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if _rounded(abs(count)) >= 1024 ** power:
            return f"{count / 1024 ** power:.3g} {unit}"
    return f"{int(count)} B"


def format_si(value: Optional[float], unit: str = "") -> str:
    """``value`` with an SI prefix (k, M, G, T, P)."""
    if value is None:
        return "n/a"
    for power, prefix in ((15, "P"), (12, "T"), (9, "G"), (6, "M"),
                          (3, "k")):
        if abs(value) >= 10 ** power:
            return f"{value / 10 ** power:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


# The Markdown summary

def markdown_summary(report: Dict[str, Any], timeline: str) -> str:
    """One page on ``report``; ``timeline``: the picture's file name."""
    sections = [_md_header(report, timeline), _md_compile(report["compile"]),
                _md_call_time(report["calls"]), _md_throughput(report),
                _md_memory(report["memory"]), _md_flops(report),
                _md_operators(report["operators"])]
    return "\n\n".join(sections) + "\n"


def _md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |"
              for row in rows]
    return "\n".join(lines)


def _md_header(report: Dict[str, Any], timeline: str) -> str:
    model = report["model"]
    layout, process = model["layout"], model["process"]
    kind = "Training" if model["training"] else "Inference"
    return (f"# Profile of `{model['name']}`\n\n"
            f"{kind} model, backend `{model['backend']}` on "
            f"`{model['device']}`; process rank {process['rank']} of "
            f"{process['world_size']} (pid {process['pid']}).\n\n"
            f"Layout: {layout['device_iterations']} device iterations × "
            f"{layout['gradient_accumulation']} gradient accumulation × "
            f"{layout['replicas']} replicas × micro-batches of "
            f"{layout['micro_batch_size']} = {report['samples_per_call']} "
            f"samples per call.\n\nTimeline: [{timeline}]({timeline})")


def _md_compile(compiled: Dict[str, Any]) -> str:
    rows = [(name, format_seconds(seconds))
            for name, seconds in compiled["phases_seconds"].items()]
    rows.append(("**total**", format_seconds(compiled["seconds"])))
    return (f"## Compilation\n\n{compiled['count']} compilation(s); "
            f"executable cache: {compiled['cache_hits']} hit(s), "
            f"{compiled['cache_misses']} miss(es).\n\n"
            + _md_table(("Phase", "Time"), rows))


def _md_call_time(calls: Dict[str, Any]) -> str:
    total, count = calls["seconds"], max(calls["count"], 1)
    rows = [(PART_LABELS[part], format_seconds(seconds / count),
             format_seconds(seconds), _percent(seconds, total))
            for part, seconds in calls["breakdown_seconds"].items()]
    rows.append(("**call**", format_seconds(total / count),
                 format_seconds(total), _percent(total, total)))
    return ("## Where a call's time went\n\n"
            + _md_table(("Part", "Per call", f"{calls['count']} calls",
                         "Share"), rows)
            + "\n\nWaiting for data between calls: "
            + format_seconds(calls["wait_for_data_seconds"]) + ".")


def _percent(part: float, total: float) -> str:
    return f"{100.0 * part / total:.1f}%" if total > 0 else "n/a"


def _md_throughput(report: Dict[str, Any]) -> str:
    calls = report["calls"]
    rate = calls["samples_per_second"]
    row = (calls["count"], format_seconds(calls["seconds"]),
           format_seconds(calls["mean_seconds"]), report["samples_per_call"],
           "n/a" if rate is None else f"{rate:.1f}")
    return "## Throughput\n\n" + _md_table(
        ("Calls", "Call time", "Mean call", "Samples per call",
         "Samples per second"), [row])


def _md_memory(memory: Dict[str, Any]) -> str:
    def cells(row):
        return [format_bytes(row[key]) for key in (
            "parameter_bytes", "optimizer_state_bytes",
            "saved_activation_bytes", "total_bytes")]
    rows = [[row["stage"]] + cells(row) for row in memory["stages"]]
    rows.append(["**total**"] + cells(memory["total"]))
    return "## Memory per stage\n\n" + _md_table(
        ("Stage", "Parameters", "Optimizer state", "Saved activations",
         "Total"), rows)


def _md_flops(report: Dict[str, Any]) -> str:
    rows = [(name, format_si(flops, "FLOP"))
            for name, flops in report["flops_per_step"].items()]
    return ("## FLOPs\n\n" + _md_table(("Step", "FLOPs per run"), rows)
            + f"\n\nPer call: {format_si(report['flops_per_call'], 'FLOP')}"
            f"; achieved during calls: "
            f"{format_si(report['flops_per_second'], 'FLOP/s')}.")


def _md_operators(operators: Dict[str, Dict[str, int]]) -> str:
    totals: Dict[str, int] = {}
    for counts in operators.values():
        for name, count in counts.items():
            totals[name] = totals.get(name, 0) + count
    top = sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:10]
    rows = [[f"`{name}`"] + [counts.get(name, 0)
                             for counts in operators.values()] + [total]
            for name, total in top]
    return "## Top 10 operators\n\n" + _md_table(
        ["Operator"] + list(operators) + ["Total"], rows)


# The timeline picture

_LABEL_WIDTH = 160
_PLOT_WIDTH = 1000
_SUB_ROW = 14
_TRACK_GAP = 8
_TOP = 36
_KINDS = (  # kind, colour, matches(range)
    ("compile", "#9e9e9e", lambda r: r.name in (
        "compile", "capture", "partition into stages", "backend compile",
        "executable cache hit", "executable cache miss")),
    ("call", "#90caf9", lambda r: r.name in ("call", "device iteration")),
    ("step", "#1e88e5", lambda r: r.name in _STEP_NAMES),
    ("stage forward", "#43a047", lambda r: bool(
        _STAGE.match(r.name)) and r.name.endswith("forward")),
    ("stage backward", "#fb8c00", lambda r: bool(
        _STAGE.match(r.name)) and r.name.endswith("backward")),
    ("optimizer", "#8e24aa", lambda r: r.name == "optimizer update"),
    ("data", "#fdd835", lambda r: r.name in (
        "host to device", "device to host", "wait for data",
        "weight upload", "weight download")),
    ("communication", "#e53935", lambda r: r.name.startswith("all-reduce")),
    ("channel", "#00acc1", lambda r: r.category == "channel"),
    ("other", "#bdbdbd", lambda r: True),
)


@dataclasses.dataclass(frozen=True)
class _Panel:
    """One panel of the picture: ``ranges`` (by start time, clipped to the
    window) drawn over the window ``begin``..``end`` (µs)."""
    name: str
    heading: str
    ranges: Sequence[_Range]
    begin: float
    end: float


def timeline_svg(ranges: Sequence[_Range], track_names: Dict[int, str],
                 title: str) -> str:
    """The picture of ``ranges`` (by start time): its panels (``<g
    class="panel">``, ids ``overview`` and ``last-call``), one above the
    other, and the legend."""
    body: List[str] = []
    top: float = 0
    axis: float = 0
    panels = timeline_panels(ranges, title)
    for panel in panels:
        lines, axis = _svg_panel(panel, track_names, top)
        body += lines
        top = axis + 24
    body += _svg_legend([r for p in panels for r in p.ranges], axis + 40)
    height = axis + 80
    width = _LABEL_WIDTH + _PLOT_WIDTH + 20
    return "\n".join(
        [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
         f'height="{height}" font-family="sans-serif" font-size="10">',
         f'<rect class="background" width="{width}" height="{height}" '
         'fill="white"/>']
        + body + ["</svg>", ""])


def timeline_panels(ranges: Sequence[_Range], title: str) -> List[_Panel]:
    """The start of the timeline (``timeline_window``), then the last call
    when there are calls."""
    begin, end = timeline_window(ranges)
    panels = [_Panel("overview",
                     f"{title}: timeline (first {_CALLS_SHOWN} calls)",
                     [dataclasses.replace(r, end=min(r.end, end))
                      for r in ranges if r.start < end], begin, end)]
    calls = [r for r in ranges if r.name == _CALL]
    return panels + [_last_call_panel(calls, ranges)] if calls else panels


def _last_call_panel(calls: Sequence[_Range], ranges: Sequence[_Range]
                     ) -> _Panel:
    """The last call and the ranges that start in it (on any track),
    clipped to it, over the call's window."""
    last = calls[-1]
    heading = (f"last call ({len(calls)} of {len(calls)}), "
               f"{format_seconds(last.seconds)}")
    return _Panel("last-call", heading,
                  [last] + _inside([last], ranges, same_track=False)[0],
                  last.start, last.end)


def _svg_panel(panel: _Panel, track_names: Dict[int, str], top: float
               ) -> Tuple[List[str], float]:
    """A group with the panel's heading, tracks and time axis from height
    ``top``; the axis's height."""
    scale = _PLOT_WIDTH / max(panel.end - panel.begin, 1e-9)
    lines = [f'<g class="panel" id="{panel.name}">',
             f'<text x="8" y="{top + 20}" font-size="14">'
             f'{escape(panel.heading)}</text>']
    y = top + _TOP
    for track in sorted({r.track for r in panel.ranges}):
        rows, y = _svg_track(track_names.get(track, f"track {track}"),
                             [r for r in panel.ranges if r.track == track],
                             panel.begin, scale, y)
        lines += rows
    lines += _svg_axis(panel.begin, panel.end, scale, y)
    return lines + ["</g>"], y


def timeline_window(ranges: Sequence[_Range]) -> Tuple[float, float]:
    """(start, end) in µs: from the first range to the end of the third
    call, or of the last range when there are three calls or fewer."""
    if not ranges:
        return 0.0, 1.0
    calls = [r for r in ranges if r.name == _CALL]
    end = (calls[_CALLS_SHOWN - 1].end if len(calls) > _CALLS_SHOWN
           else max(r.end for r in ranges))
    return ranges[0].start, end


def _depths(ranges: Sequence[_Range]) -> List[int]:
    """The nesting depth of each range of one track (by start time)."""
    open_ends: List[float] = []
    depths = []
    for r in ranges:
        while open_ends and open_ends[-1] <= r.start:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(r.end)
    return depths


def _svg_track(name: str, ranges: Sequence[_Range], begin: float,
               scale: float, y: float) -> Tuple[List[str], float]:
    """One track's label and ranges from height ``y``; the next track's
    height."""
    depths = _depths(ranges)
    rows = max(depths) + 1
    lines = [f'<text x="8" y="{y + _SUB_ROW - 3}">{escape(name)}</text>',
             f'<line x1="{_LABEL_WIDTH}" x2="{_LABEL_WIDTH + _PLOT_WIDTH}" '
             f'y1="{y + rows * _SUB_ROW + 2}" y2="{y + rows * _SUB_ROW + 2}" '
             'stroke="#eeeeee"/>']
    for r, depth in zip(ranges, depths):
        lines += _svg_range(r, _LABEL_WIDTH + (r.start - begin) * scale,
                            max((r.end - r.start) * scale, 0.5),
                            y + depth * _SUB_ROW)
    return lines, y + rows * _SUB_ROW + _TRACK_GAP


def _svg_range(r: _Range, x: float, width: float, y: float) -> List[str]:
    colour = next(colour for _, colour, matches in _KINDS if matches(r))
    tooltip = escape(f"{r.name}: {format_seconds(r.seconds)}")
    lines = [f'<rect class="range" x="{x:.2f}" y="{y:.1f}" '
             f'width="{width:.2f}" height="{_SUB_ROW - 2}" fill="{colour}">'
             f'<title>{tooltip}</title></rect>']
    if width > 6 * len(r.name):
        lines.append(f'<text x="{x + 2:.2f}" y="{y + _SUB_ROW - 4:.1f}">'
                     f'{escape(r.name)}</text>')
    return lines


def _svg_axis(begin: float, end: float, scale: float, y: float
              ) -> List[str]:
    """A time axis in ms under the tracks, at height ``y``."""
    step = _tick_step((end - begin) / 1000.0)
    lines = [f'<line x1="{_LABEL_WIDTH}" x2="{_LABEL_WIDTH + _PLOT_WIDTH}" '
             f'y1="{y}" y2="{y}" stroke="black"/>']
    for index in range(int((end - begin) / 1000.0 / step) + 1):
        x = _LABEL_WIDTH + index * step * 1000.0 * scale
        lines.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{y}" '
                     f'y2="{y + 4}" stroke="black"/>')
        lines.append(f'<text x="{x:.2f}" y="{y + 16}" text-anchor="middle">'
                     f'{index * step:g} ms</text>')
    return lines


def _tick_step(span_ms: float) -> float:
    """1, 2 or 5 × 10^k ms, about ten ticks over ``span_ms``."""
    raw = max(span_ms, 1e-6) / 10
    power = 10 ** math.floor(math.log10(raw))
    return next(power * m for m in (1, 2, 5, 10) if power * m >= raw)


def _svg_legend(ranges: Sequence[_Range], y: float) -> List[str]:
    """A swatch and the name of each kind of range shown."""
    kinds = {next(kind for kind, _, matches in _KINDS if matches(r))
             for r in ranges}
    lines, x = [], _LABEL_WIDTH
    for kind, colour, _ in _KINDS:
        if kind in kinds:
            lines.append(f'<rect class="legend" x="{x}" y="{y}" width="10" '
                         f'height="10" fill="{colour}"/>')
            lines.append(f'<text x="{x + 14}" y="{y + 9}">{kind}</text>')
            x += 24 + 7 * len(kind)
    return lines
