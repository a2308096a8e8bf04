"""Weights between host and device (semantics.md)."""
import copy
import pickle

import pytest
import torch

import poptorch
from poptorch._impl.device_state import DeviceState
from conftest import ClassifierMLP, assert_same_weights, make_data, options


@pytest.fixture
def count_copies_to_host(monkeypatch):
    counter = {"copies": 0}
    original = DeviceState.store_to_host

    def counting(self, module):
        counter["copies"] += 1
        original(self, module)

    monkeypatch.setattr(DeviceState, "store_to_host", counting)
    return counter


def test_host_read_after_training_copies_back_once(mlp, count_copies_to_host):
    before = mlp.fc1.weight.detach().clone()
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(*make_data(4))
    assert count_copies_to_host["copies"] == 0
    after = mlp.fc1.weight.detach().clone()
    assert not torch.equal(before, after)
    assert count_copies_to_host["copies"] == 1
    list(mlp.parameters())
    mlp.state_dict()
    assert count_copies_to_host["copies"] == 1
    model(*make_data(4))
    mlp.state_dict()
    assert count_copies_to_host["copies"] == 2


def test_calling_the_module_on_host_uses_trained_weights(mlp, twin):
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    optimizer.zero_grad()
    twin(x, y)[1].backward()
    optimizer.step()
    torch.testing.assert_close(mlp(x), twin(x))


def test_copy_weights_to_host_if_needed_reports_copies(mlp):
    model = poptorch.trainingModel(mlp, options())
    model(*make_data(4))
    assert model.copyWeightsToHostIfNeeded() is True
    assert model.copyWeightsToHostIfNeeded() is False


def test_inference_model_sees_newly_trained_weights(mlp):
    x, y = make_data(4)
    mlp.eval()
    inference = poptorch.inferenceModel(mlp)
    before = inference(x)
    training = poptorch.trainingModel(
        mlp, options(), torch.optim.SGD(mlp.parameters(), lr=0.5))
    training(x, y)
    after = inference(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, mlp(x))


@pytest.mark.parametrize("wrapped", ["before training", "after training"])
def test_inference_compiled_after_training_starts_from_trained_weights(
        mlp, twin, wrapped):
    """An inference model whose first call comes after a training call
    compiles from the trained weights (equal to plain PyTorch's, atol
    1e-6), whether it was wrapped before or after the training model."""
    x, y = make_data(4)
    training = poptorch.trainingModel(
        mlp, options(), torch.optim.SGD(mlp.parameters(), lr=0.5))
    if wrapped == "before training":
        inference = poptorch.inferenceModel(mlp)
    training(x, y)
    if wrapped == "after training":
        inference = poptorch.inferenceModel(mlp)
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    reference.zero_grad()
    twin(x, y)[1].backward()
    reference.step()
    torch.testing.assert_close(inference(x), twin(x), atol=1e-6, rtol=0)


def test_host_changes_need_copy_weights_to_device(mlp):
    x, _ = make_data(2)
    model = poptorch.inferenceModel(mlp)
    before = model(x)
    with torch.no_grad():
        mlp.fc2.bias.add_(1.0)
    torch.testing.assert_close(model(x), before)
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), before + 1.0)


def test_load_state_dict_reaches_the_device(mlp):
    x, _ = make_data(2)
    model = poptorch.inferenceModel(mlp)
    model(x)
    other = ClassifierMLP()
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(x), other(x))


def test_second_training_model_is_an_error_until_destroy(mlp):
    first = poptorch.trainingModel(mlp, options())
    with pytest.raises(poptorch.Error, match="already wrapped in a training"):
        poptorch.trainingModel(mlp, options())
    first.destroy()
    poptorch.trainingModel(mlp, options())(*make_data(2))


def test_destroy_keeps_trained_weights_and_recompiles(mlp, twin):
    x, y = make_data(2)
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(x, y)
    model.destroy()
    assert not model.isCompiled()
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    reference.zero_grad()
    twin(x, y)[1].backward()
    reference.step()
    assert_same_weights(mlp, twin)
    with pytest.raises(poptorch.Error, match="destroyed"):
        model.copyWeightsToHost()
    with pytest.raises(poptorch.Error, match="destroyed"):
        model.copyWeightsToDevice()
    model(x, y)
    assert model.isCompiled()


def test_module_pickles_as_its_own_class_after_wrapping(mlp):
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(*make_data(4))
    restored = pickle.loads(pickle.dumps(mlp))
    assert type(restored) is ClassifierMLP
    assert_same_weights(restored, mlp)
    assert type(copy.deepcopy(mlp)) is ClassifierMLP


def test_executor_round_trips_through_torch_save(mlp, tmp_path):
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(x, y)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded, poptorch.PoplarExecutor)
    assert_same_weights(loaded.model, mlp)
    torch.testing.assert_close(loaded(x, y)[1], model(x, y)[1])


def test_detach_and_attach(mlp):
    model = poptorch.inferenceModel(mlp)
    x, _ = make_data(2)
    expected = model(x)
    assert model.isAttachedToDevice()
    model.detachFromDevice()
    assert not model.isAttachedToDevice()
    torch.testing.assert_close(model(x), expected)
    assert model.isAttachedToDevice()


def test_training_flags_are_kept_from_wrap_time():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.9))
    net.eval()
    model = poptorch.inferenceModel(net)
    net.train()
    x = torch.ones(2, 4)
    torch.testing.assert_close(model(x), net[0](x))
