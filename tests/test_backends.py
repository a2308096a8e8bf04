"""Backends run the captured steps: "graph" as captured, "aot_eager" after
AOTAutograd's functionalization, "inductor" compiled by TorchInductor. All
must compute what plain PyTorch computes; CUDA graph replays must compute
what the plain loop computes."""
import copy

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from poptorch._impl.backends.cuda_graphs import cuda_graph_reason
from conftest import (BatchNormNet, assert_same_weights, make_images,
                      options, reference_training)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")


class WritesInput(torch.nn.Module):
    """forward writes to its argument: the write must reach the caller."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        x.mul_(2.0)
        return self.fc(x)


def _train_against_reference(backend, device_iterations=2, accumulation=2):
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    opts = options(device_iterations, accumulation)
    opts.setBackend(backend)
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    rows = 2 * device_iterations * accumulation
    for call in range(3):
        x, y = make_images(rows, seed=call)
        _, loss = model(x, y)
        expected = reference_training(twin, reference, (x, y),
                                      device_iterations, accumulation)
        torch.testing.assert_close(loss, expected[-1], atol=1e-5, rtol=1e-4)
    model.copyWeightsToHost()
    assert_same_weights(net, twin, atol=1e-5)
    return model


def _inference_writes_input(backend):
    torch.manual_seed(0)
    net = WritesInput()
    twin = copy.deepcopy(net)
    model = poptorch.inferenceModel(
        net, poptorch.Options().deviceIterations(2).setBackend(backend))
    x = torch.randn(4, 4)
    x_twin = x.clone()
    out = model(x)
    expected = torch.cat([twin(x_twin[:2]), twin(x_twin[2:])])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, x_twin)   # the write reached the caller
    return model


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
def test_training_matches_plain_pytorch(backend):
    model = _train_against_reference(backend)
    assert compiled_model(model).session.backend.name == backend


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
def test_writes_to_inputs_reach_the_caller(backend):
    _inference_writes_input(backend)


class _WritesBoth(torch.nn.Module):
    def forward(self, a, b):
        a.mul_(2.0)
        b.add_(1.0)
        return a + b


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
def test_arguments_sharing_memory_are_separate_copies(backend):
    """The same tensor passed twice (or a view of another argument) to a
    forward that writes its arguments: each argument is its own copy, as
    an IPU streams them, on every backend; the writes reach the caller in
    argument order."""
    x = torch.arange(4.0)
    model = poptorch.inferenceModel(
        _WritesBoth(), poptorch.Options().setBackend(backend))
    out = model(x, x)
    torch.testing.assert_close(out, torch.arange(4.0) * 2 +
                               torch.arange(4.0) + 1)
    torch.testing.assert_close(x, torch.arange(4.0) + 1)


@pytest.mark.slow
def test_inductor_training_matches_plain_pytorch():
    model = _train_against_reference("inductor", accumulation=2)
    step = compiled_model(model).session.steps["update"]
    assert type(step).__name__ == "InductorStep"


class _ReturnsItsDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 12)
        self.out = torch.nn.Linear(12, 1)

    def forward(self, x, y):
        h = self.fc(x)
        dropped = torch.nn.functional.dropout(h, 0.4, training=True)
        loss = torch.nn.functional.mse_loss(self.out(torch.tanh(dropped)), y)
        return h, dropped, loss


@pytest.mark.slow
def test_inductor_dropout_of_replicas_with_accumulation():
    """G = 2, R = 2, forward returning a tensor and its dropout: each
    micro-batch's dropout keeps about 60 % of the elements, and the update
    is plain PyTorch's with those masks (Inductor returned all zeros, from
    bernoulli of an expanded empty tensor, and trained on other masks)."""
    torch.manual_seed(0)
    net = _ReturnsItsDropout()
    twin = copy.deepcopy(net)
    opts = options(accumulation=2, replicas=2, randomSeed=1,
                   outputMode=poptorch.OutputMode.All, setBackend="inductor")
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.parameters(), lr=0.1))
    x, y = torch.randn(20, 6), torch.randn(20, 1)
    h, dropped, _ = model(x, y)
    masks = (dropped != 0).float()
    for kept in masks.unflatten(0, (4, 5)).mean((1, 2)):
        assert 0.3 < kept < 0.9
    torch.testing.assert_close(dropped, h * masks / 0.6)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for rows in range(0, 20, 5):
        part = slice(rows, rows + 5)
        out = twin.out(torch.tanh(twin.fc(x[part]) * masks[part] / 0.6))
        (torch.nn.functional.mse_loss(out, y[part]) / 4).backward()
    reference.step()
    assert_same_weights(net, twin)


class _SegmentSums(torch.nn.Module):
    """Rows summed into three segments chosen by their values, with
    ``index_put`` into new zeros (accumulating, and writing), and a
    ``diagonal_scatter`` into new zeros."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.fc(x)
        segment = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        sums = torch.zeros(3, 4).index_put((segment,), h, accumulate=True)
        last = torch.zeros(3, 4).index_put((segment,), h)
        diagonal = torch.zeros(4, 4).diagonal_scatter(h[:, 0])
        return sums, torch.nn.functional.mse_loss(sums + last, y) + \
            diagonal.square().mean()


