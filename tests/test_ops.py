"""PopTorch ops (API reference 11.3) and poptorch.profiling.Channel (11.2)."""
import copy

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from poptorch._impl import ops
from conftest import reference_training
from poptorch.enums import (MatMulSerializationMode, MultiConvPlanType,
                            OverlapMode)
from poptorch.errors import Error
from poptorch.profiling import Channel

poptorch_ops = torch.ops.poptorch


def trace(function, *args):
    return make_fx(function, tracing_mode="fake")(*args)


def targets(graph):
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


def lead_style_training_trace(loss_function, *args):
    """Forward + backward traced the way the executor does it."""
    step = torch.func.functionalize(torch.func.grad_and_value(loss_function),
                                    remove="mutations")
    return trace(step, *args)


def printed_lines(capsys):
    return [line for line in capsys.readouterr().out.splitlines()
            if not line.startswith("[poptorch:")]


def test_print_tensor_is_one_graph_node_printing_on_every_run(capsys):
    graph = trace(lambda x: ops.ipu_print_tensor(x * 2, "summation") + 1,
                  torch.ones(3))
    assert targets(graph).count(poptorch_ops.ipu_print_tensor.default) == 1
    assert printed_lines(capsys) == []  # nothing printed while tracing
    first = graph(torch.tensor([1.0, 2.0, 3.0]))
    second = graph(torch.tensor([0.5, 0.0, -1.0]))
    assert printed_lines(capsys) == [
        f"summation: {torch.tensor([2.0, 4.0, 6.0])}",
        f"summation: {torch.tensor([1.0, 0.0, -2.0])}"]
    assert torch.equal(first, torch.tensor([3.0, 5.0, 7.0]))
    assert torch.equal(second, torch.tensor([2.0, 1.0, -1.0]))


def test_print_tensor_without_title_prints_the_value(capsys):
    x = torch.tensor([1.5, 2.5])
    assert torch.equal(ops.ipu_print_tensor(x), x)
    assert printed_lines(capsys) == [str(x)]


def test_print_tensor_prints_the_gradient_under_torch_func_grad(capsys):
    def loss(x):
        return (ops.ipu_print_tensor(x * 2, "a") ** 2).sum()

    x = torch.tensor([1.0, -3.0])
    grad = torch.func.grad(loss)(x)
    assert torch.equal(grad, 8 * x)
    assert printed_lines(capsys) == [f"a: {2 * x}",
                                     f"a_gradient: {4 * x}"]


def test_print_tensor_prints_the_gradient_when_a_training_graph_runs(capsys):
    def loss(x):
        return (ops.ipu_print_tensor(torch.sin(x), "s") * 3).sum()

    graph = lead_style_training_trace(loss, torch.ones(2))
    assert targets(graph).count(poptorch_ops.ipu_print_tensor.default) == 2
    x = torch.tensor([0.0, 1.0])
    grad, value = graph(x)
    assert torch.allclose(grad, 3 * torch.cos(x))
    assert torch.allclose(value, 3 * torch.sin(x).sum())
    assert printed_lines(capsys) == [f"s: {torch.sin(x)}",
                                     f"s_gradient: {torch.full((2,), 3.0)}"]


def test_print_tensor_prints_the_gradient_in_eager_backward(capsys):
    x = torch.tensor([2.0, 4.0], requires_grad=True)
    (ops.ipu_print_tensor(x, "x") * x).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())
    assert printed_lines(capsys)[-1] == f"x_gradient: {x.detach()}"


def test_a_replayed_print_node_differentiates_and_prints_the_gradient(capsys):
    graph = trace(lambda x: ops.ipu_print_tensor(x, "y") * 5, torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    graph(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 5.0))
    assert printed_lines(capsys) == [f"y: {torch.ones(2)}",
                                     f"y_gradient: {torch.full((2,), 5.0)}"]


def test_print_tensor_checks_its_arguments():
    with pytest.raises(Error, match="title must be a string"):
        ops.ipu_print_tensor(torch.ones(1), 3)
    with pytest.raises(Error, match="ipu_print_tensor: tensor must be a "
                                    "torch.Tensor"):
        ops.ipu_print_tensor([1.0])


