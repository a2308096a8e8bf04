"""Shared models, data and the plain-PyTorch reference loop."""
import copy
import io
import logging
import os
import socket

import pytest
import torch
import torch.utils.checkpoint

import poptorch
from poptorch._impl import logger as logger_module

# On a GPU, float32 convolutions and matrix products default to TF32; the
# tests compare with float32 references at float32 tolerances.
torch.backends.cudnn.conv.fp32_precision = "ieee"
torch.backends.cuda.matmul.fp32_precision = "ieee"

# The default backend ("auto") compiles a model's steps with Inductor in
# the background once it has run POPTORCH_TIER_UP_AFTER seconds of calls;
# the tests of that (test_tiered_compilation.py) set it themselves, the
# others run on the graph tier without starting compilations.
os.environ.setdefault("POPTORCH_TIER_UP_AFTER", "inf")


class ClassifierMLP(torch.nn.Module):
    """A small MLP that computes its loss in forward when labels are given."""

    def __init__(self, features=4, hidden=8, classes=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if y is None:
            return out
        return out, self.loss(out, y)


class BatchNormNet(torch.nn.Module):
    """A small CNN with BatchNorm (buffers written in training)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 2)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        out = self.fc(h.flatten(1))
        return out, torch.nn.functional.cross_entropy(out, y)


class TwoBlocksNet(torch.nn.Module):
    """Two blocks on IPUs 0 and 1 (a multi-stage model), a BatchNorm in the
    first."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            h = self.bn(torch.relu(self.fc1(x)))
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(h)
            return out, torch.nn.functional.cross_entropy(out, y)


def checkpoint(value):
    """``value`` through torch.save / torch.load, as a checkpoint file."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def make_data(rows, features=4, classes=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    y = torch.randint(0, classes, (rows,), generator=generator)
    return x, y


def make_images(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, 6, 6, generator=generator)
    y = torch.randint(0, 2, (rows,), generator=generator)
    return x, y


def reference_training(model, optimizer, inputs, device_iterations=1,
                       accumulation=1, replicas=1, mean=True):
    """Plain PyTorch doing what one call of a training model does: the call's
    data is [D, G, R, S]; per device iteration, G x R micro-batch backward
    passes (loss divided by G x R for Mean) then one optimizer step.
    Returns the losses of every micro-batch in [D, G, R] order."""
    micro = accumulation * replicas
    splits = [t.unflatten(0, (device_iterations, accumulation, replicas, -1))
              for t in inputs]
    losses = []
    for d in range(device_iterations):
        optimizer.zero_grad()
        for g in range(accumulation):
            for r in range(replicas):
                _, loss = model(*[s[d, g, r] for s in splits])
                (loss / micro if mean else loss).backward()
                losses.append(loss.detach())
        optimizer.step()
    return torch.stack(losses)


def maybe_checkpointed(function, x, checkpointed):
    """``function(x)``, under non-reentrant torch.utils.checkpoint (so
    recomputed in the backward pass) when ``checkpointed``."""
    if checkpointed:
        return torch.utils.checkpoint.checkpoint(function, x,
                                                 use_reentrant=False)
    return function(x)


def cast_linear(layer, x, dtype):
    """``layer`` (a torch.nn.Linear) on ``x`` with the input, weight and
    bias cast to ``dtype``, as a casting rule computes it."""
    return torch.nn.functional.linear(x.to(dtype), layer.weight.to(dtype),
                                      layer.bias.to(dtype))


class WithLoss(torch.nn.Module):
    """The tutorials' wrapper: a model and its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def assert_same_weights(module_a, module_b, atol=1e-6):
    state_a, state_b = module_a.state_dict(), module_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        torch.testing.assert_close(state_a[name], state_b[name], atol=atol,
                                   rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_trains_like_plain_pytorch(make_model, lr, calls=2):
    """Calls of a training model of ``make_model()`` on 4 rows return the
    loss plain PyTorch computes (the second output) and leave the weights
    of the same SGD steps."""
    torch.manual_seed(0)
    net, twin = make_model(), make_model()
    twin.load_state_dict(net.state_dict())
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=lr))
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr)
    for seed in range(calls):
        x, y = make_data(4, seed=seed)
        _, loss = model(x, y)
        expected = reference_training(twin, optimizer, (x, y))
        torch.testing.assert_close(loss, expected[0])
    assert_same_weights(net, twin)


def assert_same_batches(actual, expected):
    """Equal batch structures and equal tensors, batch by batch."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
        want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
        assert got_spec == want_spec
        for got_leaf, want_leaf in zip(got_leaves, want_leaves):
            assert torch.equal(got_leaf, want_leaf)


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return ClassifierMLP()


@pytest.fixture
def twin(mlp):
    """An identical copy of the ``mlp`` fixture for reference runs."""
    return copy.deepcopy(mlp)


def options(device_iterations=1, accumulation=1, replicas=1, **extra):
    opts = poptorch.Options()
    opts.deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    for name, value in extra.items():
        args = value if isinstance(value, tuple) else (value,)
        getattr(opts, name)(*args)
    return opts


@pytest.fixture
def poptorch_log(caplog, monkeypatch):
    """INFO records of the poptorch logger (which does not propagate), with
    the log-once memory emptied and a new run of repeats (maxRepeatLogs)."""
    monkeypatch.setattr(logger_module, "_said_once", set())
    logger_module.repeat_limit.end_run()
    caplog.set_level(logging.INFO, logger="poptorch")
    logger_module.logger.addHandler(caplog.handler)
    yield caplog
    logger_module.logger.removeHandler(caplog.handler)


def free_port() -> int:
    """A TCP port nobody listens on now, for a test's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]