@pytest.mark.slow
def test_inductor_index_put_into_new_tensors_of_replicas():
    """R = 2, G = 2: each replica's sums are its own, and the update is
    plain PyTorch's (Inductor wrote every replica into the zeros expanded
    over the replicas, and each returned the sum of both replicas'; the
    diagonal_scatter failed to compile)."""
    torch.manual_seed(0)
    net = _SegmentSums()
    twin = copy.deepcopy(net)
    opts = options(accumulation=2, replicas=2,
                   outputMode=poptorch.OutputMode.All, setBackend="inductor")
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.parameters(), lr=0.1))
    x, y = torch.randn(16, 4), torch.randn(12, 4)
    sums, _ = model(x, y)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    expected = []
    for part, target in zip(x.chunk(4), y.chunk(4)):
        part_sums, loss = twin(part, target)
        expected.append(part_sums.detach())
        (loss / 4).backward()
    reference.step()
    torch.testing.assert_close(sums, torch.cat(expected))
    assert_same_weights(net, twin)


@pytest.mark.slow
def test_inductor_keeps_writes_to_inputs():
    _inference_writes_input("inductor")


@pytest.mark.slow
def test_inductor_steps_reading_constants_load_from_their_bytes():
    """A step reading a constant tensor (a plain tensor attribute, a closure
    tensor) loads from its serialized bytes, as the cache, exported files
    and auto's background compilation load it: Inductor's artifact does not
    keep the graph's constants, so the step crashed after its tier-up."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from poptorch._impl.backends.inductor import InductorBackend
    mask = torch.tril(torch.ones(3, 3))

    def step(weight, x):
        return (x @ weight @ mask + mask.sum(),)

    weight, x = torch.randn(5, 3), torch.randn(4, 5)
    backend = InductorBackend()
    compiled = backend.compile(make_fx(step)(weight, x), [weight, x])
    for portable in (False, True):
        loaded = backend.deserialize(backend.serialize(compiled, portable))
        torch.testing.assert_close(loaded(weight, x)[0], step(weight, x)[0])


def test_auto_starts_on_the_graph_backend_on_cpu():
    """The default tiers the steps (test_tiered_compilation.py): the graph
    backend's steps until the tier-up."""
    torch.manual_seed(0)
    net = BatchNormNet().eval()
    model = poptorch.inferenceModel(net, poptorch.Options().useIpuModel(True))
    x, y = make_images(2)
    model(x, y)
    assert model.options.backend == "auto"
    session = compiled_model(model).session
    assert session.backend.name == "auto"
    assert not session.tiers.on_fast_tier
    torch.testing.assert_close(model(x, y), net(x, y))


