"""poptorch.registerPreCompileHook / registerPostCompileHook: hooks run
around every compilation, in registration order, until their handle
removes them."""
import pytest
import torch

import poptorch
from conftest import ClassifierMLP, make_data


class Events(list):
    """A log of hook calls: (hook name, whether the watched model is
    compiled when the hook runs, None without a model to watch)."""

    def __init__(self):
        super().__init__()
        self.handles = []
        self.model = None

    def register(self, function, name):
        def hook():
            compiled = None if self.model is None else self.model.isCompiled()
            self.append((name, compiled))

        handle = function(hook)
        self.handles.append(handle)
        return handle


@pytest.fixture
def events():
    """Hooks registered through it are removed after the test."""
    log = Events()
    yield log
    for handle in log.handles:
        handle.remove()


def test_hooks_run_in_order_around_each_compilation(events):
    events.register(poptorch.registerPreCompileHook, "pre A")
    events.register(poptorch.registerPreCompileHook, "pre B")
    events.register(poptorch.registerPostCompileHook, "post")
    x, y = make_data(4)
    model = poptorch.trainingModel(ClassifierMLP())
    events.model = model
    model(x, y)
    model(x, y)
    assert events == [("pre A", False), ("pre B", False), ("post", True)]
    model.destroy()
    model(x, y)
    assert events == [("pre A", False), ("pre B", False), ("post", True)] * 2
    events.model = poptorch.inferenceModel(ClassifierMLP())
    events.model.compile(x)
    assert events[6:] == [("pre A", False), ("pre B", False), ("post", True)]


def test_removed_hooks_are_not_called(events):
    pre = events.register(poptorch.registerPreCompileHook, "pre")
    post = events.register(poptorch.registerPostCompileHook, "post")
    assert isinstance(pre, torch.utils.hooks.RemovableHandle)
    pre.remove()
    x, _ = make_data(4)
    poptorch.inferenceModel(ClassifierMLP())(x)
    assert events == [("post", None)]
    post.remove()
    poptorch.inferenceModel(ClassifierMLP())(x)
    assert events == [("post", None)]


def test_post_compile_hooks_skip_a_failed_compilation(events):
    events.register(poptorch.registerPreCompileHook, "pre")
    events.register(poptorch.registerPostCompileHook, "post")
    with pytest.raises(poptorch.Error, match="not a multiple"):
        poptorch.inferenceModel(ClassifierMLP(),
                                poptorch.Options().deviceIterations(3))(
            torch.randn(4, 4))
    assert events == [("pre", None)]


@pytest.mark.parametrize("register", [poptorch.registerPreCompileHook,
                                      poptorch.registerPostCompileHook])
def test_hook_must_be_callable(register):
    with pytest.raises(RuntimeError, match=f"{register.__name__}: the hook "
                       "must be callable.*got 3"):
        register(3)
