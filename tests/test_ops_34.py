"""PopTorch 3.4 API additions (issue 17): ``cond``, ``dynamic_update``,
``poptorch.optim.Optimizer``, ``Block.start`` and PopTorch's operators
called directly as ``torch.ops.poptorch.*``, each inside training and
inference models against plain PyTorch computing the same thing."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import poptorch
from conftest import (ClassifierMLP, assert_same_weights, make_data, options,
                      reference_training)

poptorch_ops = torch.ops.poptorch
close = functools.partial(torch.testing.assert_close, atol=1e-6, rtol=1e-5)


def sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1)


def micro_batch_conditions(x, rows=2):
    """The condition ``Branching`` computes for each micro-batch of
    ``rows`` rows."""
    return x.unflatten(0, (-1, rows))[:, :, 0].sum(1) > 0


class Branching(torch.nn.Module):
    """Chooses between two heads per micro-batch with ``poptorch.cond``, or
    with a Python ``if`` when ``plain``; the branches take different
    inputs."""

    def __init__(self, plain=False):
        super().__init__()
        self.plain = plain
        self.fc = torch.nn.Linear(4, 8)
        self.up = torch.nn.Linear(8, 3)
        self.down = torch.nn.Linear(8, 3)

    def then_branch(self, h):
        return self.up(torch.tanh(h))

    def else_branch(self, h, scale):
        return self.down(h) * scale

    def forward(self, x, y=None):
        h = torch.relu(self.fc(x))
        condition = (x[:, 0].sum() > 0).reshape(1)
        if self.plain:
            out = self.then_branch(h) if bool(condition) \
                else self.else_branch(h, x[:, :1])
        else:
            out, = poptorch.cond(condition, self.then_branch, [h],
                                 self.else_branch, [h, x[:, :1]])
        if y is None:
            return out
        return out, F.cross_entropy(out, y)


def branching_pair():
    torch.manual_seed(0)
    net = Branching()
    plain = copy.deepcopy(net)
    plain.plain = True
    return net, plain


def test_cond_in_inference_selects_each_micro_batchs_branch():
    net, plain = branching_pair()
    x, _ = make_data(2 * 2 * 2)
    conditions = micro_batch_conditions(x)
    assert conditions.any() and not conditions.all()
    out = poptorch.inferenceModel(net, options(2, replicas=2))(x)
    close(out, torch.cat([plain(rows) for rows in x.split(2)]))


def test_cond_in_training_matches_a_python_if_per_micro_batch():
    """D=2, G=2, R=2: a condition computed on the device, never read by the
    host (a Python ``if`` on it could not be captured); gradients reach the
    parameters of the taken branch only."""
    net, plain = branching_pair()
    initial = copy.deepcopy(net)
    x, y = make_data(2 * 2 * 2 * 2)
    conditions = micro_batch_conditions(x)
    assert conditions.any() and not conditions.all()
    model = poptorch.trainingModel(net, options(2, 2, 2), sgd(net))
    model(x, y)
    reference_training(plain, sgd(plain), (x, y), 2, 2, 2)
    model.copyWeightsToHost()
    assert_same_weights(net, plain)
    assert not torch.equal(net.up.weight, initial.up.weight)
    assert not torch.equal(net.down.weight, initial.down.weight)


def test_cond_gradients_flow_through_the_taken_branch_only():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    for flag in (True, False):
        out, = poptorch.cond(torch.tensor([flag]), torch.sin, [a],
                             lambda t: t * t, [b])
        grad_a, grad_b = torch.autograd.grad(out.sum(), [a, b])
        expected = torch.sin(a) if flag else b * b
        close(out, expected)
        close(grad_a, torch.cos(a) if flag else torch.zeros(3))
        close(grad_b, torch.zeros(3) if flag else 2 * b)


def test_cond_returns_every_output_and_leaves_its_inputs_unchanged():
    x = torch.ones(2)

    def then_body(t):
        t.add_(1)
        return [t, t.sum()]

    outputs = poptorch.cond(torch.tensor(False), then_body, [x],
                            lambda t: (t * 3, t.sum() * 3), [x])
    assert len(outputs) == 2
    close(outputs[0], torch.full((2,), 3.0))
    close(outputs[1], torch.tensor(6.0))
    close(x, torch.ones(2))


@pytest.mark.parametrize("arguments, message", [
    ((torch.tensor([1]), torch.sin, [torch.ones(2)], torch.cos,
      [torch.ones(2)]), "condition must be a tensor holding one boolean; "
     "got dtype torch.int64"),
    ((torch.tensor([True, False]), torch.sin, [torch.ones(2)], torch.cos,
      [torch.ones(2)]), r"holding one boolean; got dtype torch.bool and "
     r"shape \(2,\)"),
    ((True, torch.sin, [torch.ones(2)], torch.cos, [torch.ones(2)]),
     "condition must be a torch.Tensor, not bool"),
    ((torch.tensor(True), "sin", [torch.ones(2)], torch.cos,
      [torch.ones(2)]), "then_body must be callable, not str"),
    ((torch.tensor(True), torch.sin, [torch.ones(2)], torch.cos, [3]),
     "else_inputs must be a tensor or a list or tuple of tensors"),
    ((torch.tensor(True), torch.sin, [torch.ones(2)], torch.cos,
      [torch.ones(3)]), r"output 0 of then_body is torch.float32 \(2,\) but "
     r"output 0 of else_body is torch.float32 \(3,\)"),
    ((torch.tensor(True), torch.sin, [torch.ones(2)], torch.cos,
      [torch.ones(2, dtype=torch.float64)]), "torch.float64 .2,.; both "
     "branches must return the same shapes and dtypes"),
    ((torch.tensor(True), lambda t: [t, t], [torch.ones(2)], torch.cos,
      [torch.ones(2)]), "then_body returned 2 tensor.s. but else_body "
     "returned 1"),
])
def test_cond_rejects_bad_conditions_and_mismatched_branches(arguments,
                                                              message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.cond(*arguments)


def test_cond_branch_mismatch_is_an_error_at_capture():
    class Mismatched(torch.nn.Module):
        def forward(self, x):
            return poptorch.cond((x.sum() > 0).reshape(1), torch.sin, [x],
                                 lambda t: t.sum(0), [x])

    with pytest.raises(poptorch.Error, match="output 0 of then_body"):
        poptorch.inferenceModel(Mismatched())(torch.randn(2, 4))


def sliced_assignment(input, src, dim, start, size):
    """``input[start:start + size] = src`` along ``dim``, on a copy."""
    updated = input.clone()
    index = [slice(None)] * input.dim()
    index[dim] = slice(start, start + size)
    updated[tuple(index)] = src
    return updated


@pytest.mark.parametrize("dim, start, size", [(0, 1, 2), (1, 3, 2),
                                              (-1, 0, 5), (1, 4, 1)])
def test_dynamic_update_writes_like_slicing_and_differentiates(dim, start,
                                                               size):
    torch.manual_seed(0)
    input = torch.randn(3, 5, requires_grad=True)
    shape = list(input.shape)
    shape[dim] = size
    src = torch.randn(shape, requires_grad=True)
    weights = torch.randn(3, 5)
    out = poptorch.dynamic_update(input, src, dim, torch.tensor([start]),
                                  size)
    expected = sliced_assignment(input, src, dim, start, size)
    close(out, expected)
    got = torch.autograd.grad((out * weights).sum(), [input, src])
    want = torch.autograd.grad((expected * weights).sum(), [input, src])
    close(got[0], want[0])
    close(got[1], want[1])
    assert input.grad is None and not torch.equal(out, input)


class Writer(torch.nn.Module):
    """Writes two rows computed from the micro-batch into a parameter, at a
    row the data chooses, with ``dynamic_update`` or (``plain``) slicing."""

    def __init__(self, plain=False):
        super().__init__()
        self.plain = plain
        self.memory = torch.nn.Parameter(torch.randn(5, 4))
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        src = torch.tanh(self.fc(x))
        start = (x[:, 0] > 0).sum()
        if self.plain:
            updated = sliced_assignment(self.memory, src, 0, int(start), 2)
        else:
            updated = poptorch.dynamic_update(self.memory, src, 0, start, 2)
        out = self.head(x + updated.mean(0))
        return out, F.cross_entropy(out, y)


def test_dynamic_update_in_training_matches_slicing_assignment():
    torch.manual_seed(0)
    net = Writer()
    plain = copy.deepcopy(net)
    plain.plain = True
    initial = copy.deepcopy(net)
    x, y = make_data(2 * 2 * 2 * 2)
    starts = (x.unflatten(0, (-1, 2))[:, :, 0] > 0).sum(1)
    assert len(set(starts.tolist())) > 1
    model = poptorch.trainingModel(net, options(2, 2, 2), sgd(net))
    model(x, y)
    reference_training(plain, sgd(plain), (x, y), 2, 2, 2)
    model.copyWeightsToHost()
    assert_same_weights(net, plain)
    assert not torch.equal(net.memory, initial.memory)
    assert not torch.equal(net.fc.weight, initial.fc.weight)


@pytest.mark.parametrize("arguments, message", [
    ((torch.ones(3, 4), torch.ones(2, 3), 0, torch.tensor(0), 2),
     r"src must be a torch.float32 tensor of shape \(2, 4\)"),
    ((torch.ones(3, 4), torch.ones(2, 4, dtype=torch.float64), 0,
      torch.tensor(0), 2), "got torch.float64 of shape"),
    ((torch.ones(3, 4), torch.ones(4, 4), 0, torch.tensor(0), 4),
     "size 4 exceeds dimension 0 of input, of size 3"),
    ((torch.ones(3, 4), torch.ones(2, 4), 0, torch.tensor(0.0), 2),
     "start must be a tensor holding one integer"),
    ((torch.ones(3, 4), torch.ones(2, 4), 2, torch.tensor(0), 2),
     r"dim must be an integer in \[-2, 1\]"),
    ((torch.ones(3, 4), [1.0], 0, torch.tensor(0), 1),
     "src must be a torch.Tensor, not list"),
])
def test_dynamic_update_rejects_bad_arguments(arguments, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.dynamic_update(*arguments)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "LAMB"])
def test_poptorch_optimizers_share_the_optimizer_base_class(name):
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = getattr(poptorch.optim, name)(params, lr=0.1)
    assert isinstance(optimizer, poptorch.optim.Optimizer)
    assert isinstance(optimizer, torch.optim.Optimizer)
    if hasattr(torch.optim, name):
        torch_optimizer = getattr(torch.optim, name)(params, lr=0.1)
        assert not isinstance(torch_optimizer, poptorch.optim.Optimizer)


def push_scope(name, module, args):
    poptorch_ops.push_name_scope(name)


def pop_scope(module, args, output):
    poptorch_ops.pop_name_scope()


def hooked_mlp():
    """ClassifierMLP whose layers open a name scope from forward hooks, as
    Graphcore's CNN training application does."""
    torch.manual_seed(0)
    net = ClassifierMLP()
    for name, module in net.named_children():
        module.register_forward_pre_hook(
            functools.partial(push_scope, f"hooked_{name}"))
        module.register_forward_hook(pop_scope)
    return net


