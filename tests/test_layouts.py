"""Tensor layouts (strides) at run time that differ from those seen at
capture: a first call with non-contiguous inputs, and backward kernels
whose real layout differs from PyTorch's prediction
(``backends/reshapes.py``). Compared with plain PyTorch on the same data
(atol 1e-6)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch
from conftest import assert_same_weights, options, reference_training

ACTIVATIONS = {"elu": F.elu, "softplus": F.softplus,
               "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
               "relu6": F.relu6}


class TokenMixing(torch.nn.Module):
    """MLP-Mixer style: an activation of a transposed activation, then a
    linear layer over the other dimension."""

    def __init__(self, activation):
        super().__init__()
        self.channels = torch.nn.Linear(8, 8)
        self.tokens = torch.nn.Linear(5, 5)
        self.activation = activation

    def forward(self, x, y):
        mixed = self.activation(self.channels(x).transpose(1, 2))
        out = self.tokens(mixed).flatten(1)
        return out, F.cross_entropy(out, y)


class AttentionRegression(torch.nn.Module):
    """MSE on the output of batch-first attention (a transposed tensor)."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, target):
        out, _ = self.attention(x, x, x, need_weights=False)
        return out, F.mse_loss(out, target)


def _train_against_plain_pytorch(net, data, backend="graph", calls=2):
    twin = copy.deepcopy(net)
    opts = options(accumulation=2)
    opts.setBackend(backend)
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(calls):
        model(*data)
        reference_training(twin, reference, data, accumulation=2)
    assert_same_weights(net, twin)


def _token_data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 5, 8, generator=generator),
            torch.randint(0, 40, (4,), generator=generator))


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_backward_kernels_laid_out_otherwise_than_predicted(name, backend):
    torch.manual_seed(0)
    _train_against_plain_pytorch(TokenMixing(ACTIVATIONS[name]),
                                 _token_data(), backend)


def test_a_loss_of_a_transposed_attention_output():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = (torch.randn(4, 5, 8, generator=generator),
            torch.randn(4, 5, 8, generator=generator))
    _train_against_plain_pytorch(AttentionRegression(), data)


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, 0.0,
                                                      batch_first=True)

    def forward(self, x, y=None):
        out = self.layer(x)
        if y is None:
            return out
        return out, F.l1_loss(out, y)


def test_a_first_call_with_non_contiguous_inputs():
    """Batch-first views of sequence-first data, in the call that compiles
    the model and in later calls, contiguous or not."""
    torch.manual_seed(0)
    net = Encoder()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    sequence_first = torch.randn(6, 2, 8)
    y = torch.randn(2, 6, 8)
    for x in (sequence_first.transpose(0, 1),
              sequence_first.transpose(0, 1).contiguous()):
        model(x, y)
        reference_training(twin, reference, (x, y))
    assert_same_weights(net, twin)
    inference = poptorch.inferenceModel(copy.deepcopy(net).eval())
    x = sequence_first.transpose(0, 1)
    torch.testing.assert_close(inference(x), twin.eval()(x), atol=1e-6,
                               rtol=0)
