"""What the capture cannot turn into a static graph raises poptorch.Error
naming the operation and the user's source line; any other exception raised
while the model is captured reaches the caller as itself, with the source
line as a note."""
import copy
import importlib.util
import logging
import re

import pytest
import torch

import poptorch
from conftest import assert_same_weights

THIS_FILE = __file__


class Wrapped(torch.nn.Module):
    """Runs ``body(self, x)`` after a linear layer."""

    def __init__(self, body):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.body = body

    def forward(self, x):
        return self.body(self, self.fc(x))


def _capture_error(body, training=False) -> str:
    torch.manual_seed(0)
    model = Wrapped(body)
    wrapper = (poptorch.trainingModel(model) if training
               else poptorch.inferenceModel(model))
    x = torch.randn(2, 4)
    with pytest.raises(poptorch.Error) as info:
        wrapper(x)
    assert not wrapper.isCompiled()
    return str(info.value)


def _line_of(text: str) -> int:
    """The line of this file holding ``text``."""
    with open(THIS_FILE) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def _item(self, h):
    return h * h.sum().item()  # marker: item


def _tolist(self, h):
    return torch.tensor(h.tolist())  # marker: tolist


def _branch(self, h):
    if h.sum() > 0:  # marker: branch
        return h
    return -h


def _mask(self, h):
    return h[h > 0]  # marker: mask


def _unique(self, h):
    return torch.unique(h)  # marker: unique


def _shape_error(self, h):
    return h @ torch.ones(3, 3)  # marker: shape


def _bad_arguments(self, h):
    return torch.scatter(h, 0, 1)  # marker: arguments


def _out_of_range(self, h):
    return h[:, 7]  # marker: index


def _user_check(self, h):
    raise ValueError(f"expected 3 features, got {h.shape[1]}")  # marker: user


@pytest.mark.parametrize("body,marker,operation,problem", [
    (_item, "item", "aten._local_scalar_dense", "reads the value of a tensor"),
    (_tolist, "tolist", "aten._local_scalar_dense",
     "reads the value of a tensor"),
    (_branch, "branch", "aten._local_scalar_dense",
     "if/while condition on a tensor"),
    (_mask, "mask", "aten.nonzero", "result shape depends on the data"),
    (_unique, "unique", "aten._unique2", "result shape depends on the data"),
])
def test_error_names_the_operation_and_the_source_line(body, marker,
                                                      operation, problem):
    message = _capture_error(body)
    line = _line_of(f"# marker: {marker}")
    assert f'File "{THIS_FILE}", line {line}, in {body.__name__}' in message
    assert f"marker: {marker}" in message
    assert operation in message
    assert problem in message


def _plain_and_captured(body, training=False):
    """The exceptions that ``Wrapped(body)`` raises in plain PyTorch and
    when wrapped (the wrapper is also returned)."""
    torch.manual_seed(0)
    model = Wrapped(body)
    x = torch.randn(2, 4)
    with pytest.raises(Exception) as plain:
        model(x)
    wrapper = (poptorch.trainingModel(model) if training
               else poptorch.inferenceModel(model))
    with pytest.raises(Exception) as captured:
        wrapper(x)
    return plain.value, captured.value, wrapper


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("body,marker,same_message", [
    (_bad_arguments, "arguments", False),
    (_out_of_range, "index", True),
    (_user_check, "user", True),
    (_shape_error, "shape", False),
])
def test_exceptions_of_pytorch_and_the_model_keep_their_type(
        body, marker, same_message, training):
    """A TypeError from bad operator arguments, an IndexError, the model's
    own ValueError and a RuntimeError from a shape mismatch reach the
    caller with the type plain PyTorch raises, the message first (PyTorch's
    own for errors raised in Python; the fake tensors' kernels may word a
    shape error differently) and the user's source line as a note."""
    plain, captured, wrapper = _plain_and_captured(body, training)
    assert type(captured) is type(plain)
    if same_message:
        assert str(captured) == str(plain)
    line = _line_of(f"# marker: {marker}")
    assert captured.__notes__ == [
        f'Raised while poptorch captured the model, at File "{THIS_FILE}", '
        f"line {line}, in {body.__name__}: {_source_line(line)}"]
    assert not wrapper.isCompiled()


