"""Operations mixing float16 and float32 tensors follow
``Precision.halfFloatCasting`` (features chapter "Half / float16 support"):
by default they compute in float16, so a float32 model takes float16
inputs; ``HalfUpcastToFloat`` computes them in float32. Each case is
compared with plain PyTorch doing the same casts by hand."""
import copy

import pytest
import torch

import poptorch
from conftest import cast_linear, maybe_checkpointed, options


class Classifier(torch.nn.Module):
    """With ``checkpointed``, the hidden layer runs under
    torch.utils.checkpoint (recomputed in the backward pass)."""

    def __init__(self, checkpointed=False):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def _features(self, x):
        return torch.relu(self.hidden(x))

    def forward(self, x, y=None):
        features = maybe_checkpointed(self._features, x, self.checkpointed)
        logits = self.out(features)
        if y is None:
            return logits
        return logits, torch.nn.functional.cross_entropy(logits, y)


def _by_hand(net, x, dtype):
    """``net`` on ``x`` with every float tensor cast to ``dtype``."""
    h = cast_linear(net.hidden, x, dtype)
    return cast_linear(net.out, torch.relu(h), dtype)


def _half_options(behavior=None, **extra):
    opts = options(**extra)
    if behavior is not None:
        opts.Precision.halfFloatCasting(behavior)
    return opts


@pytest.mark.parametrize("behavior, dtype", [
    (None, torch.float16),
    (poptorch.HalfFloatCastingBehavior.FloatDowncastToHalf, torch.float16),
    (poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat, torch.float32),
])
def test_a_float32_model_runs_on_float16_inputs(behavior, dtype):
    """In plain PyTorch the float16 input makes Linear raise; here the
    weights are cast to float16 (or the input to float32); the output
    equals PyTorch with those casts made by hand (exactly)."""
    torch.manual_seed(0)
    net = Classifier()
    x = torch.randn(6, 4).half()
    with pytest.raises(RuntimeError, match="dtype"):
        net(x)
    model = poptorch.inferenceModel(net, _half_options(behavior))
    out = model(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _by_hand(net, x, dtype), atol=0, rtol=0)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_keeps_float32_weights_and_updates(checkpointed):
    """float32 weights, float16 inputs: the forward pass runs in float16
    (its recomputation under torch.utils.checkpoint too), gradients reach
    the float32 weights through the casts, and the SGD update is float32,
    as PyTorch computes it with the casts written out (atol 1e-6 after two
    steps)."""
    torch.manual_seed(0)
    net = Classifier(checkpointed)
    twin = copy.deepcopy(net)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(
        net, _half_options(), torch.optim.SGD(net.parameters(), lr=0.1,
                                              momentum=0.9))
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 4, generator=generator).half()
        y = torch.randint(0, 3, (6,), generator=generator)
        logits, loss = model(x, y)
        assert logits.dtype == torch.float16
        optimizer.zero_grad()
        reference = torch.nn.functional.cross_entropy(
            _by_hand(twin, x, torch.float16), y)
        reference.backward()
        optimizer.step()
        torch.testing.assert_close(loss, reference.detach(), atol=0, rtol=0)
    for name, value in net.named_parameters():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, dict(twin.named_parameters())[name],
                                   atol=1e-6, rtol=0)


class Recurrent(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.layer = kind(4, 6, num_layers=2, batch_first=True,
                          bidirectional=True)
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x, y):
        logits = self.out(self.layer(x)[0][:, -1])
        return logits, torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("kind", [torch.nn.GRU, torch.nn.LSTM])
def test_float32_recurrent_layers_train_on_float16_inputs(kind):
    """PyTorch's recurrent layers refuse an input of another dtype than
    their weights (outside autocast); under the half/float rule they run in
    float16 on the float32 weights cast, as PyTorch with the casts written
    out (functional_call on float16 copies), and train float32 weights
    (rtol 1e-3: float16 kernels)."""
    torch.manual_seed(0)
    net = Recurrent(kind)
    twin = copy.deepcopy(net)
    x = torch.randn(4, 5, 4).half()
    y = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="does not match weight dtype"):
        net(x, y)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    model = poptorch.trainingModel(
        net, _half_options(), torch.optim.SGD(net.parameters(), lr=0.5))
    for _ in range(2):
        _, loss = model(x, y)
        optimizer.zero_grad()
        halves = {name: value.half() for name, value in
                  twin.named_parameters()}
        reference = torch.func.functional_call(twin, halves, (x, y))[1]
        reference.float().backward()
        optimizer.step()
        torch.testing.assert_close(loss.float(), reference.float(),
                                   rtol=1e-3, atol=1e-3)
    for name, value in net.named_parameters():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, dict(twin.named_parameters())[name],
                                   rtol=1e-3, atol=1e-3)


