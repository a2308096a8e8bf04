"""Arguments of custom types (poptorch.ICustomArgParser,
poptorch.registerCustomArgParser): their tensors are cut into micro-batches
and the value is rebuilt per micro-batch, through wrapped models and the
data loaders, as plain PyTorch computes it on each micro-batch."""
import copy
import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

import poptorch
from poptorch._impl import custom_args
from poptorch.enums import DataLoaderMode, SharingStrategy
from conftest import (ClassifierMLP, assert_same_weights, make_data, options,
                      reference_training)


@dataclasses.dataclass
class Batch:
    """Two tensors and a non-tensor field."""
    x: torch.Tensor
    y: torch.Tensor
    scale: float


class BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.x
        yield struct.y

    def reconstruct(self, original_structure, tensor_iterator):
        return dataclasses.replace(original_structure,
                                   x=next(tensor_iterator),
                                   y=next(tensor_iterator))


class Graph:
    """A plain class holding its tensors in a list (no attribute holds
    one), an optional edge weight and a plain attribute."""

    def __init__(self, tensors, weighted, name="g"):
        self.tensors = tensors
        self.weighted = weighted
        self.name = name


class GraphParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield from struct.tensors

    def reconstruct(self, original_structure, tensor_iterator):
        tensors = [next(tensor_iterator) + 0
                   for _ in original_structure.tensors]
        return Graph(tensors, original_structure.weighted,
                     original_structure.name)


@pytest.fixture(autouse=True)
def parsers():
    poptorch.registerCustomArgParser(Batch, BatchParser())
    poptorch.registerCustomArgParser(Graph, GraphParser())
    yield
    poptorch.registerCustomArgParser(Batch, None)
    poptorch.registerCustomArgParser(Graph, None)


class BatchClassifier(ClassifierMLP):
    def forward(self, batch):
        return super().forward(batch.x * batch.scale, batch.y)


class GraphNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, graph):
        out = self.fc(graph.tensors[0])
        if graph.weighted:
            out = out * graph.tensors[1]
        return out


def collate(samples):
    x, y = torch.utils.data.default_collate(samples)
    return Batch(x, y, 0.5)


def _train_and_compare(batches):
    """Train a model with D = G = R = 2 on ``batches`` (Batch objects) and
    check its losses (the last device iteration's, per replica) and its
    weights against plain PyTorch (tolerance 1e-5 / 1e-6)."""
    torch.manual_seed(0)
    net = BatchClassifier()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(2, 2, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for batch in batches:
        _, losses = model(batch)
        expected = reference_training(
            lambda x, y, scale=batch.scale: twin(Batch(x, y, scale)),
            reference, [batch.x, batch.y], 2, 2, 2)
        torch.testing.assert_close(losses, expected[-2:], rtol=1e-5,
                                   atol=1e-5)
    assert_same_weights(net, twin)


def test_custom_batch_trains_as_pytorch_with_d_g_r():
    x, y = make_data(32)
    batches = [Batch(x[:16], y[:16], 0.5), Batch(x[16:], y[16:], 0.5)]
    _train_and_compare(batches)


@pytest.mark.parametrize("loading", ["sync", "async", "accessor"])
def test_custom_batches_from_the_data_loaders_train_as_pytorch(loading):
    x, y = make_data(48)
    mode = DataLoaderMode.Async if loading == "async" else DataLoaderMode.Sync
    fork = {"sharing_strategy": SharingStrategy.Fork}
    loader = poptorch.DataLoader(
        options(2, 2, 2), TensorDataset(x, y), batch_size=2,
        collate_fn=collate, mode=mode,
        async_options=fork if loading == "async" else None)
    if loading == "accessor":
        loader = poptorch.AsynchronousDataAccessor(loader, **fork)
    batches = [Batch(b.x.clone(), b.y.clone(), b.scale) for b in loader]
    assert [type(b) for b in batches] == [Batch] * 3
    torch.testing.assert_close(torch.cat([b.x for b in batches]), x)
    loader.terminate()
    _train_and_compare(batches)


def test_custom_argument_and_output_in_inference_as_pytorch():
    torch.manual_seed(0)
    net = GraphNet()
    model = poptorch.inferenceModel(net, options(2, replicas=2))

    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, graph):
            return Graph([self.net(graph)], graph.weighted, "out")

    echo = poptorch.inferenceModel(Echo(), options(2, replicas=2))
    nodes, weights = torch.randn(8, 4), torch.randn(8, 2)
    graph = Graph([nodes, weights], True)
    torch.testing.assert_close(model(graph), net(graph), rtol=1e-6,
                               atol=1e-6)
    result = echo(graph)
    assert type(result) is Graph and result.name == "out"
    torch.testing.assert_close(result.tensors[0], net(graph), rtol=1e-6,
                               atol=1e-6)


def test_changed_custom_argument_is_named():
    x, y = make_data(8)
    model = poptorch.inferenceModel(BatchClassifier())
    model(Batch(x, y, 0.5))
    with pytest.raises(poptorch.Error, match=r"'batch\.x' changed.*\(4, 4\)"):
        model(Batch(x[:4], y[:4], 0.5))
    with pytest.raises(poptorch.Error,
                       match=r"'batch\.scale' changed.*0\.5, got the value 2"):
        model(Batch(x, y, 2.0))
    graph_model = poptorch.inferenceModel(GraphNet())
    nodes = torch.randn(4, 4)
    graph_model(Graph([nodes, torch.ones(4, 2)], True))
    with pytest.raises(poptorch.Error, match=r"'graph<tensor 1>' changed"):
        graph_model(Graph([nodes, torch.ones(4, 3)], True))
    with pytest.raises(poptorch.Error, match="structure of the model's "
                       "arguments changed"):
        graph_model(Graph([nodes], True))


def test_parser_must_be_an_icustomargparser_and_none_removes_it():
    with pytest.raises(poptorch.Error, match="parser for Batch must be an "
                       "instance of poptorch.ICustomArgParser or None"):
        poptorch.registerCustomArgParser(Batch, lambda struct: struct)
    with pytest.raises(poptorch.Error, match="arg_type must be a class"):
        poptorch.registerCustomArgParser("Batch", BatchParser())
    for built_in in (dict, torch.Tensor):
        with pytest.raises(poptorch.Error, match=f"arg_type must be a "
                           f"custom type, got {built_in.__name__}"):
            poptorch.registerCustomArgParser(built_in, BatchParser())
    x, y = make_data(8)
    batch = Batch(x, y, 0.5)
    assert custom_args.has_parser(batch)
    poptorch.registerCustomArgParser(Batch, None)
    assert not custom_args.has_parser(batch)
