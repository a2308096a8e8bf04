"""Replicas in one process: the vectorised path (one computation for all
replicas) and the sequential fallback give what plain PyTorch gives when it
runs every replica's micro-batch itself (tolerance: assert_same_weights,
atol 1e-6 / rtol 1e-5)."""
import copy

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from poptorch._impl.replication import batch_norm as replica_batch_norm
from conftest import (BatchNormNet, ClassifierMLP, assert_same_weights,
                      make_data, make_images, options, reference_training)


def _train(net, opts, inputs, lr=0.1):
    model = poptorch.trainingModel(
        net, opts, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.5))
    return model, model(*inputs)


def _reference(twin, inputs, lr=0.1, **layout):
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.5)
    return reference_training(twin, optimizer, inputs, **layout)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean,
                                       poptorch.ReductionType.Sum])
def test_replicas_train_like_plain_pytorch(mlp, twin, replicas, reduction):
    opts = options(device_iterations=2, accumulation=3, replicas=replicas,
                   outputMode=poptorch.OutputMode.All)
    opts.Training.accumulationAndReplicationReductionType(reduction)
    inputs = make_data(2 * 3 * replicas * 5)
    model, (_, losses) = _train(mlp, opts, inputs)
    expected = _reference(twin, inputs, device_iterations=2, accumulation=3,
                          replicas=replicas,
                          mean=reduction == poptorch.ReductionType.Mean)
    assert compiled_model(model).engine.replicas.path == "vectorised"
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=1e-5)
    assert_same_weights(mlp, twin)


@pytest.mark.parametrize("strategy", list(poptorch.MeanReductionStrategy))
def test_mean_reduction_strategies_with_vectorised_replicas(mlp, twin,
                                                            strategy):
    opts = options(accumulation=2, replicas=4)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    inputs = make_data(2 * 4 * 3)
    _train(mlp, opts, inputs)
    _reference(twin, inputs, accumulation=2, replicas=4)
    assert_same_weights(mlp, twin)


def _matmul_rows(graph: torch.fx.GraphModule) -> list:
    """Rows of the left operand of every matrix multiplication."""
    operand = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1}
    return sorted(node.args[operand[node.target]].meta["val"].shape[0]
                  for node in graph.graph.nodes
                  if node.op == "call_function" and node.target in operand)


def test_vectorised_step_is_one_batch_of_all_replicas(mlp):
    """No loop over replicas in the graph: it has as many matrix
    multiplications as the one-replica step, each over R x S rows (or
    contracting them, for the weight gradients)."""
    single, _ = _train(copy.deepcopy(mlp), options(), make_data(5))
    replicated, _ = _train(mlp, options(replicas=4), make_data(20))
    rows_single = _matmul_rows(
        compiled_model(single).session.graphs["update"])
    rows_replicated = _matmul_rows(
        compiled_model(replicated).session.graphs["update"])
    assert len(rows_replicated) == len(rows_single)
    assert rows_replicated == sorted(4 * rows if rows == 5 else rows
                                     for rows in rows_single)


def _batchnorm_reference(twin, inputs, replicas, lr=0.1):
    """Each replica with its own BatchNorm buffers (functional_call), one
    SGD step on the mean of the replicas' gradients."""
    params = dict(twin.named_parameters())
    buffer_sets = [{name: b.clone() for name, b in twin.named_buffers()}
                   for _ in range(replicas)]
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.5)
    splits = [t.unflatten(0, (replicas, -1)) for t in inputs]
    optimizer.zero_grad()
    losses = []
    for replica in range(replicas):
        _, loss = torch.func.functional_call(
            twin, (params, buffer_sets[replica]),
            tuple(s[replica] for s in splits))
        (loss / replicas).backward()
        losses.append(loss.detach())
    optimizer.step()
    return torch.stack(losses), buffer_sets