def test_nop_is_an_identity_that_stays_in_the_graph():
    graph = trace(lambda x: ops.nop(x) * 2, torch.ones(2))
    assert poptorch_ops.nop.default in targets(graph)
    x = torch.tensor([1.0, float("inf"), float("nan")])
    assert torch.equal(graph(x)[:2], x[:2] * 2) and graph(x)[2].isnan()
    grad = torch.func.grad(lambda v: (ops.nop(v) * v).sum())(x[:2])
    assert torch.equal(grad, 2 * x[:2])
    training = lead_style_training_trace(lambda v: ops.nop(v).sum(),
                                         torch.ones(2))
    assert poptorch_ops.nop.default in targets(training)
    assert torch.equal(training(torch.ones(2))[0], torch.ones(2))


def test_recomputation_checkpoint_returns_the_tensors_marked(poptorch_log):
    a, b = torch.randn(2, 3), torch.randn(4)
    single = ops.recomputationCheckpoint(a)
    assert isinstance(single, torch.Tensor) and torch.equal(single, a)
    pair = ops.recomputationCheckpoint(a, b)
    assert isinstance(pair, list) and len(pair) == 2
    assert torch.equal(pair[0], a) and torch.equal(pair[1], b)
    listed = ops.recomputationCheckpoint([a])
    assert isinstance(listed, list) and torch.equal(listed[0], a)
    messages = poptorch_log.messages
    assert sum("recompute the rest of each stage" in m for m in messages) == 1
    graph = trace(lambda x, y: sum(t.sum() for t in
                                   ops.recomputationCheckpoint(x, y)), a, b)
    assert targets(graph).count(
        poptorch_ops.recomputation_checkpoint.default) == 2


def test_recomputation_checkpoint_keeps_gradients():
    def loss(x):
        hidden = ops.recomputationCheckpoint(torch.tanh(x))
        return (hidden ** 2).sum()

    x = torch.randn(5)
    expected = torch.func.grad(lambda v: (torch.tanh(v) ** 2).sum())(x)
    assert torch.allclose(torch.func.grad(loss)(x), expected)
    grad, _ = lead_style_training_trace(loss, x)(x)
    assert torch.allclose(grad, expected)


def test_recomputation_checkpoint_needs_tensors():
    with pytest.raises(Error, match="needs at least one tensor"):
        ops.recomputationCheckpoint()
    with pytest.raises(Error, match="tensor 1 must be a torch.Tensor"):
        ops.recomputationCheckpoint(torch.ones(1), 2.0)


def test_set_available_memory_is_validated_and_has_no_effect(poptorch_log):
    x = torch.randn(3)
    assert ops.set_available_memory(x, 0.2) is x
    assert ops.set_available_memory(x, 1) is x
    assert any("set_available_memory" in m and "no effect" in m
               for m in poptorch_log.messages)
    for bad in (1.5, -0.1, True, "0.5"):
        with pytest.raises(Error, match="available_memory_proportion must be "
                                        "a number between 0.0 and 1.0"):
            ops.set_available_memory(x, bad)


def test_set_overlap_returns_any_structure_of_tensors(poptorch_log):
    inputs = {"a": torch.ones(1), "b": (torch.zeros(2), [torch.ones(3)])}
    mode = OverlapMode.OverlapAccumulationLoop
    assert ops.set_overlap_for_input(inputs, mode) is inputs
    out = torch.ones(2)
    assert ops.set_overlap_for_output(out, OverlapMode.NoOverlap) is out
    assert any("set_overlap_for_input" in m for m in poptorch_log.messages)
    assert any("set_overlap_for_output" in m for m in poptorch_log.messages)


def test_set_overlap_checks_mode_and_tensors():
    with pytest.raises(Error, match="set_overlap_for_input: mode must be a "
                                    "poptorch.OverlapMode"):
        ops.set_overlap_for_input(torch.ones(1), 0)
    with pytest.raises(Error, match="set_overlap_for_output: output_tensors "
                                    "must be a tensor.*found int 3"):
        ops.set_overlap_for_output([torch.ones(1), 3], OverlapMode.NoOverlap)


@pytest.mark.parametrize("mode", list(MatMulSerializationMode))
@pytest.mark.parametrize("lhs_shape, rhs_shape", [
    ((8, 6), (6, 4)), ((2, 4, 6), (6, 8)), ((3, 4, 6), (3, 6, 4))])
