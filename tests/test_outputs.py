"""Output modes, shapes and structures (docs/semantics.md, "What a call
returns")."""
import copy

import pytest
import torch

import poptorch
from conftest import make_data, options


def micro_outputs(module, x, device_iterations, replicas):
    """The module's output for every micro-batch, in [D, R] order."""
    split = x.unflatten(0, (device_iterations, replicas, -1))
    return [module(split[d, r]) for d in range(device_iterations)
            for r in range(replicas)]


def test_inference_all_returns_every_micro_batch(mlp):
    x, _ = make_data(2 * 3 * 2)
    model = poptorch.inferenceModel(mlp, options(3, replicas=2))
    expected = torch.cat(micro_outputs(mlp, x, 3, 2))
    torch.testing.assert_close(model(x), expected)
    assert model(x).shape == (12, 3)


def test_inference_final_returns_last_iteration_per_replica(mlp):
    x, _ = make_data(2 * 3 * 2)
    model = poptorch.inferenceModel(
        mlp, options(3, replicas=2, outputMode=poptorch.OutputMode.Final))
    expected = torch.cat(micro_outputs(mlp, x, 3, 2)[-2:])
    torch.testing.assert_close(model(x), expected)


def test_inference_final_with_one_replica_keeps_model_shape(mlp):
    x, _ = make_data(2 * 3)
    model = poptorch.inferenceModel(
        mlp, options(3, outputMode=poptorch.OutputMode.Final))
    torch.testing.assert_close(model(x), mlp(x[4:]))


def test_inference_sum_adds_iterations_per_replica(mlp):
    x, _ = make_data(2 * 4 * 2)
    model = poptorch.inferenceModel(
        mlp, options(4, replicas=2, outputMode=poptorch.OutputMode.Sum))
    outs = micro_outputs(mlp, x, 4, 2)
    expected = torch.cat([sum(outs[0::2]), sum(outs[1::2])])
    torch.testing.assert_close(model(x), expected)


def test_inference_every_n_returns_iterations_n_minus_1_2n_minus_1(mlp):
    x, _ = make_data(2 * 6)
    model = poptorch.inferenceModel(
        mlp, options(6, outputMode=(poptorch.OutputMode.EveryN, 3)))
    outs = micro_outputs(mlp, x, 6, 1)
    torch.testing.assert_close(model(x), torch.cat([outs[2], outs[5]]))


@pytest.mark.parametrize("mode, kept", [
    (poptorch.OutputMode.All, lambda outs: torch.cat(outs)),
    (poptorch.OutputMode.Final, lambda outs: outs[-1]),
    (poptorch.OutputMode.Sum, sum),
])
def test_a_return_period_is_ignored_by_modes_other_than_every_n(
        mlp, poptorch_log, mode, kept):
    """PopTorch accepts outputMode(mode, period) for every mode and only
    EveryN uses the period (4 here does not divide the 3 iterations)."""
    x, _ = make_data(2 * 3)
    opts = options(3, outputMode=(mode, 4))
    assert opts.output_return_period == 1
    model = poptorch.inferenceModel(mlp, opts)
    torch.testing.assert_close(model(x), kept(micro_outputs(mlp, x, 3, 1)))
    assert f"output_return_period=4 is ignored with OutputMode.{mode.name}" \
        in poptorch_log.text


def test_training_default_returns_final_loss(mlp):
    x, y = make_data(2 * 3)
    model = poptorch.trainingModel(mlp, options(3),
                                   torch.optim.SGD(mlp.parameters(), lr=0.0))
    out, loss = model(x, y)
    assert out.shape == (2, 3) and loss.shape == ()
    expected_out, expected_loss = mlp(x[4:], y[4:])
    torch.testing.assert_close(loss, expected_loss.detach())
    torch.testing.assert_close(out, expected_out.detach())


def test_training_outputs_format_copy_and_save_as_plain_tensors(
        mlp, tmp_path):
    """Training outputs refuse backward() but are used as PyTorch's are:
    f-string formatting of the loss, deepcopy, torch.save and a
    weights_only torch.load."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.0))
    out, loss = model(x, y)
    with pytest.raises(poptorch.Error, match="backward"):
        loss.backward()
    value = loss.item()
    assert f"{loss:.3f}" == f"{value:.3f}" == format(loss, ".3f")
    assert type(copy.deepcopy(loss)) is torch.Tensor
    torch.save({"loss": loss, "out": out}, tmp_path / "outputs.pt")
    loaded = torch.load(tmp_path / "outputs.pt", weights_only=True)
    assert type(loaded["loss"]) is torch.Tensor
    assert loaded["loss"].item() == value and torch.equal(loaded["out"], out)


def test_training_all_makes_scalar_losses_one_dimensional(mlp):
    x, y = make_data(2 * 2 * 3)
    model = poptorch.trainingModel(
        mlp, options(2, 3, outputMode=poptorch.OutputMode.All),
        torch.optim.SGD(mlp.parameters(), lr=0.0))
    out, loss = model(x, y)
    assert out.shape == (12, 3) and loss.shape == (6,)
    expected = [mlp(x[i:i + 2], y[i:i + 2])[1] for i in range(0, 12, 2)]
    torch.testing.assert_close(loss, torch.stack(expected).detach())


def test_outputs_keep_the_model_structure():
    class Structured(torch.nn.Module):
        def forward(self, x):
            doubled = x * 2
            return {"b": (doubled, [x + 1]), "a": doubled, "n": 3}

    x = torch.arange(8.0).reshape(4, 2)
    out = poptorch.inferenceModel(Structured(), options(2))(x)
    assert list(out) == ["b", "a", "n"]
    torch.testing.assert_close(out["b"][0], x * 2)
    torch.testing.assert_close(out["b"][1][0], x + 1)
    torch.testing.assert_close(out["a"], x * 2)
    assert out["n"] == 3


class _WithNone(torch.nn.Module):
    """Returns None beside its tensors, as models with optional outputs
    (attention weights, a loss without labels) do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 3)

    def forward(self, x, y=None):
        out = self.linear(x)
        loss = None if y is None else torch.nn.functional.mse_loss(out, y)
        return loss, out, None, [x.sum(1), None]