class MixedParameters(torch.nn.Module):
    """float32 and float16 layers with the casts written by hand (the
    features chapter's third way to use float16)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 8).half()
        self.fc3 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        hidden = torch.tanh(self.fc2(torch.relu(self.fc1(x)).half()))
        logits = self.fc3(hidden.float())
        return logits, torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("behavior", [
    poptorch.HalfFloatCastingBehavior.Default,
    poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat])
def test_float32_and_float16_parameters_all_train(behavior):
    """No operation mixes the dtypes, so both casting rules train every
    parameter as PyTorch does (the backward pass's list of parameters of
    both dtypes is not cast; it was, and one dtype got no gradients)."""
    torch.manual_seed(0)
    net = MixedParameters()
    twin = copy.deepcopy(net)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    model = poptorch.trainingModel(
        net, _half_options(behavior),
        poptorch.optim.SGD(net.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=generator), torch.tensor([0, 1, 2] * 2)
    for _ in range(3):
        _, loss = model(x, y)
        optimizer.zero_grad()
        reference = twin(x, y)[1]
        reference.backward()
        optimizer.step()
        torch.testing.assert_close(loss, reference.detach())
    for name, value in net.named_parameters():
        torch.testing.assert_close(value, dict(twin.named_parameters())[name])


class Normalised(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return poptorch.identity_loss(self.norm(self.conv(x)).sum(),
                                      reduction="sum")


def test_batch_norm_keeps_float32_running_statistics():
    """The convolution runs in float16; BatchNorm gets the float16
    activations with its float32 weights and statistics, as PyTorch runs
    it, and its running statistics stay float32 buffers updated like
    PyTorch's (atol 1e-6)."""
    torch.manual_seed(0)
    net = Normalised()
    twin = copy.deepcopy(net)
    x = torch.randn(4, 2, 5, 5).half()
    model = poptorch.trainingModel(
        net, _half_options(), torch.optim.SGD(net.parameters(), lr=0.0))
    model(x)
    model.copyWeightsToHost()
    activations = torch.nn.functional.conv2d(
        x, twin.conv.weight.half(), twin.conv.bias.half(), padding=1)
    twin.norm(activations)
    assert net.norm.running_mean.dtype == torch.float32
    torch.testing.assert_close(net.norm.running_mean,
                               twin.norm.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(net.norm.running_var, twin.norm.running_var,
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm, training", [
    (torch.nn.BatchNorm2d(3), False), (torch.nn.BatchNorm2d(3), True),
    (torch.nn.InstanceNorm2d(3, affine=True), False)])
def test_replicas_normalise_float16_inputs_with_float32_weights(norm,
                                                                 training):
    """Two replicas of an inference model whose float32 normalisation
    (BatchNorm in evaluation or training mode, InstanceNorm) meets a
    float16 input: float16 outputs equal to PyTorch's on each replica's
    half of the batch, within a float16 rounding unit (vmap's own rules
    failed for BatchNorm and returned float32 for InstanceNorm)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), norm)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if isinstance(norm, torch.nn.BatchNorm2d):
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
    net.train(training)
    x = torch.randn(4, 2, 5, 5).half()
    halves = {name: value.half() for name, value in
              net[0].named_parameters(prefix="0")}
    expected = torch.cat([torch.func.functional_call(net, halves, (part,))
                          for part in x.split(2)])
    model = poptorch.inferenceModel(copy.deepcopy(net),
                                    _half_options(replicationFactor=2))
    out = model(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=2e-3)


class Conversions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        as_float = x.type_as(self.scale)       # a cast asked for: float32
        scaled = x * torch.tensor(3.0)         # 0-d: PyTorch promotion
        return as_float, scaled, x + self.scale


def test_explicit_conversions_and_0d_tensors_follow_pytorch():
    model = poptorch.inferenceModel(Conversions(), _half_options())
    x = torch.tensor([1.0, 2.0, 3.0]).half()
    as_float, scaled, mixed = model(x)
    assert (as_float.dtype, scaled.dtype, mixed.dtype) == (
        torch.float32, torch.float16, torch.float16)
    torch.testing.assert_close(mixed, (x.float() + 2).half())


def test_bad_casting_behavior_is_an_error():
    with pytest.raises(poptorch.Error, match="halfFloatCasting"):
        poptorch.Options().Precision.halfFloatCasting("half")
