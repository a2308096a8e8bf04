"""opts.updatableNamedBuffers and PoplarExecutor.copyNamedBuffersToDevice:
only the named buffers go from the host module to the device."""
import copy

import pytest
import torch

import poptorch
from conftest import assert_same_weights, make_data, options, \
    reference_training


class ShiftedClassifier(torch.nn.Module):
    """A linear classifier whose input is shifted and scaled by buffers."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.zeros(4))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x, y=None):
        out = self.fc((x + self.shift) * self.scale)
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def _net():
    torch.manual_seed(0)
    return ShiftedClassifier()


@pytest.mark.parametrize("broadcast", [True, False])
def test_inference_copies_only_the_named_buffers(broadcast):
    net = _net()
    opts = options(2, replicas=2, broadcastBuffers=broadcast)
    opts.updatableNamedBuffers(["shift"])
    model = poptorch.inferenceModel(net, opts)
    x, _ = make_data(8)
    model(x)
    with torch.no_grad():
        net.shift.fill_(0.5)
        net.scale.fill_(3.0)
    model.copyNamedBuffersToDevice()
    expected = copy.deepcopy(net)
    expected.scale.fill_(1.0)       # still the compiled value on the device
    torch.testing.assert_close(model(x), expected(x), rtol=1e-6, atol=1e-6)
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), net(x), rtol=1e-6, atol=1e-6)


def test_training_uses_the_copied_buffer_with_its_trained_weights():
    net = _net()
    twin = copy.deepcopy(net)
    opts = options(2, 2, 2).updatableNamedBuffers(["shift", "scale"])
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = make_data(16)
    model(x, y)
    reference_training(twin, reference, [x, y], 2, 2, 2)
    with torch.no_grad():
        model.shift.copy_(torch.arange(4.0) / 4)
        twin.shift.copy_(torch.arange(4.0) / 4)
    model.copyNamedBuffersToDevice()
    _, losses = model(x, y)
    expected = reference_training(twin, reference, [x, y], 2, 2, 2)
    torch.testing.assert_close(losses, expected[-2:], rtol=1e-5, atol=1e-5)
    assert_same_weights(net, twin)


def test_copy_named_buffers_errors():
    x, _ = make_data(4)
    model = poptorch.inferenceModel(_net())
    model(x)
    with pytest.raises(poptorch.Error, match=r"no buffer is updatable.*"
                       r"updatableNamedBuffers"):
        model.copyNamedBuffersToDevice()
    net = _net()
    unknown = poptorch.inferenceModel(
        net, poptorch.Options().updatableNamedBuffers(["shift", "fc.weight"]))
    with pytest.raises(poptorch.Error, match=r"\['fc.weight'\] are not "
                       r"buffers of the model; its buffers are \['scale', "
                       r"'shift'\]"):
        unknown.copyNamedBuffersToDevice()
    resized = poptorch.inferenceModel(
        net, poptorch.Options().updatableNamedBuffers(["shift"]))
    resized(x)
    net.shift = torch.zeros(1)
    with pytest.raises(poptorch.Error, match=r"buffer 'shift' is a tensor of "
                       r"shape \(1,\).*compiled for a tensor of shape \(4,\)"):
        resized.copyNamedBuffersToDevice()
    with pytest.raises(poptorch.Error, match="updatableNamedBuffers must be "
                       "a list of buffer names"):
        poptorch.Options().updatableNamedBuffers("shift")
