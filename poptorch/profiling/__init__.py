"""Profiling (API reference 11.2, docs/profiling.md):
``poptorch.profiling.Channel`` and ``flush``.

Tracepoints are ``torch.profiler.record_function`` ranges named
``"<channel>.<tracepoint>"``: with profiling on (``enableProfiling``,
``PVTI_OPTIONS``) they go on the channel's own track of every profiled
model's timeline; they appear in a ``torch.profiler.profile`` the user
runs, and cost next to nothing when no profiler is recording, the
counterpart of PopTorch's no-op mode without libpvti.

``python -m poptorch.profiling DIR`` prints the summary of the reports in
``DIR`` (the processes of a ``poprun`` run merged).
"""
import functools
from typing import Callable, ContextManager

from .._impl.profiling import SESSION, profile_range
from ..errors import Error


class Channel:
    """A named profiling channel.

    >>> channel = poptorch.profiling.Channel("MyApp")
    >>> with channel.tracepoint("TimeThis"):
    ...     functionToTime()
    >>> channel.instrument(myobj, "methodName", "otherMethod")
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise Error(f"profiling.Channel: name must be a non-empty string, "
                        f"not {name!r}")
        self._name = name
        SESSION.add_channel(name)

    def tracepoint(self, name: str) -> ContextManager:
        """A context manager timing its body as ``"<channel>.<name>"``."""
        if not isinstance(name, str) or not name:
            raise Error("Channel.tracepoint: name must be a non-empty "
                        f"string, not {name!r}")
        return profile_range(f"{self._name}.{name}")

    def instrument(self, obj: object, *methods: str) -> None:
        """Wrap the named methods of ``obj`` (an object or a class) so that
        each call is a tracepoint named after the method."""
        if not methods:
            raise Error("Channel.instrument: give one or more method names")
        originals = [self._method(obj, name) for name in methods]
        for name, original in zip(methods, originals):
            setattr(obj, name, self._traced(name, original))

    def _method(self, obj: object, name: str) -> Callable:
        method = getattr(obj, name, None) if isinstance(name, str) else None
        if not callable(method):
            raise Error(f"Channel.instrument: {type(obj).__name__} has no "
                        f"method {name!r}")
        return method

    def _traced(self, name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def traced(*args, **kwargs):
            with self.tracepoint(name):
                return method(*args, **kwargs)

        return traced


def flush() -> None:
    """Write the timeline and report files of every profiled model of this
    process now, with what was recorded so far (they are also written when a
    model is destroyed and when the process exits)."""
    SESSION.flush()
