"""float64 arguments are converted to float32, as PopTorch converted them
(IPUs have no 64-bit floats; numpy float64 data made into tensors reached
models so), unless the model holds float64 parameters."""
import copy

import numpy as np
import torch

import poptorch
from conftest import ClassifierMLP, assert_same_weights, make_data, options


def test_a_float32_model_trains_on_float64_inputs_as_on_float32(
        poptorch_log):
    torch.manual_seed(0)
    net = ClassifierMLP()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(2), torch.optim.SGD(
        net.parameters(), lr=0.1))
    reference = poptorch.trainingModel(twin, options(2), torch.optim.SGD(
        twin.parameters(), lr=0.1))
    for seed in range(2):
        x, y = make_data(8, seed=seed)
        _, loss = model(torch.from_numpy(x.numpy().astype(np.float64)), y)
        _, expected = reference(x, y)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert_same_weights(net, twin, atol=0)
    assert "Argument 'x' is a float64 tensor: it is converted to float32" \
        in poptorch_log.text


def test_a_float64_model_runs_in_float64(poptorch_log):
    torch.manual_seed(0)
    net = ClassifierMLP().double()
    x = make_data(4)[0].double()
    out = poptorch.inferenceModel(net)(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, net(x))
    assert "float64 tensor" not in poptorch_log.text