def test_serialized_matmul_equals_matmul(mode, lhs_shape, rhs_shape):
    torch.manual_seed(0)
    lhs = torch.randn(lhs_shape, requires_grad=True)
    rhs = torch.randn(rhs_shape, requires_grad=True)
    result = ops.serializedMatMul(lhs, rhs, mode, factor=2)
    expected = lhs @ rhs
    assert torch.allclose(result, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(result.sum(), (lhs, rhs))
    expected_grads = torch.autograd.grad(expected.sum(), (lhs, rhs))
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, pieces", [
    (MatMulSerializationMode.InputChannels, 4),
    (MatMulSerializationMode.ReducingDim, 3),
    (MatMulSerializationMode.OutputChannels, 2)])
def test_serialized_matmul_really_splits_the_multiplication(mode, pieces):
    graph = trace(lambda a, b: ops.serializedMatMul(a, b, mode, pieces),
                  torch.randn(8, 6), torch.randn(6, 4))
    assert targets(graph).count(torch.ops.aten.mm.default) == pieces


def test_serialized_matmul_keep_precision_adds_in_float32():
    torch.manual_seed(0)
    lhs = torch.randn(4, 512).half()
    rhs = torch.randn(512, 4).half()
    exact = (lhs.double() @ rhs.double())
    kept = ops.serializedMatMul(lhs, rhs, MatMulSerializationMode.ReducingDim,
                                8, keep_precision=True)
    assert kept.dtype == torch.float16
    assert torch.allclose(kept.double(), exact, rtol=1e-3, atol=0.05)


@pytest.mark.parametrize("call, message", [
    (lambda a, b: ops.serializedMatMul(
        a, b, MatMulSerializationMode.ReducingDim, 4),
     "factor 4 does not divide the reducing dimension \\(dimension n\\), of "
     "size 6, of lhs"),
    (lambda a, b: ops.serializedMatMul(
        a, b, MatMulSerializationMode.OutputChannels, 3),
     "factor 3 does not divide the output channels"),
    (lambda a, b: ops.serializedMatMul(
        a, b, MatMulSerializationMode.InputChannels),
     "factor must be an integer >= 1, not 0"),
    (lambda a, b: ops.serializedMatMul(a, b, 0, 2), "mode must be a poptorch"),
    (lambda a, b: ops.serializedMatMul(b, b, MatMulSerializationMode.Disabled),
     "must be matrices with matching n"),
    (lambda a, b: ops.serializedMatMul(
        a, b, MatMulSerializationMode.Disabled, keep_precision=1),
     "keep_precision must be a bool"),
])
def test_serialized_matmul_rejects_bad_arguments(call, message):
    with pytest.raises(Error, match=message):
        call(torch.randn(8, 6), torch.randn(6, 4))


def test_dynamic_slice_traces_to_a_static_graph_that_matches_slicing():
    graph = trace(lambda t, s: ops.dynamic_slice(t, 1, s, 5, 2),
                  torch.randn(2, 10), torch.tensor(0))
    tensor = torch.randn(2, 10)
    for start in range(6):
        result = graph(tensor, torch.tensor(start))
        assert result.shape == (2, 3)
        assert torch.equal(result, tensor[:, start:start + 5:2])


def test_dynamic_slice_accepts_a_one_element_start_and_negative_dim():
    tensor = torch.arange(24.0).reshape(2, 3, 4)
    start = torch.tensor([1], dtype=torch.int32)
    result = ops.dynamic_slice(tensor, -1, start, 3, 1)
    assert torch.equal(result, tensor[..., 1:4])


@pytest.mark.parametrize("args, message", [
    ((0, torch.tensor(0.5), 2, 1), "start must be a tensor holding one "
                                   "integer"),
    ((0, torch.tensor([0, 1]), 2, 1), "start must be a tensor holding one"),
    ((0, 1, 2, 1), "start must be a torch.Tensor"),
    ((2, torch.tensor(0), 2, 1), "dim must be an integer in \\[-2, 1\\]"),
    ((0, torch.tensor(0), 0, 1), "size must be an integer >= 1"),
    ((0, torch.tensor(0), 2, 0), "step must be an integer >= 1"),
    ((0, torch.tensor(0), 5, 1), "size 5 exceeds dimension 0"),
])
def test_dynamic_slice_rejects_bad_arguments(args, message):
    with pytest.raises(Error, match=message):
        ops.dynamic_slice(torch.ones(4, 4), *args)


