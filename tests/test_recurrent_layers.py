"""Recurrent layers train through the captured step
(``poptorch/_impl/recurrent_layers.py``): PyTorch's oneDNN kernels for them
need grad mode on in their backward pass, so a training capture traces
them into PyTorch's own cell operations instead. Compared with plain
PyTorch on the same micro-batches."""
import copy

import pytest
import torch

import poptorch
from conftest import (assert_same_weights, maybe_checkpointed, options,
                      reference_training)


class Recurrent(torch.nn.Module):
    """A recurrent layer and a head; with ``checkpointed``, the layer runs
    under torch.utils.checkpoint (recomputed in the backward pass)."""

    def __init__(self, layer, checkpointed=False):
        super().__init__()
        self.layer = layer
        self.head = torch.nn.Linear(2 * 6 if layer.bidirectional else 6, 3)
        self.checkpointed = checkpointed

    def forward(self, x, y=None):
        h, _ = maybe_checkpointed(self.layer, x, self.checkpointed)
        out = self.head(h[:, -1])
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


LAYERS = {
    "lstm-2-layers": lambda: torch.nn.LSTM(4, 6, num_layers=2,
                                           batch_first=True),
    "lstm-bidirectional": lambda: torch.nn.LSTM(4, 6, batch_first=True,
                                                bidirectional=True),
    "gru": lambda: torch.nn.GRU(4, 6, batch_first=True),
    "rnn-relu": lambda: torch.nn.RNN(4, 6, batch_first=True,
                                     nonlinearity="relu"),
}


def _sequences(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 5, 4, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


@pytest.mark.parametrize("checkpointed", [False, True],
                         ids=["", "checkpointed"])
@pytest.mark.parametrize("make_layer", list(LAYERS.values()), ids=list(LAYERS))
def test_recurrent_layers_train_like_plain_pytorch(make_layer, checkpointed):
    """2 calls of 2 optimizer steps of 2 micro-batches: the weights equal
    plain PyTorch's (atol 1e-5: its oneDNN kernels round differently from
    the cell operations), and oneDNN is still on afterwards. Under
    torch.utils.checkpoint the recomputation runs the cell operations too."""
    torch.manual_seed(0)
    net = Recurrent(make_layer(), checkpointed)
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(device_iterations=2, accumulation=2),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for call in range(2):
        x, y = _sequences(8, call)
        model(x, y)
        reference_training(twin, reference, (x, y), device_iterations=2,
                           accumulation=2)
    assert_same_weights(net, twin, atol=1e-5)
    assert torch.backends.mkldnn.enabled


def test_inference_keeps_the_recurrent_layers_as_they_are():
    torch.manual_seed(0)
    net = Recurrent(LAYERS["lstm-2-layers"]()).eval()
    x, _ = _sequences(6, 0)
    model = poptorch.inferenceModel(net, options())
    torch.testing.assert_close(model(x), net(x), atol=1e-6, rtol=0)
