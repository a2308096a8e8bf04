"""torch.profiler's recorded ranges as Chrome trace events, and which model
each belongs to.

Every range becomes a complete event (``"ph": "X"``, ``ts`` and ``dur`` in
microseconds, ``pid``, ``tid``). Ranges stay on the thread that ran them,
except two kinds that get a track of their own (a ``tid`` named by a
``thread_name`` metadata event): a pipeline stage's ``stage k forward`` /
``stage k backward`` ranges go to the track ``stage k``, so that the stages'
1F1B order and the bubble read as in PopVision; a ``profiling.Channel``'s
tracepoints go to the track ``channel <name>``.

A model owns the ranges inside the top-level ranges it recorded (its
compilations, calls and weight copies, ``Interval``), on the same thread;
the other ranges (waits for data, channel tracepoints outside calls) belong
to the process and appear in the file of every model it profiles.
"""
import dataclasses
import os
import re
import threading
from typing import Dict, Iterable, List, Sequence

WAIT_FOR_DATA = "wait for data"
_DATALOADER_NEXT = "enumerate(DataLoader)#"
_STAGE = re.compile(r"stage (\d+) (forward|backward)$")
_STAGE_TRACKS = 1 << 30
_CHANNEL_TRACKS = 1 << 31


@dataclasses.dataclass(frozen=True)
class Interval:
    """A top-level range of a model: thread id and times in ns (the clock of
    ``time.time_ns()``, which the profiler's timestamps share)."""
    thread: int
    start: int
    end: int

    def holds(self, event: "RecordedRange") -> bool:
        return (event.thread == self.thread and event.start >= self.start
                and event.start + event.duration <= self.end)


@dataclasses.dataclass(frozen=True)
class RecordedRange:
    """One range as the profiler recorded it."""
    name: str
    start: int         # ns
    duration: int      # ns
    thread: int
    operator: bool     # a torch operator rather than a named range


def recorded_ranges(results) -> List[RecordedRange]:
    """The ranges of torch.profiler's results (``_disable_profiler()``);
    torch's range around a DataLoader's ``__next__`` is a ``wait for
    data``."""
    return [RecordedRange(_renamed(event.name()), event.start_ns(),
                          event.duration_ns(), event.device_resource_id(),
                          not event.is_user_annotation())
            for event in results.events()]


def _renamed(name: str) -> str:
    return WAIT_FOR_DATA if name.startswith(_DATALOADER_NEXT) else name


def owned(ranges: Iterable[RecordedRange], intervals: Sequence[Interval]
          ) -> List[RecordedRange]:
    """The ranges inside one of ``intervals``."""
    return [r for r in ranges if any(i.holds(r) for i in intervals)]


def chrome_events(ranges: Iterable[RecordedRange], channels: Sequence[str]
                  ) -> List[Dict]:
    """Complete events for ``ranges`` and the thread names of their tracks;
    ``channels``: the names of the ``profiling.Channel``s made so far."""
    pid = os.getpid()
    tracks: Dict[int, str] = {}
    events = []
    for recorded in ranges:
        tid, track, category = _placement(recorded, channels)
        tracks.setdefault(tid, track)
        events.append({"ph": "X", "name": recorded.name, "cat": category,
                       "ts": recorded.start / 1000.0,
                       "dur": recorded.duration / 1000.0, "pid": pid,
                       "tid": tid, "args": {}})
    names = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
              "args": {"name": name}} for tid, name in sorted(tracks.items())]
    return names + events


def _placement(recorded: RecordedRange, channels: Sequence[str]):
    """(tid, track name, category) of a range."""
    if recorded.operator:
        return recorded.thread, _thread_name(recorded.thread), "cpu_op"
    stage = _STAGE.match(recorded.name)
    if stage:
        index = int(stage.group(1))
        return _STAGE_TRACKS + index, f"stage {index}", "poptorch"
    channel = recorded.name.split(".", 1)[0]
    if "." in recorded.name and channel in channels:
        index = channels.index(channel)
        return _CHANNEL_TRACKS + index, f"channel {channel}", "channel"
    return recorded.thread, _thread_name(recorded.thread), "poptorch"


def _thread_name(thread: int) -> str:
    if thread == threading.main_thread().native_id:
        return "main thread"
    for running in threading.enumerate():
        if running.native_id == thread:
            return f"thread {running.name}"
    return f"thread {thread}"