def test_for_loop_feeds_outputs_back_as_inputs():
    def body(x, total):
        return x * 2, total + x

    x, total = torch.tensor([1.0, 3.0]), torch.zeros(2)
    result = ops.for_loop(3, body, [x, total])
    assert isinstance(result, list)
    assert torch.equal(result[0], x * 8)
    assert torch.equal(result[1], x * 7)
    assert torch.equal(ops.for_loop(2, lambda v: v + 1, [x])[0], x + 2)
    assert torch.equal(ops.for_loop(0, body, [x, total])[1], total)


def test_for_loop_traces_the_iterations_into_the_graph():
    graph = trace(lambda x: ops.for_loop(4, torch.sin, [x])[0], torch.ones(2))
    assert targets(graph).count(torch.ops.aten.sin.default) == 4
    x = torch.tensor([0.3, -1.0])
    assert torch.allclose(graph(x), x.sin().sin().sin().sin())


def accumulate_in_place(x, total):
    total.add_(x)
    return x, total


def test_for_loop_passes_its_inputs_by_value():
    x, total = torch.tensor([1.0, 2.0]), torch.zeros(2)
    result = ops.for_loop(3, accumulate_in_place, [x, total])
    assert torch.equal(result[1], x * 3)
    assert torch.equal(total, torch.zeros(2))


class InPlaceLoop(torch.nn.Module):
    def forward(self, x, total):
        return ops.for_loop(2, accumulate_in_place, [x, total])[1] * 1


def test_for_loop_in_a_model_leaves_the_callers_inputs_unchanged():
    x, total = torch.tensor([[1.0, 2.0]]), torch.ones(1, 2)
    model = poptorch.inferenceModel(InPlaceLoop())
    assert torch.equal(model(x, total), 1 + 2 * x)
    assert torch.equal(total, torch.ones(1, 2))
    assert torch.equal(model(x, total), 1 + 2 * x)


@pytest.mark.parametrize("count, body, message", [
    (2, lambda a, b: a, "body takes 2 tensor\\(s\\) but returned 1"),
    (2, lambda a, b: (a, b.sum()), "body output 1 is torch.float32 \\(\\) "
                                   "but input 1 is torch.float32 \\(2,\\)"),
    (2, lambda a, b: (a, b.long()), "body output 1 is torch.int64"),
    (2, lambda a, b: (a, 1.0), "must be a tensor or a list or tuple of "
                               "tensors"),
    (-1, lambda a, b: (a, b), "count must be an integer >= 0"),
    (2, "body", "body must be callable"),
])
def test_for_loop_rejects_bad_bodies(count, body, message):
    with pytest.raises(Error, match=message):
        ops.for_loop(count, body, [torch.ones(2), torch.ones(2)])


class TwoConvs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(2, 3, 3)
        self.b = torch.nn.Conv1d(2, 2, 1)

    def forward(self, x, u, multi_conv=None):
        if multi_conv is None:
            return self.a(x), self.b(u)
        with multi_conv:
            return self.a(x), self.b(u)


def test_multi_conv_builders_chain_and_change_no_result(poptorch_log):
    torch.manual_seed(0)
    model = TwoConvs()
    x, u = torch.randn(1, 2, 5, 5), torch.randn(1, 2, 4)
    multi = (ops.MultiConv()
             .availableMemoryProportions([0.5, 0.9])
             .partialsTypes(torch.float16)
             .enableConvDithering([True, False])
             .planType(MultiConvPlanType.Serial)
             .perConvReservedTiles(20)
             .cycleBackOff(0.3))
    assert isinstance(multi, ops.MultiConv)
    for got, expected in zip(model(x, u, multi), model(x, u)):
        assert torch.equal(got, expected)
    assert any("MultiConv" in m and "no effect" in m
               for m in poptorch_log.messages)


