"""Named time ranges: ``torch.profiler.record_function`` while a torch
profiler records (poptorch's own session, ``session.py``, or the user's
``torch.profiler.profile()``), nothing otherwise.

The check is a flag and one call into torch's C++ state, so a call of a
model that nobody profiles pays no range bookkeeping (``record_function``
alone would cost a dispatcher call per range). The session's recording
covers all threads, which torch's per-thread state does not show: the
session sets the flag. The session records for the profiled models only:
the ranges of a model that is not profiled (``unprofiled_range``) stay out
of it, but reach a torch profiler the user runs. docs/profiling.md lists
the names.
"""
import contextlib
import threading
from typing import ContextManager, Iterator

import torch

_torch_recording = torch._C._autograd._profiler_enabled
_NO_RANGE = contextlib.nullcontext()
_session_recording = False
_unprofiled = threading.local()


def user_profiler_recording() -> bool:
    """Whether a torch profiler other than poptorch's session records on
    this thread."""
    return _torch_recording() and not _session_recording


def set_session_recording(recording: bool) -> None:
    """Called by the session when its recording starts and stops."""
    global _session_recording
    _session_recording = recording


def profile_range(name: str) -> ContextManager:
    """A range named ``name`` on the timeline around the ``with`` body."""
    if _session_recording:
        if getattr(_unprofiled, "active", False):
            return _NO_RANGE
        return torch.profiler.record_function(name)
    if _torch_recording():
        return torch.profiler.record_function(name)
    return _NO_RANGE


@contextlib.contextmanager
def unprofiled_range(name: str) -> Iterator[None]:
    """A top-level range of a model that is not profiled: it and the ranges
    inside it are left out of the session's recording."""
    previous = getattr(_unprofiled, "active", False)
    _unprofiled.active = True
    try:
        with profile_range(name):
            yield
    finally:
        _unprofiled.active = previous
