"""Lightning's IPU strategy on poptorch (issue 17).

The tests marked slow run ``lightning_program.py`` where Lightning 2.0 and
lightning-graphcore are installed (``pip install -e .[lightning]``) and
compare what it trained, logged and predicted with plain PyTorch. The
others need no Lightning: what the strategy reads from poptorch
(``ipuHardwareIsAvailable`` under ``POPTORCH_CPU_IS_IPU``,
``PoplarExecutor._executable``), tensors deep-copied while a step is
traced (as torchmetrics does), and ``self.log`` of a stand-in
``LightningModule`` made with each call's values.
"""
import copy
import os
import subprocess
import sys
import types

import pytest
import torch

import poptorch
from poptorch._impl.devices import select_device

from conftest import ClassifierMLP, assert_same_weights, make_data, options

PROGRAM = os.path.join(os.path.dirname(__file__), "lightning_program.py")
ATOL = 1e-5


# --- POPTORCH_CPU_IS_IPU ----------------------------------------------------
def test_cpu_is_ipu_declares_hardware_without_moving_models(monkeypatch):
    monkeypatch.delenv("POPTORCH_CPU_IS_IPU", raising=False)
    unset = (poptorch.ipuHardwareIsAvailable(), select_device(False))
    monkeypatch.setenv("POPTORCH_CPU_IS_IPU", "0")
    assert (poptorch.ipuHardwareIsAvailable(), select_device(False)) == unset
    monkeypatch.setenv("POPTORCH_CPU_IS_IPU", "1")
    assert poptorch.ipuHardwareIsAvailable()
    assert poptorch.ipuHardwareIsAvailable(64)
    assert poptorch.ipuHardwareVersion() == 2
    assert select_device(False) == unset[1]


def test_cpu_is_ipu_rejects_other_values(monkeypatch):
    monkeypatch.setenv("POPTORCH_CPU_IS_IPU", "yes")
    with pytest.raises(poptorch.Error,
                       match="POPTORCH_CPU_IS_IPU must be 1 .* or 0, "
                             "got 'yes'"):
        poptorch.ipuHardwareIsAvailable()


# --- PoplarExecutor._executable --------------------------------------------
def test_executable_exists_only_while_compiled(mlp):
    model = poptorch.inferenceModel(mlp)
    assert model._executable is None
    model(make_data(4)[0])
    assert model._executable is not None
    model.destroy()
    assert model._executable is None


# --- copy.deepcopy while traced ---------------------------------------------
class MetricInStep(torch.nn.Module):
    """A step that deep-copies tensors as torchmetrics does: a metric
    state's default (``Metric.add_state``), a detached value it records,
    and a weight (a leaf that requires gradients)."""

    def __init__(self):
        super().__init__()
        self.net = ClassifierMLP()

    def forward(self, x, y):
        out, loss = self.net(x, y)
        default = copy.deepcopy(torch.tensor(0.0))
        recorded = default + copy.deepcopy(loss.detach())
        return out, loss, recorded, copy.deepcopy(self.net.fc1.weight)


@pytest.mark.parametrize("training", [True, False])
def test_a_step_may_deep_copy_tensors(training):
    torch.manual_seed(0)
    module = MetricInStep()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = (poptorch.trainingModel(module, optimizer=optimizer) if training
             else poptorch.inferenceModel(module))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for call in range(3):
        x, y = make_data(4, seed=call)
        got = model(x, y)
        want = reference(x, y)
        if training:
            reference_optimizer.zero_grad()
            want[1].backward()
            reference_optimizer.step()
        for got_value, want_value in zip(got, want):
            torch.testing.assert_close(got_value.as_subclass(torch.Tensor),
                                       want_value.detach(), atol=ATOL,
                                       rtol=ATOL)
        torch.testing.assert_close(got[2], got[1].as_subclass(torch.Tensor))
    assert_same_weights(module, reference, atol=ATOL)


# --- self.log of a LightningModule ------------------------------------------
class StandInLightningModule(torch.nn.Module):
    """Lightning's ``LightningModule`` as far as logging goes: ``log``
    keeps a detached copy of each value it is given, with its options."""

    def __init__(self):
        super().__init__()
        self.logged = []

    def log(self, name, value, prog_bar=False, on_step=None):
        if isinstance(value, torch.Tensor):
            value = value.clone().detach()
        self.logged.append((name, value, prog_bar, on_step))


class LoggingClassifier(StandInLightningModule):
    def __init__(self):
        super().__init__()
        self.net = ClassifierMLP()

    def forward(self, x, y):
        out, loss = self.net(x, y)
        self.log("loss", loss, prog_bar=True)
        self.log("constant", 2.5, on_step=False)
        return out, loss


