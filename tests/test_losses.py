"""Loss discovery (docs/semantics.md, "Losses in training")."""
import pytest
import torch

import poptorch
from conftest import (assert_same_weights, assert_trains_like_plain_pytorch,
                      make_data, options, reference_training)


class CustomLoss(torch.nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.reduction = reduction

    def forward(self, x):
        out = self.fc(x)
        return out, poptorch.identity_loss(out ** 2, self.reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_identity_loss_trains_like_the_same_loss_in_pytorch(reduction):
    torch.manual_seed(0)
    net = CustomLoss(reduction)
    twin = CustomLoss(reduction)
    twin.load_state_dict(net.state_dict())
    x = torch.randn(4, 4)
    poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))(x)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    out = twin.fc(x) ** 2
    (out.sum() if reduction == "sum" else out.mean()).backward()
    optimizer.step()
    assert_same_weights(net, twin)


def test_identity_loss_rejects_unknown_reduction():
    with pytest.raises(poptorch.Error, match="reduction"):
        poptorch.identity_loss(torch.ones(2), "max")


def test_loss_feeding_another_loss_is_part_of_the_graph():
    class Combined(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            ce = torch.nn.functional.cross_entropy(out, y)
            mse = torch.nn.functional.mse_loss(out, torch.zeros_like(out))
            return poptorch.identity_loss(ce + 0.5 * mse, "none")

    torch.manual_seed(0)
    net, twin = Combined(), Combined()
    twin.load_state_dict(net.state_dict())
    x, y = make_data(4)
    poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))(x, y)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x, y).backward()
    optimizer.step()
    assert_same_weights(net, twin)


class ReturnedTotal(torch.nn.Module):
    """Losses finished by further operations and returned without
    identity_loss: a hand-written label smoothing, two torch losses added
    together, and an L2 term on a parameter the loss functions never
    see."""

    def __init__(self, kind):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.kind = kind

    def forward(self, x, y):
        out = self.fc(x)
        if self.kind == "label-smoothing":
            log_p = torch.log_softmax(out, -1)
            nll = torch.nn.functional.nll_loss(log_p, y, reduction="none")
            total = (0.9 * nll - 0.1 * log_p.mean(-1)).mean()
        elif self.kind == "two-losses":
            total = 0.3 * torch.nn.functional.cross_entropy(out, y) + \
                0.7 * torch.nn.functional.mse_loss(out, torch.zeros_like(out))
        else:
            total = torch.nn.functional.cross_entropy(out, y) + \
                0.1 * (self.scale ** 2).sum()
        return out, total


@pytest.mark.parametrize("kind", ["label-smoothing", "two-losses",
                                  "regulariser"])
def test_a_returned_total_of_the_losses_is_what_trains(kind):
    """The backward pass starts from the returned scalar computed from the
    final loss(es), as its backward() would in PyTorch; before, it started
    from the loss function's output and left the rest out, silently (or
    refused two added losses)."""
    assert_trains_like_plain_pytorch(lambda: ReturnedTotal(kind), lr=0.1)


def _one_step_like_plain_pytorch(make_model):
    """One training call of a new model on 4 rows: its weights equal plain
    PyTorch's after the same SGD step (conftest's ``reference_training``
    reads the loss from the second output)."""
    torch.manual_seed(0)
    net, twin = make_model(), make_model()
    twin.load_state_dict(net.state_dict())
    x, y = make_data(4)
    poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y))
    assert_same_weights(net, twin)


def test_a_returned_final_loss_starts_the_backward_pass_beside_others():
    """With the final loss itself returned, a scaled copy of it returned
    for reporting does not replace it."""
    class Reported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            loss = torch.nn.functional.cross_entropy(self.fc(x), y)
            return 100 * loss, loss

    _one_step_like_plain_pytorch(Reported)