def _assert_per_replica_training(net, twin, inputs, replicas, losses):
    """``net`` (trained on ``inputs``, returning ``losses``) matches
    ``_batchnorm_reference`` on ``twin``; its buffers are replica 0's.
    Returns the reference's buffer sets."""
    expected, buffer_sets = _batchnorm_reference(twin, inputs, replicas)
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=1e-5)
    for name, value in net.named_parameters():
        torch.testing.assert_close(value, dict(twin.named_parameters())[name],
                                   atol=1e-6, rtol=1e-5)
    for name, value in net.named_buffers():
        torch.testing.assert_close(value, buffer_sets[0][name])
    return buffer_sets


def test_batchnorm_statistics_stay_per_replica(twin_bn=None):
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    inputs = make_images(4 * 6)
    model, (_, losses) = _train(net, options(replicas=4,
                                             broadcastBuffers=False), inputs)
    buffer_sets = _assert_per_replica_training(net, twin, inputs, 4, losses)
    assert compiled_model(model).engine.replicas.path == "vectorised"
    assert not torch.equal(buffer_sets[0]["bn.running_mean"],
                           buffer_sets[1]["bn.running_mean"])


@pytest.mark.parametrize("replicas", [2, 4])
def test_batchnorm_trains_per_replica_with_buffers_broadcast(replicas):
    """With the default broadcastBuffers(True), as in PopTorch, each replica
    updates its own running statistics and the host sees the first
    replica's."""
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    inputs = make_images(replicas * 6)
    _, (_, losses) = _train(net, options(replicas=replicas), inputs)
    _assert_per_replica_training(net, twin, inputs, replicas, losses)


def _batch_norm_ops(model) -> list:
    graph = compiled_model(model).session.graphs["update"].graph
    return [node.target for node in graph.nodes
            if "batch_norm" in str(node.target)]


class NormVariants(torch.nn.Module):
    """BatchNorm1d of a given kind on a linear layer's output."""

    def __init__(self, **batch_norm):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6, **batch_norm)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.head(torch.tanh(self.bn(self.fc(x))))
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("batch_norm", [
    {}, {"affine": False}, {"track_running_stats": False}],
    ids=["affine", "no-affine", "no-stats"])
def test_batchnorm_variants_run_per_replica_without_copies(batch_norm):
    """Each replica's BatchNorm runs PyTorch's kernel on its own slice
    (``poptorch::replica_batch_norm``, no vmap batching rule), with the
    statistics, running averages and gradients of a replica on its own."""
    torch.manual_seed(0)
    net = NormVariants(**batch_norm)
    twin = copy.deepcopy(net)
    inputs = make_data(2 * 8)
    model, (_, losses) = _train(net, options(
        replicas=2, broadcastBuffers=False), inputs)
    _assert_per_replica_training(net, twin, inputs, 2, losses)
    assert _batch_norm_ops(model) == [
        torch.ops.poptorch.replica_batch_norm.default,
        torch.ops.poptorch.replica_batch_norm_backward.default]


@pytest.mark.parametrize("replicas", [2, 4])
def test_cumulative_batchnorm_statistics_update_per_replica(replicas):
    """BatchNorm with momentum=None: each replica's cumulative average of
    its own batches (they stayed at 0 and 1 under replication before)."""
    torch.manual_seed(0)
    net = NormVariants(momentum=None)
    twin = copy.deepcopy(net)
    inputs = make_data(replicas * 8)
    _, (_, losses) = _train(net, options(replicas=replicas), inputs)
    buffer_sets = _assert_per_replica_training(net, twin, inputs, replicas,
                                               losses)
    assert not torch.equal(buffer_sets[0]["bn.running_mean"],
                           torch.zeros(6))


@pytest.mark.parametrize("shared", [True, False], ids=["shared-weight",
                                                      "weight-per-replica"])
