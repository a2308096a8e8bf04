"""A training model with nothing to train (every parameter frozen, an
optimizer over no parameter that reaches the loss, no parameters at all)
runs its forward pass for every micro-batch, writes its buffers and returns
its outputs and loss as plain PyTorch computes them, and updates nothing."""
import copy

import pytest
import torch

import poptorch
from conftest import (BatchNormNet, TwoBlocksNet, assert_same_weights,
                      make_images, options)


class _WithUnusedLayer(BatchNormNet):
    """BatchNormNet with a layer that does not reach the loss."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(2, 2)


def _frozen(net):
    for param in net.parameters():
        param.requires_grad_(False)
    return None


def _optimizer_over_the_unused_layer(net):
    return torch.optim.SGD(net.unused.parameters(), lr=0.1)


def _plain_micro_batches(net, inputs, micro_batches):
    """Plain PyTorch running ``net`` (in training mode) on each micro-batch
    in order: the outputs and the losses, concatenated as OutputMode.All
    returns them."""
    outputs, losses = [], []
    for x, y in zip(*(t.chunk(micro_batches) for t in inputs)):
        out, loss = net(x, y)
        outputs.append(out.detach())
        losses.append(loss.detach())
    return torch.cat(outputs), torch.stack(losses)


@pytest.mark.parametrize("nothing_to_train", [
    _frozen, _optimizer_over_the_unused_layer])
@pytest.mark.parametrize("strategy", [
    poptorch.MeanReductionStrategy.Running,
    poptorch.MeanReductionStrategy.Post], ids=["Running", "Post"])
def test_frozen_model_runs_forward_and_writes_buffers(nothing_to_train,
                                                      strategy):
    """D = 2, G = 3: six micro-batches per call give PyTorch's outputs,
    losses and BatchNorm running statistics (atol 1e-6); the weights stay
    as they were (PyTorch's, which only ran forward)."""
    torch.manual_seed(0)
    net = _WithUnusedLayer()
    optimizer = nothing_to_train(net)
    reference = copy.deepcopy(net)
    opts = options(2, 3, outputMode=poptorch.OutputMode.All)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    model = poptorch.trainingModel(net, opts, optimizer)
    for call in range(2):
        inputs = make_images(12, seed=call)
        out, loss = model(*inputs)
        expected_out, expected_loss = _plain_micro_batches(reference, inputs,
                                                           6)
        torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    assert_same_weights(net, reference)
    assert int(net.bn.num_batches_tracked) == 12


class _Parameterless(torch.nn.Module):
    def forward(self, x):
        out = torch.tanh(x) * 2
        return out, poptorch.identity_loss((out ** 2).mean(), "mean")


def test_model_without_parameters_returns_outputs_and_loss():
    """With the default optimizer (SGD over no parameter), D = 2 and R = 2
    replicas: the outputs and the final iteration's per-replica losses of
    plain PyTorch (atol 1e-6)."""
    model = poptorch.trainingModel(_Parameterless(), options(2, replicas=2))
    x = torch.randn(8, 3)
    out, loss = model(x)
    plain_out, plain_losses = zip(*(_Parameterless()(chunk)
                                    for chunk in x.chunk(4)))
    torch.testing.assert_close(out, torch.cat(plain_out[2:]), atol=1e-6,
                               rtol=1e-5)
    torch.testing.assert_close(loss, torch.stack(plain_losses[2:]),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strategy", [poptorch.PipelinedExecution,
                                      poptorch.ShardedExecution])
def test_frozen_multi_stage_model_runs_forward_and_writes_buffers(strategy):
    """Two stages, D = 2, G = 3: PyTorch's outputs, losses and BatchNorm
    running statistics (atol 1e-6), no update."""
    torch.manual_seed(0)
    net = TwoBlocksNet()
    _frozen(net)
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(2, 3, outputMode=poptorch.OutputMode.All,
                     setExecutionStrategy=strategy()))
    x = torch.randn(24, 4)
    y = torch.randint(0, 3, (24,))
    out, loss = model(x, y)
    expected_out, expected_loss = _plain_micro_batches(reference, (x, y), 6)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    assert_same_weights(net, reference)