def _source_line(number: int) -> str:
    with open(THIS_FILE) as source:
        return source.read().splitlines()[number - 1].strip()


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("this backward cannot run")  # marker: backward


def _failing_backward(self, h):
    out = _FailingBackward.apply(h)
    return out, poptorch.identity_loss(out.sum(), "none")


@pytest.mark.parametrize("replicas", [1, 2])
def test_exception_of_a_backward_pass_keeps_its_type(replicas):
    """An exception of the model's own backward pass, met when the training
    step is captured, is raised as itself, on the vectorised replica path
    too (which falls back to the sequential path, where it is raised
    again)."""
    model = Wrapped(_failing_backward)
    x = torch.randn(2 * replicas, 4)
    with pytest.raises(ValueError, match="this backward cannot run"):
        model(x)[1].backward()
    wrapper = poptorch.trainingModel(
        model, poptorch.Options().replicationFactor(replicas))
    with pytest.raises(ValueError) as info:
        wrapper(x)
    assert str(info.value) == "this backward cannot run"
    line = _line_of("# marker: backward")
    assert info.value.__notes__ == [
        f'Raised while poptorch captured the model, at File "{THIS_FILE}", '
        f"line {line}, in backward: {_source_line(line)}"]


@pytest.mark.parametrize("training", [False, True])
def test_a_corrected_call_compiles_after_an_exception(training):
    """After a call that fails in capture with PyTorch's RuntimeError (a
    shape mismatch), the wrapper is as it was: a call with correct
    arguments compiles and runs as plain PyTorch (atol 1e-6), from the
    user's unchanged weights."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    twin = copy.deepcopy(net)
    loss = torch.nn.MSELoss()

    class WithLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, target):
            out = self.inner(x)
            return out, loss(out, target)

    if training:
        wrapper = poptorch.trainingModel(
            WithLoss(net), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    else:
        wrapper = poptorch.inferenceModel(WithLoss(net))
    with pytest.raises(RuntimeError) as info:
        wrapper(torch.randn(2, 5), torch.randn(2, 3))
    assert type(info.value) is RuntimeError
    assert not wrapper.isCompiled()
    assert_same_weights(net, twin)
    x, target = torch.randn(2, 4), torch.randn(2, 3)
    out, value = wrapper(x, target)
    expected = WithLoss(twin)(x, target)
    torch.testing.assert_close(out, expected[0].detach(), atol=1e-6,
                               rtol=1e-5)
    torch.testing.assert_close(value, expected[1].detach(), atol=1e-6,
                               rtol=1e-5)
    if training:
        expected[1].backward()
        torch.optim.SGD(twin.parameters(), lr=0.1).step()
        wrapper.copyWeightsToHost()
    assert_same_weights(net, twin)


def test_torch_does_not_log_the_failure_before_the_error():
    """Fake tensors log a failing operation with torch's traceback; the
    user gets the exception alone."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensor_log.addHandler(handler)
    try:
        _, captured, _ = _plain_and_captured(_shape_error)
    finally:
        fake_tensor_log.removeHandler(handler)
    assert "must have same reduction dim" in str(captured)
    assert [record.getMessage() for record in records] == []


class GaussianHead(torch.nn.Module):
    """A Gaussian likelihood from torch.distributions, which validates its
    arguments by default with Python conditions on tensor values."""

    def __init__(self, validate_args=None):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.validate_args = validate_args

    def forward(self, x, target):
        mu, log_sigma = self.fc(x).chunk(2, dim=1)
        normal = torch.distributions.Normal(mu, log_sigma.exp(),
                                            validate_args=self.validate_args)
        return normal.rsample(), poptorch.identity_loss(
            -normal.log_prob(target).mean(), "none")


def test_distributions_validate_by_default_outside_capture_only():
    """Training with a torch.distributions likelihood matches plain PyTorch
    (whose default validation stays on)."""
    torch.manual_seed(0)
    net = GaussianHead()
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, poptorch.Options(),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, target = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(2):
        sample, loss = model(x, target)
        optimizer.zero_grad()
        expected = reference(x, target)[1]
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach())
    assert sample.shape == (3, 2)
    assert torch.distributions.Distribution._validate_args is True
    with pytest.raises(ValueError, match="constraint"):
        torch.distributions.Normal(torch.zeros(1), -torch.ones(1))