def test_replica_batch_norm_equals_the_kernel_on_each_replica(shared):
    """The op behind vectorised BatchNorm, with a weight and no bias, against
    batch_norm on each replica's slice: outputs, running statistics and
    gradients."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, 5, 4, requires_grad=True)
    weight = torch.rand(5 if shared else (3, 5), requires_grad=True)
    means, variances = torch.randn(3, 5), torch.rand(3, 5) + 0.5
    out, _, _, new_means, new_variances = \
        torch.ops.poptorch.replica_batch_norm(x, weight, None, means,
                                              variances, 0.2, 1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, weight], grad)
    x_ref = x.detach().requires_grad_()
    weight_ref = weight.detach().requires_grad_()
    running = [means.clone(), variances.clone()]
    expected = torch.stack([torch.nn.functional.batch_norm(
        x_ref[r], running[0][r], running[1][r],
        weight_ref if shared else weight_ref[r], None, True, 0.2, 1e-5)
        for r in range(3)])
    close = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, expected, **close)
    torch.testing.assert_close(new_means, running[0], **close)
    torch.testing.assert_close(new_variances, running[1], **close)
    for value, reference in zip(got, torch.autograd.grad(
            expected, [x_ref, weight_ref], grad)):
        torch.testing.assert_close(value, reference, **close)


@pytest.mark.parametrize("device, dtype, expected", [
    ("cpu", torch.float16, torch.float16),
    ("cpu", torch.float32, torch.float32),
    ("meta", torch.float16, torch.float32),
    ("meta", torch.bfloat16, torch.float32),
])
def test_replica_batch_norm_statistics_have_the_kernels_dtype(
        device, dtype, expected):
    """PyTorch's CPU kernel keeps a float16 model's saved statistics in
    float16; its GPU kernel (any other device here) in float32."""
    x = torch.empty(2, 4, 3, 5, 5, dtype=dtype, device=device)
    weight = torch.empty(3, dtype=dtype, device=device)
    assert replica_batch_norm.statistics_storage(x, weight, None).dtype == \
        expected


class _Doubler(torch.autograd.Function):
    """An autograd.Function without a vmap rule."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _DoublingMLP(ClassifierMLP):
    def forward(self, x, y):
        out = self.fc2(_Doubler.apply(torch.relu(self.fc1(x))))
        return out, self.loss(out, y)


def test_models_vmap_cannot_trace_fall_back_to_sequential(poptorch_log):
    torch.manual_seed(0)
    net = _DoublingMLP()
    twin = copy.deepcopy(net)
    poptorch_log.set_level("DEBUG", logger="poptorch")
    inputs = make_data(2 * 2 * 3)
    model, _ = _train(net, options(accumulation=2, replicas=2), inputs)
    _reference(twin, inputs, accumulation=2, replicas=2)
    assert compiled_model(model).engine.replicas.path == "sequential"
    assert "falling back to the sequential path" in poptorch_log.text
    assert "autograd.Function" in poptorch_log.text
    assert_same_weights(net, twin)


class _ScatteredTokens(torch.nn.Module):
    """Operations whose gradients vmap gets wrong: select_scatter, and an
    embedding scaling its gradient by the tokens' frequencies."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(6, 3, scale_grad_by_freq=True)
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, ids, y):
        features = self.embedding(ids).mean(1)
        scores = self.fc(features)
        out = torch.zeros(ids.shape[0], 5).select_scatter(scores[:, 0], 1, 2)
        out = out[:, :3] + scores
        return out, torch.nn.functional.cross_entropy(out, y)


def test_ops_vmap_batches_wrongly_send_replicas_to_sequential():
    torch.manual_seed(0)
    net = _ScatteredTokens()
    twin = copy.deepcopy(net)
    ids = torch.randint(0, 6, (8, 4))
    ids[:, 0] = ids[:, 1] = 2
    inputs = (ids, torch.randint(0, 3, (8,)))
    model, _ = _train(net, options(accumulation=2, replicas=2), inputs)
    _reference(twin, inputs, accumulation=2, replicas=2)
    assert_same_weights(net, twin)
    assert compiled_model(model).engine.replicas.path == "sequential"


class _SeparatedIndices(torch.nn.Module):
    """``h[:, heads, :, positions] = token``: index tensors separated by a
    slice, on a per-replica tensor (vmap writes the wrong places)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 24)
        self.token = torch.nn.Parameter(torch.randn(2, 1, 3))
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x, y):
        h = self.fc(x).view(x.shape[0], 2, 3, 4).clone()
        h[:, torch.tensor([0, 1]), :, torch.tensor([3, 1])] = self.token
        out = self.head(h.flatten(1))
        return out, torch.nn.functional.cross_entropy(out, y)


