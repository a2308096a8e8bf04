"""Models that differentiate inside forward train as in plain PyTorch:
an inner gradient step with respect to their own parameters (MAML), and
a loss function applied per sample under torch.func.vmap."""
import torch
import torch.nn.functional as F

from conftest import assert_trains_like_plain_pytorch


class InnerStep(torch.nn.Module):
    """MAML: one inner SGD step on the first half of the batch (with
    create_graph, so the outer loss differentiates through it), the outer
    loss on the second half with the adapted weight."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        support, query = x.chunk(2), y.chunk(2)
        inner = F.cross_entropy(self.fc(support[0]), query[0])
        weight_grad, = torch.autograd.grad(inner, self.fc.weight,
                                           create_graph=True)
        adapted = self.fc.weight - 0.5 * weight_grad
        out = F.linear(support[1], adapted, self.fc.bias)
        return out, F.cross_entropy(out, query[1])


class PerSampleLoss(torch.nn.Module):
    """torch.func.vmap of a loss function: per-sample losses, whose square
    root's mean is the loss."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        target = F.one_hot(y, 3).float()
        per_sample = torch.func.vmap(F.mse_loss)(out, target)
        root = (per_sample + 1e-6).sqrt()
        return out, F.l1_loss(root, torch.zeros_like(root))


def test_an_inner_gradient_step_on_parameters_trains_like_plain_pytorch():
    assert_trains_like_plain_pytorch(InnerStep, lr=0.5)


def test_a_loss_function_under_vmap_trains_like_plain_pytorch():
    assert_trains_like_plain_pytorch(PerSampleLoss, lr=0.5)