class TotalBesideItsParts(torch.nn.Module):
    """A total returned with the loss function's result, or values
    computed from it, beside it: a VAE's reconstruction and KL terms, a
    z-loss with the perplexity, per-sample losses weighted by an input
    (prioritised replay) with the unweighted ones."""

    def __init__(self, kind):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.latent = torch.nn.Parameter(torch.ones(3))
        self.kind = kind

    def forward(self, x, y, weights):
        out = self.fc(x) * self.latent
        if self.kind == "vae":
            recon = torch.nn.functional.mse_loss(out, torch.zeros_like(out))
            kl = (self.latent ** 2).mean()
            return (recon, kl), recon + 4 * kl
        if self.kind == "z-loss":
            ce = torch.nn.functional.cross_entropy(out, y)
            z = torch.logsumexp(out, -1).pow(2).mean()
            return torch.exp(ce), ce + 1e-2 * z
        per_sample = torch.nn.functional.smooth_l1_loss(
            out.sum(-1), torch.zeros_like(weights), reduction="none")
        return per_sample.detach(), (per_sample * weights).mean()


@pytest.mark.parametrize("kind", ["vae", "z-loss", "weighted-per-sample"])
def test_a_returned_total_trains_beside_its_parts(kind):
    """Before, returning the loss function's result (or a value computed
    from it alone) beside the total made the backward pass start from that
    result, leaving the other terms untrained, silently."""
    torch.manual_seed(0)
    net, twin = TotalBesideItsParts(kind), TotalBesideItsParts(kind)
    twin.load_state_dict(net.state_dict())
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    for seed in range(2):
        x, y = make_data(4, seed=seed)
        data = (x, y, torch.linspace(0.1, 2.0, 4))
        model(*data)
        reference_training(twin, optimizer, data)
    assert_same_weights(net, twin)