class _FillWithReplicaValue(torch.nn.Module):
    """``weight.index_fill(0, rows, h.max())``: a per-replica fill value
    (vmap fills wrong values)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 5)
        self.weight = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, x, y):
        h = self.fc(x)
        out = h @ self.weight.index_fill(0, torch.tensor([1, 3]),
                                         h.max().detach())
        return out, torch.nn.functional.cross_entropy(out, y)


class _PaddedReplicaEmbedding(torch.nn.Module):
    """An embedding with a padding index and a weight computed from the
    replica's data (vmap's gradient of the weight is wrong)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 5)
        self.embedding = torch.nn.Embedding(5, 5, padding_idx=0)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x, y):
        h = self.fc(x)
        weight = self.embedding.weight * (1 + h.mean())
        ids = torch.arange(x.shape[0]) % 5
        out = self.head(torch.nn.functional.embedding(ids, weight,
                                                      padding_idx=0) + h)
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("make_net", [
    _SeparatedIndices, _FillWithReplicaValue, _PaddedReplicaEmbedding])
def test_indexing_vmap_gets_wrong_sends_replicas_to_sequential(make_net):
    torch.manual_seed(0)
    net = make_net()
    twin = copy.deepcopy(net)
    inputs = make_data(2 * 2 * 4)
    model, _ = _train(net, options(accumulation=2, replicas=2), inputs)
    _reference(twin, inputs, accumulation=2, replicas=2)
    assert_same_weights(net, twin)
    assert compiled_model(model).engine.replicas.path == "sequential"


