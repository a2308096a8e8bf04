"""Parameters and buffers replaced by assignment in ``forward``
(``poptorch/_impl/state_writes.py``): written in place, so the captured
graph keeps them, as PyTorch does. Compared with plain PyTorch on the same
data (atol 1e-6)."""
import copy

import pytest
import torch

import poptorch
from conftest import assert_same_weights, make_data, options


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