class StepWrapper(torch.nn.Module):
    """The module Lightning's strategy hands to poptorch: it holds the
    LightningModule and calls its step."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x, y):
        return self.module(x, y)


@pytest.fixture
def stand_in_lightning(monkeypatch):
    """``lightning.pytorch`` as imported, with the stand-in class."""
    package = types.ModuleType("lightning.pytorch")
    package.LightningModule = StandInLightningModule
    monkeypatch.setitem(sys.modules, "lightning.pytorch", package)


def _assert_logged(logged, losses):
    """``logged`` holds, per call, the loss then the constant."""
    expected = []
    for call_losses in losses:
        expected += [("loss", loss, True, None) for loss in call_losses]
        expected.append(("constant", 2.5, False, False))
    assert [entry[0] for entry in logged] == [e[0] for e in expected]
    for got, want in zip(logged, expected):
        assert got[2:] == want[2:]
        torch.testing.assert_close(torch.as_tensor(got[1]),
                                   torch.as_tensor(want[1]), atol=ATOL,
                                   rtol=ATOL)
        assert type(got[1]) in (torch.Tensor, float)


def test_training_steps_log_each_calls_values(stand_in_lightning):
    torch.manual_seed(0)
    module = LoggingClassifier()
    reference = copy.deepcopy(module.net)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = poptorch.trainingModel(StepWrapper(module), optimizer=optimizer)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for call in range(3):
        x, y = make_data(4, seed=call)
        _, loss = model(x, y)
        reference_optimizer.zero_grad()
        _, want = reference(x, y)
        want.backward()
        reference_optimizer.step()
        losses.append([want.detach()])
        torch.testing.assert_close(loss.as_subclass(torch.Tensor),
                                   want.detach(), atol=ATOL, rtol=ATOL)
    _assert_logged(module.logged, losses)
    assert_same_weights(module.net, reference, atol=ATOL)


def test_inference_logs_each_micro_batch(stand_in_lightning):
    torch.manual_seed(0)
    module = LoggingClassifier()
    reference = copy.deepcopy(module.net)
    model = poptorch.inferenceModel(StepWrapper(module),
                                    options(device_iterations=2))
    losses = []
    for call in range(2):
        x, y = make_data(8, seed=call)
        model(x, y)
        losses.append([reference(x[:4], y[:4])[1].detach(),
                       reference(x[4:], y[4:])[1].detach()])
    _assert_logged(module.logged, losses)


# --- Lightning itself ------------------------------------------------------
def _run_program(tmp_path, flavour: str) -> dict:
    output = tmp_path / "lightning.pt"
    run = subprocess.run([sys.executable, PROGRAM, str(output), flavour],
                         capture_output=True, text=True,
                         env={**os.environ, "POPTORCH_CPU_IS_IPU": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(output)


def _reference_run(initial, x, y, batch, epochs, lr):
    """Plain PyTorch: the per-step losses and accuracies, the final
    weights' validation loss and predictions, and the final weights."""
    net = ClassifierMLP()
    net.load_state_dict(initial)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    steps = []
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            logits, loss = net(x[start:start + batch], y[start:start + batch])
            accuracy = (logits.argmax(1) == y[start:start + batch]).float()
            steps.append((loss.detach(), accuracy.mean()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        batches = [(x[s:s + batch], y[s:s + batch])
                   for s in range(0, len(x), batch)]
        val_loss = torch.stack([net(bx, by)[1] for bx, by in batches]).mean()
        predictions = [net(bx) for bx, _ in batches]
    return steps, val_loss, predictions, net


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["graphcore", "builtin"])
def test_lightning_fit_validate_predict(tmp_path, flavour):
    pytest.importorskip("lightning.pytorch")
    if flavour == "graphcore":
        pytest.importorskip("lightning_graphcore")
    result = _run_program(tmp_path, flavour)
    x, y = result["data"]
    steps, val_loss, predictions, net = _reference_run(
        result["initial"], x, y, batch=8, epochs=2, lr=0.1)
    assert len(result["steps"]) == len(steps)
    for logged, (loss, accuracy) in zip(result["steps"], steps):
        torch.testing.assert_close(logged["train_loss_step"], loss,
                                   atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(logged["train_acc"], accuracy)
        assert logged["constant"].item() == 2.5
    last_epoch = torch.stack([loss for loss, _ in steps[-4:]]).mean()
    torch.testing.assert_close(result["fitted"]["train_loss_epoch"],
                               last_epoch, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(result["fitted"]["val_loss"], val_loss,
                               atol=ATOL, rtol=ATOL)
    assert result["validated"][0]["val_loss"] == pytest.approx(
        val_loss.item(), abs=ATOL)
    for got, want in zip(result["predictions"], predictions):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    final = ClassifierMLP()
    final.load_state_dict(result["final"])
    assert_same_weights(final, net, atol=ATOL)