class _QueueWriter(torch.nn.Module):
    """Writes its keys into a queue buffer at a pointer buffer, as MoCo
    does: ``queue[:, index] = keys.T`` with a per-replica index, which
    vmap's batching rule writes transposed."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("queue", torch.zeros(3, 8))
        self.register_buffer("pointer", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        keys = self.fc(x)
        with torch.no_grad():
            index = (self.pointer + torch.arange(x.shape[0])) % 8
            self.queue[:, index] = keys.detach().T
            self.pointer.copy_((self.pointer + x.shape[0]) % 8)
        return keys @ self.queue, torch.nn.functional.mse_loss(
            keys, torch.zeros_like(keys))


def _queue_reference(net, batches):
    """Each replica's outputs and queue, run as the module alone on its
    micro-batches in order."""
    replica = copy.deepcopy(net)
    with torch.no_grad():
        outputs = [replica(batch)[0] for batch in batches]
    return torch.cat(outputs), replica.queue


@pytest.mark.parametrize("training", [True, False])
def test_writes_at_a_per_replica_index_run_as_each_replica_alone(training):
    torch.manual_seed(0)
    net = _QueueWriter()
    x = torch.randn(2 * 2 * 3, 4)
    opts = options(device_iterations=2, replicas=2,
                   outputMode=poptorch.OutputMode.All)
    opts.broadcastBuffers(False)
    twin = copy.deepcopy(net)
    if training:
        model = poptorch.trainingModel(
            net, opts, torch.optim.SGD(net.parameters(), lr=0.0))
    else:
        model = poptorch.inferenceModel(net, opts)
    outputs = model(x)[0].reshape(2, 2, 3, 8)
    model.copyWeightsToHost()
    batches = x.reshape(2, 2, 3, 4)
    for replica in range(2):
        expected, queue = _queue_reference(twin, batches[:, replica])
        torch.testing.assert_close(outputs[:, replica].reshape(6, 8),
                                   expected)
        if replica == 0:
            torch.testing.assert_close(net.queue, queue)
    assert compiled_model(model).engine.replicas.path == "sequential"


class _MeanTeacher(torch.nn.Module):
    """A teacher updated in forward as an EMA of the student, its momentum
    read from a step counter buffer (which vmap cannot write into the
    shared teacher: the replicas run in turn)."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(3, 2)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.step += 1
        with torch.no_grad():
            momentum = 0.5 + 0.1 / self.step.float()
            for student, teacher in zip(self.student.parameters(),
                                        self.teacher.parameters()):
                teacher.lerp_(student, 1 - momentum)
        return torch.nn.functional.mse_loss(self.student(x),
                                            self.teacher(x))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_teacher_written_in_forward_is_updated_once_per_micro_batch(
        accumulation):
    """Each replica updates its own copy of the teacher in PopTorch; the
    replicas running in turn each wrote on top of the one before (R
    updates per step)."""
    torch.manual_seed(0)
    net = _MeanTeacher()
    with torch.no_grad():
        net.teacher.weight.fill_(1.0)
    twin = copy.deepcopy(net)
    opts = options(accumulation=accumulation, replicas=2)
    opts.broadcastBuffers(False)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.student.parameters(), lr=0.1))
    twin_optimizer = torch.optim.SGD(twin.student.parameters(), lr=0.1)
    x = torch.randn(2, accumulation, 2, 4, 3)
    for call in range(2):
        model(x[call].reshape(-1, 3))
        twin_optimizer.zero_grad()
        for step in range(accumulation):
            replicas = [copy.deepcopy(twin) for _ in range(2)]
            losses = [replica(x[call, step, r])
                      for r, replica in enumerate(replicas)]
            for replica, loss in zip(replicas, losses):
                loss.backward()
            for name, param in twin.student.named_parameters():
                grads = [dict(r.student.named_parameters())[name].grad
                         for r in replicas]
                extra = sum(grads) / (2 * accumulation)
                param.grad = extra if param.grad is None else \
                    param.grad + extra
            twin.teacher.load_state_dict(replicas[0].teacher.state_dict())
            twin.step.copy_(replicas[0].step)
        twin_optimizer.step()
    assert compiled_model(model).engine.replicas.path == "sequential"
    assert_same_weights(net, twin)


class _CountingModel(torch.nn.Module):
    """Inference writes a buffer shared by all replicas."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * self.calls


def test_written_buffers_broadcast_to_inference_replicas_are_an_error():
    """As in training: parallel replicas cannot share a buffer they write
    (they ran in turn on one buffer before, which no device does)."""
    model = poptorch.inferenceModel(_CountingModel(), options(replicas=3))
    with pytest.raises(poptorch.Error,
                       match=r"writes to its buffers \(calls\).*"
                       r"broadcastBuffers\(False\)"):
        model(torch.ones(3, 2))


def test_inference_replicas_keep_the_buffers_they_write():
    """With broadcastBuffers(False) each replica counts its own calls;
    the host sees the first replica's count."""
    module = _CountingModel()
    model = poptorch.inferenceModel(module, options(
        device_iterations=2, replicas=3, broadcastBuffers=False))
    out = model(torch.ones(6, 2))
    torch.testing.assert_close(out, torch.tensor([[1.0] * 2] * 3 +
                                                 [[2.0] * 2] * 3))
    model.copyWeightsToHost()
    assert module.calls.item() == 2.0


def test_batchnorm_in_training_mode_in_inference_runs_per_replica():
    """A BatchNorm left in training mode in an inference model normalises
    each replica's micro-batch by its own statistics and updates each
    replica's running statistics, as in training."""
    torch.manual_seed(0)
    net = torch.nn.BatchNorm1d(2)
    twin = copy.deepcopy(net)
    x = torch.randn(8, 2)
    model = poptorch.inferenceModel(net, options(device_iterations=2,
                                                 replicas=2))
    out = model(x)
    replica_0 = copy.deepcopy(twin)
    expected = [replica_0(x[0:2]), twin(x[2:4]), replica_0(x[4:6]),
                twin(x[6:8])]
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-6, rtol=0)
    model.copyWeightsToHost()
    assert_same_weights(net, replica_0)