def test_name_scopes_pushed_by_forward_hooks_name_the_tensors():
    net = hooked_mlp()
    plain = copy.deepcopy(net)
    x, y = make_data(2 * 2 * 2 * 2)
    model = poptorch.trainingModel(net, options(2, 2, 2), sgd(net))
    model(x, y)
    reference_training(plain, sgd(plain), (x, y), 2, 2, 2)
    model.copyWeightsToHost()
    assert_same_weights(net, plain)

    inference = poptorch.inferenceModel(
        hooked_mlp(), options(disableModuleNamescope=()))
    out = inference(x[:2])
    close(out, hooked_mlp()(x[:2]))
    names = inference.getTensorNames()
    assert "hooked_fc1/addmm" in names and "hooked_fc2/addmm" in names
    assert "relu" in names


def test_pop_name_scope_needs_an_open_scope():
    with pytest.raises(poptorch.Error, match="pop_name_scope: no name scope "
                       "is open"):
        poptorch_ops.pop_name_scope()


class OpBlocks(torch.nn.Module):
    """Three linear layers in two blocks begun by PopTorch's
    begin_ipu_block / end_ipu_block ops (stage 0 on IPU 0, stage 1 on IPU
    1), or by ``Block.start`` (the second inside a sub-module)."""

    def __init__(self, use_ops=True):
        super().__init__()
        self.use_ops = use_ops
        self.first = torch.nn.Linear(4, 4)
        self.middle = StartsBlock(not use_ops)
        self.last = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        if self.use_ops:
            poptorch_ops.begin_ipu_block(0, 0, 0)
        else:
            poptorch.Block.start("0", ipu_id=0)
        x = torch.tanh(self.first(x))
        if self.use_ops:
            poptorch_ops.end_ipu_block()
            poptorch_ops.begin_ipu_block(1, 0, 1)
        x = torch.tanh(self.middle(x))
        x = self.last(x)
        if self.use_ops:
            poptorch_ops.end_ipu_block()
        return x, F.cross_entropy(x, y)


