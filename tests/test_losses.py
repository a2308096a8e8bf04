"""Loss discovery (docs/semantics.md, "Losses in training")."""
import pytest
import torch

import poptorch
from conftest import assert_same_weights, make_data, options


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
    with pytest.raises(poptorch.Error, match="identity_loss"):
        model(*make_data(2))


def test_backward_on_an_output_explains_it_is_automatic(mlp):
    model = poptorch.trainingModel(mlp, options())
    _, loss = model(*make_data(2))
    with pytest.raises(poptorch.Error, match="automatically"):
        loss.backward()
    assert type(loss * 2) is torch.Tensor