@pytest.mark.parametrize("mode, period, factor", [
    (poptorch.OutputMode.All, 1, 3 * 4),
    (poptorch.OutputMode.EveryN, 3, 4),
    (poptorch.OutputMode.Final, 1, 4),
    (poptorch.OutputMode.Sum, 1, 4)])
def test_inference_outputs_keep_replica_order(mlp, mode, period, factor):
    """[D, R] order and every OutputMode's shape, from a vectorised step."""
    opts = options(device_iterations=3, replicas=4)
    if mode == poptorch.OutputMode.EveryN:
        opts.outputMode(mode, period)
    else:
        opts.outputMode(mode)
    x, _ = make_data(3 * 4 * 2)
    model = poptorch.inferenceModel(copy.deepcopy(mlp), opts)
    out = model(x)
    assert compiled_model(model).engine.replicas.path == "vectorised"
    per_step = mlp(x).detach().unflatten(0, (3, 4, 2))
    expected = {poptorch.OutputMode.All: per_step,
                poptorch.OutputMode.EveryN: per_step[2:],
                poptorch.OutputMode.Final: per_step[2:],
                poptorch.OutputMode.Sum: per_step.sum(0, keepdim=True)}[mode]
    assert out.shape == (factor * 2, 3)
    torch.testing.assert_close(out, expected.flatten(0, 2))


@pytest.mark.parametrize("group_type", [poptorch.CommGroupType.Consecutive,
                                        poptorch.CommGroupType.Orthogonal])
def test_input_replica_grouping_trains_like_plain_pytorch(mlp, twin,
                                                          group_type):
    """4 replicas in groups of 2: the call carries 2 slices per step and
    each replica reads its group's slice."""
    opts = options(device_iterations=2, replicas=4,
                   inputReplicaGrouping=(2, group_type),
                   outputMode=poptorch.OutputMode.All)
    x, y = make_data(2 * 2 * 3)
    model, (_, losses) = _train(mlp, opts, (x, y))
    slices = [t.unflatten(0, (2, 2, -1)) for t in (x, y)]
    consecutive = group_type == poptorch.CommGroupType.Consecutive
    slice_of = [0, 0, 1, 1] if consecutive else [0, 1, 0, 1]
    replicated = [torch.stack([s[:, i] for i in slice_of], 1).flatten(0, 2)
                  for s in slices]
    expected = _reference(twin, replicated, device_iterations=2, replicas=4)
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=1e-5)
    assert_same_weights(mlp, twin)


def test_input_group_size_must_divide_the_replicas(mlp):
    opts = options(replicas=4, inputReplicaGrouping=(
        3, poptorch.CommGroupType.Consecutive))
    model = poptorch.trainingModel(mlp, opts)
    with pytest.raises(poptorch.Error,
                       match=r"input_group_size \(3\) must be a factor of "
                       r"replicationFactor \(4\)"):
        model(*make_data(3))
    assert not model.isCompiled()


# --- grouped weights (parameter.replicaGrouping) ---------------------------

class _GroupedNet(torch.nn.Module):
    """``weight`` may be grouped; ``fc`` is shared by all replicas."""

    def __init__(self, rows):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, 4, 5))
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x, y):
        out = self.fc(torch.tanh(x @ self.weight))
        return out, torch.nn.functional.cross_entropy(out, y)


