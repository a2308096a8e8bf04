"""Bad input gets a clear poptorch.Error and leaves weights and optimizer
state unchanged."""
import copy

import pytest
import torch

import poptorch
from conftest import ClassifierMLP, assert_same_weights, make_data, options


@pytest.fixture
def trained():
    """A compiled training model after one call, and a snapshot of its
    module's weights."""
    torch.manual_seed(0)
    module = ClassifierMLP()
    model = poptorch.trainingModel(module, options(2), torch.optim.SGD(
        module.parameters(), lr=0.1, momentum=0.9))
    model(*make_data(4))
    model.copyWeightsToHost()
    return model, copy.deepcopy(module)


def assert_unchanged(model, snapshot):
    assert_same_weights(model.model, snapshot)
    model.copyWeightsToHost()
    assert_same_weights(model.model, snapshot)


def test_batch_not_a_multiple_names_options_and_multiple(mlp):
    model = poptorch.trainingModel(mlp, options(2, 3))
    with pytest.raises(poptorch.Error) as error:
        model(*make_data(8))
    message = str(error.value)
    assert "deviceIterations (2)" in message
    assert "gradientAccumulation (3)" in message
    assert "replicationFactor (1)" in message
    assert "multiple of" in message and "= 6" in message
    assert "gradient accumulation step" in message


def test_inference_batch_error_leaves_out_gradient_accumulation(mlp):
    model = poptorch.inferenceModel(mlp, options(2))
    with pytest.raises(poptorch.Error) as error:
        model(make_data(5)[0])
    message = str(error.value)
    assert "deviceIterations (2) x replicationFactor (1) = 2" in message
    assert "gradient" not in message.lower()


@pytest.mark.parametrize("bad_call,match", [
    (lambda x, y: (x[:2], y[:2]), r"Argument 'x' changed .*shape \(4, 4\)"),
    (lambda x, y: (x.half(), y), "dtype torch.float16"),
    (lambda x, y: (x,), "Argument 'y' changed.*got the value None"),
    (lambda x, y: ((x,), y), "structure of the model's arguments changed"),
    (lambda x, y: (x, y, 3), "cannot take these arguments"),
])
def test_changed_arguments_after_compile(trained, bad_call, match):
    model, snapshot = trained
    with pytest.raises(poptorch.Error, match=match):
        model(*bad_call(*make_data(4)))
    assert_unchanged(model, snapshot)


@pytest.mark.parametrize("rows,match", [
    (5, r"5 rows in dimension 0, which is not a multiple of "
        r"deviceIterations \(4\)"),
    (4, r"changed after compilation")])
def test_an_incomplete_last_batch_is_named_after_compile(mlp, rows, match):
    """A data loader's last batch of fewer rows (drop_last=False): the
    error says why the rows do not fit the compiled call, and that this is
    what an incomplete last batch does."""
    model = poptorch.inferenceModel(mlp, options(4))
    model(make_data(8)[0])
    with pytest.raises(poptorch.Error, match=match) as info:
        model(make_data(rows)[0])
    assert "incomplete last batch of a data loader" in str(info.value)
    assert "drop_last=True" in str(info.value)


def test_non_tensor_argument_change_is_an_error():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * scale

    model = poptorch.inferenceModel(Scaled())
    model(torch.ones(2), 2.0)
    with pytest.raises(poptorch.Error, match="Argument 'scale'.*2.0"):
        model(torch.ones(2), 3.0)


def test_zero_sized_tensor_is_an_error(mlp):
    with pytest.raises(poptorch.Error, match="zero-sized"):
        poptorch.inferenceModel(mlp)(torch.ones(0, 4))


def test_inference_with_gradient_accumulation_is_an_error(mlp):
    with pytest.raises(poptorch.Error, match="gradientAccumulation"):
        poptorch.inferenceModel(mlp, options(accumulation=2))


def test_options_are_frozen_once_used_and_clone_unfreezes(mlp):
    opts = options(2)
    poptorch.inferenceModel(mlp, opts)
    with pytest.raises(poptorch.Error, match="frozen"):
        opts.deviceIterations(4)
    assert opts.clone().deviceIterations(4).device_iterations == 4
    assert opts.device_iterations == 2


def test_destroyed_model_weight_copies_are_errors(trained):
    model, _ = trained
    model.destroy()
    for method in (model.copyWeightsToHost, model.copyWeightsToDevice):
        with pytest.raises(poptorch.Error, match="destroyed"):
            method()


def test_set_optimizer_with_changed_constant_is_an_error(trained):
    model, snapshot = trained
    with pytest.raises(poptorch.Error, match="nesterov"):
        model.setOptimizer(torch.optim.SGD(model.model.parameters(), lr=0.1,
                                           momentum=0.9, nesterov=True))
    assert_unchanged(model, snapshot)


def test_never_connected_model_compiles_but_does_not_run(mlp):
    opts = options(connectionType=poptorch.ConnectionType.Never)
    model = poptorch.inferenceModel(mlp, opts)
    model.compile(torch.ones(2, 4))
    assert model.isCompiled()
    with pytest.raises(poptorch.Error, match="Never"):
        model(torch.ones(2, 4))


class CountingNet(torch.nn.Module):
    """Writes a buffer of its own in forward (not a normalisation
    statistic)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, y):
        self.calls.add_(1)
        out = self.fc(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_buffers_the_model_writes_need_broadcast_buffers_off_with_replicas():
    net = CountingNet()
    before = copy.deepcopy(net.state_dict())
    model = poptorch.trainingModel(net, options(replicas=2))
    with pytest.raises(poptorch.Error,
                       match=r"\(calls\).*broadcastBuffers\(False\)"):
        model(*make_data(4))
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name])
    model.destroy()
    poptorch.trainingModel(net, options(replicas=2, broadcastBuffers=False))(
        *make_data(4))
    assert net.calls.item() == 1


def test_set_optimizer_with_changed_defaulted_weight_decay_is_an_error(
        trained):
    model, snapshot = trained
    with pytest.raises(poptorch.Error, match="weight_decay"):
        model.setOptimizer(torch.optim.SGD(model.model.parameters(), lr=0.1,
                                           momentum=0.9, weight_decay=0.1))
    assert_unchanged(model, snapshot)
