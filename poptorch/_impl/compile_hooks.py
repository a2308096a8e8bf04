"""Functions called around every compilation (PopTorch 3.4):
``registerPreCompileHook`` and ``registerPostCompileHook``.

A compilation is the capture and compilation of a model: its first call
or ``compile()``, ``compileAndExport()``, loading an exported file
(``loadExecutable``, ``poptorch.load``) and the first call after
``destroy()``. Pre-compile hooks run before it starts, post-compile hooks
after it succeeded, each without arguments, in the order they were
registered; an exception from a hook stops the compilation.
"""
import collections
import contextlib
from typing import Callable, Dict, Iterator

from torch.utils.hooks import RemovableHandle

_PRE_COMPILE: Dict[int, Callable[[], None]] = collections.OrderedDict()
_POST_COMPILE: Dict[int, Callable[[], None]] = collections.OrderedDict()


def _register(hooks: Dict[int, Callable[[], None]], hook: Callable[[], None],
              name: str) -> RemovableHandle:
    if not callable(hook):
        raise RuntimeError(f"{name}: the hook must be callable (a function "
                           f"taking no arguments), got {hook!r}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Call ``hook()`` before every compilation of a model. Returns a
    ``torch.utils.hooks.RemovableHandle``: ``handle.remove()`` unregisters
    the hook. Raises ``RuntimeError`` if ``hook`` is not callable."""
    return _register(_PRE_COMPILE, hook, "registerPreCompileHook")


def registerPostCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Call ``hook()`` after every successful compilation of a model.
    Returns a ``torch.utils.hooks.RemovableHandle``: ``handle.remove()``
    unregisters the hook. Raises ``RuntimeError`` if ``hook`` is not
    callable."""
    return _register(_POST_COMPILE, hook, "registerPostCompileHook")


@contextlib.contextmanager
def around_compilation() -> Iterator[None]:
    """Run the pre-compile hooks, the block (one compilation), then, if it
    succeeded, the post-compile hooks."""
    for hook in list(_PRE_COMPILE.values()):
        hook()
    yield
    for hook in list(_POST_COMPILE.values()):
        hook()