def _group_of(group_type, shards, replicas):
    if group_type == poptorch.CommGroupType.NoGrouping:
        return list(range(replicas))
    count = replicas // shards
    if group_type == poptorch.CommGroupType.Orthogonal:
        return [r % count for r in range(replicas)]
    return [r // shards for r in range(replicas)]


def _grouped_reference(weight, fc, inputs, group_of, steps, reduction):
    """Plain PyTorch: replica r uses weight[group_of[r]]; fc's gradient is
    reduced over all replicas, each group's weight over its replicas."""
    replicas = len(group_of)
    groups = max(group_of) + 1
    mean = reduction == poptorch.ReductionType.Mean
    optimizer = torch.optim.SGD([weight, *fc.parameters()], lr=0.1,
                                momentum=0.5)
    splits = [t.unflatten(0, (steps, replicas, -1)) for t in inputs]
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for replica in range(replicas):
            x, y = (s[step, replica] for s in splits)
            out = fc(torch.tanh(x @ weight[group_of[replica]]))
            loss = torch.nn.functional.cross_entropy(out, y)
            (loss / replicas if mean else loss).backward()
            losses.append(loss.detach())
        if mean:
            weight.grad *= groups
        optimizer.step()
    return torch.stack(losses)


@pytest.mark.parametrize("group_type, shards", [
    (poptorch.CommGroupType.Consecutive, 2),
    (poptorch.CommGroupType.Orthogonal, 2),
    (poptorch.CommGroupType.NoGrouping, 0)])
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean,
                                       poptorch.ReductionType.Sum])
def test_grouped_weight_trains_each_group_on_its_replicas(group_type, shards,
                                                          reduction):
    replicas = 4
    group_of = _group_of(group_type, shards, replicas)
    torch.manual_seed(0)
    net = _GroupedNet(max(group_of) + 1)
    weight = torch.nn.Parameter(net.weight.detach().clone())
    fc = copy.deepcopy(net.fc)
    opts = options(device_iterations=2, replicas=replicas,
                   outputMode=poptorch.OutputMode.All)
    opts.Training.accumulationAndReplicationReductionType(reduction)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.parameters(), lr=0.1, momentum=0.5))
    model.weight.replicaGrouping(group_type, shards,
                                 poptorch.VariableRetrievalMode.OnePerGroup)
    inputs = make_data(2 * replicas * 3, features=4)
    _, losses = model(*inputs)
    expected = _grouped_reference(weight, fc, inputs, group_of, 2, reduction)
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(net.weight, weight, atol=1e-6, rtol=1e-5)
    assert_same_weights(net.fc, fc)


