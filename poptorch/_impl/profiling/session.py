"""The process's profiling session: one torch.profiler (Kineto) recording
shared by every profiled model, flushed into each model's files.

Recording starts when the first profiled model is created. It records the
``record_function`` ranges only (torch's ``USER_SCOPE``), or every torch
operator too with ``POPTORCH_PROFILE_OPERATORS=1``, on all threads. A flush
stops it, hands each model the ranges it owns (``trace_events.py``) and
writes the models' files, then starts it again while a profiled model
remains. Flushes happen when a model is destroyed (``destroy()``), at
``poptorch.profiling.flush()`` and at the process's exit.

When the user's own ``torch.profiler.profile()`` is already recording, the
session does not start one: the ranges go to the user's trace and the
models write their reports without a timeline of their own (logged once).
A ``torch.profiler.profile()`` entered while this session records takes
the recording over (two torch profilers cannot record at once): the models
lose the ranges recorded since the last flush, and the next flush starts
recording again.
"""
import atexit
import os
from typing import Dict, List, Optional

from torch._C._autograd import (_disable_profiler, _enable_profiler,
                                _prepare_profiler)
from torch._C._profiler import (ProfilerActivity, ProfilerConfig,
                                ProfilerState, RecordScope,
                                _ExperimentalConfig)

from ..logger import info_once
from .ranges import set_session_recording, user_profiler_recording
from .trace_events import RecordedRange, recorded_ranges


class ProfilingSession:
    """The models profiled in this process and the recording they share."""

    def __init__(self) -> None:
        self._models: List = []
        self._channels: List[str] = []
        self._recording = False
        self._operators = False
        self._exit_registered = False

    @property
    def channels(self) -> List[str]:
        """The ``profiling.Channel`` names, in the order they were made."""
        return self._channels

    def add_channel(self, name: str) -> None:
        if name not in self._channels:
            self._channels.append(name)

    def join(self, model, operators: bool) -> None:
        """Record for ``model`` (a ``ModelProfile``) from now on."""
        if not self._exit_registered:
            atexit.register(self._at_exit)
            self._exit_registered = True
        if self._recording and operators and not self._operators:
            self._hand_over(self._stop())
        self._models.append(model)
        self._operators = self._operators or operators
        self._start()

    def leave(self, model) -> None:
        """Flush ``model``'s files and stop recording for it."""
        if model not in self._models:
            return
        self.flush()
        self._models.remove(model)
        if not self._models:
            self._stop()
            self._operators = False

    def flush(self) -> None:
        """Write every profiled model's files with what was recorded."""
        self._write()
        self._start()

    def _at_exit(self) -> None:
        """The last flush, which leaves torch's profiler stopped (a
        recording still registered at the interpreter's exit crashes it)."""
        self._write()
        self._models.clear()

    def _write(self) -> None:
        if not self._models:
            return
        self._hand_over(self._stop())
        for model in self._models:
            model.write()

    def _hand_over(self, ranges: Optional[List[RecordedRange]]) -> None:
        """Give each model the ranges it owns and the process's."""
        if ranges is None:
            for model in self._models:
                model.take(None, self._channels)
            return
        owned: Dict[int, List[RecordedRange]] = {
            id(model): [] for model in self._models}
        shared = []
        for recorded in ranges:
            owner = next((m for m in self._models if m.owns(recorded)),
                         None)
            (shared if owner is None else owned[id(owner)]).append(recorded)
        for model in self._models:
            model.take(owned[id(model)] + shared, self._channels)

    def _start(self) -> None:
        if self._recording or not self._models:
            return
        if user_profiler_recording():
            info_once("A torch profiler is already recording: poptorch's "
                      "ranges go to its trace, and profiled models write "
                      "their reports without a timeline file")
            return
        # Kineto prints a line at each start and stop unless told otherwise.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        config = ProfilerConfig(ProfilerState.KINETO, False, False, False,
                                False, False,
                                _ExperimentalConfig(profile_all_threads=True))
        activities = {ProfilerActivity.CPU}
        scopes = set() if self._operators else {RecordScope.USER_SCOPE}
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities, scopes)
        self._recording = True
        set_session_recording(True)

    def _stop(self) -> Optional[List[RecordedRange]]:
        """Stop recording; the ranges recorded (None when this session was
        not recording)."""
        if not self._recording:
            return None
        self._recording = False
        set_session_recording(False)
        return recorded_ranges(_disable_profiler())


SESSION = ProfilingSession()