def test_explicit_distribution_validation_fails_with_a_hint():
    model = poptorch.inferenceModel(GaussianHead(validate_args=True))
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(3, 4), torch.randn(3, 2))
    message = str(info.value)
    assert "reads the value of a tensor" in message
    assert "create the distribution with validate_args=False" in message
    assert "in forward" in message


class _Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(4, 4, batch_first=True)

    def forward(self, x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False)
        return self.rnn(packed)[1]


def test_packed_sequences_fail_with_a_hint():
    model = poptorch.inferenceModel(_Packed())
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
    message = str(info.value)
    assert "whose result shape depends on the data" in message
    assert "run the recurrent layer on the padded batch" in message


def _seeded_noise(self, h):
    generator = torch.Generator().manual_seed(3)
    return h + torch.randn(4, generator=generator)  # marker: generator


@pytest.mark.parametrize("training", [False, True])
def test_a_torch_generator_in_forward_is_refused_at_its_line(training):
    """The graph would draw on from the generator's state at each step,
    where PyTorch draws from its state in the program (seeded anew in each
    forward here: the same numbers every time)."""
    body = (_seeded_noise if not training else
            lambda self, h: (_seeded_noise(self, h),
                             poptorch.identity_loss(h.sum(), "none")))
    with pytest.raises(poptorch.Error,
                       match="forward passes a torch.Generator to randn") \
            as info:
        model = Wrapped(body)
        (poptorch.trainingModel(model) if training
         else poptorch.inferenceModel(model))(torch.randn(2, 4))
    line = _line_of("# marker: generator")
    assert f"line {line}, in _seeded_noise" in str(info.value)


def test_training_capture_reports_the_same_location():
    message = _capture_error(_item, training=True)
    assert f"line {_line_of('# marker: item')}, in _item" in message


def _multi_line_statement(self, h):
    return h * h.sum().item(  # marker: multi-line
    )


def test_a_multi_line_statement_is_quoted_as_its_first_line_and_dots():
    message = _capture_error(_multi_line_statement)
    line = _line_of("# marker: multi-line")
    assert (f"line {line}, in _multi_line_statement: return h * "
            "h.sum().item(  # marker: multi-line ..., the model reads"
            ) in message


def test_custom_operator_without_fake_implementation(tmp_path):
    @torch.library.custom_op("poptorch_tests::no_fake", mutates_args=())
    def no_fake(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def body(self, h):
        return no_fake(h)  # marker: custom op

    message = _capture_error(body)
    assert f"line {_line_of('# marker: custom op')}, in body" in message
    assert "cannot be captured" in message and "register_fake" in message


HELPER = '''
def read_value(tensor):
    return tensor * tensor.max().item()
'''


def _helper_module(tmp_path):
    path = tmp_path / "value_helper.py"
    path.write_text(HELPER)
    spec = importlib.util.spec_from_file_location("value_helper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path)


def _helper_error(helper, opts) -> str:
    def body(self, h):
        return helper.read_value(h)  # marker: calls helper

    model = poptorch.inferenceModel(Wrapped(body), opts)
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(2, 4))
    return str(info.value)


def test_location_excludes_choose_the_reported_frame(tmp_path):
    helper, helper_path = _helper_module(tmp_path)
    default = _helper_error(helper, poptorch.Options())
    assert f'File "{helper_path}", line 3, in read_value' in default

    opts = poptorch.Options().appendToLocationExcludes("value_helper.py")
    skipped = _helper_error(helper, opts)
    line = _line_of("# marker: calls helper")
    assert f'File "{THIS_FILE}", line {line}, in body' in skipped


def test_when_every_frame_is_excluded_the_user_frame_is_still_found(
        tmp_path):
    helper, helper_path = _helper_module(tmp_path)
    opts = poptorch.Options().sourceLocationExcludes(
        ["torch/", "poptorch/", "<", "value_helper", "test_compile_errors"])
    message = _helper_error(helper, opts)
    assert re.search(rf'File "{re.escape(helper_path)}", line 3', message)
