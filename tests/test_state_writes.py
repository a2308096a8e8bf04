"""Parameters and buffers replaced by assignment in ``forward``
(``poptorch/_impl/state_writes.py``): written in place, so the captured
graph keeps them, as PyTorch does. Compared with plain PyTorch on the same
data (atol 1e-6)."""
import copy

import pytest
import torch

import poptorch
from conftest import WithLoss, assert_same_weights, make_data, options


class MomentumEncoder(torch.nn.Module):
    """MoCo: a key encoder following the query encoder by a momentum
    update through ``.data``."""

    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(4, 3)
        self.key = torch.nn.Linear(4, 3)
        for key in self.key.parameters():
            key.requires_grad_(False)

    @torch.no_grad()
    def _momentum_update(self):
        for query, key in zip(self.query.parameters(),
                              self.key.parameters()):
            key.data = key.data * 0.5 + query.data * 0.5

    def forward(self, x, y):
        self._momentum_update()
        logits = self.query(x) + self.key(x)
        return logits, torch.nn.functional.cross_entropy(logits, y)


class ReassignedAverage(torch.nn.Module):
    """A running average buffer assigned anew on every call."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("average", torch.zeros(3))

    def forward(self, x, y):
        out = self.fc(x)
        self.average = 0.5 * self.average + out.detach().mean(0)
        return self.average.clone(), torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("make_model", [MomentumEncoder, ReassignedAverage],
                         ids=["data-assignment", "buffer-assignment"])
def test_assigned_state_persists_like_pytorch(make_model):
    """3 calls of 2 device iterations; the outputs of every iteration and
    the final weights and buffers equal plain PyTorch's."""
    torch.manual_seed(0)
    net = make_model()
    twin = copy.deepcopy(net)
    opts = options(device_iterations=2)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(3):
        x, y = make_data(4, seed=call)
        outputs, _ = model(x, y)
        expected = []
        for rows in (slice(0, 2), slice(2, 4)):
            optimizer.zero_grad()
            out, loss = twin(x[rows], y[rows])
            loss.backward()
            optimizer.step()
            expected.append(out.detach())
        torch.testing.assert_close(outputs, torch.cat(expected), atol=1e-6,
                                   rtol=0)
    assert_same_weights(net, twin)


def test_a_buffer_assigned_another_shape_is_an_error():
    class Growing(ReassignedAverage):
        def forward(self, x, y):
            self.average = torch.zeros(4)
            return super().forward(x, y)

    model = poptorch.trainingModel(Growing(), options())
    with pytest.raises(poptorch.Error,
                       match="Buffer 'average' of Growing .*shape"):
        model(*make_data(2))


def _qat_linear():
    """torch.ao's default QAT set-up: per-channel weight fake-quantization,
    whose observers resize their buffers on their first call."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.ao.quantization.QuantStub(),
                              torch.nn.Linear(4, 3),
                              torch.ao.quantization.DeQuantStub())
    net.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    return torch.ao.quantization.prepare_qat(net.train(), inplace=True)


@pytest.mark.filterwarnings("ignore")  # torch.ao deprecation notices
def test_buffers_resized_by_observers_are_an_error_before_any_change():
    """The fused observers' fake kernels keep the shapes the real kernels
    change: the call that resizes is rolled back and names the buffer."""
    module = WithLoss(_qat_linear())
    snapshot = copy.deepcopy(module)
    model = poptorch.trainingModel(module, options(2), torch.optim.SGD(
        module.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="Buffer 'model.1.weight_fake_"
                       r"quant.scale' changes shape in forward, from \(1,\) "
                       r"to \(3,\).*Run the module once"):
        model(*make_data(4))
    model.copyWeightsToHost()
    assert_same_weights(module, snapshot)


@pytest.mark.filterwarnings("ignore")  # torch.ao deprecation notices
def test_qat_after_a_first_pytorch_call_trains_like_pytorch():
    module = WithLoss(_qat_linear())
    x, y = make_data(4)
    with torch.no_grad():
        module(x, y)
    twin = copy.deepcopy(module)
    model = poptorch.trainingModel(module, options(2), torch.optim.SGD(
        module.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(3):
        model(x, y)
        for half_x, half_y in zip(x.split(2), y.split(2)):
            optimizer.zero_grad()
            twin(half_x, half_y)[1].backward()
            optimizer.step()
    assert_same_weights(module, twin, atol=1e-6)


def test_a_buffer_resized_in_place_is_an_error():
    class Histogram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x):
            self.seen.resize_(4).copy_(x.mean(0))
            return x * 2

    model = poptorch.inferenceModel(Histogram())
    with pytest.raises(poptorch.Error, match=r"Buffer 'seen' changes shape "
                       r"in forward, from \(1,\) to \(4,\)"):
        model(torch.ones(2, 4))


@pytest.mark.filterwarnings("ignore")  # torch.ao deprecation notices
def test_a_converted_integer_model_is_refused_naming_a_layer():
    """After torch.ao's convert() the layers hold quantized tensors; a
    quantizable float model's FloatFunctional still runs."""
    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.add = torch.ao.nn.quantized.FloatFunctional()

        def forward(self, x):
            return self.add.add(self.fc(x), x)

    net = Residual().eval()
    x = torch.randn(4, 4)
    torch.testing.assert_close(poptorch.inferenceModel(net)(x), net(x))
    quantized = torch.nn.Sequential(torch.ao.quantization.QuantStub(),
                                    torch.nn.Linear(4, 2),
                                    torch.ao.quantization.DeQuantStub())
    quantized.eval().qconfig = torch.ao.quantization.get_default_qconfig(
        "fbgemm")
    torch.ao.quantization.prepare(quantized, inplace=True)
    quantized(x)
    torch.ao.quantization.convert(quantized, inplace=True)
    with pytest.raises(poptorch.Error, match=r"integer-quantized layers "
                       r"\('0' \(Quantize\).*before convert\(\)"):
        poptorch.inferenceModel(quantized)(x)
