"""Capture failures located at the line of the user's code that caused
them.

The capture traces the model with fake tensors that have shapes and dtypes
but no data, in a static-shape mode: anything that needs the data while the
model is captured raises there. These are the runtime's refusals, reported
as ``poptorch.Error`` naming the operation and the line:

* reading a tensor's value in Python (``.item()``, ``.tolist()``,
  ``bool(t)``, ``if t > 0:``, ``int(t)``...);
* operations whose result shape depends on the data (boolean-mask indexing
  ``x[mask]``, ``nonzero``, ``unique``, ``masked_select``, ``bincount``
  without ``minlength``, ``repeat_interleave`` with tensor repeats and no
  ``output_size``, ``one_hot`` without ``num_classes``...), with the
  fixed-shape alternative to each;
* operations that cannot run on fake tensors (a custom operator without a
  fake implementation, ``.numpy()``...).

Any other exception raised while the model is traced, by PyTorch (a
``TypeError`` from bad arguments to an operator, a ``RuntimeError`` from a
shape mismatch) or by the model's own code (an ``IndexError``), reaches the
caller as itself, as in PopTorch and in plain PyTorch: same type, same
message, with the line added as a note (``add_note``; on Python 3.10, which
has no ``add_note``, the note is appended to the exception's ``__notes__``
as 3.11 does, where 3.10's tracebacks do not print it).

The source location is the innermost frame of the failure whose file name
contains none of ``Options.sourceLocationExcludes`` (default ``torch/``,
``poptorch/``, ``<frozen``); when every frame is excluded, the innermost
frame of a real file outside the torch and poptorch packages is used.
"""
import contextlib
import contextvars
import os
import traceback
from typing import Iterator, List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException,
                                           UnsupportedOperatorException)

from ..errors import Error
from .exception_notes import add_note

DEFAULT_EXCLUDES = ("torch/", "poptorch/", "<frozen")

_excludes: contextvars.ContextVar = contextvars.ContextVar(
    "poptorch_source_location_excludes", default=DEFAULT_EXCLUDES)

_PACKAGE_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)

_READS_VALUE = (
    "reads the value of a tensor in Python ({op}), as .item(), .tolist(), "
    "bool(), int(), float() or an if/while condition on a tensor do. The "
    "model is captured once into a static graph with tensors that have no "
    "values yet, so Python cannot branch on or read them (PopTorch traced "
    "with the first call's values and froze such a branch to the path they "
    "took); keep the computation in tensor operations (for example "
    "torch.where instead of an if) or do it outside the model")
_DYNAMIC_SHAPE = (
    "uses {op}, whose result shape depends on the data. A static graph "
    "needs every shape when it is captured: {alternative}")
_MASKED = ("keep the shape with torch.where(mask, x, 0) or a "
           "multiplication by the mask")
_UNIQUE = ("for integers in [0, N), torch.bincount(x, minlength=N) counts "
           "each value in N bins (> 0 marks the values present); "
           "torch.sort(x) orders the values, repeated ones included")
_aten = torch.ops.aten
# The fixed-shape alternative to each operator whose result shape depends
# on the data, by operator.
_STATIC_ALTERNATIVES = {
    _aten.nonzero: (
        "instead of boolean-mask indexing x[mask], " + _MASKED + "; where "
        "the indices are needed (nonzero, argwhere, torch.where(condition)),"
        " torch.nonzero_static(condition, size=N, fill_value=-1) returns N "
        "of them, padded with fill_value"),
    _aten.masked_select: _MASKED,
    _aten._unique2: _UNIQUE,
    _aten.unique_dim: _UNIQUE,
    _aten.unique_consecutive: _UNIQUE,
    _aten.bincount: (
        "pass minlength=N to torch.bincount, which then returns N bins, "
        "counting the values in [0, N) (values outside it are not counted)"),
    _aten.repeat_interleave: (
        "pass output_size=, the sum of repeats, to torch.repeat_interleave; "
        "it must be the same for every input"),
    _aten.one_hot: (
        "pass num_classes=N to torch.nn.functional.one_hot (the values must "
        "be in [0, N))"),
}
_ANY_STATIC_ALTERNATIVE = ("use a fixed-shape form of the computation, "
                           "such as torch.where(mask, x, 0) or a "
                           "multiplication by a mask")
_UNSUPPORTED = ("uses the operation {op}, which cannot be captured: it has "
                "no implementation for tensors without data (fake tensors)")


@contextlib.contextmanager
def source_location_excludes(excludes: Sequence[str]) -> Iterator[None]:
    """Use ``excludes`` to find the user's frame of capture failures."""
    token = _excludes.set(tuple(excludes))
    try:
        yield
    finally:
        _excludes.reset(token)


