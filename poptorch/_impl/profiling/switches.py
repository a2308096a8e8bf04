"""The switches that turn profiling on, as PopTorch users set them, and
where the files go (docs/profiling.md).

* ``opts.enableProfiling(profile_dir)`` — the timeline and the report of
  the model, in ``profile_dir`` (the current directory when not given).
* ``POPLAR_ENGINE_OPTIONS='{"autoReport.all": "true",
  "autoReport.directory": "DIR"}'`` — the report (PopVision Graph
  Analyser's place); ``autoReport.outputGraphProfile`` or
  ``autoReport.outputExecutionProfile`` set to true turn it on too.
* ``PVTI_OPTIONS='{"enable": "true", "directory": "DIR"}'`` — the timeline
  (PopVision System Analyser's place).
* ``POPTORCH_PROFILE_OPERATORS=1`` — the timeline also holds every torch
  operator the calls run (torch.profiler's operator ranges), when profiling
  is on.

A directory given by ``enableProfiling`` wins over the variables'. Keys of
the two JSON variables that mean nothing here (Poplar has hundreds) are
logged once at INFO, never an error; a variable that is not a JSON object
is logged once as a warning and ignored.
"""
import dataclasses
import json
import os
from typing import Any, Dict, Optional

from ..logger import info_once, warn_once

ENGINE_OPTIONS = "POPLAR_ENGINE_OPTIONS"
PVTI_OPTIONS = "PVTI_OPTIONS"
OPERATORS = "POPTORCH_PROFILE_OPERATORS"

_REPORT_KEYS = ("autoReport.all", "autoReport.outputGraphProfile",
                "autoReport.outputExecutionProfile")
_ENGINE_KEYS = frozenset(_REPORT_KEYS + ("autoReport.directory",))
_PVTI_KEYS = frozenset(("enable", "directory"))


@dataclasses.dataclass(frozen=True)
class ProfilingSwitches:
    """What one model writes: its timeline (a Chrome trace) and its report,
    in ``directory``; ``operators`` adds torch's operator ranges."""
    timeline: bool
    report: bool
    directory: str
    operators: bool


def profiling_switches(options) -> Optional[ProfilingSwitches]:
    """The model's switches from its options and the environment; None when
    profiling is off."""
    engine = _json_variable(ENGINE_OPTIONS, _ENGINE_KEYS)
    pvti = _json_variable(PVTI_OPTIONS, _PVTI_KEYS)
    profile_dir = options.profile_dir
    report = profile_dir is not None or any(
        _true(engine.get(key)) for key in _REPORT_KEYS)
    timeline = profile_dir is not None or _true(pvti.get("enable"))
    if not (report or timeline):
        return None
    directory = (profile_dir or engine.get("autoReport.directory")
                 or pvti.get("directory") or ".")
    return ProfilingSwitches(
        timeline=timeline, report=report, directory=str(directory),
        operators=_true(os.environ.get(OPERATORS)))


def _json_variable(name: str, known: frozenset) -> Dict[str, Any]:
    text = os.environ.get(name)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        warn_once(f"{name} is not valid JSON ({error}); ignored")
        return {}
    if not isinstance(value, dict):
        warn_once(f"{name} must be a JSON object, got {text!r}; ignored")
        return {}
    unknown = sorted(set(value) - known)
    if unknown:
        info_once(f"{name}: {', '.join(unknown)} have no effect here "
                  f"(used: {', '.join(sorted(known))})")
    return value


def _true(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return value is True or value == 1
