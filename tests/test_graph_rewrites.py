"""The graph backend's rewrites of a captured step (``backends/in_place.py``
and ``backends/accumulation.py``): values never change, only where they are
stored and when gradients are summed. Each rewritten graph is compared with
the graph as captured, on the same inputs."""
import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from conftest import (assert_same_weights, make_data, options,
                      reference_training)
from poptorch._impl.backends.accumulation import accumulate_where_computed
from poptorch._impl.backends.in_place import Donation, reuse_dead_tensors
from poptorch._impl.backends.linear_layers import fuse_linear_layers
from poptorch._impl.backends.pooling import pool_channels_last
from poptorch._impl.backends.scaled_addition import fuse_scaled_additions

aten = torch.ops.aten


def _captured(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _rewritten(graph_module, donation=Donation({}), accumulate=False):
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    if accumulate:
        accumulate_where_computed(graph)
    fuse_linear_layers(graph)
    fuse_scaled_additions(graph)
    pool_channels_last(graph)
    reuse_dead_tensors(graph, donation)
    return torch.fx.GraphModule(graph_module, graph)


def _targets(graph_module):
    return [n.target for n in graph_module.graph.nodes
            if n.op == "call_function"]


def _run_both(fn, inputs, donation=Donation({}), accumulate=False):
    """(captured outputs, rewritten outputs, inputs after the rewritten
    run) for copies of ``inputs``."""
    graph = _captured(fn, *inputs)
    expected = graph(*[t.clone() for t in inputs])
    given = [t.clone() for t in inputs]
    rewritten = _rewritten(graph, donation, accumulate)
    return expected, rewritten(*given), given, rewritten


def _momentum_step(param, velocity, grad, lr):
    velocity = torch._foreach_add(torch._foreach_mul([velocity], 0.9), [grad])
    param = torch._foreach_sub([param], torch._foreach_mul(velocity, lr))
    return [param[0], velocity[0]]


def test_donated_state_is_updated_in_place_with_the_same_values():
    inputs = [torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3),
              torch.tensor(0.1)]
    expected, result, given, graph = _run_both(
        _momentum_step, inputs, Donation({0: 0, 1: 1}))
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-7)
    assert result[0] is given[0] and result[1] is given[1]
    assert aten._foreach_addcmul_.Scalar in _targets(graph)


def test_inputs_not_donated_are_never_written():
    inputs = [torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3),
              torch.tensor(0.1)]
    expected, result, given, _ = _run_both(_momentum_step, inputs)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-7)
    for before, after in zip(inputs, given):
        assert torch.equal(before, after)


def test_a_tensor_the_step_made_is_reused_once_dead():
    def fn(x):
        y = torch.exp(x)
        return [torch.sqrt(y + 1.0) * 2.0]

    expected, result, _, graph = _run_both(fn, [torch.rand(4, 4)])
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    targets = _targets(graph)
    assert aten.add_.Tensor in targets and aten.sqrt_.default in targets