def test_totals_none_computed_from_the_others_are_an_error():
    class TwoTotals(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            ce = torch.nn.functional.cross_entropy(out, y)
            return ce + out.pow(2).mean(), ce + out.abs().mean()

    model = poptorch.trainingModel(TwoTotals(), options())
    with pytest.raises(poptorch.Error, match="outputs 0, 1 .*identity_loss"):
        model(*make_data(4))


def test_a_loss_computed_under_no_grad_is_a_metric():
    """It is not a second final loss: the identity loss trains."""
    class WithMetric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            with torch.no_grad():
                metric = torch.nn.functional.mse_loss(out, out.round())
            ce = torch.nn.functional.cross_entropy(out, y)
            return metric, poptorch.identity_loss(ce, "none")

    _one_step_like_plain_pytorch(WithMetric)


class DetachedMetric(torch.nn.Module):
    """Values for logging returned beside the loss without gradients: the
    loss times the number of rows, another loss or the sum of both,
    detached or computed under no_grad."""

    def __init__(self, kind):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.kind = kind

    def forward(self, x, y):
        out = self.fc(x)
        ce = torch.nn.functional.cross_entropy(out, y)
        mse = torch.nn.functional.mse_loss(out, torch.zeros_like(out))
        if self.kind == "detached-total":
            return ce.detach() * x.new_tensor(float(len(x))), ce
        if self.kind == "detached-loss":
            return mse.detach(), ce
        if self.kind == "detached-sum":
            return (ce + mse).detach(), ce
        if self.kind == "the-loss-detached":
            return ce.detach(), ce
        with torch.no_grad():
            total = ce + mse
        return total, ce


@pytest.mark.parametrize("kind", ["detached-total", "detached-loss",
                                  "detached-sum", "sum-under-no-grad",
                                  "the-loss-detached"])
def test_values_without_gradients_are_metrics_beside_the_loss(kind):
    """They are neither totals nor final losses: the cross-entropy trains,
    as ce.backward() does in PyTorch (a detached total was taken as the
    start of the backward pass and crashed; a detached second loss was an
    "unrelated final losses" error)."""
    _one_step_like_plain_pytorch(lambda: DetachedMetric(kind))


@pytest.mark.parametrize("loss", [
    lambda out, x, y: torch.nn.functional.mse_loss(out.detach(),
                                                   torch.zeros_like(out)),
    lambda out, x, y: torch.nn.functional.mse_loss(x, x * 0),
    lambda out, x, y: poptorch.identity_loss((out > 0).sum(), "none")])
def test_a_loss_without_gradients_is_an_error(loss):
    """PyTorch's loss.backward() fails on it; it failed inside torch."""
    class Detached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            return out, loss(out, x, y)

    model = poptorch.trainingModel(Detached(), options())
    with pytest.raises(poptorch.Error, match="loss .*test_losses.py.* does "
                       "not require gradients"):
        model(*make_data(4))


def test_a_loss_no_output_uses_is_dead_code():
    """Computed and never used, beside the returned loss: PopTorch's graph
    leaves it out, so it is not a second final loss."""
    class WithUnusedLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            torch.nn.functional.cross_entropy(out, y, reduction="none")
            return out, torch.nn.functional.cross_entropy(out, y)

    _one_step_like_plain_pytorch(WithUnusedLoss)


def test_losses_written_into_a_tensor_and_summed_train_together():
    """Multi-task losses gathered in a tensor (``terms[0] = ce``): the
    returned sum is the total of both, not a report of the one used
    directly."""
    class Gathered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.aux = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            out = self.fc(x)
            ce = torch.nn.functional.cross_entropy(out, y)
            terms = torch.zeros(1)
            terms[0] = torch.nn.functional.mse_loss(
                self.aux(x).squeeze(1), y.float())
            return out, ce + terms.sum()

    _one_step_like_plain_pytorch(Gathered)


class GaussianHead(torch.nn.Module):
    """A mean and a variance head trained with nn.GaussianNLLLoss, whose
    variance check reads values in Python."""

    def __init__(self, variance_shape, full, reduction):
        super().__init__()
        self.mean = torch.nn.Linear(4, 3)
        self.variance = torch.nn.Linear(4, 3 if variance_shape == "same"
                                        else 1)
        self.variance_shape = variance_shape
        self.loss = torch.nn.GaussianNLLLoss(full=full, reduction=reduction)

    def forward(self, x, y):
        mean = self.mean(x)
        variance = torch.nn.functional.softplus(self.variance(x))
        if self.variance_shape == "one short":
            variance = variance.squeeze(1)
        target = torch.nn.functional.one_hot(y, 3).float()
        loss = self.loss(mean, target, variance)
        return mean, loss if loss.dim() == 0 else loss.mean()


@pytest.mark.parametrize("variance_shape, full, reduction", [
    ("same", False, "mean"), ("one short", True, "sum"),
    ("size 1", False, "none")])
def test_gaussian_nll_loss_trains_as_in_pytorch(variance_shape, full,
                                                reduction):
    _one_step_like_plain_pytorch(
        lambda: GaussianHead(variance_shape, full, reduction))


def test_model_without_loss_is_an_error(mlp):
    model = poptorch.trainingModel(torch.nn.Linear(4, 2), options())
    with pytest.raises(poptorch.Error, match="no loss"):
        model(torch.ones(2, 4))


def test_two_unrelated_losses_are_an_error():
    class TwoLosses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            return (torch.nn.functional.cross_entropy(out, y),
                    torch.nn.functional.mse_loss(out, torch.zeros_like(out)))

    model = poptorch.trainingModel(TwoLosses(), options())
    with pytest.raises(poptorch.Error, match="identity_loss") as error:
        model(*make_data(2))
    # Each final loss is named by the user's line that computed it.
    assert str(error.value).count("test_losses.py\", line") == 2
    assert "mse_loss(out, torch.zeros_like(out))" in str(error.value)
    assert "under torch.no_grad()" in str(error.value)


def test_a_loss_computed_under_no_grad_is_a_returned_metric(mlp, twin):
    """The remedy the error above names: a per-sample loss returned for
    logging, computed under no_grad, is not taken for a training loss."""
    class WithMetric(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out, loss = self.net(x, y)
            with torch.no_grad():
                per_sample = torch.nn.functional.cross_entropy(
                    out, y, reduction="none")
            return loss, per_sample

    x, y = make_data(4)
    model = poptorch.trainingModel(WithMetric(mlp), options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.1))
    loss, per_sample = model(x, y)
    torch.testing.assert_close(loss, per_sample.mean())
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y))
    assert_same_weights(mlp, twin)


def test_backward_on_an_output_explains_it_is_automatic(mlp):
    model = poptorch.trainingModel(mlp, options())
    _, loss = model(*make_data(2))
    with pytest.raises(poptorch.Error, match="automatically"):
        loss.backward()
    assert type(loss * 2) is torch.Tensor