def test_grouped_weight_values_are_set_from_the_host_and_read_per_replica():
    """AllReplicas: one row per replica on the host (rows of a group equal);
    new host values reach the device with copyWeightsToDevice."""
    torch.manual_seed(0)
    groups = torch.randn(2, 4, 5)
    net = _GroupedNet(4)
    with torch.no_grad():
        net.weight.copy_(groups.repeat_interleave(2, 0))
    opts = options(replicas=4)
    model = poptorch.inferenceModel(net, opts)
    model.weight.replicaGrouping(poptorch.CommGroupType.Consecutive, 2,
                                 poptorch.VariableRetrievalMode.AllReplicas)
    x, y = make_data(4 * 2, features=4)
    out, _ = model(x, y)
    rows = x.unflatten(0, (4, 2))
    expected = [net.fc(torch.tanh(rows[r] @ groups[r // 2])) for r in range(4)]
    torch.testing.assert_close(out, torch.cat(expected).detach())
    with torch.no_grad():
        net.weight.copy_(torch.zeros(2, 4, 5).repeat_interleave(2, 0))
    model.copyWeightsToDevice()
    out, _ = model(x, y)
    torch.testing.assert_close(out, net.fc.bias.detach().expand(8, 3))


def test_all_replicas_retrieval_returns_every_replica_value_after_training():
    torch.manual_seed(0)
    net = _GroupedNet(4)
    with torch.no_grad():
        net.weight.copy_(net.weight[:2].repeat_interleave(2, 0))
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(replicas=4))
    model.weight.replicaGrouping(poptorch.CommGroupType.Consecutive, 2,
                                 poptorch.VariableRetrievalMode.AllReplicas)
    model(*make_data(4 * 2, features=4))
    assert net.weight.shape == (4, 4, 5)
    torch.testing.assert_close(net.weight[0], net.weight[1])
    torch.testing.assert_close(net.weight[2], net.weight[3])
    assert not torch.allclose(net.weight[0], reference.weight[0])


@pytest.mark.parametrize("call, message", [
    (lambda w: w.replicaGrouping(poptorch.CommGroupType.Consecutive, 3,
                                 poptorch.VariableRetrievalMode.OnePerGroup),
     r"shards \(3\) must divide replicationFactor \(4\); allowed values are "
     r"\[1, 2, 4\]"),
    (lambda w: w.replicaGrouping(poptorch.CommGroupType.Consecutive, 4,
                                 poptorch.VariableRetrievalMode.OnePerGroup),
     r"'weight' has shape \(2, 4, 5\).*dimension 0 must hold one row per "
     r"group \(1\)"),
    (lambda w: w.replicaGrouping(poptorch.CommGroupType.Consecutive, 1,
                                 poptorch.VariableRetrievalMode.AllReplicas),
     r"dimension 0 must hold one row per replica \(4\)")])
def test_bad_groupings_are_errors_at_compilation(call, message):
    net = _GroupedNet(2)
    model = poptorch.trainingModel(net, options(replicas=4))
    call(model.weight)
    with pytest.raises(poptorch.Error, match=message):
        model(*make_data(4, features=4))
    assert not model.isCompiled()


@pytest.mark.parametrize("args, message", [
    (("Consecutive", 2, poptorch.VariableRetrievalMode.OnePerGroup),
     "comm_group_type must be a poptorch.CommGroupType"),
    ((poptorch.CommGroupType.Orthogonal, 0,
      poptorch.VariableRetrievalMode.OnePerGroup),
     r"shards must be an int >= 1 with CommGroupType.Orthogonal, got 0"),
    ((poptorch.CommGroupType.Consecutive, 2, 1),
     "variable_retrieval_mode must be a poptorch.VariableRetrievalMode")])
def test_bad_replica_grouping_arguments(args, message):
    with pytest.raises(poptorch.Error, match=message):
        _GroupedNet(2).weight.replicaGrouping(*args)


def test_grouping_after_compilation_is_an_error():
    net = _GroupedNet(2)
    model = poptorch.trainingModel(net, options(replicas=2))
    model.weight.replicaGrouping(poptorch.CommGroupType.Consecutive, 1,
                                 poptorch.VariableRetrievalMode.OnePerGroup)
    model(*make_data(2, features=4))
    with pytest.raises(poptorch.Error, match="already compiled"):
        model.weight.replicaGrouping(
            poptorch.CommGroupType.NoGrouping, 0,
            poptorch.VariableRetrievalMode.OnePerGroup)
    model.destroy()
    model.weight.replicaGrouping(poptorch.CommGroupType.NoGrouping, 0,
                                 poptorch.VariableRetrievalMode.OnePerGroup)


def test_unequal_rows_of_a_group_are_an_error():
    net = _GroupedNet(4)
    model = poptorch.inferenceModel(net, options(replicas=4))
    model.weight.replicaGrouping(poptorch.CommGroupType.Consecutive, 2,
                                 poptorch.VariableRetrievalMode.AllReplicas)
    with pytest.raises(poptorch.Error, match="rows of the replicas of one "
                       "group must hold the same value"):
        model(*make_data(4, features=4))


@pytest.mark.parametrize("optimizer", [
    lambda params: poptorch.optim.LAMB(params, lr=0.1),
    lambda params: poptorch.optim.SGD(params, lr=0.1, max_grad_norm=1.0)])
def test_updates_mixing_groups_are_errors(optimizer):
    net = _GroupedNet(2)
    model = poptorch.trainingModel(net, options(replicas=2),
                                   optimizer(net.parameters()))
    model.weight.replicaGrouping(poptorch.CommGroupType.Consecutive, 1,
                                 poptorch.VariableRetrievalMode.OnePerGroup)
    with pytest.raises(poptorch.Error, match="not supported with grouped"):
        model(*make_data(2, features=4))