def test_a_tensor_still_read_later_is_not_overwritten():
    def fn(x, y):
        z = x * 2.0
        w = z + y          # z is read again below: no in-place add
        return [w, z.sum()]

    expected, result, _, graph = _run_both(
        fn, [torch.randn(3, 3), torch.randn(3, 3)], Donation({0: 0, 1: 1}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert aten.add.Tensor in _targets(graph)


def test_a_view_of_a_tensor_written_in_place_keeps_it_alive():
    """``h = x * 3`` runs in place on x's copy; ``h`` is then read through
    a view (a linear layer's reshape) after ``h + out``: that addition may
    not overwrite h (the weight gradient of ``h = h + fc(h)`` was wrong)."""
    def fn(x, weight):
        h = torch.exp(x) * 3.0
        flat = h.reshape(-1, 4)
        out = (flat @ weight).reshape(h.shape)
        total = h + out
        return [total, flat.t() @ total.reshape(-1, 4)]

    expected, result, _, _ = _run_both(fn, [torch.randn(2, 3, 4),
                                            torch.randn(4, 4)])
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


class _ScaledResidual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(24, 16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, tokens):
        h = self.embedding(tokens) * 3.0
        h = h + self.fc(h)
        return poptorch.identity_loss((h ** 2).mean(), reduction="mean")


def test_a_residual_around_a_linear_layer_trains_like_pytorch():
    torch.manual_seed(0)
    net = _ScaledResidual()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    tokens = torch.randint(0, 24, (8, 12))
    for _ in range(2):
        model(tokens)
        reference.zero_grad()
        twin(tokens).backward()
        reference.step()
    assert_same_weights(net, twin)


@pytest.mark.parametrize("fn, inputs", [
    # a broadcast result is larger than the first operand
    (lambda x, y: [x + y], [torch.randn(1, 4), torch.randn(3, 4)]),
    # type promotion: the result is float64
    (lambda x, y: [x * y], [torch.randn(3, 4), torch.randn(3, 4,
                                                          dtype=torch.float64)]),
    # the other operand is a transposed view of the first
    (lambda x, y: [x + x.t()], [torch.randn(4, 4), torch.randn(1)]),
], ids=["broadcast", "promotion", "partial-overlap"])
def test_no_in_place_where_it_would_change_values(fn, inputs):
    expected, result, given, graph = _run_both(fn, inputs,
                                               Donation({0: 0, 1: 1}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert torch.equal(given[0], inputs[0])


def test_one_tensor_twice_in_a_list_operation_is_not_written_twice():
    def fn(x, y, z):
        return torch._foreach_add([x, x], [y, z])

    inputs = [torch.randn(3), torch.randn(3), torch.randn(3)]
    expected, result, given, _ = _run_both(fn, inputs, Donation({0: 0}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert torch.equal(given[0], inputs[0])


def test_an_output_in_another_inputs_storage_is_cloned():
    # Each new value would land in the other input's storage; a caller that
    # copies output j into input j (CUDA graphs) must not clobber one with
    # the other, so both outputs are separate tensors.
    def fn(a, b):
        return [b * 2.0, a + 1.0]

    inputs = [torch.randn(4), torch.randn(4)]
    expected, result, given, _ = _run_both(fn, inputs, Donation({0: 0, 1: 1}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    pointers = {t.data_ptr() for t in given}
    assert result[0].data_ptr() not in pointers
    assert result[1].data_ptr() not in pointers


def test_outputs_fed_back_never_share_storage():
    def fn(a, b):
        c = a + b
        return [c, c]

    inputs = [torch.randn(4), torch.randn(4)]
    expected, result, _, _ = _run_both(fn, inputs, Donation({0: 0, 1: 1}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert result[0].data_ptr() != result[1].data_ptr()


def test_an_output_in_a_scratch_input_is_cloned():
    def fn(running, param):
        return [param - running * 0.5]

    inputs = [torch.randn(4), torch.randn(4)]
    expected, result, given, _ = _run_both(
        fn, inputs, Donation({}, frozenset({0})))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert result[0].data_ptr() != given[0].data_ptr()


@pytest.mark.parametrize("tensor_scale, fused", [
    (False, aten._foreach_add_.List),
    (True, aten._foreach_addcmul_.Scalar),
], ids=["number", "tensor"])
def test_a_scaled_addition_is_one_operation(tensor_scale, fused):
    def fn(base, other, scale):
        scale = scale if tensor_scale else 0.25
        return torch._foreach_sub([base], torch._foreach_mul([other], scale))

    inputs = [torch.randn(4, 4), torch.randn(4, 4), torch.tensor(0.25)]
    expected, result, given, graph = _run_both(fn, inputs, Donation({0: 0}))
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-7)
    targets = _targets(graph)
    assert fused in targets and aten._foreach_mul.Scalar not in targets
    assert aten._foreach_mul.Tensor not in targets
    assert result[0] is given[0]


def test_a_product_read_elsewhere_is_kept():
    def fn(base, other):
        product = torch._foreach_mul([other], 0.5)
        return torch._foreach_add([base], product) + product

    inputs = [torch.randn(4), torch.randn(4)]
    expected, result, _, graph = _run_both(fn, inputs, Donation({0: 0}))
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert aten._foreach_mul.Scalar in _targets(graph)


def test_a_linear_layer_under_vmap_adds_its_bias_in_the_product():
    def fn(x, w, b):
        linear = torch.func.vmap(torch.nn.functional.linear,
                                 in_dims=(0, None, None))
        return [torch.relu(linear(x, w, b))]

    inputs = [torch.randn(4, 3, 6), torch.randn(5, 6), torch.randn(5)]
    expected, result, given, graph = _run_both(fn, inputs)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
    targets = _targets(graph)
    assert aten.addmm.default in targets and aten.mm.default not in targets
    assert aten.relu_.default in targets
    for before, after in zip(inputs, given):
        assert torch.equal(before, after)


def _accumulate(running, a, b, bias_grad):
    grads = [torch.mm(a, b), bias_grad * 2.0]
    torch._foreach_add_(running, grads)
    return []


def test_gradients_are_added_where_computed_and_products_fused():
    inputs = [torch.randn(3, 5), torch.randn(5), torch.randn(3, 4),
              torch.randn(4, 5), torch.randn(5)]

    def fn(r0, r1, a, b, g):
        _accumulate([r0, r1], a, b, g)
        return [r0, r1]

    expected, result, given, graph = _run_both(
        fn, inputs, Donation({0: 0, 1: 1}), accumulate=True)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
    targets = _targets(graph)
    assert aten.addmm_.default in targets
    assert aten.mm.default not in targets
    assert aten._foreach_add_.List not in targets
    assert result[0] is given[0]


def test_a_transposed_product_is_fused_with_its_operands_swapped():
    def fn(r, a, b):
        torch._foreach_add_([r], [torch.mm(a, b).t()])
        return [r]

    inputs = [torch.randn(5, 3), torch.randn(3, 4), torch.randn(4, 5)]
    expected, result, _, graph = _run_both(fn, inputs, Donation({0: 0}),
                                           accumulate=True)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
    assert aten.addmm_.default in _targets(graph)


def test_a_product_written_into_the_buffer_is_computed_there():
    def fn(r0, r1, a, b, g):
        torch._foreach_copy_([r0, r1], [torch.mm(a, b), g * 2.0])
        return [r0, r1]

    inputs = [torch.randn(3, 5), torch.randn(5), torch.randn(3, 4),
              torch.randn(4, 5), torch.randn(5)]
    expected, result, given, graph = _run_both(
        fn, inputs, Donation({0: 0, 1: 1}), accumulate=True)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
    targets = _targets(graph)
    assert aten.mm.out in targets and aten.mm.default not in targets
    assert aten._foreach_copy_.default not in targets
    assert result[0] is given[0]


def test_a_sum_read_before_the_addition_keeps_its_old_value():
    def fn(r, a, b):
        g = torch.mm(a, b)
        before = r.sum()
        torch._foreach_add_([r], [g])
        return [r, before]

    inputs = [torch.randn(3, 5), torch.randn(3, 4), torch.randn(4, 5)]
    expected, result, _, _ = _run_both(fn, inputs, Donation({0: 0}),
                                       accumulate=True)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)


class _ReturnsWeight(torch.nn.Module):
    """Returns a view of a weight the optimizer updates: the collected
    output of each micro-batch must keep the weight of its time."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return self.fc.weight.t(), torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_with_rewrites_matches_plain_pytorch(optimizer):
    torch.manual_seed(0)
    net = _ReturnsWeight()
    twin = copy.deepcopy(net)

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    opts = options(device_iterations=2, accumulation=2)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts, make(net.parameters()))
    reference = make(twin.parameters())
    for call in range(2):
        x, y = make_data(8, seed=call)
        weights, _ = model(x, y)
        for step in range(2):
            expected = twin.fc.weight.detach().t().clone()
            reference.zero_grad()
            for micro in range(2):
                rows = slice((2 * step + micro) * 2,
                             (2 * step + micro + 1) * 2)
                _, loss = twin(x[rows], y[rows])
                (loss / 2).backward()
                torch.testing.assert_close(
                    weights[(2 * step + micro) * 4:(2 * step + micro + 1) * 4],
                    expected, rtol=1e-5, atol=1e-6)
            reference.step()
    model.copyWeightsToHost()
    assert_same_weights(net, twin, atol=1e-6)


def _pool(x):
    values, indices = torch.nn.functional.max_pool2d(
        x, 3, stride=2, padding=1, return_indices=True)
    return values * 2, indices


@pytest.mark.parametrize("layout, rewritten", [
    ((6, 5, 9, 7), True),       # contiguous, several channels
    ((6, 1, 9, 7), False),      # one channel: both layouts are one
    ("channels_last", False),   # already the fast kernel's layout
])
def test_max_pools_run_on_channels_last_copies(layout, rewritten):
    """The rewritten pool gives the same values and indices (exactly), in
    contiguous tensors as traced, through the channels-last kernel."""
    x = torch.randn(6, 5, 9, 7)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    else:
        x = torch.randn(*layout)
    expected, result, _, graph = _run_both(_pool, [x])
    for want, got in zip(expected, result):
        assert torch.equal(want, got) and got.stride() == want.stride()
    copies = [n for n in graph.graph.nodes
              if n.target is aten.clone.default
              and n.kwargs.get("memory_format") is torch.channels_last]
    assert bool(copies) == rewritten


class _Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(4 * 3 * 3, 3)

    def forward(self, x, y=None):
        out = self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def test_a_pooling_model_trains_and_infers_like_plain_pytorch():
    """Max pooling forward on the channels-last copy and its backward
    through the indices: the weights after 2 calls (2 steps of 2
    micro-batches each) and the inference outputs equal plain PyTorch's
    (atol 1e-6)."""
    torch.manual_seed(0)
    net = _Pooled()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(device_iterations=2, accumulation=2),
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for call in range(2):
        generator = torch.Generator().manual_seed(call)
        x = torch.randn(8, 2, 6, 6, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        model(x, y)
        reference_training(twin, reference, (x, y), device_iterations=2,
                           accumulation=2)
    assert_same_weights(net, twin, atol=1e-6)
    model.detachFromDevice()
    inference = poptorch.inferenceModel(net.eval(), options())
    torch.testing.assert_close(inference(x), twin.eval()(x), atol=1e-6,
                               rtol=0)
