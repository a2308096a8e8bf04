"""PopART's built-in ai.graphcore ops through poptorch.custom_op
(graphcore_ops.py), against their PyTorch equivalents (exactly), and inside
a training model against plain PyTorch (assert_same_weights tolerance).
The Ctc op is tested with the CTC loss (test_ctc_loss.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch
from conftest import assert_same_weights, options, reference_training


X = torch.tensor([[-1.5, -0.2, 0.3, 2.0], [0.7, -3.1, 1.2, 0.05]])
Y = torch.tensor([[0.5, 1.0, -2.0, 3.0], [1.5, -0.5, 0.25, 2.0]])


@pytest.mark.parametrize("name, inputs, attributes, expected", [
    ("Gelu", [X], {}, F.gelu(X, approximate="tanh")),
    ("GeluErf", [X], {}, F.gelu(X)),
    ("Swish", [X], {}, F.silu(X)),
    ("Detach", [X], {}, X),
    ("Nop", [X], {}, X),
    ("Round", [X], {}, torch.round(X)),
    ("Expm1", [X], {}, torch.expm1(X)),
    ("Log1p", [X.abs()], {}, torch.log1p(X.abs())),
    ("Atan2", [X, Y], {}, torch.atan2(X, Y)),
    ("Fmod", [X, Y], {}, torch.fmod(X, Y)),
    ("Remainder", [X, Y], {}, torch.remainder(X, Y)),
    ("Scale", [X], {"scale": 0.5}, X * 0.5),
    ("Reverse", [X], {"dimensions": [1]}, torch.flip(X, [1])),
])
def test_graphcore_ops_run_as_their_pytorch_equivalents(name, inputs,
                                                         attributes,
                                                         expected):
    result, = poptorch.custom_op(inputs, name, "ai.graphcore", 1,
                                 example_outputs=[expected],
                                 attributes=attributes)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


class GeluThenScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        h, = poptorch.custom_op([self.fc(x)], "Gelu", "ai.graphcore", 1,
                                example_outputs=[torch.zeros(x.shape[0], 3)])
        out, = poptorch.custom_op([h], "Scale", "ai.graphcore", 1,
                                  example_outputs=[h],
                                  attributes={"scale": 2.0})
        return out, F.cross_entropy(out, y)


def test_graphcore_ops_train_inside_a_model():
    torch.manual_seed(0)
    net = GeluThenScale()
    twin = copy.deepcopy(net)
    data = (torch.randn(2 * 2 * 4, 4), torch.randint(0, 3, (2 * 2 * 4,)))
    model = poptorch.trainingModel(net, options(2, accumulation=2),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(*data)

    class Plain(torch.nn.Module):
        def __init__(self, fc):
            super().__init__()
            self.fc = fc

        def forward(self, x, y):
            out = 2.0 * F.gelu(self.fc(x), approximate="tanh")
            return out, F.cross_entropy(out, y)

    plain = Plain(twin.fc)
    reference_training(plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                       data, device_iterations=2, accumulation=2)
    assert_same_weights(net, twin)


@pytest.mark.parametrize("name, inputs, attributes, message", [
    ("Atan2", [X], {}, "takes 2 input"),
    ("Scale", [X], {}, "takes the attributes \\['scale'\\]"),
    ("Gelu", [X], {"approximate": 1}, "takes the attributes \\[\\]"),
    ("Bucketize", [X], {}, "cannot be loaded"),
])
def test_graphcore_ops_check_their_arguments(name, inputs, attributes,
                                             message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.custom_op(inputs, name, "ai.graphcore", 1,
                           example_outputs=[X], attributes=attributes)
