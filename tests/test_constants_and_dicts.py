"""Models reading constant tensors (closure tensors, plain tensor
attributes) and taking dict arguments compute what plain PyTorch computes;
dict arguments are matched by key, as PopTorch flattens them."""
import collections
import copy
import dataclasses
from typing import Optional

import numpy
import pytest
import torch

import poptorch
from poptorch._impl import capture, tracing_context
from conftest import WithLoss, options

OFFSET = torch.tensor([0.5, -1.0, 2.0])


class _Constants(torch.nn.Module):
    """No parameter, buffer or tensor argument: a closure tensor and a
    plain tensor attribute (not a buffer)."""

    def __init__(self):
        super().__init__()
        self.table = torch.arange(6.0).reshape(2, 3)

    def forward(self, scale: float):
        return self.table * scale + (OFFSET + OFFSET)


def test_forward_of_constants_alone_is_captured():
    module = _Constants()
    model = poptorch.inferenceModel(module)
    torch.testing.assert_close(model(2.0), module(2.0), atol=0, rtol=0)


class _ConstantsWithLoss(_Constants):
    def __init__(self):
        super().__init__()
        self.weights = torch.ones(3, requires_grad=True)

    def forward(self, scale: float):
        out = self.table * scale * self.weights + OFFSET
        return out, poptorch.identity_loss((out ** 2).mean(), "none")


def test_training_on_constants_alone_updates_no_constant():
    """A training model whose loss reads constants only returns PyTorch's
    output and loss on every call; a constant is no parameter, so it gets
    no gradient and keeps its value."""
    module = _ConstantsWithLoss()
    model = poptorch.trainingModel(module)
    expected = module(3.0)
    for _ in range(2):
        out, loss = model(3.0)
        torch.testing.assert_close(out, expected[0].detach(), atol=0, rtol=0)
        torch.testing.assert_close(loss, expected[1].detach(), atol=0,
                                   rtol=0)
    torch.testing.assert_close(module.weights, torch.ones(3), atol=0, rtol=0)
    assert module.weights.grad is None


def test_constants_are_captured_on_the_capture_device():
    """Real tensors on another device than the one the model is captured
    for (the meta device stands in for a GPU) become constants on that
    device, detached from autograd, as PopTorch keeps every tensor of a
    model on the IPU."""
    weights = torch.ones(3, requires_grad=True)

    def forward(x):
        with tracing_context.GraphConstants():
            return x * OFFSET + weights

    with tracing_context.capture_device(torch.device("meta")):
        graph = capture.trace(forward, [torch.ones(3, device="meta")])
    constants = [getattr(graph, node.target) for node in graph.graph.nodes
                 if node.op == "get_attr"]
    assert [(c.device.type, c.requires_grad) for c in constants] == [
        ("meta", False), ("meta", False)]


class _Counter(torch.nn.Module):
    """The guide's "wrong way to have a persistent tensor": a plain tensor
    attribute incremented in place by ``forward``."""

    def __init__(self):
        super().__init__()
        self.i = torch.tensor([0.0])

    def forward(self):
        self.i += 1
        return self.i


def test_a_plain_tensor_attribute_written_in_place_is_frozen():
    """As PopTorch freezes the value captured, every call starts from it
    (1 on every call, not 1, 2, 3), and neither the capture nor the calls
    change the user's tensor."""
    module = _Counter()
    tensor = module.i
    model = poptorch.inferenceModel(module)
    returned = [model().clone() for _ in range(3)]
    assert [value.item() for value in returned] == [1.0, 1.0, 1.0]
    assert module.i is tensor and tensor.item() == 0.0


class _ClassWeighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.class_weights = torch.ones(3)

    def forward(self, x, y):
        logits = self.fc(x)
        return logits, torch.nn.functional.cross_entropy(
            logits, y, weight=self.class_weights)


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
def test_a_tensor_attribute_changed_on_the_host_stays_frozen(backend,
                                                            poptorch_log):
    """A plain tensor attribute the program edits between calls keeps the
    value it had at compilation on every backend, as PopTorch freezes it
    (the graph backend read the live tensor, so auto changed at tier-up),
    and the change is reported once, naming the attribute."""
    torch.manual_seed(0)
    module = _ClassWeighted()
    opts = options()
    opts.setBackend(backend)
    model = poptorch.trainingModel(module, opts, torch.optim.SGD(
        module.parameters(), lr=0.0))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    first = model(x, y)[1]
    assert "constants" not in poptorch_log.text
    module.class_weights.copy_(torch.tensor([10.0, 1.0, 0.1]))
    torch.testing.assert_close(model(x, y)[1], first, atol=0, rtol=0)
    model(x, y)
    warning = "Tensors that forward reads as constants ('class_weights')"
    assert poptorch_log.text.count(warning) == 1
    assert "register it as a buffer" in poptorch_log.text


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.drop = torch.nn.Dropout(0.0)
        self.temperature = 1.0

    def forward(self, x, y):
        logits = self.drop(self.fc(x)) / self.temperature
        return logits, torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("attribute", ["temperature", "drop.p"])
