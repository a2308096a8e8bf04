"""The bucketed gradient all-reduce of a distributed training step and the
graph order that starts each bucket's collective as soon as its gradients
exist (``poptorch/_impl/distributed/gradients.py``), run in one process
against a recording stand-in for the process group."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from poptorch._impl.distributed import collectives, gradients, process_group

PROCESSES = 3


class RecordingGroup:
    """Acts as a group of 3 processes that computed the same gradients:
    a sum multiplies by 3. Records the order of starts and waits, and the
    values each start sees."""

    size = PROCESSES

    def __init__(self):
        self.events = []
        self.started = {}

    def start_all_reduce_(self, tensor, key):
        self.events.append(("start", key))
        self.started[key] = tensor.clone()

    def finish_all_reduce_(self, tensor, key, average, what):
        self.events.append(("wait", key))
        tensor.mul_(PROCESSES)
        if average:
            tensor.div_(PROCESSES)


@pytest.fixture
def group(monkeypatch):
    recording = RecordingGroup()
    monkeypatch.setattr(process_group, "current", lambda: recording)
    return recording


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
        torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _sgd_step_graph(net, average):
    """make_fx graph of (x, y, *params) -> params after one SGD step
    (lr 0.1) on the gradients all-reduced by ``GradientAllReduce``, its
    token created first, as a training step creates it."""
    names = [name for name, _ in net.named_parameters()]

    def step(x, y, *params):
        reduce = gradients.GradientAllReduce(average,
                                             collectives.new_token(x))

        def loss(weights):
            out = torch.func.functional_call(net, weights, (x,))
            return torch.nn.functional.cross_entropy(out, y)

        grads = torch.func.grad(loss)(dict(zip(names, params)))
        reduced = reduce([grads[name] for name in names])
        return [p - 0.1 * g for p, g in zip(params, reduced)]

    example = [torch.randn(8, 16), torch.randint(0, 4, (8,)),
               *net.parameters()]
    return make_fx(step, tracing_mode="fake")(*example)


def _expected(net, x, y, factor):
    params = list(net.parameters())
    loss = torch.nn.functional.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss, params)
    return [p - 0.1 * factor * g for p, g in zip(params, grads)]


def test_buckets_follow_the_parameters_backwards_by_dtype_and_size(
        monkeypatch):
    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", 100)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 200)
    grads = [torch.zeros(10), torch.zeros(30), torch.zeros(4,
                                                            dtype=torch.half),
             torch.zeros(20), torch.zeros(5), torch.zeros(50)]
    # Backwards: 5 (200 bytes) closes the first bucket at once; then
    # 4 + 3 (20 + 80 bytes, under 200); the half tensor opens its own
    # bucket; 1 reaches 220 bytes and closes; 0 opens another. The open
    # buckets follow, in the order they were opened.
    assert gradients.buckets(grads) == [[5], [4, 3, 1], [2], [0]]
    default = [torch.zeros(1000, 1000), torch.zeros(10)]
    assert gradients.buckets(default) == [[1, 0]]


@pytest.mark.parametrize("average, factor", [(False, PROCESSES),
                                             (True, 1)])
def test_reordered_step_gives_each_parameter_its_reduced_gradient(
        group, monkeypatch, average, factor):
    """Buckets of about one layer each: the reordered graph's new weights
    equal eager PyTorch's SGD step on the gradients summed (or averaged)
    over the 3 processes (atol 1e-6)."""
    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", 500)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 500)
    net = _net()
    graph = _sgd_step_graph(net, average)
    gradients.start_all_reduces_early(graph.graph)
    graph.recompile()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with torch.no_grad():
        new = graph(x, y, *net.parameters())
    for got, want in zip(new, _expected(net, x, y, factor)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert group.events == [("start", 0), ("start", 1), ("start", 2),
                            ("wait", 0), ("wait", 1), ("wait", 2)]


def test_the_last_layers_collectives_start_before_the_backward_pass_ends(
        monkeypatch):
    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", 500)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 500)
    graph = _sgd_step_graph(_net(), True)
    order = list(graph.graph.nodes)
    traced_starts = [order.index(n) for n in order
                     if n.target is torch.ops.poptorch.all_reduce_start_
                     .default]
    matmuls = [order.index(n) for n in order
               if n.target is torch.ops.aten.mm.default]
    assert min(traced_starts) > max(matmuls)   # as traced: after backward

    gradients.start_all_reduces_early(graph.graph)
    order = list(graph.graph.nodes)
    starts = [order.index(n) for n in order
              if n.target is torch.ops.poptorch.all_reduce_start_.default]
    matmuls = [order.index(n) for n in order
               if n.target is torch.ops.aten.mm.default]
    waits = [order.index(n) for n in order
             if n.target is torch.ops.poptorch.all_reduce_wait_.default]
    assert len(starts) == 3 and starts == sorted(starts)
    # The last layer's bucket starts before the weight gradients of the
    # two layers below are computed, the middle one's before the first's.
    assert sum(mm > starts[0] for mm in matmuls) >= 2
    assert sum(mm > starts[1] for mm in matmuls) >= 1
    assert max(starts) < min(waits)


def test_no_operation_moves_above_an_in_place_write(group):
    """A value read after an in-place write keeps reading the written
    tensor, even through a view taken before the write (no graph edge
    leads from the write to the read): the start it feeds stays after the
    write."""

    def step(a, g):
        view = a.view(-1)
        doubled = g * 2
        a.add_(1)
        flat = torch.cat([doubled, view * 3])
        token = flat.new_empty(0)
        torch.ops.poptorch.all_reduce_start_(flat, 0, token)
        later = a.sum()
        torch.ops.poptorch.all_reduce_wait_(flat, 0, False, token)
        return flat, later

    graph = make_fx(step, tracing_mode="fake")(torch.zeros(2),
                                                torch.zeros(2))
    gradients.start_all_reduces_early(graph.graph)
    graph.recompile()
    order = [n.target for n in graph.graph.nodes]
    assert (order.index(torch.ops.aten.add_.Tensor)
            < order.index(torch.ops.poptorch.all_reduce_start_.default))
    a, g = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0])
    flat, later = graph(a, g)
    torch.testing.assert_close(group.started[0],
                               torch.tensor([10.0, 12.0, 6.0, 9.0]))
    torch.testing.assert_close(flat, 3 * torch.tensor([10.0, 12.0, 6.0,
                                                       9.0]))
    torch.testing.assert_close(later, torch.tensor(5.0))


def test_random_draws_keep_their_order(group):
    """A random draw that only feeds a bucket stays after the draws that
    preceded it, so each draw gets the same numbers as in the traced
    order."""

    def step(g):
        first = torch.rand_like(g)
        flat = torch.cat([g * torch.rand_like(g)])
        token = flat.new_empty(0)
        torch.ops.poptorch.all_reduce_start_(flat, 0, token)
        torch.ops.poptorch.all_reduce_wait_(flat, 0, True, token)
        return flat, first

    graph = make_fx(step, tracing_mode="fake")(torch.zeros(4))
    draws = [n for n in graph.graph.nodes
             if n.target is torch.ops.aten.rand_like.default]
    gradients.start_all_reduces_early(graph.graph)
    assert [n for n in graph.graph.nodes if n in draws] == draws


def test_a_step_without_collectives_is_left_as_traced():
    graph = make_fx(lambda a: (a * 2).sum(), tracing_mode="fake")(
        torch.zeros(3))
    before = [n.name for n in graph.graph.nodes]
    gradients.start_all_reduces_early(graph.graph)
    assert [n.name for n in graph.graph.nodes] == before


@pytest.mark.slow
def test_every_backend_runs_the_collectives_in_the_traced_order(
        group, monkeypatch):
    """Processes running one step compiled by different backends (tiered
    compilation switches each process on its own) must start the same
    collectives in the same order: Inductor, which reorders independent
    operations, keeps the traced order of the operations that write the
    step's token (bucket starts before waits; gathers as traced)."""
    from poptorch._impl.backends import get_backend

    gathered = []
    group.all_gather = lambda part, what: (
        gathered.append(part.numel()) or torch.cat([part] * PROCESSES))

    def step(a, b, c):
        token = collectives.new_token(a)
        reduced = gradients.GradientAllReduce(True, token)(
            [c * 3, b.sin(), a * 2])
        first = torch.ops.poptorch.all_gather(reduced[2] * 3, PROCESSES,
                                              token)
        second = torch.ops.poptorch.all_gather(reduced[1], PROCESSES, token)
        third = torch.ops.poptorch.all_gather(reduced[0] * 2, PROCESSES,
                                              token)
        return third.sum() + second.sum(), first

    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", 50)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 50)
    inputs = [torch.randn(10), torch.randn(20), torch.randn(30)]
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    gradients.start_all_reduces_early(graph.graph)
    graph.recompile()
    orders = []
    for backend in ("graph", "inductor"):
        group.events.clear()
        gathered.clear()
        get_backend(backend).compile(graph, inputs, None)(*inputs)
        orders.append((list(group.events), list(gathered)))
    assert orders[0] == orders[1]
    assert orders[0] == ([("start", 0), ("start", 1), ("wait", 0),
                          ("wait", 1)], [10, 20, 30])
