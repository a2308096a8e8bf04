"""Profiling (issue 18, docs/profiling.md): the switches PopTorch users set
(``switches.py``), named ranges on torch.profiler (``ranges.py``), the
process's recording (``session.py``), each model's timeline and report
(``model_profile.py``, ``trace_events.py``, ``facts.py``, ``report.py``)
and the summary of a directory (``summary.py``)."""
from typing import Union

from .model_profile import ModelProfile, Unprofiled
from .ranges import profile_range
from .session import SESSION
from .switches import profiling_switches
from ..options.effects import model_name


def for_model(options, training: bool) -> Union[ModelProfile, Unprofiled]:
    """The profile of a model with ``options``, named after ``modelName``
    (by default ``"training"`` or ``"inference"``, as in PopTorch)."""
    switches = profiling_switches(options)
    if switches is None:
        return Unprofiled()
    return ModelProfile(switches, model_name(options, training), options)


__all__ = ["SESSION", "ModelProfile", "Unprofiled", "for_model",
           "profile_range"]
