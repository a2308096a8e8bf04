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


def test_the_ipu_model_takes_any_ipu_count():
    """PopTorch needs a power-of-2 IPU count only to acquire hardware: the
    IPU Model runs three IPUs, computing what the plain model computes."""
    net = Staged(ipus=[0, 1, 2])
    x, y = make_data(2 * 3)
    out, loss = poptorch.inferenceModel(net, options(3, useIpuModel=True))(
        x, y)
    expected = [net(*chunk) for chunk in zip(x.split(2), y.split(2))]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]))
    torch.testing.assert_close(loss, torch.stack([e[1] for e in expected]))


def test_a_never_connected_model_compiles_for_any_ipu_count():
    model = poptorch.inferenceModel(
        Staged(ipus=[0, 1, 2]),
        options(3, connectionType=poptorch.ConnectionType.Never))
    model.compile(*make_data(2 * 3))
    assert model.isCompiled()


class FunctionBlocks(torch.nn.Module):
    """Staged's layers, with the second block begun by a function and the
    blocks named by integers, as PopTorch allows."""

    def __init__(self):
        super().__init__()
        self.layers = Staged().layers
        poptorch.BeginBlock(self.layers[0], user_id=0, ipu_id=0)
        self.squash = poptorch.BeginBlock(torch.tanh, user_id=1, ipu_id=1)

    def forward(self, x, y):
        x = torch.tanh(self.layers[0](x))
        x = self.squash(self.layers[1](x))
        x = torch.tanh(self.layers[2](x))
        return x, torch.nn.functional.cross_entropy(x, y)


def test_function_blocks_with_integer_ids_run_as_named_stages():
    torch.manual_seed(0)
    net = FunctionBlocks()
    strategy = poptorch.ShardedExecution("0", "1")
    x, y = make_data(2)
    out, loss = poptorch.inferenceModel(
        net, options(1, setExecutionStrategy=strategy))(x, y)
    expected_out, expected_loss = Staged.forward(net, x, y)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(loss, expected_loss)


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
