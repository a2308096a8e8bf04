"""Train/eval modes follow PopTorch's shallow copy of the module: the
module's own ``training`` flag as it was when wrapped, its sub-modules'
flags (shared with the copy) as they are when the model compiles; a change
after wrapping is logged; ``poptorch_model.train()``/``eval()`` set both."""
import copy

import torch

import poptorch
from conftest import BatchNormNet, make_images, options


class TopLevelBranch(torch.nn.Module):
    """Reads its own ``training`` flag; a Dropout sub-module."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.9)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return h * 2 if self.training else h


def test_sub_modules_modes_are_read_at_compilation(poptorch_log):
    """A Dropout put in training mode between wrapping and the first call
    is active in the inference model; the module's own flag stays the one
    it had when wrapped, and the change is logged."""
    torch.manual_seed(0)
    net = TopLevelBranch().eval()
    model = poptorch.inferenceModel(net)
    net.train()
    x = torch.ones(64, 4)
    out = model(x)
    fc = net.fc(x)
    assert bool((out == 0).any())
    kept = out != 0
    torch.testing.assert_close(out[kept], (fc / 0.1)[kept])
    assert "drop (Dropout): training" in poptorch_log.text
    assert "own flag as it was when wrapped (evaluation)" in poptorch_log.text


def test_frozen_batch_norm_after_destroy_like_plain_pytorch():
    """Fine-tuning: after an epoch, BatchNorm is put in evaluation mode
    and the model recompiled (destroy()): it trains as plain PyTorch does,
    with the running statistics left alone."""
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    for epoch in range(2):
        if epoch == 1:
            net.bn.eval()
            twin.bn.eval()
            model.destroy()
        x, y = make_images(4, seed=epoch)
        _, loss = model(x, y)
        optimizer.zero_grad()
        _, expected = twin(x, y)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach())
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(net.state_dict()[name], value,
                                   msg=name)


def test_wrapper_eval_sets_the_modes_and_returns_the_wrapper(poptorch_log):
    """As PopTorch's copy: the sub-modules and the wrapped model's own
    flag, not the module's; nothing changed behind the wrapper's back."""
    torch.manual_seed(0)
    net = TopLevelBranch()
    model = poptorch.inferenceModel(net)
    assert model.eval() is model
    x = torch.ones(8, 4)
    torch.testing.assert_close(model(x), net.fc(x))
    assert not net.drop.training and net.training
    assert "changed after" not in poptorch_log.text


def test_a_partial_mode_change_after_compilation_is_reported(poptorch_log):
    """bn.eval() after the first call does not reach the compiled model
    (as in PopTorch, which compiled it in training mode): logged once; the
    whole module put in evaluation mode for validation between training
    calls is not."""
    net = BatchNormNet()
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.1))
    x, y = make_images(4)
    model(x, y)
    net.eval()
    poptorch.inferenceModel(net)(x, y)
    net.train()
    model(x, y)
    assert "train/eval mode" not in poptorch_log.text
    net.bn.eval()
    model(x, y)
    assert ("train/eval mode of 'bn' in the wrapped module changed after "
            "the model was compiled (training when compiled, now "
            "evaluation)") in poptorch_log.text