def test_multi_conv_lists_need_one_value_per_convolution():
    model = TwoConvs()
    x, u = torch.randn(1, 2, 5, 5), torch.randn(1, 2, 4)
    multi = ops.MultiConv().availableMemoryProportions([0.1, 0.2, 0.3])
    with pytest.raises(Error, match="availableMemoryProportions: 3 values "
                                    "were given for the 2 convolution"):
        model(x, u, multi)
    multi = ops.MultiConv().partialsTypes([torch.float32, torch.float16])
    graph = trace(lambda p, a, b: torch.func.functional_call(
        model, p, (a, b, multi)), dict(model.named_parameters()), x, u)
    assert targets(graph).count(torch.ops.aten.convolution.default) == 2


@pytest.mark.parametrize("build, message", [
    (lambda m: m.availableMemoryProportions(1.0), "a number in \\[0, 1\\)"),
    (lambda m: m.availableMemoryProportions([0.2, "x"]), "a number in"),
    (lambda m: m.partialsTypes(torch.int32), "torch.float16 or torch.float32"),
    (lambda m: m.enableConvDithering([1]), "a bool"),
    (lambda m: m.planType(1), "poptorch.MultiConvPlanType"),
    (lambda m: m.perConvReservedTiles(-1), "integer >= 0"),
    (lambda m: m.cycleBackOff(2), "between 0 and 1"),
])
def test_multi_conv_rejects_bad_values(build, message):
    with pytest.raises(Error, match=message):
        build(ops.MultiConv())


class WithCpuOp(torch.nn.Module):
    """The API reference's example, with a host function that reads values
    and uses NumPy, as only the host can, and counts its runs."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu = ops.CPU(self.my_cpu_op, "MyCPUOp")
        self.sort = ops.CPU(self.numpy_sort, "Sort")
        self.runs = 0

    def my_cpu_op(self, x):
        self.runs += 1
        return x * 2.0

    @staticmethod
    def numpy_sort(x, descending):
        order = np.sort(x.numpy(), axis=-1)
        scale = float(x.abs().max().item()) or 1.0
        return torch.from_numpy(order[..., ::-1].copy() if descending
                                else order) / scale

    def forward(self, x):
        return self.sort(self.cpu(self.cpu(self.cpu(x))), descending=True)


def test_cpu_op_is_a_plain_call_outside_a_model():
    model = WithCpuOp()
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.equal(model(x), torch.tensor([[0.5, 0.25, -1.0]]))
    assert model.cpu.execute() is None
    assert model.cpu.registerPersistentData() is None


@pytest.mark.parametrize("device_iterations, replicas", [(1, 1), (3, 2)])
def test_cpu_op_runs_on_the_host_at_every_step(device_iterations, replicas):
    """Each call runs the function D x R times per op on real tensors
    (three ops here), after the runs that learnt its shapes at compile."""
    net = WithCpuOp()
    opts = poptorch.Options().deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    model = poptorch.inferenceModel(net, opts)
    rows = device_iterations * replicas * 2
    for seed in range(2):
        x = torch.randn(rows, 5, generator=torch.Generator().manual_seed(seed))
        expected = torch.cat([WithCpuOp()(part) for part in x.split(2)])
        torch.testing.assert_close(model(x), expected)
        if seed == 0:
            runs = net.runs
    assert net.runs - runs == 3 * device_iterations * replicas


def test_cpu_op_results_must_keep_their_shapes():
    class Growing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = ops.CPU(lambda x: x[x > 0], "Positive")

        def forward(self, x):
            return self.cpu(x)

    model = poptorch.inferenceModel(Growing())
    with pytest.raises(Error, match=r"'Positive' returned \[2\] float32, but "
                       r"the model was compiled for \[0\] float32"):
        model(torch.tensor([1.0, 2.0, -1.0]))


def test_cpu_op_in_training_is_traced_inline():
    """Gradients flow through it (PopTorch allowed CPU ops in inference
    only): the update is plain PyTorch's."""
    class Trained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.cpu = ops.CPU(lambda x: x * 2.0, "Double")

        def forward(self, x, y):
            out = self.cpu(self.fc(x))
            return out, torch.nn.functional.cross_entropy(out, y)

    torch.manual_seed(0)
    net = Trained()
    twin = copy.deepcopy(net)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    poptorch.trainingModel(net, optimizer=torch.optim.SGD(
        net.parameters(), lr=0.1))(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y))
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[name])


