"""``python -m poptorch.profiling DIR``: a plain-text summary of the
profiling reports (``*.report.json``, ``report.py``) in a directory.

The reports of one model name from several processes (a ``poprun`` run)
make one entry: its processes, calls and samples summed, samples per second
summed over the processes (they run at the same time), the compilation
time of the slowest process, the call-time breakdown summed over the
processes and the memory of each process.
"""
import glob
import json
import os
import sys
from typing import Any, Dict, List, Optional, TextIO

from .report import (PART_LABELS, format_bytes, format_seconds,
                     format_si)

#: The exit status when the directory holds no report.
NO_REPORTS = 2


def main(directory: str, out: Optional[TextIO] = None) -> int:
    """Print the summary of ``directory`` on ``out`` (stdout); the exit
    status: 0, or ``NO_REPORTS`` with a message on stderr."""
    out = out or sys.stdout
    reports = load_reports(directory)
    if not reports:
        print(f"No profiling reports (*.report.json) in {directory}: "
              "profile a model with opts.enableProfiling(directory) or "
              "POPLAR_ENGINE_OPTIONS (docs/profiling.md)", file=sys.stderr)
        return NO_REPORTS
    models = group_by_model(reports)
    print(f"Profiling summary of {directory}: {len(reports)} report(s), "
          f"{len(models)} model(s)", file=out)
    for name, group in models.items():
        print("", file=out)
        print(describe(name, group), file=out)
    return 0


def load_reports(directory: str) -> List[Dict[str, Any]]:
    """The reports in ``directory`` by file name; unreadable files are
    named on stderr and skipped."""
    reports = []
    for path in sorted(glob.glob(os.path.join(glob.escape(directory),
                                              "*.report.json"))):
        try:
            with open(path, encoding="utf-8") as file:
                reports.append(json.load(file))
        except (OSError, ValueError) as error:
            print(f"Skipped {path}: {error}", file=sys.stderr)
    return reports


def group_by_model(reports: List[Dict[str, Any]]
                   ) -> Dict[str, List[Dict[str, Any]]]:
    """Reports by model name (sorted), each group by rank and pid."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for report in reports:
        groups.setdefault(report["model"]["name"], []).append(report)
    return {name: sorted(group, key=_process_key)
            for name, group in sorted(groups.items())}


def _process_key(report: Dict[str, Any]):
    process = report["model"]["process"]
    return process["rank"], process["pid"]


def describe(name: str, group: List[Dict[str, Any]]) -> str:
    """The entry of one model: its reports from one or more processes."""
    model = group[0]["model"]
    kind = "training" if model.get("training") else "inference"
    lines = [f"Model {name!r} ({kind}, backend {model.get('backend')}, "
             f"device {model.get('device')})",
             f"  processes:   {_processes(group)}"]
    lines += _throughput(group)
    lines.append("  compile:     " + format_seconds(
        max(r["compile"]["seconds"] for r in group)) + " (slowest process)")
    lines.append("  call time:   " + _breakdown(group))
    lines.append("  FLOPs/call:  " + format_si(
        group[0]["flops_per_call"], "FLOP") + " per process")
    lines.append("  memory:")
    lines += [f"    {_process(r)}: {_memory(r['memory']['total'])}"
              for r in group]
    return "\n".join(lines)


def _process(report: Dict[str, Any]) -> str:
    process = report["model"]["process"]
    return f"rank {process['rank']} (pid {process['pid']})"


def _processes(group: List[Dict[str, Any]]) -> str:
    world = group[0]["model"]["process"]["world_size"]
    return ", ".join(_process(r) for r in group) + f" of {world}"


def _throughput(group: List[Dict[str, Any]]) -> List[str]:
    calls = [r["calls"] for r in group]
    samples = [c["samples"] for c in calls]
    rates = [c["samples_per_second"] for c in calls]
    return [
        f"  calls:       {sum(c['count'] for c in calls)}",
        "  samples:     " + _sum_or_na(samples),
        "  samples/s:   " + (_sum_or_na(rates, "{:.1f}")
                             + " (summed over processes)")]


def _sum_or_na(values: List[Optional[float]], form: str = "{}") -> str:
    if any(value is None for value in values):
        return "n/a"
    return form.format(sum(values))


def _breakdown(group: List[Dict[str, Any]]) -> str:
    """Shares of the call time, summed over the processes."""
    total = sum(r["calls"]["seconds"] for r in group)
    if total <= 0:
        return "no calls"
    parts = []
    for part, label in PART_LABELS.items():
        seconds = sum(r["calls"]["breakdown_seconds"][part] for r in group)
        parts.append(f"{label} {100.0 * seconds / total:.1f}%")
    return ", ".join(parts)


def _memory(total: Dict[str, int]) -> str:
    return (f"{format_bytes(total['total_bytes'])} (parameters "
            f"{format_bytes(total['parameter_bytes'])}, optimizer state "
            f"{format_bytes(total['optimizer_state_bytes'])}, saved "
            f"activations {format_bytes(total['saved_activation_bytes'])})")