class StartsBlock(torch.nn.Module):
    def __init__(self, start):
        super().__init__()
        self.start = start
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.start:
            poptorch.Block.start("1", ipu_id=1)
        return self.fc(x)


@pytest.mark.parametrize("use_ops", [True, False],
                         ids=["begin_ipu_block", "Block.start"])
def test_blocks_begun_without_a_scope_form_pipeline_stages(use_ops):
    torch.manual_seed(0)
    net = OpBlocks(use_ops)
    plain = copy.deepcopy(net)
    initial = copy.deepcopy(net)
    x, y = make_data(2 * 3 * 2)
    with pytest.raises(poptorch.Error,
                       match="gradientAccumulation must be at least 3"):
        poptorch.trainingModel(copy.deepcopy(net), options(1, 2))(x, y)
    model = poptorch.trainingModel(net, options(2, 3), sgd(net))
    model(x, y)
    reference_training(plain, sgd(plain), (x, y), 2, 3)
    model.copyWeightsToHost()
    assert_same_weights(net, plain)
    assert not torch.equal(net.last.weight, initial.last.weight)


def test_blocks_begun_without_a_scope_run_as_named_sharded_stages():
    torch.manual_seed(0)
    net = OpBlocks(use_ops=False)
    x, y = make_data(2)
    strategy = poptorch.ShardedExecution("0", "1")
    out, loss = poptorch.inferenceModel(
        net, options(setExecutionStrategy=strategy))(x, y)
    expected_out, expected_loss = net(x, y)
    close(out, expected_out)
    close(loss, expected_loss)


