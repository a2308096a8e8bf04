"""Inference models: same numbers as the module, buffers, inputs, kwargs,
zero-d arguments and isRunningOnIpu."""
import copy

import torch

import poptorch
from conftest import BatchNormNet, make_data, make_images, options


def test_inference_matches_module_with_kwargs(mlp):
    x, _ = make_data(4)
    model = poptorch.inferenceModel(mlp, options(2))
    torch.testing.assert_close(model(x=x), mlp(x))


def test_zero_d_argument_is_passed_whole_to_every_step():
    class Scale(torch.nn.Module):
        def forward(self, x, factor):
            return x * factor

    x = torch.arange(6.0).reshape(6, 1)
    out = poptorch.inferenceModel(Scale(), options(3))(x, torch.tensor(2.0))
    torch.testing.assert_close(out, x * 2)


class _DefaultBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, bias=torch.tensor([1.0, 2.0, 3.0]), scale=2.0):
        return self.fc(x) * scale + bias


def test_a_tensor_default_argument_is_used_whole_when_not_given():
    """As in PyTorch, forward reads its default (it was an input cut into
    micro-batches, refused as 3 rows for D = 2); a given value is cut."""
    net = _DefaultBias()
    x = torch.randn(8, 4)
    model = poptorch.inferenceModel(net, options(2, replicas=2))
    torch.testing.assert_close(model(x), net(x))
    torch.testing.assert_close(model(x, scale=2.0), net(x))
    rows = torch.randn(8, 3)
    given = poptorch.inferenceModel(net, options(2, replicas=2))
    torch.testing.assert_close(given(x, rows), net(x, rows))


def test_buffer_written_in_place_persists_between_calls(poptorch_log):
    """The device keeps the buffer; as in PopTorch the host sees it after
    copyWeightsToHost(), and a read before says so, once."""
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count += 1
            return x + self.count

    counter = Counter()
    model = poptorch.inferenceModel(counter, options(2))
    x = torch.zeros(2, 1)
    torch.testing.assert_close(model(x), torch.tensor([[1.0], [2.0]]))
    torch.testing.assert_close(model(x), torch.tensor([[3.0], [4.0]]))
    assert counter.count.item() == 0
    assert counter.state_dict()["count"].item() == 0
    warning = "An inference model of this Counter wrote buffers"
    assert poptorch_log.text.count(warning) == 1
    assert "Call copyWeightsToHost() on the inference model" in \
        poptorch_log.text
    model.copyWeightsToHost()
    assert counter.count.item() == 4


def test_plain_attribute_is_frozen_at_compilation():
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.i = torch.tensor(1.0)

        def forward(self, x):
            self.i = self.i + 1
            return x + self.i

    model = poptorch.inferenceModel(Frozen())
    x = torch.zeros(1)
    first = model(x)
    torch.testing.assert_close(model(x), first)


def test_in_place_writes_to_inputs_reach_the_caller():
    class WritesInput(torch.nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x + 1

    x = torch.arange(4.0)
    out = poptorch.inferenceModel(WritesInput(), options(2))(x)
    torch.testing.assert_close(x, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    torch.testing.assert_close(out, x + 1)


def test_is_running_on_ipu_selects_the_device_path():
    class Paths(torch.nn.Module):
        def forward(self, x):
            if poptorch.isRunningOnIpu():
                return x + 100
            return x

    module = Paths()
    x = torch.zeros(2)
    assert not poptorch.isRunningOnIpu()
    torch.testing.assert_close(poptorch.inferenceModel(module)(x), x + 100)
    torch.testing.assert_close(module(x), x)


def test_output_aliasing_a_weight_is_a_copy():
    class ReturnsWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.w

    model = poptorch.inferenceModel(ReturnsWeight())
    out = model(torch.zeros(1))
    out.add_(5)
    torch.testing.assert_close(model(torch.zeros(1)), torch.ones(3))


def test_executor_delegates_attributes_and_repr(mlp):
    model = poptorch.inferenceModel(mlp)
    assert model.fc1 is mlp.fc1
    assert repr(model) == repr(mlp)
    assert model.model is mlp
    assert model.options.device_iterations == 1


def test_plain_tensor_attribute_becomes_a_graph_constant():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)
            self.scale = torch.tensor([1.0, 2.0, 3.0])

        def forward(self, x):
            return self.fc(x) * self.scale

    module = Scaled()
    x = torch.randn(4, 3)
    torch.testing.assert_close(poptorch.inferenceModel(module, options(2))(x),
                               module(x))


def test_validation_model_created_from_a_training_model():
    """The guide's precompilation chapter: ``inferenceModel(training_model)``
    then ``validation_model.model.eval()`` validates the trained weights in
    evaluation mode (BatchNorm's running statistics, left unchanged)."""
    torch.manual_seed(0)
    net = BatchNormNet()
    training_model = poptorch.trainingModel(net, options())
    x, y = make_images(4)
    training_model(x, y)
    validation_model = poptorch.inferenceModel(training_model)
    validation_model.model.eval()
    out, _ = validation_model(x, y)
    reference = copy.deepcopy(net).eval()
    torch.testing.assert_close(out, reference(x, y)[0])
    torch.testing.assert_close(net.bn.running_mean, reference.bn.running_mean)
    net.train()
    training_model(x, y)
    net.eval()
    torch.testing.assert_close(validation_model(x, y)[0],
                               copy.deepcopy(net)(x, y)[0])