def test_none_among_outputs_is_returned_in_place():
    torch.manual_seed(0)
    net = _WithNone()
    x = torch.randn(4, 2)
    loss, out, nothing, (total, also_nothing) = poptorch.inferenceModel(
        net, options(2))(x)
    assert loss is None and nothing is None and also_nothing is None
    torch.testing.assert_close(out, net.linear(x).detach())
    torch.testing.assert_close(total, x.sum(1))


class _ShapeOf(torch.nn.Module):
    def forward(self, x, shape):
        return x.new_zeros(shape) + x.sum(), x.shape


def test_a_torch_size_stays_a_torch_size():
    """As an output (a micro-batch's shape) and as an argument (it came
    back as a plain tuple; an argument reached forward as one)."""
    out, shape = poptorch.inferenceModel(_ShapeOf(), options(2))(
        torch.ones(4, 3), torch.Size([2]))
    assert type(shape) is torch.Size and shape == (2, 3)
    torch.testing.assert_close(out, torch.full((4,), 6.0))


def test_none_among_training_outputs_is_returned_in_place():
    torch.manual_seed(0)
    net = _WithNone()
    x, y = torch.randn(4, 2), torch.randn(4, 3)
    expected = torch.nn.functional.mse_loss(net.linear(x), y).detach()
    model = poptorch.trainingModel(net, options(1),
                                   torch.optim.SGD(net.parameters(), lr=0.0))
    loss, out, nothing, (total, also_nothing) = model(x, y)
    assert nothing is None and also_nothing is None
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(total, x.sum(1))


def test_every_n_needs_a_dividing_period(mlp):
    model = poptorch.inferenceModel(
        mlp, options(4, outputMode=(poptorch.OutputMode.EveryN, 3)))
    with pytest.raises(poptorch.Error, match="multiple of 3"):
        model(make_data(8)[0])


class WithIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y, ids):
        return ids, torch.nn.functional.cross_entropy(self.fc(x), y)


def test_every_n_in_training_returns_whole_device_iterations():
    """D = 4, G = 2, N = 2: every micro-batch of device iterations 1 and 3
    (micro-batches 2, 3, 6, 7 of two rows each), in [D, G] order."""
    model = poptorch.trainingModel(WithIds(), options(
        4, accumulation=2, outputMode=(poptorch.OutputMode.EveryN, 2)))
    x, y = make_data(16)
    ids, losses = model(x, y, torch.arange(16))
    assert ids.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert losses.shape == (4,)


def test_every_n_needs_a_period_dividing_the_device_iterations(mlp):
    model = poptorch.trainingModel(mlp, options(
        1, accumulation=4, outputMode=(poptorch.OutputMode.EveryN, 2)))
    with pytest.raises(poptorch.Error, match="deviceIterations = 1"):
        model(*make_data(8))


class PassThrough(torch.nn.Module):
    """Returns its labels and its weight beside the loss, as programs
    collecting ids or inspecting a layer did."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return out, y, self.fc.weight, torch.nn.functional.cross_entropy(
            out, y)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mode", [poptorch.OutputMode.All,
                                  poptorch.OutputMode.Final])
def test_outputs_handing_back_inputs_or_weights_are_copies(training, mode):
    """An IPU sends copies back: writing to the inputs later (a data
    loader's ring buffer reuses them) or to an output leaves the other
    alone."""
    opts = options(outputMode=mode)
    net = PassThrough()
    model = (poptorch.trainingModel(net, opts) if training
             else poptorch.inferenceModel(net, opts))
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    _, labels, weight, _ = model(x, y)
    weight_before = model.fc.weight.detach().clone()
    y += 10
    torch.testing.assert_close(labels, torch.tensor([0, 2]))
    weight.zero_()
    model.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight.detach(), weight_before)


def test_a_returned_constant_is_a_copy():
    """A plain tensor attribute is a constant of the graph: writing to the
    output leaves the next call's value alone."""
    class WithTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.arange(3.0)

        def forward(self, x):
            return x * 2, self.table

    model = poptorch.inferenceModel(WithTable())
    _, table = model(torch.ones(2))
    table.zero_()
    torch.testing.assert_close(model(torch.ones(2))[1], torch.arange(3.0))


class _ReturnsWrittenWeight(torch.nn.Module):
    """Returns a frozen weight that forward adds 1 to in place."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.counter = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.counter.add_(1.0)
        loss = torch.nn.functional.mse_loss(x * self.scale,
                                            torch.zeros_like(x))
        return loss, self.counter


@pytest.mark.parametrize("mode, expected", [
    (poptorch.OutputMode.All, [1.0, 2.0, 3.0]),
    (poptorch.OutputMode.Sum, [6.0])])
def test_a_weight_written_in_place_is_returned_as_each_step_saw_it(
        mode, expected):
    """Every device iteration's value of a weight forward writes in place
    (all of them were the last one's)."""
    opts = poptorch.Options().deviceIterations(3)
    opts.outputMode(mode)
    net = _ReturnsWrittenWeight()
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(
        net.parameters(), lr=0.1))
    _, counter = model(torch.ones(3, 1))
    assert counter.flatten().tolist() == expected