class TunedMLP(ClassifierMLP):
    """ClassifierMLP calling PopTorch's identity ops directly, in their
    PopTorch schemas."""

    def forward(self, x, y):
        h = torch.relu(self.fc1(x))
        h = poptorch_ops.set_available_memory(h, 0.4)
        h = poptorch_ops.nop(h)
        h = poptorch_ops.recomputation_checkpoint(h)
        poptorch_ops.optimizer_group(0, [self.fc1.weight, self.fc1.bias])
        out = poptorch_ops.set_matmul_serialization(
            self.fc2(h), "output_channels", 3, False)
        out = poptorch_ops.ipu_print_tensor(out, "logits", 0, 1000, 3, 80, 4,
                                            0, " ", "[", "]")
        return out, self.loss(out, y)


def test_identity_ops_called_directly_train_like_plain_pytorch(
        poptorch_log, capsys):
    torch.manual_seed(0)
    net = TunedMLP()
    plain = ClassifierMLP()
    plain.load_state_dict(net.state_dict())
    x, y = make_data(2 * 2 * 2 * 2)
    model = poptorch.trainingModel(net, options(2, 2, 2), sgd(net))
    model(x, y)
    reference_training(plain, sgd(plain), (x, y), 2, 2, 2)
    model.copyWeightsToHost()
    assert_same_weights(net, plain)
    printed = capsys.readouterr().out
    assert "logits: tensor(" in printed and "logits_gradient" not in printed
    for op in ("set_available_memory", "set_matmul_serialization",
               "optimizer_group"):
        assert sum(op in r.getMessage() for r in poptorch_log.records) == 1


def test_print_op_takes_poptorchs_formatting_arguments(capsys, poptorch_log):
    value = torch.tensor([1.23456, 100.0])
    poptorch_ops.ipu_print_tensor(value, "v", 1, 1000, 3, 80, 2, 2)
    poptorch_ops.ipu_print_tensor(value, "v", 1, 1000, 3, 80, 3, 1)
    poptorch_ops.ipu_print_tensor(torch.arange(10.0), "long", 1, 5, 1)
    poptorch_ops.ipu_print_tensor(torch.arange(10.0), "all", 1, 0, 1)
    assert capsys.readouterr().out.splitlines() == [
        "v: tensor([1.23e+00, 1.00e+02])",
        "v: tensor([  1.235, 100.000])",
        "long: tensor([0.,  ..., 9.])",
        "all: tensor([0., 1., 2., 3., 4., 5., 6., 7., 8., 9.])"]
    poptorch_ops.ipu_print_tensor(value, "v", 1, 1000, 3, 80, 4, 0, ",")
    assert "separator, open_bracket and close_bracket are accepted but " \
        "have no effect" in poptorch_log.text


def test_print_op_gradient_follows_print_gradient(capsys):
    x = torch.ones(2, requires_grad=True)
    poptorch_ops.ipu_print_tensor(x, "shown").sum().backward()
    poptorch_ops.ipu_print_tensor(x, "hidden", 0).sum().backward()
    printed = capsys.readouterr().out
    assert "shown_gradient: tensor([1., 1.])" in printed
    assert "hidden: tensor" in printed and "hidden_gradient" not in printed


@pytest.mark.parametrize("call, message", [
    (lambda: poptorch_ops.set_matmul_serialization(
        torch.ones(2, 2), "rows", 2, False), "mode must be one of "
     "'input_channels', 'reducing_dim', 'output_channels', 'none', not "
     "'rows'"),
    (lambda: poptorch_ops.set_matmul_serialization(
        torch.ones(2, 2), "none", -1, False), "factor must be an integer >= "
     "0, not -1"),
    (lambda: poptorch_ops.set_available_memory(torch.ones(2), 1.5),
     "available_memory_proportion must be a number between 0.0 and 1.0"),
    (lambda: poptorch_ops.optimizer_group(-1, [torch.ones(2)]),
     "group must be an integer >= 0"),
    (lambda: poptorch_ops.ipu_print_tensor(torch.ones(2), "t", 1, 1000, 3,
                                           80, 4, 7),
     r"float_format must be one of 0 \(auto\), 1 \(fixed\), 2 "
     r"\(scientific\), 3 \(none\), not 7"),
])
def test_tuning_ops_check_their_arguments(call, message):
    with pytest.raises(poptorch.Error, match=message):
        call()
