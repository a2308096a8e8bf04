"""Operators whose output shape depends on the data: captured with the
static shape an argument bounds (bincount's minlength, repeat_interleave's
output_size), refused with the fixed-shape alternative otherwise."""
import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (assert_same_weights, make_data, options,
                      reference_training)

THIS_FILE = __file__
CLASSES = 3
BINS = 5


def _micro_batches(tensor, count):
    return tensor.unflatten(0, (count, -1))


class Counts(torch.nn.Module):
    """The counts of ``y`` and the sums of a feature per value of ``y``."""

    def __init__(self, method=False):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
        self.method = method

    def forward(self, x, y):
        weights = self.fc(x)[:, 0]
        if self.method:
            return y.bincount(minlength=BINS), y.bincount(weights, BINS)
        return (torch.bincount(y, minlength=BINS),
                torch.bincount(y, weights=weights, minlength=BINS))


@pytest.mark.parametrize("method", [False, True])
def test_bincount_with_minlength_has_minlength_bins(method):
    torch.manual_seed(0)
    model = Counts(method)
    x = torch.randn(12, 4)
    y = torch.randint(0, BINS - 1, (12,))
    wrapper = poptorch.inferenceModel(
        model, options(device_iterations=2, replicas=2))
    counts, sums = wrapper(x, y)
    assert compiled_model(wrapper).engine.replicas.path == "vectorised"
    with torch.no_grad():
        expected = [model(xs, ys) for xs, ys in
                    zip(_micro_batches(x, 4), _micro_batches(y, 4))]
    assert counts.dtype == torch.int64 and sums.dtype == torch.float32
    assert torch.equal(counts, torch.cat([c for c, _ in expected]))
    torch.testing.assert_close(sums, torch.cat([s for _, s in expected]),
                               atol=1e-6, rtol=1e-5)


def test_bincount_weights_dtypes_follow_pytorch():
    class Sums(torch.nn.Module):
        def forward(self, y, w16, w32, i32):
            return [torch.bincount(y, weights=w, minlength=BINS)
                    for w in (w16, w32, i32)]

    y = torch.tensor([0, 1, 1, 4])
    weights = [torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=dtype)
               for dtype in (torch.float16, torch.float32, torch.int32)]
    captured = poptorch.inferenceModel(Sums())(y, *weights)
    for got, w in zip(captured, weights):
        want = torch.bincount(y, weights=w, minlength=BINS)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_values_outside_minlength_are_not_counted(poptorch_log):
    class Count(torch.nn.Module):
        def forward(self, y):
            return torch.bincount(y, minlength=BINS)

    y = torch.tensor([0, 7, 2, 5, 2, -1, 4, 9])
    counts = poptorch.inferenceModel(Count())(y)
    inside = y[(y >= 0) & (y < BINS)]
    assert torch.equal(counts, torch.bincount(inside, minlength=BINS))
    assert any(record.levelname == "WARNING" and
               "values outside [0, minlength) are not counted" in
               record.getMessage() for record in poptorch_log.records)


class BalancedLoss(torch.nn.Module):
    """Cross entropy with each sample weighted by the inverse frequency of
    its class in the micro-batch, plus the mean per class of the sample
    losses (summed by bincount with weights, or by index_add for plain
    PyTorch, whose bincount has no derivative)."""

    def __init__(self, index_add=False):
        super().__init__()
        self.fc = torch.nn.Linear(4, CLASSES)
        self.index_add = index_add

    def forward(self, x, y):
        out = self.fc(x)
        losses = F.cross_entropy(out, y, reduction="none")
        counts = torch.bincount(y, minlength=CLASSES)
        if self.index_add:
            per_class = torch.zeros(CLASSES).index_add(0, y, losses)
        else:
            per_class = torch.bincount(y, weights=losses, minlength=CLASSES)
        balanced = (losses / counts[y]).sum() / CLASSES
        loss = balanced + (per_class / counts.clamp(min=1)).mean()
        return out, poptorch.identity_loss(loss, reduction="none")


def test_bincount_in_training_matches_pytorch():
    torch.manual_seed(0)
    model = BalancedLoss()
    reference = copy.deepcopy(model)
    reference.index_add = True
    x, y = make_data(48, classes=CLASSES)
    opts = options(device_iterations=2, accumulation=2, replicas=2,
                   outputMode=poptorch.OutputMode.All)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = poptorch.trainingModel(model, opts, optimizer)
    _, loss = wrapper(x, y)
    assert compiled_model(wrapper).engine.replicas.path == "vectorised"
    expected = reference_training(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1), (x, y),
        device_iterations=2, accumulation=2, replicas=2)
    torch.testing.assert_close(loss.flatten(), expected.flatten(), atol=1e-6,
                               rtol=1e-5)
    assert_same_weights(model, reference)


class Repeated(torch.nn.Module):
    """Each row repeated as often as ``repeats`` says, ``total`` rows."""

    def __init__(self, total):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.total = total

    def forward(self, x, repeats, y):
        rows = torch.repeat_interleave(self.fc(x), repeats, dim=0,
                                       output_size=self.total)
        return rows, F.mse_loss(rows, y)


