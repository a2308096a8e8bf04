"""Tensor names (getTensorNames) follow the module paths and name scopes of
the operations; anchored tensors return the named intermediate values of
each call."""
import pytest
import torch

import poptorch
from conftest import make_data


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.NameScope("gate"):
            return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = Block()
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x, y=None):
        out = self.head(self.layer1(x))
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def _inference(device_iterations=1, **option_calls):
    torch.manual_seed(0)
    net = Net()
    opts = poptorch.Options().deviceIterations(device_iterations)
    for name, args in option_calls.items():
        getattr(opts, name)(*args)
    return net, poptorch.inferenceModel(net, opts)


def test_names_follow_module_paths_and_name_scopes():
    _, model = _inference()
    model(torch.randn(2, 4))
    names = model.getTensorNames()
    assert "layer1/fc/gate/addmm" in names
    assert "layer1/gate/relu" in names
    assert "head/addmm" in names
    assert names.index("layer1/fc/gate/addmm") < names.index("head/addmm")
    assert len(names) == len(set(names))


def test_without_module_namescope_only_name_scopes_remain():
    _, model = _inference(disableModuleNamescope=())
    model(torch.randn(2, 4))
    names = model.getTensorNames()
    assert "gate/addmm" in names and "gate/relu" in names
    assert "addmm" in names
    assert not any(name.startswith(("layer1/", "head/")) for name in names)


def test_training_names_include_the_backward_and_update():
    torch.manual_seed(0)
    net = Net()
    model = poptorch.trainingModel(net)
    model(*make_data(2))
    names = model.getTensorNames()
    assert "head/addmm" in names
    assert any(name.startswith("_foreach_") for name in names)


def test_names_need_a_compiled_model():
    _, model = _inference()
    with pytest.raises(poptorch.Error, match="getTensorNames: the model is "
                       "not compiled yet"):
        model.getTensorNames()


def _relu_of(net, x):
    return torch.relu(net.layer1.fc(x))


@pytest.mark.parametrize("mode,expected_rows", [
    (None, [0, 1, 2, 3]),                     # the model's mode: All
    (poptorch.OutputMode.Final, [3]),
    (poptorch.OutputMode.EveryN, [1, 3]),
])
def test_anchored_tensor_follows_its_output_mode(mode, expected_rows):
    args = ("hidden", "layer1/gate/relu", mode)
    if mode == poptorch.OutputMode.EveryN:
        args += (2,)
    net, model = _inference(device_iterations=4, anchorTensor=args)
    x = torch.randn(8, 4)
    out = model(x)
    with torch.no_grad():
        torch.testing.assert_close(out, net(x))
        per_iteration = [_relu_of(net, x[2 * i:2 * i + 2]) for i in range(4)]
    expected = torch.cat([per_iteration[i] for i in expected_rows])
    torch.testing.assert_close(model.getAnchoredTensor("hidden"), expected)


def test_anchored_tensor_of_a_training_step():
    """The anchored activation is that of the weights before the update."""
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        x, y = make_data(2)
        expected = _relu_of(net, x)
    opts = poptorch.Options().anchorTensor("hidden", "layer1/gate/relu")
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    model(x, y)
    torch.testing.assert_close(model.getAnchoredTensor("hidden"), expected)


def test_unknown_anchor_name_is_an_error_listing_similar_names():
    _, model = _inference(anchorTensor=("hidden", "layer1/gate/relus"))
    with pytest.raises(poptorch.Error, match=r"anchorTensor\('hidden', "
                       r"'layer1/gate/relus'\): the inference step has no "
                       r"tensor named 'layer1/gate/relus'; similar names: "
                       r"layer1/gate/relu"):
        model(torch.randn(2, 4))
    assert not model.isCompiled()


def test_get_anchored_tensor_errors():
    _, model = _inference(anchorTensor=("hidden", "layer1/gate/relu"))
    model.compile(torch.randn(2, 4))
    with pytest.raises(poptorch.Error, match="has not run yet"):
        model.getAnchoredTensor("hidden")
    model(torch.randn(2, 4))
    with pytest.raises(poptorch.Error, match=r"no tensor is anchored as "
                       r"'other' \(anchored: 'hidden'\)"):
        model.getAnchoredTensor("other")


def test_anchors_need_a_single_replica():
    _, model = _inference(anchorTensor=("hidden", "layer1/gate/relu"),
                          replicationFactor=(2,))
    with pytest.raises(poptorch.Error, match="only available with "
                       r"replicationFactor\(1\), got 2"):
        model(torch.randn(2, 4))


class TwoStagesOfTanh(torch.nn.Module):
    """The same unscoped operation in two stages."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.fc2 = torch.nn.Linear(4, 3)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.fc1(x))
        with poptorch.Block("B", ipu_id=1):
            return torch.tanh(self.fc2(h))


def test_names_of_several_stages_are_unique():
    torch.manual_seed(0)
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.ShardedExecution("A", "B"))
    model = poptorch.inferenceModel(TwoStagesOfTanh(), opts)
    model(torch.randn(4, 4))
    names = model.getTensorNames()
    assert "tanh" in names and "tanh_1" in names
    assert len(names) == len(set(names))
