"""Warnings raised while a model is traced, reported at the user's line.

While the capture traces ``forward``, each operation passes through the
tracing machinery (poptorch's torch function modes, fake tensors,
``make_fx``), so the frame a warning's ``stacklevel`` names is often in that
machinery: ``F.softmax`` without ``dim`` would be reported in a file of
poptorch. A warning whose frame's file name matches
``Options.sourceLocationExcludes`` is reported instead at the innermost
frame outside them, as capture errors are (``compile_errors.py``), which
for the model's own operations is the line of ``forward`` that called them.

The user's warning filters then decide at that location, as they would in
eager PyTorch: ``"error"`` raises the warning where it was raised (the
capture fails with it), ``"ignore"`` drops it, and every other warning is
issued at the end of the compilation, through the filters and registry of
its module, once per message and location however many times the model
is traced (the analysis and each step trace it again). torch's warning
that vmap has no batching rule for an operation, which the vectorised
replica path meets, is logged at INFO instead, in poptorch's words.
"""
import contextlib
import contextvars
import re
import sys
import traceback
import types
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

from .compile_errors import innermost_user_file, locate
from .logger import info_once

_Key = Tuple[type, str, str, int]

#: torch's warning when vmap runs an operation without a batching rule
#: once per sample: on the vectorised replica path (``replication/``),
#: which the user did not write, an INFO log says it instead.
_VMAP_FALLBACK = re.compile(r"There is a performance drop because we have "
                            r"not yet implemented the batching rule for "
                            r"(\S+)\. ")


class _Located:
    """A warning at the user's frame."""

    def __init__(self, message: Warning, filename: str, lineno: int,
                 function: str, module_globals: Optional[dict]) -> None:
        self.message = message
        self.filename = filename
        self.lineno = lineno
        self.function = function
        self.module_globals = module_globals

    @property
    def module(self) -> Optional[str]:
        return (self.module_globals or {}).get("__name__")

    def frame(self) -> traceback.FrameSummary:
        return traceback.FrameSummary(self.filename, self.lineno,
                                      self.function)

    def key(self) -> _Key:
        return (type(self.message), str(self.message), self.filename,
                self.lineno)

    def issue(self) -> None:
        """Issue the warning as raised at its frame."""
        registry = (None if self.module_globals is None else
                    self.module_globals.setdefault("__warningregistry__", {}))
        warnings.warn_explicit(self.message, type(self.message),
                               self.filename, self.lineno, module=self.module,
                               registry=registry,
                               module_globals=self.module_globals)


class _Collector:
    """The warnings of one compilation, judged by the user's filters."""

    def __init__(self, filters: List[tuple]) -> None:
        self._filters = filters
        self._found: Dict[_Key, _Located] = {}

    def show(self, message, category, filename, lineno, file=None,
             line=None) -> None:
        """``warnings.showwarning`` while the model is traced."""
        if not isinstance(message, Warning):
            message = category(message)
        unbatched = _VMAP_FALLBACK.search(str(message))
        if unbatched:
            info_once(f"Replicas: PyTorch has no vmap batching rule for "
                      f"{unbatched.group(1)}, so the replicas run it one "
                      "after another (same results, slower)")
            return
        located = _at_user_frame(message, filename, lineno)
        action = self._action(located)
        if action == "error":
            locate(located.message, located.frame())
            raise located.message
        if action != "ignore":
            self._found.setdefault(located.key(), located)

    def _action(self, located: _Located) -> str:
        text = str(located.message)
        module = located.module or ""
        for action, text_re, category, module_re, line in self._filters:
            if (_matches(text_re, text) and
                    issubclass(type(located.message), category) and
                    _matches(module_re, module) and
                    line in (0, located.lineno)):
                return action
        return warnings.defaultaction

    def issue_all(self) -> None:
        found, self._found = self._found, {}
        for located in found.values():
            located.issue()


def _matches(pattern, text: str) -> bool:
    """A warning filter's message or module pattern: None matches all, a
    string (Python's own default filters) the same text, else a compiled
    regular expression from the start."""
    if pattern is None:
        return True
    if isinstance(pattern, str):
        return pattern == text
    return bool(pattern.match(text))


def _at_user_frame(message: Warning, filename: str,
                   lineno: int) -> _Located:
    """``message``, reported at (``filename``, ``lineno``), at the innermost
    frame of the user's code from there outwards (unchanged when that
    frame is not on the stack)."""
    frames = _stack_from(filename, lineno)
    if not frames:
        return _Located(message, filename, lineno, "<unknown>", None)
    index = innermost_user_file([frame.f_code.co_filename
                                 for frame in frames])
    frame = frames[-1] if index is None else frames[index]
    return _Located(message, frame.f_code.co_filename, frame.f_lineno,
                    frame.f_code.co_name, frame.f_globals)


def _stack_from(filename: str, lineno: int) -> List[types.FrameType]:
    """The stack, outermost frame first, ending at the innermost frame
    running line ``lineno`` of ``filename``; empty when none does."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename != filename or
                                 frame.f_lineno != lineno):
        frame = frame.f_back
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


_collector: contextvars.ContextVar = contextvars.ContextVar(
    "poptorch_traced_warnings", default=None)


@contextlib.contextmanager
def compilation() -> Iterator[None]:
    """Issue the warnings of the traces in the block at its end."""
    if _collector.get() is not None:
        yield
        return
    collector = _Collector(list(warnings.filters))
    token = _collector.set(collector)
    try:
        yield
    finally:
        _collector.reset(token)
        collector.issue_all()


@contextlib.contextmanager
def tracing(ignored_messages: Tuple[str, ...] = ()) -> Iterator[None]:
    """Collect the warnings raised in the block for the enclosing
    ``compilation`` (issued at the end of the block when there is none),
    except those whose message starts with one of ``ignored_messages``
    (regular expressions)."""
    with compilation():
        collector = _collector.get()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for message in ignored_messages:
                warnings.filterwarnings("ignore", message=message)
            warnings.showwarning = collector.show
            yield