def test_cpu_op_checks_its_arguments():
    with pytest.raises(Error, match="layer_to_call must be callable"):
        ops.CPU(3, "id")
    with pytest.raises(Error, match="ID must be a string"):
        ops.CPU(torch.sin, 3)


def test_custom_op_explains_popart_ops_cannot_load_here():
    x = torch.ones(2)
    with pytest.raises(Error, match="'LeakyRelu', domain 'custom.ops'.*cannot "
                                    "be loaded on CPU or GPU.*Register the op "
                                    "as torch.ops.custom_ops.LeakyRelu"):
        ops.custom_op([x], "LeakyRelu", "custom.ops", 1, example_outputs=[x])


@torch.library.custom_op("com_acme::ScaledCube", mutates_args=())
def _scaled_cube(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A PopART custom op ported to PyTorch under its domain and name."""
    return scale * x ** 3


_scaled_cube.register_fake(lambda x, scale: torch.empty_like(x))
_scaled_cube.register_autograd(
    lambda ctx, grad: (grad * 3 * ctx.scale * ctx.x ** 2, None),
    setup_context=lambda ctx, inputs, output: (
        setattr(ctx, "x", inputs[0]), setattr(ctx, "scale", inputs[1])))


class _WithCustomOp(torch.nn.Module):
    def __init__(self, ported=True):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.ported = ported

    def forward(self, x, y):
        h = self.linear(x)
        if self.ported:
            h = ops.custom_op([h], "ScaledCube", "com.acme", 1,
                              example_outputs=[h],
                              attributes={"scale": 0.5})[0]
        else:
            h = 0.5 * h ** 3
        return h, torch.nn.functional.mse_loss(h, y)


def test_custom_op_calls_the_ported_torch_op_in_training():
    torch.manual_seed(0)
    net = _WithCustomOp()
    reference = copy.deepcopy(net)
    reference.ported = False
    model = poptorch.trainingModel(net, poptorch.Options().deviceIterations(2),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out, _ = model(x, y)
    reference_training(reference, optimizer, (x, y), device_iterations=2)
    model.copyWeightsToHost()
    torch.testing.assert_close(net.linear.weight, reference.linear.weight)
    assert out.shape == (2, 3)


def test_custom_op_outputs_must_match_the_examples():
    x = torch.ones(2)
    with pytest.raises(Error, match=r"returned tensors of \(shape, dtype\) "
                                    r"\[\(\(2,\), torch.float32\)\], but "
                                    r"example_outputs give \[\(\(3,\)"):
        ops.custom_op([x], "ScaledCube", "com.acme", 1,
                      example_outputs=[torch.ones(3)],
                      attributes={"scale": 1.0})


def profiled_event_names(function):
    with torch.profiler.profile(activities=[
            torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    return [event.name for event in profile.events()]


def test_channel_tracepoints_appear_in_a_profiler_trace():
    channel = Channel("MyApp")

    def run():
        with channel.tracepoint("TimeThis"):
            torch.ones(3).sum()

    assert "MyApp.TimeThis" in profiled_event_names(run)


def test_channel_instruments_methods_of_an_object_or_class():
    class Worker:
        def scale(self, x):
            return x * 3

        def shift(self, x):
            return x + 1

    channel = Channel("Work")
    worker = Worker()
    channel.instrument(worker, "scale")
    channel.instrument(Worker, "shift")
    results = []
    names = profiled_event_names(lambda: results.extend(
        [worker.scale(2), Worker().shift(2)]))
    assert results == [6, 3]
    assert "Work.scale" in names and "Work.shift" in names
    assert worker.scale.__name__ == "scale"


def test_channel_rejects_unknown_methods_and_bad_names():
    channel = Channel("C")
    with pytest.raises(Error, match="has no method 'missing'"):
        channel.instrument(object(), "missing")
    with pytest.raises(Error, match="give one or more method names"):
        channel.instrument(object())
    with pytest.raises(Error, match="name must be a non-empty string"):
        Channel(3)
    with pytest.raises(Error, match="tracepoint: name must be"):
        channel.tracepoint("")
