"""Tensor names (getTensorNames) follow the module paths and name scopes of
the operations; anchored tensors return the named intermediate values of
each call."""
import copy

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (ClassifierMLP, assert_same_weights, make_data, options,
                      reference_training)


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


# --- PopART's names of parameters, gradients and optimizer state -----------

_SGD_STATE = {"Accl___": "momentum_buffer"}
_ADAM_STATE = {"Accl1___": "exp_avg", "Accl2___": "exp_avg_sq",
               "Step___": "step"}
_RMSPROP_STATE = {"Accl1___": "square_avg", "Accl3___": "momentum_buffer",
                  "Accl2___": "grad_avg"}
_OPTIMIZERS = [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _SGD_STATE),
    (lambda p: torch.optim.Adam(p, lr=0.05), _ADAM_STATE),
    (lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
     _ADAM_STATE),
    (lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
     _RMSPROP_STATE),
]


def _twins():
    torch.manual_seed(0)
    net = ClassifierMLP()
    return net, copy.deepcopy(net)


def _anchor_all(opts, names, mode=poptorch.OutputMode.All, period=1):
    for name in names:
        opts.anchorTensor(name, name, mode, period)
    return opts


def _reference_steps(twin, optimizer, x, y, steps, accumulation,
                     state_names=None, param="fc1.weight", mean=True):
    """Plain PyTorch, one optimizer step per device iteration: per step the
    parameter ``param`` before it, its ``.grad`` and value after it and its
    optimizer state, under PopART's names."""
    state_names = state_names or {}
    weight = twin.get_parameter(param)
    size = len(x) // steps
    rows = {name: [] for name in [param, f"Gradient___{param}",
                                  f"UpdatedVar___{param}"] +
            [prefix + param for prefix in state_names]}
    for step in range(steps):
        rows[param].append(weight.detach().clone())
        part = slice(step * size, (step + 1) * size)
        reference_training(twin, optimizer, [x[part], y[part]],
                           accumulation=accumulation, mean=mean)
        rows[f"Gradient___{param}"].append(weight.grad.clone())
        rows[f"UpdatedVar___{param}"].append(weight.detach().clone())
        for prefix, torch_name in state_names.items():
            rows[prefix + param].append(
                optimizer.state[weight][torch_name].clone())
    return rows


def _combined(rows):
    return torch.stack(rows) if rows[0].dim() == 0 else torch.cat(rows)


@pytest.mark.parametrize("make_optimizer,state_names", _OPTIMIZERS)
def test_training_names_list_parameters_gradients_and_optimizer_state(
        make_optimizer, state_names):
    net, _ = _twins()
    net.fc1.bias.requires_grad_(False)
    model = poptorch.trainingModel(net,
                                   optimizer=make_optimizer(net.parameters()))
    model(*make_data(2))
    names = model.getTensorNames()
    trained = ["fc1.weight", "fc2.weight", "fc2.bias"]
    expected = (trained + ["fc1.bias"] +
                [f"Gradient___{p}" for p in trained] +
                [f"UpdatedVar___{p}" for p in trained] +
                [prefix + p for prefix in state_names for p in trained])
    assert names[:len(expected)] == expected
    assert "Gradient___fc1.bias" not in names
    assert "fc1/addmm" in names and len(names) == len(set(names))


@pytest.mark.parametrize("make_optimizer,state_names", _OPTIMIZERS)
def test_anchored_parameter_gradient_update_and_state_match_pytorch(
        make_optimizer, state_names):
    """D = 3 optimizer steps of G = 2 micro-batches, OutputMode.All: one
    value per optimizer step, as param.grad, the parameter and
    optimizer.state of plain PyTorch steps (mean reduction)."""
    net, twin = _twins()
    x, y = make_data(12)
    expected = _reference_steps(twin, make_optimizer(twin.parameters()), x,
                                y, 3, 2, state_names)
    opts = _anchor_all(options(device_iterations=3, accumulation=2),
                       expected)
    model = poptorch.trainingModel(net, opts,
                                   make_optimizer(net.parameters()))
    model(x, y)
    for name, rows in expected.items():
        torch.testing.assert_close(model.getAnchoredTensor(name),
                                   _combined(rows), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert_same_weights(net, twin)


def test_anchored_gradients_of_a_sum_reduction_are_those_of_each_step():
    """With ReductionType.Sum the gradient is the running gradient buffer
    itself, which the next optimizer step zeroes: each value returned is
    that of its own step (aot_eager returns the buffer as the output)."""
    net, twin = _twins()
    x, y = make_data(12)
    expected = _reference_steps(twin, torch.optim.SGD(twin.parameters(),
                                                      lr=0.1),
                                x, y, 3, 2, mean=False)
    opts = _anchor_all(options(device_iterations=3, accumulation=2),
                       expected)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Sum)
    opts.setBackend("aot_eager")
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    for name, rows in expected.items():
        torch.testing.assert_close(model.getAnchoredTensor(name),
                                   _combined(rows), rtol=1e-5, atol=1e-6)