def _repeats(micro_batches, size, total, seed=0):
    """Repeats of each row, ``total`` per micro-batch."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(micro_batches):
        cuts = torch.randint(0, total + 1, (size - 1,), generator=generator)
        edges = torch.cat([torch.tensor([0]), cuts.sort().values,
                           torch.tensor([total])])
        rows.append(edges.diff())
    return torch.cat(rows)


def test_repeat_interleave_with_output_size_in_inference():
    torch.manual_seed(0)
    model = Repeated(total=6)
    x = torch.randn(12, 4)
    repeats = _repeats(4, 3, 6)
    y = torch.zeros(4 * 6, 2)
    rows, _ = poptorch.inferenceModel(
        model, options(device_iterations=2, replicas=2))(x, repeats, y)
    with torch.no_grad():
        expected = [model(xs, rs, ys)[0] for xs, rs, ys in zip(
            _micro_batches(x, 4), _micro_batches(repeats, 4),
            _micro_batches(y, 4))]
    torch.testing.assert_close(rows, torch.cat(expected), atol=1e-6,
                               rtol=1e-5)


def test_repeat_interleave_with_output_size_in_training():
    torch.manual_seed(0)
    model = Repeated(total=6)
    reference = copy.deepcopy(model)
    x = torch.randn(24, 4)
    repeats = _repeats(8, 3, 6)
    y = torch.randn(8 * 6, 2)
    opts = options(device_iterations=2, accumulation=2, replicas=2,
                   outputMode=poptorch.OutputMode.All)
    wrapper = poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = wrapper(x, repeats, y)
    expected = reference_training(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1),
        (x, repeats, y), device_iterations=2, accumulation=2, replicas=2)
    torch.testing.assert_close(loss.flatten(), expected.flatten(), atol=1e-6,
                               rtol=1e-5)
    assert_same_weights(model, reference)


class Body(torch.nn.Module):
    """Runs ``body(h, y)`` after a linear layer."""

    def __init__(self, body):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.body = body

    def forward(self, x, y):
        return self.body(self.fc(x), y)


def _bincount(h, y):
    return torch.bincount(y)  # marker: bincount


def _repeat_interleave(h, y):
    return torch.repeat_interleave(h, y, dim=0)  # marker: repeat_interleave


def _one_hot(h, y):
    return h[:, :3] + F.one_hot(y)  # marker: one_hot


def _nonzero(h, y):
    return torch.nonzero(h > 0, as_tuple=True)[0]  # marker: nonzero


def _where(h, y):
    return torch.where(h > 0)[1]  # marker: where


def _unique(h, y):
    return torch.unique(y)  # marker: unique


def _line_of(text: str) -> int:
    with open(THIS_FILE) as source:
        for number, line in enumerate(source, 1):
            if text in line:
                return number
    raise AssertionError(text)


@pytest.mark.parametrize("body,operation,alternative", [
    (_bincount, "aten.bincount", "pass minlength=N to torch.bincount"),
    (_repeat_interleave, "aten.repeat_interleave",
     "pass output_size=, the sum of repeats"),
    (_one_hot, "aten.one_hot", "pass num_classes=N"),
    (_nonzero, "aten.nonzero",
     "torch.nonzero_static(condition, size=N, fill_value=-1)"),
    (_where, "aten.nonzero", "torch.nonzero_static"),
    (_unique, "aten._unique2", "torch.bincount(x, minlength=N)"),
])
def test_refusal_names_the_operation_the_line_and_the_alternative(
        body, operation, alternative):
    wrapper = poptorch.inferenceModel(Body(body))
    with pytest.raises(poptorch.Error) as info:
        wrapper(torch.randn(4, 4), torch.tensor([0, 1, 1, 2]))
    message = str(info.value)
    marker = body.__name__[1:]
    line = _line_of(f"# marker: {marker}")
    assert f'File "{THIS_FILE}", line {line}, in {body.__name__}' in message
    assert operation in message
    assert "result shape depends on the data" in message
    assert alternative in message


def test_bincount_argument_errors_are_pytorch_errors():
    def two_dimensional(h, y):
        return torch.bincount(y.view(2, 2), minlength=BINS)

    y = torch.tensor([0, 1, 1, 2])
    with pytest.raises(RuntimeError) as plain:
        Body(two_dimensional)(torch.randn(4, 4), y)
    with pytest.raises(RuntimeError) as captured:
        poptorch.inferenceModel(Body(two_dimensional))(torch.randn(4, 4), y)
    assert not isinstance(captured.value, poptorch.Error)
    assert str(captured.value) == str(plain.value)


class _ScalarIndices(torch.nn.Module):
    """Rows chosen by 0-d integer tensors (an action, a position): read,
    written, and counted from the end."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, x, choice):
        row = self.table[choice[0]] + self.table[choice[1] - 5]
        mask = torch.ones(4)
        mask[choice[0] % 4] = 0.0
        out = x * row.sum() * mask
        return out, torch.nn.functional.mse_loss(out, torch.zeros_like(out))


@pytest.mark.parametrize("replicas", [1, 2])
def test_zero_d_integer_indices_select_rows_like_pytorch(replicas):
    """As PopTorch's tracer recorded them (PyTorch reads their value,
    which a static graph cannot: they were refused). Each replica's own
    indices; the update equals plain PyTorch's."""
    torch.manual_seed(0)
    net = _ScalarIndices()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(replicas=replicas, outputMode=poptorch.OutputMode.All),
        torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(2 * replicas, 4)
    choices = torch.tensor([1, 4, 3, 2])[:2 * replicas]   # 2 per replica
    out, _ = model(x, choices)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    expected = []
    for part, picks in zip(x.chunk(replicas), choices.chunk(replicas)):
        part_out, loss = twin(part, picks)
        expected.append(part_out.detach())
        (loss / replicas).backward()
    reference.step()
    torch.testing.assert_close(out, torch.cat(expected))
    assert_same_weights(net, twin)