def _excluded(filename: str, excludes: Sequence[str]) -> bool:
    return any(pattern in filename for pattern in excludes)


def user_frame(frames: List[traceback.FrameSummary]
               ) -> Optional[traceback.FrameSummary]:
    """The innermost frame of the user's code among ``frames`` (outermost
    first)."""
    index = innermost_user_file([frame.filename for frame in frames])
    return None if index is None else frames[index]


def innermost_user_file(filenames: Sequence[str]) -> Optional[int]:
    """The index in ``filenames`` (outermost frame first) of the user's
    innermost frame: the last whose file name contains none of the
    source location excludes, else the last of a real file outside the
    torch and poptorch packages."""
    excludes = _excludes.get()
    for index in reversed(range(len(filenames))):
        if not _excluded(filenames[index], excludes):
            return index
    for index in reversed(range(len(filenames))):
        if not filenames[index].startswith("<") and not os.path.abspath(
                filenames[index]).startswith(_PACKAGE_DIRS):
            return index
    return None


def describe_frame(frame: Optional[traceback.FrameSummary]) -> str:
    if frame is None:
        return ("an unknown location (every frame matched "
                "sourceLocationExcludes)")
    text = f"File \"{frame.filename}\", line {frame.lineno}, in {frame.name}"
    if frame.line:
        text += f": {frame.line.strip()}"
        if (frame.end_lineno or frame.lineno) > frame.lineno:
            text += " ..."              # the statement's first line only
    return text


def _operation(error: Exception) -> str:
    func = getattr(error, "func", None)
    return str(func) if func is not None else type(error).__name__


def _static_alternative(error: DynamicOutputShapeException) -> str:
    packet = getattr(error.func, "overloadpacket", None)
    return _STATIC_ALTERNATIVES.get(packet, _ANY_STATIC_ALTERNATIVE)


def _refusal(error: Exception) -> Optional[str]:
    """What the model does that a static graph cannot hold, None when
    ``error`` is no refusal of the runtime."""
    name = type(error).__name__
    if isinstance(error, DataDependentOutputException) or \
            name in ("GuardOnDataDependentSymNode",
                     "DataDependentOutputException"):
        return _READS_VALUE.format(op=_operation(error))
    if isinstance(error, DynamicOutputShapeException):
        return _DYNAMIC_SHAPE.format(op=_operation(error),
                                     alternative=_static_alternative(error))
    if isinstance(error, UnsupportedOperatorException):
        return _UNSUPPORTED.format(op=_operation(error))
    if "fake impl" in str(error) or "tensor subclasses" in str(error):
        return f"uses an operation that cannot be captured: {error}"
    return None


_DISTRIBUTION_CHECKS = (
    " The failure is in torch.distributions, which checks its arguments "
    "with Python conditions on tensor values when validate_args=True: "
    "create the distribution with validate_args=False (the default while "
    "a model is captured).")

_DISTRIBUTIONS_DIR = os.path.join("torch", "distributions") + os.sep


_PACKED_SEQUENCES = (
    " Packed sequences (torch.nn.utils.rnn.pack_padded_sequence) have "
    "data-dependent shapes: run the recurrent layer on the padded batch and "
    "pick each sequence's last valid step by its length (for example with "
    "torch.gather), or mask the padded steps")

_RNN_UTILITIES = os.path.join("torch", "nn", "utils", "rnn.py")


def _hint(frames: List[traceback.FrameSummary]) -> str:
    if any(_DISTRIBUTIONS_DIR in frame.filename for frame in frames):
        return _DISTRIBUTION_CHECKS
    if any(frame.filename.endswith(_RNN_UTILITIES) for frame in frames):
        return _PACKED_SEQUENCES + "."
    return ""


def capture_refusal(error: Exception) -> Optional[Error]:
    """``error``, raised while the model was traced, as a ``poptorch.Error``
    naming the operation and the user's source line when it is a refusal
    of the runtime; None for any other exception, which then gets the
    source line as a note (``locate``)."""
    problem = _refusal(error)
    if problem is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    location = describe_frame(user_frame(frames))
    return Error(f"The model could not be captured into a static graph: at "
                 f"{location}, the model {problem}.{_hint(frames)}")


_LOCATED = "Raised while poptorch captured the model, at "


def locate(error: Exception,
           frame: Optional[traceback.FrameSummary] = None) -> None:
    """Add the user's source line to ``error``, raised while the model was
    traced, as a note: ``frame``, else the user's innermost frame of the
    error's traceback; an error located already keeps its note."""
    if any(note.startswith(_LOCATED)
           for note in getattr(error, "__notes__", ())):
        return
    if frame is None:
        frame = user_frame(traceback.extract_tb(error.__traceback__))
    add_note(error, _LOCATED + describe_frame(frame))
