"""BatchNorm with ``momentum=None`` (cumulative moving average of the batch
statistics) is captured and trains like plain PyTorch
(``poptorch/_impl/cumulative_batch_norm.py``)."""
import copy

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (assert_same_weights, make_data, options,
                      reference_training)


class CumulativeNet(torch.nn.Module):
    def __init__(self, stages: bool = False):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8, momentum=None)
        self.out = torch.nn.Linear(8, 3)
        if stages:
            self.out = poptorch.BeginBlock(self.out, ipu_id=1)

    def forward(self, x, y=None):
        logits = self.out(torch.relu(self.norm(self.hidden(x))))
        if y is None:
            return logits
        return logits, torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("stages", [False, True])
def test_training_keeps_the_cumulative_average_like_pytorch(stages):
    """3 optimizer steps of 3 micro-batches each (9 batch-norm updates; the
    second model runs as 2 pipelined stages, the batch norm in the first):
    weights, running statistics and num_batches_tracked equal plain
    PyTorch's (atol 1e-6), and the model still has momentum=None
    afterwards."""
    torch.manual_seed(0)
    net = CumulativeNet(stages)
    twin = copy.deepcopy(net)
    opts = options(device_iterations=3, accumulation=3)
    if stages:
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(3 * 3 * 5)
    model(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y), device_iterations=3, accumulation=3)
    assert int(net.norm.num_batches_tracked) == 9
    if stages:
        assert len(compiled_model(model).engine.execution.graph.stages) == 2
    assert_same_weights(net, twin, atol=1e-6)
    assert net.norm.momentum is None


def test_inference_after_training_uses_the_cumulative_statistics():
    torch.manual_seed(0)
    net = CumulativeNet()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(device_iterations=2),
        torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(2 * 6)
    model(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y), device_iterations=2)
    model.detachFromDevice()
    inference = poptorch.inferenceModel(net.eval(), options())
    torch.testing.assert_close(inference(x), twin.eval()(x), atol=1e-6,
                               rtol=0)