def test_a_python_attribute_changed_after_compilation_is_reported(
        attribute, poptorch_log):
    """Plain Python attributes are compiled in, as PopTorch freezes them: an
    annealed temperature or a dropout rate changed between calls has no
    effect until destroy(), and the first change is logged once."""
    torch.manual_seed(0)
    module = _Tempered()
    model = poptorch.trainingModel(module, options(), torch.optim.SGD(
        module.parameters(), lr=0.0))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    first = model(x, y)[1]
    owner, name = (module.drop, "p") if attribute == "drop.p" else (
        module, "temperature")
    setattr(owner, name, 0.5)
    torch.testing.assert_close(model(x, y)[1], first, atol=0, rtol=0)
    model(x, y)
    message = f"The attribute '{attribute}' of the wrapped module"
    assert poptorch_log.text.count(message) == 1
    model.destroy()
    assert not torch.equal(model(x, y)[1], first)


def _add_global_hook(module):
    return torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out + 5 if mod is module[1] else None)


@pytest.mark.parametrize("change, where", [
    ("add", "The forward pre hooks of '1' in the wrapped module"),
    ("remove", "The forward hooks of '0' in the wrapped module"),
    ("global", "torch's global forward hooks")])
def test_a_hook_added_or_removed_after_compilation_is_reported(
        change, where, poptorch_log):
    """The compiled model runs the hooks it was traced with: adding or
    removing one between calls has no effect until destroy() (it was
    silent), and the change is logged once."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    handle = module[0].register_forward_hook(lambda mod, args, out: out * 10)
    model = poptorch.inferenceModel(module, options(2))
    x = torch.randn(4, 4)
    first = model(x)
    added = None
    if change == "add":
        module[1].register_forward_pre_hook(lambda mod, args: args[0] + 5)
    elif change == "global":
        added = _add_global_hook(module)
    else:
        handle.remove()
    try:
        torch.testing.assert_close(model(x), first, atol=0, rtol=0)
        model(x)
        assert poptorch_log.text.count(f"{where} changed (added or "
                                       "removed)") == 1
        model.destroy()
        torch.testing.assert_close(model(x), module(x))
    finally:
        if added is not None:
            added.remove()


def test_a_gradient_hook_added_after_compilation_is_reported(poptorch_log):
    module = torch.nn.Linear(4, 3)
    model = poptorch.trainingModel(WithLoss(module), options())
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    model(x, y)
    module.weight.register_hook(lambda gradient: gradient * 0)
    model(x, y)
    assert "The gradient hooks of 'model.weight' in the wrapped module " \
        "changed" in poptorch_log.text


class _ScaledByCounter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)
        self.calls = torch.zeros(())

    def forward(self, x, y):
        self.calls.add_(1)
        out = self.fc(x) * self.calls
        return out, torch.nn.functional.mse_loss(out, y)


def test_training_reads_the_frozen_value_of_a_written_attribute():
    """Every step of every call computes with the captured value plus one,
    as plain PyTorch does with that value fixed."""
    torch.manual_seed(0)
    module = _ScaledByCounter()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(module.fc.state_dict())
    model = poptorch.trainingModel(module, options(2), torch.optim.SGD(
        module.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 3, generator=generator)
        y = torch.randn(4, 1, generator=generator)
        model(x, y)
        for rows in (slice(0, 2), slice(2, 4)):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(x[rows]),
                                         y[rows]).backward()
            optimizer.step()
    model.copyWeightsToHost()
    torch.testing.assert_close(module.fc.weight, reference.weight)
    torch.testing.assert_close(module.fc.bias, reference.bias)
    assert module.calls.item() == 0.0


class _Fields(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, batch):
        return self.fc(batch["image"]) - batch["bias"]


def _batch(seed, container=dict, order=("image", "bias")):
    generator = torch.Generator().manual_seed(seed)
    values = {"image": torch.randn(4, 4, generator=generator),
              "bias": torch.randn(4, 3, generator=generator)}
    return container((key, values[key]) for key in order)


class _Mapping(dict):
    pass


class _OrderedMapping(collections.OrderedDict):
    pass


def _defaultdict(items):
    return collections.defaultdict(list, items)


def test_dict_in_another_key_order_is_matched_by_key():
    """D = 2; the second call's dict holds the keys in the other order, so
    matching by position would swap image and bias; other keys are still a
    changed structure."""
    torch.manual_seed(0)
    module = _Fields()
    model = poptorch.inferenceModel(module, options(2))
    for seed, order in enumerate([("image", "bias"), ("bias", "image")]):
        batch = _batch(seed, order=order)
        torch.testing.assert_close(model(batch), module(batch), atol=1e-6,
                                   rtol=1e-5)
    renamed = {"image": torch.randn(4, 4), "offset": torch.randn(4, 3)}
    with pytest.raises(poptorch.Error, match="structure of the model's "
                                             "arguments changed"):
        model(renamed)


@pytest.mark.parametrize("container", [collections.OrderedDict, _Mapping,
                                       _OrderedMapping, _defaultdict],
                         ids=["OrderedDict", "dict subclass",
                              "OrderedDict subclass", "defaultdict"])
def test_dict_types_behave_like_dict(container):
    """A model compiled for a dict takes the other dict types in either key
    order, and a model compiled for one of them takes a dict: the results
    of plain PyTorch (atol 1e-6) on new values in every call."""
    torch.manual_seed(0)
    module = _Fields()
    for first, second in [(dict, container), (container, dict)]:
        model = poptorch.inferenceModel(module, options(2))
        calls = [_batch(0, first), _batch(1, second, ("bias", "image")),
                 _batch(2, second)]
        for batch in calls:
            torch.testing.assert_close(model(batch), module(batch),
                                       atol=1e-6, rtol=1e-5)
        model.destroy()


def test_dict_subclass_output_keeps_its_structure():
    class Outputs(torch.nn.Module):
        def forward(self, x):
            return _Mapping(doubled=x * 2, nested={"plus": x + 1})

    x = torch.arange(4.0)
    out = poptorch.inferenceModel(Outputs(), options(2))(x)
    assert out.keys() == {"doubled", "nested"}
    torch.testing.assert_close(out["doubled"], x * 2, atol=0, rtol=0)
    torch.testing.assert_close(out["nested"]["plus"], x + 1, atol=0, rtol=0)


@dataclasses.dataclass
class _ModelOutput(collections.OrderedDict):
    """As Hugging Face's ModelOutput: a dataclass and an OrderedDict whose
    items are its fields that are not None."""
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class _Scores(dict):
    """A plain dict subclass."""


class _Tagged(collections.OrderedDict):
    """An OrderedDict subclass whose __init__ needs arguments."""

    def __init__(self, logits, tag):
        super().__init__(logits=logits)
        self.tag = tag


class _ReturnsDictTypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y=None):
        logits = self.fc(x)
        scores = _Scores(top=logits.amax(dim=1))
        tagged = _Tagged(logits * 2, "doubled")
        if y is None:
            return _ModelOutput(logits=logits), scores, tagged
        loss = torch.nn.functional.cross_entropy(logits, y)
        return _ModelOutput(loss=loss, logits=logits), scores, tagged


@pytest.mark.parametrize("training", [False, True])
def test_returned_dict_subclasses_keep_their_types(training):
    """A ModelOutput-like dataclass dict and a dict subclass come back as
    themselves (out.loss, out[0] work), holding what the module returns."""
    torch.manual_seed(0)
    net = _ReturnsDictTypes()
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    args = (x, y) if training else (x,)
    expected = net(*args)
    model = (poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.0)) if training
             else poptorch.inferenceModel(net))
    output, scores, tagged = model(*args)
    assert type(output) is _ModelOutput and type(scores) is _Scores
    assert type(tagged) is _Tagged and tagged.tag == "doubled"
    assert list(output.keys()) == list(expected[0].keys())
    torch.testing.assert_close(output.logits, expected[0].logits)
    torch.testing.assert_close(scores["top"], expected[1]["top"])
    torch.testing.assert_close(tagged["logits"], expected[2]["logits"])
    if training:
        torch.testing.assert_close(output.loss, expected[0].loss)


@dataclasses.dataclass
class _Prediction:
    logits: torch.Tensor
    score: torch.Tensor
    label: str = "scores"


@dataclasses.dataclass(frozen=True)
class _FrozenLoss:
    loss: torch.Tensor
    logits: torch.Tensor


@dataclasses.dataclass(eq=False)
class _Batch:
    features: torch.Tensor
    scale: float


class _DataclassModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, batch: _Batch, y=None):
        logits = self.fc(batch.features) * batch.scale
        if y is None:
            return (_Prediction(logits, logits.sum(-1)),)
        return _FrozenLoss(torch.nn.functional.cross_entropy(logits, y),
                           logits)


def test_dataclass_arguments_and_outputs_hold_each_micro_batch():
    """Dataclass instances passed to or returned by the model are flattened
    by field: the model sees each micro-batch's rows, and the call returns
    the dataclass with the real values of every micro-batch."""
    torch.manual_seed(0)
    net = _DataclassModel()
    model = poptorch.inferenceModel(net, options(2))
    for _ in range(2):
        batch = _Batch(torch.randn(4, 4), 0.5)
        (output,) = model(batch)
        expected = torch.cat([net(_Batch(half, 0.5))[0].logits
                              for half in batch.features.split(2)])
        assert type(output) is _Prediction and output.label == "scores"
        torch.testing.assert_close(output.logits, expected)
        torch.testing.assert_close(output.score, expected.sum(-1))


def test_training_with_the_loss_in_a_frozen_dataclass_matches_pytorch():
    torch.manual_seed(0)
    net = _DataclassModel()
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        batch = _Batch(torch.randn(4, 4), 2.0)
        y = torch.randint(0, 3, (4,))
        output = model(batch, y)
        optimizer.zero_grad()
        expected = reference(batch, y)
        expected.loss.backward()
        optimizer.step()
        assert type(output) is _FrozenLoss
        torch.testing.assert_close(output.loss, expected.loss.detach())
    torch.testing.assert_close(net.fc.weight, reference.fc.weight)


class _Pair(tuple):
    """A tuple subclass with a helper, as batches and results often are."""

    def first(self):
        return self[0]


class _Boxes(list):
    pass


class _Holder:
    def __init__(self, tensor):
        self.tensor = tensor


class _SequenceTypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, pair):
        logits = self.fc(pair.first()) * pair[1]
        return _Pair((logits, logits.sum(-1))), _Boxes([logits * 2])


def test_tuple_and_list_subclasses_are_cut_into_micro_batches():
    """Arguments and outputs of tuple and list subclasses are flattened by
    item: each micro-batch gets its rows and the outputs hold every one's."""
    torch.manual_seed(0)
    net = _SequenceTypes()
    model = poptorch.inferenceModel(net, options(2))
    for _ in range(2):
        x, scale = torch.randn(4, 4), torch.rand(4, 1)
        pair, boxes = model(_Pair((x, scale)))
        expected = torch.cat([net(_Pair((x[i:i + 2], scale[i:i + 2])))[0][0]
                              for i in (0, 2)])
        assert type(pair) is _Pair and type(boxes) is _Boxes
        torch.testing.assert_close(pair.first(), expected)
        torch.testing.assert_close(pair[1], expected.sum(-1))
        torch.testing.assert_close(boxes[0], expected * 2)


def test_plain_objects_holding_tensors_are_refused():
    class ReturnsHolder(torch.nn.Module):
        def forward(self, x):
            return _Holder(x * 2)

    with pytest.raises(poptorch.Error, match="Argument 'x' is a _Holder "
                       "object holding tensors.*registerCustomArgParser"):
        poptorch.inferenceModel(ReturnsHolder())(_Holder(torch.ones(2)))
    with pytest.raises(poptorch.Error, match="forward returned a _Holder "
                       "object holding tensors"):
        poptorch.inferenceModel(ReturnsHolder())(torch.ones(2))


def test_numpy_array_arguments_are_refused():
    """A numpy array would be compiled in whole, as a constant, for every
    micro-batch; numpy scalars stay constants."""
    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * float(scale)

    model = poptorch.inferenceModel(Scaled(), options(2))
    torch.testing.assert_close(model(torch.ones(4), numpy.float32(2.0)),
                               torch.full((4,), 2.0))
    with pytest.raises(poptorch.Error, match="Argument 'x' is a numpy array"
                       r".*torch.from_numpy"):
        model(numpy.ones(4, dtype=numpy.float32), numpy.float32(2.0))
