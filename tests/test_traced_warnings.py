"""Warnings raised while a model is traced reach the user at the line of
their code that raised them, once per compilation, judged by their warning
filters at that line, as when the model runs eagerly."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import poptorch

SOFTMAX_WARNING = "Implicit dimension choice for softmax"
OWN_WARNING = "the model's own warning"


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, start=1)
                    if line.rstrip().endswith(marker))


class Warns(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y=None):
        probabilities = F.softmax(self.fc(x))  # softmax without dim
        warnings.warn(OWN_WARNING)  # own warning
        if y is None:
            return probabilities
        return probabilities, F.mse_loss(probabilities, y)


def _compile(training: bool) -> None:
    torch.manual_seed(0)
    model = Warns()
    x, y = torch.randn(2, 4), torch.rand(2, 3)
    if training:
        poptorch.trainingModel(model)(x, y)
    else:
        poptorch.inferenceModel(model)(x)


@pytest.mark.parametrize("training", [False, True])
def test_warnings_name_the_users_line_once(training):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile(training)
    found = [(str(w.message), w.filename, w.lineno) for w in caught
             if SOFTMAX_WARNING in str(w.message) or
             OWN_WARNING in str(w.message)]
    assert sorted(found) == sorted([
        (next(str(w.message) for w in caught
              if SOFTMAX_WARNING in str(w.message)),
         __file__, _line_of("# softmax without dim")),
        (OWN_WARNING, __file__, _line_of("# own warning"))])


def test_ignore_filter_for_the_users_module_applies():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=__name__)
        _compile(training=True)
    assert not [w for w in caught if SOFTMAX_WARNING in str(w.message) or
                OWN_WARNING in str(w.message)]


def test_error_filter_raises_where_the_warning_is_raised():
    torch.manual_seed(0)
    model = Warns()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper = poptorch.trainingModel(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=OWN_WARNING)
        with pytest.raises(UserWarning, match=OWN_WARNING) as info:
            wrapper(torch.randn(2, 4), torch.rand(2, 3))
    assert not wrapper.isCompiled()
    assert any(f"line {_line_of('# own warning')}" in note
               for note in getattr(info.value, "__notes__", []))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _Deprecated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        warnings.warn("old API", DeprecationWarning)  # deprecated call
        return self.fc(x)


def test_python_s_own_string_filters_are_understood():
    """Python's default filters hold plain strings, not patterns
    (('default', None, DeprecationWarning, '__main__', 0))."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filters.insert(
            0, ("default", None, DeprecationWarning, "__main__", 0))
        warnings._filters_mutated()
        poptorch.inferenceModel(_Deprecated())(torch.randn(2, 4))
    assert [(w.filename, w.lineno) for w in caught
            if str(w.message) == "old API"] == [
                (__file__, _line_of("# deprecated call"))]