def test_environment_variable_selects_the_backend(monkeypatch):
    monkeypatch.setenv("POPTORCH_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = poptorch.inferenceModel(BatchNormNet().eval())
    model(*make_images(2))
    assert compiled_model(model).session.backend.name == "aot_eager"


def test_set_backend_takes_precedence_over_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_BACKEND", "aot_eager")
    opts = poptorch.Options().setBackend("graph")
    model = poptorch.inferenceModel(BatchNormNet().eval(), opts)
    model(*make_images(2))
    assert compiled_model(model).session.backend.name == "graph"


def test_unknown_backend_in_the_environment_is_an_error(monkeypatch):
    monkeypatch.setenv("POPTORCH_BACKEND", "tvm")
    model = poptorch.inferenceModel(BatchNormNet().eval())
    with pytest.raises(poptorch.Error, match="POPTORCH_BACKEND: unknown "
                       "backend 'tvm'; allowed: 'auto'"):
        model(*make_images(2))
    assert not model.isCompiled()


@pytest.mark.parametrize("args,message", [
    (("tvm",), "setBackend backend must be one of 'auto', 'aot_eager', "
               "'graph', 'inductor', got 'tvm'"),
    (("graph", 1), "setBackend cuda_graphs must be a bool"),
])
def test_set_backend_rejects_bad_arguments(args, message):
    opts = poptorch.Options()
    with pytest.raises(poptorch.Error, match=message):
        opts.setBackend(*args)
    assert opts.backend == "auto" and opts.cuda_graphs is False


@pytest.mark.parametrize("writes, anchors, off_device, all_reduces, why", [
    (True, False, False, False, "writes to its input tensors"),
    (False, True, False, False, "anchored tensors"),
    (False, False, True, False, "optimizer state is kept off the device"),
    (False, False, False, True, "all-reduces the gradients with the other "
     "processes"),
])
def test_cuda_graphs_say_why_a_cuda_model_cannot_use_them(
        writes, anchors, off_device, all_reduces, why):
    cuda = torch.device("cuda")
    assert cuda_graph_reason(cuda, True, False, False, False, False) is None
    assert why in cuda_graph_reason(cuda, True, writes, anchors, off_device,
                                    all_reduces)


def test_cuda_graphs_are_not_used_with_floating_point_exceptions():
    """The device loop keeps every step's flags, which a replay would not
    hand back."""
    reason = cuda_graph_reason(torch.device("cuda"), True, False, False,
                               False, False, finite_checks=True)
    assert "floating-point exceptions" in reason


def test_cuda_graphs_are_not_used_on_the_cpu():
    """cuda_graphs=True on a CPU model runs the plain loop."""
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    opts = options(2).setBackend("graph", cuda_graphs=True).useIpuModel(True)
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = make_images(4)
    model(x, y)
    reference_training(twin, reference, (x, y), 2)
    assert compiled_model(model).cuda_graph_call is None
    assert_same_weights(net, twin, atol=1e-5)


def _cuda_training(cuda_graphs, calls, lr_change_at=None):
    torch.manual_seed(0)
    net = BatchNormNet()
    opts = options(3).setBackend("graph", cuda_graphs=cuda_graphs)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(net, opts, optimizer)
    losses = []
    for call in range(calls):
        if call == lr_change_at:
            for group in optimizer.param_groups:
                group["lr"] = 0.01
            model.setOptimizer(optimizer)
        losses.append(model(*make_images(6, seed=call))[1])
    model.copyWeightsToHost()
    return net, losses, model


@needs_cuda
def test_cuda_graph_training_matches_the_plain_loop():
    plain_net, plain_losses, _ = _cuda_training(False, 4, lr_change_at=2)
    graph_net, graph_losses, model = _cuda_training(True, 4, lr_change_at=2)
    assert compiled_model(model).cuda_graph_call is not None
    torch.testing.assert_close(torch.stack(graph_losses),
                               torch.stack(plain_losses))
    assert_same_weights(graph_net, plain_net, atol=1e-5)


@needs_cuda
def test_cuda_graph_inference_sees_new_weights():
    torch.manual_seed(0)
    net = BatchNormNet().eval()
    model = poptorch.inferenceModel(
        net, poptorch.Options().deviceIterations(2).setBackend(
            "graph", cuda_graphs=True))
    x, y = make_images(4)
    first = model(x, y)[0]
    assert compiled_model(model).cuda_graph_call is not None
    with torch.no_grad():
        net.fc.weight.mul_(2.0)
    model.copyWeightsToDevice()
    second = model(x, y)[0]
    expected = torch.cat([net(x[:2], y[:2])[0], net(x[2:], y[2:])[0]])
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(first, second)
