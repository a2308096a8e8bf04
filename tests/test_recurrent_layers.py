"""Recurrent layers train through the captured step
(``poptorch/_impl/recurrent_layers.py``): while a training step is
captured, each layer of ``torch.lstm``/``gru``/``rnn_*`` becomes one
``poptorch::recurrent_layer`` op that runs PyTorch's own function, its
backward PyTorch's own gradients of it. Compared with plain PyTorch on the
same micro-batches (atol 1e-6: the gradients differ from PyTorch's only by
the order micro-batches are summed in)."""
import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from poptorch._impl.recurrent_layers import RecurrentLayersAsOps
from conftest import (assert_same_weights, maybe_checkpointed, options,
                      reference_training)


def _features(layer) -> int:
    directions = 2 if layer.bidirectional else 1
    return directions * (getattr(layer, "proj_size", 0) or layer.hidden_size)


class Recurrent(torch.nn.Module):
    """A recurrent layer and a head; with ``checkpointed``, the layer runs
    under torch.utils.checkpoint (recomputed in the backward pass)."""

    def __init__(self, layer, checkpointed=False):
        super().__init__()
        self.layer = layer
        self.head = torch.nn.Linear(_features(layer), 3)
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
    "lstm-projections": lambda: torch.nn.LSTM(4, 6, num_layers=2,
                                              batch_first=True, proj_size=3),
    "gru": lambda: torch.nn.GRU(4, 6, batch_first=True),
    "gru-2-layers-no-bias": lambda: torch.nn.GRU(
        4, 6, num_layers=2, batch_first=True, bias=False,
        bidirectional=True),
    "rnn-relu": lambda: torch.nn.RNN(4, 6, batch_first=True,
                                     nonlinearity="relu"),
}


def _sequences(rows, seed, steps=5):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, steps, 4, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def _train_against_plain_pytorch(net, calls=2, **shape):
    """``calls`` calls of a training model against plain PyTorch on the
    same data: the weights equal its (atol 1e-6)."""
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(**shape),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    rows = 2 * shape.get("device_iterations", 1) \
        * shape.get("accumulation", 1) * shape.get("replicas", 1)
    for call in range(calls):
        data = _sequences(rows, call)
        model(*data)
        reference_training(twin, reference, data, **shape)
    assert_same_weights(net, twin)
    return model


@pytest.mark.parametrize("checkpointed", [False, True],
                         ids=["", "checkpointed"])
@pytest.mark.parametrize("make_layer", list(LAYERS.values()), ids=list(LAYERS))
def test_recurrent_layers_train_like_plain_pytorch(make_layer, checkpointed):
    """2 calls of 2 optimizer steps of 2 micro-batches; under
    torch.utils.checkpoint the recomputation runs the layer op again. The
    oneDNN switch is left on."""
    torch.manual_seed(0)
    _train_against_plain_pytorch(Recurrent(make_layer(), checkpointed),
                                 device_iterations=2, accumulation=2)
    assert torch.backends.mkldnn.enabled


def test_replicas_run_the_layer_each():
    torch.manual_seed(0)
    _train_against_plain_pytorch(Recurrent(LAYERS["lstm-2-layers"]()),
                                 replicas=2, accumulation=2)


def test_dropout_between_layers_is_applied_to_each_layers_output():
    """With dropout 1 every layer but the first sees zeros, so the result
    does not depend on random masks and equals plain PyTorch's."""
    torch.manual_seed(0)
    layer = torch.nn.GRU(4, 6, num_layers=3, batch_first=True, dropout=1.0)
    _train_against_plain_pytorch(Recurrent(layer))


class LearnedInitialState(torch.nn.Module):
    """An LSTM starting from trained states, its loss read from both its
    outputs and its final states."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True,
                                   bidirectional=True)
        self.h0 = torch.nn.Parameter(torch.randn(4, 1, 6))
        self.c0 = torch.nn.Parameter(torch.randn(4, 1, 6))
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x, y):
        rows = x.shape[0]
        h, (h_n, c_n) = self.layer(x, (self.h0.expand(-1, rows, -1),
                                       self.c0.expand(-1, rows, -1)))
        out = self.head(h[:, -1]) + (h_n + c_n).sum(0).sum(-1, keepdim=True)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_initial_and_final_states_train_like_plain_pytorch():
    torch.manual_seed(0)
    _train_against_plain_pytorch(LearnedInitialState(), accumulation=2)


def _training_step_graph(net, steps):
    """make_fx graph of the gradients of ``net``'s loss on sequences of
    ``steps`` steps, traced as a training capture traces them."""
    params = dict(net.named_parameters())
    x, y = _sequences(3, 0, steps)

    def step(weights, x, y):
        with RecurrentLayersAsOps():
            loss = torch.func.functional_call(net, weights, (x, y))[1]
        return torch.autograd.grad(loss, list(weights.values()))

    return make_fx(step, tracing_mode="fake")(params, x, y)


def test_the_captured_step_does_not_grow_with_the_sequence_length():
    """One forward and one backward op per layer, whatever the length."""
    net = Recurrent(LAYERS["gru-2-layers-no-bias"]())
    sizes = []
    for steps in (5, 40):
        nodes = list(_training_step_graph(net, steps).graph.nodes)
        ops = [str(node.target) for node in nodes
               if "recurrent_layer" in str(node.target)]
        assert sorted(ops) == ["poptorch.recurrent_layer.default"] * 2 + [
            "poptorch.recurrent_layer_backward.default"] * 2
        sizes.append(len(nodes))
    assert sizes[0] == sizes[1]


@pytest.mark.slow
def test_inductor_compiles_the_layer_ops():
    torch.manual_seed(0)
    net = Recurrent(LAYERS["lstm-bidirectional"]())
    twin = copy.deepcopy(net)
    opts = options(accumulation=2)
    opts.setBackend("inductor")
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(2):
        data = _sequences(4, call)
        model(*data)
        reference_training(twin, reference, data, accumulation=2)
    assert_same_weights(net, twin)


def test_inference_keeps_the_recurrent_layers_as_they_are():
    torch.manual_seed(0)
    net = Recurrent(LAYERS["lstm-2-layers"]()).eval()
    x, _ = _sequences(6, 0)
    model = poptorch.inferenceModel(net, options())
    torch.testing.assert_close(model(x), net(x), atol=1e-6, rtol=0)