def test_anchored_gradient_is_unscaled_and_clipped():
    """Gradient___ is what the optimizer applies: without the loss scale,
    after clipping to max_grad_norm (PyTorch: clip_grad_norm_ before
    step())."""
    net, twin = _twins()
    x, y = make_data(4)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    _, loss = twin(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    reference.step()
    opts = poptorch.Options().anchorTensor("grad", "Gradient___fc2.weight")
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1,
                                   loss_scaling=64.0, max_grad_norm=0.05)
    model = poptorch.trainingModel(net, opts, optimizer)
    model(x, y)
    torch.testing.assert_close(model.getAnchoredTensor("grad"),
                               twin.fc2.weight.grad, rtol=1e-5, atol=1e-6)
    assert_same_weights(net, twin)


@pytest.mark.parametrize("mode,period,combine", [
    (poptorch.OutputMode.Final, 1, lambda rows: rows[-1]),
    (poptorch.OutputMode.EveryN, 2, lambda rows: torch.cat(rows[1::2])),
    (poptorch.OutputMode.Sum, 1, lambda rows: sum(rows)),
])
def test_update_names_follow_their_output_mode(mode, period, combine):
    """Counted in optimizer steps (D = 4, G = 2); the model's outputs and
    activation anchors are unchanged."""
    net, twin = _twins()
    x, y = make_data(16)
    reference = copy.deepcopy(twin)
    expected = _reference_steps(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1,
                                   momentum=0.9),
        x, y, 4, 2, _SGD_STATE, param="fc2.bias")
    losses = reference_training(
        twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9),
        [x, y], 4, 2)
    opts = _anchor_all(options(device_iterations=4, accumulation=2),
                       expected, mode, period)
    opts.anchorTensor("hidden", "fc1/addmm", poptorch.OutputMode.All)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.parameters(), lr=0.1, momentum=0.9))
    _, loss = model(x, y)
    torch.testing.assert_close(loss, losses)
    assert model.getAnchoredTensor("hidden").shape == (16, 8)
    for name, rows in expected.items():
        torch.testing.assert_close(model.getAnchoredTensor(name),
                                   combine(rows), rtol=1e-5, atol=1e-6)


def test_every_n_of_an_update_name_counts_optimizer_steps():
    net, _ = _twins()
    opts = options(device_iterations=3, accumulation=2).anchorTensor(
        "grad", "Gradient___fc1.weight", poptorch.OutputMode.EveryN, 2)
    model = poptorch.trainingModel(net, opts)
    with pytest.raises(poptorch.Error, match=r"'Gradient___fc1.weight' is "
                       r"computed once per optimizer step and a call runs "
                       r"deviceIterations = 3 optimizer steps, which is not "
                       r"a multiple of 2"):
        model(*make_data(12))


@pytest.mark.parametrize("mode,copies", [(poptorch.OutputMode.All, 2),
                                         (poptorch.OutputMode.Final, 1)])
def test_inference_model_anchors_a_parameter(mode, copies):
    net, model = _inference(device_iterations=2, anchorTensor=(
        "weight", "layer1.fc.weight", mode))
    x = torch.randn(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x))
    assert model.getTensorNames()[:4] == [
        "layer1.fc.weight", "layer1.fc.bias", "head.weight", "head.bias"]
    assert not any(n.startswith("Gradient___")
                   for n in model.getTensorNames())
    torch.testing.assert_close(model.getAnchoredTensor("weight"),
                               torch.cat([net.layer1.fc.weight] * copies))


def test_misspelt_gradient_name_lists_similar_names():
    net, _ = _twins()
    opts = poptorch.Options().anchorTensor("grad", "Gradient___fc1.weigth")
    model = poptorch.trainingModel(net, opts)
    with pytest.raises(poptorch.Error, match=r"the update step has no tensor "
                       r"named 'Gradient___fc1.weigth'; similar names: "
                       r"Gradient___fc1.weight"):
        model(*make_data(2))


def test_parameter_names_of_a_multi_stage_model_are_an_error():
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.ShardedExecution("A", "B"))
    opts.anchorTensor("weight", "fc1.weight")
    model = poptorch.inferenceModel(TwoStagesOfTanh(), opts)
    with pytest.raises(poptorch.Error, match="no tensor named 'fc1.weight'.*"
                       "a model whose blocks form several stages has no "
                       "names of parameters, gradients or optimizer state"):
        model(torch.randn(4, 4))


class DeepMLP(torch.nn.Module):
    def __init__(self, layers=40):
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[torch.nn.Linear(4, 4) for _ in range(layers)])

    def forward(self, x, y):
        out = self.layers(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_named_tensors_survive_a_deep_copy_of_the_step():
    """Compilers (Inductor) deep-copy a captured step with its metadata: the
    names it records must not hold the graph's nodes, whose deep copy
    recurses through the whole graph."""
    net = DeepMLP()
    model = poptorch.trainingModel(net, options(),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(2, 4), torch.tensor([0, 1]))
    graph = compiled_model(model).session.graphs["update"]
    copied = copy.deepcopy(graph)
    assert copied.meta == graph.meta
    assert "Gradient___layers.0.weight" in model.getTensorNames()
