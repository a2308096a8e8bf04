"""Weight sharding (replicated tensor sharding on the weight location,
``poptorch/_impl/distributed/weight_sharding.py``): the graph pass that
gathers each weight just before its use, checked on a captured step by
the whole weights it keeps alive at once and, run by two simulated
processes, against the same step on whole weights; what is logged where
weight sharding has nothing to do. Training with sharded weights over
real processes is compared with unsharded training in test_sharding.py
(slow)."""
import pytest
import torch
import torch.fx.traceback as fx_traceback

import poptorch
from poptorch._impl.capture import trace
from poptorch._impl.distributed import collectives, weight_sharding
from poptorch._impl.distributed.weight_sharding import (
    gather_weights_before_use)
from poptorch._impl.profiling.facts import BACKWARD, PASS_KEY
import sharding_program as program
from test_sharding import _messages, _rts, _run_as_processes

PARTS = 2
LAYERS = 4
WIDTH = 6
SHAPES = [(WIDTH, WIDTH), (WIDTH,)] * LAYERS


def _whole_step(weights, x):
    """An MLP's loss gradients for whole ``weights`` (plain autograd)."""
    weights = [w.detach().requires_grad_() for w in weights]
    with torch.enable_grad():
        h = x
        for layer in range(LAYERS):
            h = torch.tanh(torch.nn.functional.linear(
                h, weights[2 * layer], weights[2 * layer + 1]))
        loss = h.square().sum()
        with fx_traceback.annotate({PASS_KEY: BACKWARD}):
            return list(torch.autograd.grad(loss, weights))


def _sharded_step(*flat):
    """``_whole_step`` on weights gathered from rows, as a weight-sharded
    training step starts."""
    *rows, x = flat
    token = collectives.new_token(x)
    weights = [torch.ops.poptorch.gather_rows(r, PARTS, list(shape), token)
               for r, shape in zip(rows, SHAPES)]
    return _whole_step(weights, x)


def _captured_step() -> torch.fx.GraphModule:
    rows = [torch.zeros(collectives.shard_numel(torch.Size(s).numel(),
                                                PARTS)) for s in SHAPES]
    with fx_traceback.preserve_node_meta():
        return trace(_sharded_step, rows + [torch.zeros(3, WIDTH)])


def _most_whole_weights_alive(graph: torch.fx.Graph) -> int:
    """The most gathered buckets of weights whose memory is alive at one
    time: a bucket from the start of its collective until the last use of
    it or of a view of it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    started = {node.args[1]: order[node] for node in graph.nodes
               if node.target is torch.ops.poptorch.all_gather_start_.default}
    root, begins = {}, {}
    for node in graph.nodes:
        if node.target is torch.ops.poptorch.gather_rows.default:
            root[node], begins[node] = node, order[node]
        elif node.target is torch.ops.poptorch.all_gather_wait.default:
            root[node], begins[node] = node, started[node.args[1]]
        elif (isinstance(node.target, torch._ops.OpOverload)
              and node.target.is_view and node.args[0] in root):
            root[node] = root[node.args[0]]
    ends = {}
    for node, bucket in root.items():
        last = max((order[user] for user in node.users), default=order[node])
        ends[bucket] = max(ends.get(bucket, 0), last)
    return max(sum(1 for bucket, end in ends.items()
                   if begins[bucket] <= i <= end) for i in order.values())


def _waits(graph: torch.fx.GraphModule, backward: bool):
    return [n for n in graph.graph.nodes
            if n.target is torch.ops.poptorch.all_gather_wait.default
            and ((n.meta.get("custom") or {}).get(PASS_KEY) == BACKWARD)
            == backward]


def test_weights_are_gathered_just_before_use_and_again_for_backward(
        monkeypatch):
    """With one weight per bucket: captured as written, the step gathers
    the four layers' weights at its start and holds them all through both
    passes; after the pass it holds at most five at a time (two layers'
    weight and bias, and the next weight arriving), and the backward pass
    has its own gathers."""
    monkeypatch.setattr(weight_sharding, "GATHER_BUCKET_BYTES", 1)
    graph = _captured_step()
    assert _most_whole_weights_alive(graph.graph) == len(SHAPES)
    gather_weights_before_use(graph.graph)
    assert _most_whole_weights_alive(graph.graph) <= 5
    # The weight matrix of every layer but the first (whose backward use
    # would be the input's gradient, not needed) is gathered again; the
    # backward pass does not read the biases.
    assert len(_waits(graph, backward=False)) == len(SHAPES)
    assert len(_waits(graph, backward=True)) == LAYERS - 1


def test_small_weights_are_gathered_together(monkeypatch):
    """Weights of fewer bytes than a bucket together are gathered by one
    collective in each pass."""
    monkeypatch.setattr(weight_sharding, "GATHER_BUCKET_BYTES", 1 << 20)
    graph = _captured_step()
    gather_weights_before_use(graph.graph)
    assert len(_waits(graph, backward=False)) == 1
    assert len(_waits(graph, backward=True)) == 1


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1 << 20])
def test_the_gathering_step_computes_the_whole_steps_gradients(
        monkeypatch, bucket_bytes):
    """The reordered step run by two simulated processes, each with its
    rows, returns the gradients that autograd computes on the whole
    weights (atol 1e-6), on both processes, with buckets of one weight,
    of a few, and of all."""
    monkeypatch.setattr(weight_sharding, "GATHER_BUCKET_BYTES",
                        bucket_bytes)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=generator) for s in SHAPES]
    x = torch.randn(3, WIDTH, generator=generator)
    graph = _captured_step()
    gather_weights_before_use(graph.graph)
    graph.recompile()

    def rows_of(rank):
        return [collectives.padded_rows(w, PARTS)[rank].clone()
                for w in weights]

    results = _run_as_processes(
        monkeypatch, PARTS, lambda rank: graph(*rows_of(rank), x))
    want = _whole_step(weights, x)
    for got in results:
        for value, expected in zip(got, want):
            torch.testing.assert_close(value, expected, atol=1e-6,
                                       rtol=1e-5)


def test_multi_stage_models_say_their_weights_stay_whole(poptorch_log):
    """A multi-stage model's stages are separate steps: weight sharding is
    logged as having no effect on it, with the reason."""
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.setWeightLocation(_rts())
    net = program.TwoStageNet()
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(4, 5), torch.randint(0, 3, (4,)))
    assert any("setWeightLocation with useReplicatedTensorSharding(True) "
               "has no effect on a multi-stage model" in m
               for m in _messages(poptorch_log))


def test_off_chip_weights_are_said_to_have_no_effect(poptorch_log):
    opts = poptorch.Options()
    opts.TensorLocations.setWeightLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    assert any("setWeightLocation with useOnChipStorage(False) has no "
               "effect yet" in m for m in _messages(poptorch_log))
