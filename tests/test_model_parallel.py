"""Blocks and execution strategies: the configurations PopTorch rejects are
rejected at compilation, and annotated models train like unannotated ones."""
import copy

import pytest
import torch

import poptorch
from conftest import assert_same_weights, make_data, options


class Staged(torch.nn.Module):
    """Three linear layers, optionally placed on IPUs with BeginBlock."""

    def __init__(self, ipus=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
             torch.nn.Linear(4, 3)])
        for layer, ipu in zip(self.layers, ipus or []):
            poptorch.BeginBlock(layer, ipu_id=ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.cross_entropy(x, y)


def test_pipelined_training_matches_the_unannotated_model():
    torch.manual_seed(0)
    plain = Staged()
    annotated = Staged(ipus=[0, 1, 1])
    annotated.load_state_dict(plain.state_dict())
    twin = copy.deepcopy(plain)
    x, y = make_data(2 * 3 * 2)
    for net in (plain, annotated):
        poptorch.trainingModel(net, options(2, 3), torch.optim.SGD(
            net.parameters(), lr=0.1))(x, y)
    assert_same_weights(annotated, plain)
    assert not torch.equal(twin.layers[0].weight, plain.layers[0].weight)


def test_training_pipeline_needs_accumulation_of_2k_minus_1():
    model = poptorch.trainingModel(Staged(ipus=[0, 1, 1]), options(1, 2))
    with pytest.raises(poptorch.Error,
                       match="gradientAccumulation must be at least 3"):
        model(*make_data(4))


def test_inference_pipeline_needs_device_iterations_per_stage():
    net = Staged(ipus=[0, 1, 1])
    x, y = make_data(2)
    with pytest.raises(poptorch.Error, match="deviceIterations of at least 2"):
        poptorch.inferenceModel(net, options(1))(x, y)
    out, _ = poptorch.inferenceModel(net, options(2))(*make_data(4))
    assert out.shape == (4, 3)


def test_ipu_count_must_be_a_power_of_two_unless_rounded():
    x, y = make_data(2 * 5)
    with pytest.raises(poptorch.Error, match="3 IPUs, which is not a power"):
        poptorch.trainingModel(Staged(ipus=[0, 1, 2]), options(1, 5))(x, y)
    poptorch.trainingModel(Staged(ipus=[0, 1, 2]),
                           options(1, 5, autoRoundNumIPUs=True))(x, y)


def test_stage_ids_must_ascend_in_a_pipeline():
    x, y = make_data(2 * 5)
    with pytest.raises(poptorch.Error, match="AutoIncrement"):
        poptorch.trainingModel(Staged(ipus=[0, 1, 0]), options(1, 5))(x, y)
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    poptorch.trainingModel(Staged(ipus=[0, 1, 0]), options(
        1, 5, setExecutionStrategy=strategy))(x, y)


def test_stages_naming_unknown_blocks_are_an_error():
    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                return self.fc(x)

    strategy = poptorch.PipelinedExecution("A", "Z")
    model = poptorch.inferenceModel(
        Named(), options(2, setExecutionStrategy=strategy))
    with pytest.raises(poptorch.Error, match="block 'Z'"):
        model(make_data(4)[0])
