"""Automatic mixed-precision casting (features chapter "Automatic
mixed-precision casting"): ``model.autocast()``, layer-level settings,
``@poptorch.autocast``, ``with poptorch.autocast()``,
``Precision.autocastEnabled`` and custom casting policies. Each case is
compared with plain PyTorch making the same casts by hand (exactly for
single calls; training to float32 rounding)."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch.autocasting import Policy
from conftest import cast_linear, maybe_checkpointed, options

HALF, FLOAT = torch.float16, torch.float32


class Net(torch.nn.Module):
    """Linear (fp16 by default) -> ReLU -> LayerNorm (fp32) -> Linear; with
    ``checkpointed``, the first three run under torch.utils.checkpoint."""

    def __init__(self, checkpointed=False):
        super().__init__()
        self.first = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.norm = torch.nn.LayerNorm(8)
        self.last = torch.nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def _features(self, x):
        return self.norm(self.act(self.first(x)))

    def forward(self, x, y=None):
        features = maybe_checkpointed(self._features, x, self.checkpointed)
        out = self.last(features)
        if y is None:
            return out
        return out, F.mse_loss(out, y)


def _by_hand(net, x, last_dtype=HALF):
    """``net`` with the default policy's casts: linears in ``last_dtype``
    (the first always float16), layer norm in float32."""
    h = torch.relu(cast_linear(net.first, x, HALF))
    h = F.layer_norm(h.float(), (8,), net.norm.weight, net.norm.bias)
    return cast_linear(net.last, h, last_dtype)


def _net(checkpointed=False):
    torch.manual_seed(0)
    return Net(checkpointed)


def _exact(actual, expected):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected.detach(), atol=0, rtol=0)


def test_casting_is_off_until_enabled():
    net = _net()
    x = torch.randn(4, 4)
    _exact(poptorch.inferenceModel(net, options())(x), net(x))


def test_model_autocast_types_operations_by_the_default_policy():
    net = _net()
    assert net.autocast() is net
    x = torch.randn(4, 4)
    _exact(poptorch.inferenceModel(net, options())(x), _by_hand(net, x))


def test_casting_to_float16_on_the_cpu_warns_once_that_it_is_slow(
        poptorch_log):
    net = _net()
    net.autocast()
    poptorch.inferenceModel(net, options())(torch.randn(4, 4))
    poptorch.inferenceModel(_net().autocast(), options())(torch.randn(4, 4))
    warnings = [record.getMessage() for record in poptorch_log.records
                if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "far slower than float32" in warnings[0]
    assert "autocastEnabled(False)" in warnings[0]


def test_a_layer_can_turn_casting_off_for_itself():
    net = _net()
    net.autocast()
    net.last.autocast(False)
    x = torch.randn(4, 4)
    _exact(poptorch.inferenceModel(net, options())(x),
           _by_hand(net, x, last_dtype=FLOAT))


def test_precision_option_turns_casting_off_for_the_whole_model():
    net = _net()
    net.autocast()
    opts = options()
    opts.Precision.autocastEnabled(False)
    x = torch.randn(4, 4)
    _exact(poptorch.inferenceModel(net, opts)(x), net(x))


def test_a_plain_pytorch_run_is_not_affected():
    net = _net()
    x = torch.randn(4, 4)
    expected = net(x)
    net.autocast()
    _exact(net(x), expected)


class Decorated(Net):
    @poptorch.autocast()
    def forward(self, x):
        out = self.first(x)
        with poptorch.autocast(False):
            return out, self.last(self.norm(out.float()))


def test_decorator_and_block_enable_and_disable_casting():
    torch.manual_seed(0)
    net = Decorated()
    x = torch.randn(4, 4)
    first, out = poptorch.inferenceModel(net, options())(x)
    expected_first = cast_linear(net.first, x, HALF)
    _exact(first, expected_first)
    h = F.layer_norm(expected_first.float(), (8,), net.norm.weight,
                     net.norm.bias)
    _exact(out, cast_linear(net.last, h, FLOAT))


@pytest.mark.parametrize("stages, checkpointed", [(1, False), (2, False),
                                                  (1, True)])
def test_training_keeps_float32_weights_and_matches_pytorch(stages,
                                                            checkpointed):
    """Two calls of D = 2 SGD steps of 3 accumulated micro-batches, in one
    graph, a 2-stage pipeline or with torch.utils.checkpoint (whose
    recomputation casts as the forward pass did): the casts are part of the
    step, their gradients reach the float32 weights."""
    net = _net(checkpointed)
    reference = copy.deepcopy(net)
    net.autocast()
    opts = options(2, 3)
    if stages == 2:
        net.last = poptorch.BeginBlock(net.last, ipu_id=1)
        opts.setExecutionStrategy(poptorch.PipelinedExecution())
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(12, 4), torch.randn(12, 3)
        out, loss = model(x, y)
        for step in range(2):
            optimizer.zero_grad()
            for micro in range(3):
                rows = slice(6 * step + 2 * micro, 6 * step + 2 * micro + 2)
                expected = _by_hand(reference, x[rows])
                expected_loss = F.mse_loss(expected.float(), y[rows])
                expected_loss.backward()
            for param in reference.parameters():
                param.grad /= 3
            optimizer.step()
        assert out.dtype == HALF and loss.dtype == FLOAT
        torch.testing.assert_close(loss, expected_loss.detach())
    model.copyWeightsToHost()
    for name, param in net.named_parameters():
        assert param.dtype == FLOAT
        torch.testing.assert_close(param, dict(
            reference.named_parameters())[name], msg=name)


def test_replicas_cast_like_one_replica():
    net = _net()
    net.autocast()
    x = torch.randn(8, 4)
    out = poptorch.inferenceModel(net, options(replicas=2))(x)
    _exact(out, _by_hand(net, x))


class PolicyNet(torch.nn.Module):
    """The spec's example sets: conv and ReLU float16, bmm float32, dot
    promoted."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, images, a, b, u, v):
        features = torch.relu(self.conv(images))
        product = torch.bmm(a, b)
        return (features, product, torch.dot(u, v), self.linear(a),
                torch.add(u, v))


def _spec_policy():
    return Policy(fp16=[torch.nn.Conv2d, torch.relu], fp32=[torch.bmm],
                  promote=[torch.dot], demote=[])


def test_custom_policy_types_modules_and_operations():
    torch.manual_seed(0)
    net = PolicyNet()
    net.autocast()
    opts = options()
    opts.Precision.autocastPolicy(_spec_policy())
    images = torch.randn(2, 1, 5, 5)
    a, b = torch.randn(2, 3, 3).half(), torch.randn(2, 3, 3).half()
    u, v = torch.randn(3).half(), torch.randn(3)
    features, product, dot, linear, added = poptorch.inferenceModel(
        net, opts)(images, a, b, u, v)
    conv = F.conv2d(images.half(), net.conv.weight.half(),
                    net.conv.bias.half())
    _exact(features, torch.relu(conv))
    _exact(product, torch.bmm(a.float(), b.float()))
    _exact(dot, torch.dot(u.float(), v))
    # Not in the policy: the half/float rule (float16 by default).
    _exact(linear, cast_linear(net.linear, a, HALF))
    _exact(added, u + v.half())


def test_demote_computes_mixed_inputs_in_float16():
    class Mul(torch.nn.Module):
        def forward(self, a, b):
            return torch.mul(a, b), torch.sub(a, b)

    net = Mul()
    net.autocast()
    opts = options()
    opts.Precision.autocastPolicy(Policy(demote=[torch.mul]))
    opts.Precision.halfFloatCasting(
        poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)
    a, b = torch.randn(4).half(), torch.randn(4)
    product, difference = poptorch.inferenceModel(net, opts)(a, b)
    _exact(product, a * b.half())
    _exact(difference, a.float() - b)


def test_attention_layers_run_in_float16_and_train():
    """The attention of a transformer layer computes in float16: its loss
    differs from the float32 layer's by float16 rounding only."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                             batch_first=True)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer
            self.register_buffer("mix", torch.randn(8))

        def forward(self, x):
            out = self.layer(x)
            return out, poptorch.identity_loss((out * self.mix).mean(),
                                               "none")

    net = Encoder()
    x = torch.randn(2, 4, 8)
    float_loss = net(x)[1].detach()
    net.autocast()
    before = copy.deepcopy(net.state_dict())
    model = poptorch.trainingModel(net, options(),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    out, loss = model(x)
    assert out.dtype == FLOAT   # the last operation is a float32 layer norm
    assert loss != float_loss
    torch.testing.assert_close(loss, float_loss, rtol=1e-2, atol=0)
    model.copyWeightsToHost()
    changed = [name for name, value in net.state_dict().items()
               if not torch.equal(value, before[name])]
    assert "layer.self_attn.in_proj_weight" in changed


def test_default_policy_lists_the_documented_operations():
    default = poptorch.autocasting.default
    assert {"linear", "conv2d", "matmul", "bmm"} <= set(default.names("fp16"))
    assert {"layer_norm", "softmax", "cross_entropy", "exp"} <= set(
        default.names("fp32"))
    assert {"cat", "stack", "dot"} <= set(default.names("promote"))
    assert default.names("demote") == []


def test_the_policy_is_part_of_the_compile_time_options():
    changed = options()
    changed.Precision.autocastPolicy(_spec_policy())
    assert changed.toDict() != options().toDict()
    assert "Conv2d" in str(changed)


@pytest.mark.parametrize("make, message", [
    (lambda: Policy(fp16=[3]),
     "Policy fp16: 3 is neither a torch.nn.Module class nor a torch "
     "operation"),
    (lambda: Policy(fp32=[int]), "Policy fp32: <class 'int'> is a class "
     "but not a torch.nn.Module subclass"),
    (lambda: Policy(fp16=[torch.nn.Linear], fp32=[torch.nn.Linear]),
     "Linear is in both fp16 and fp32"),
    (lambda: Policy(fp16=[torch.relu], demote=[F.relu]),
     "relu is in both fp16 and demote"),
    (lambda: Policy(promote="cat"), "Policy promote must be a list"),
    (lambda: options().Precision.autocastPolicy([torch.relu]),
     "Precision.autocastPolicy must be a poptorch.autocasting.Policy"),
    (lambda: poptorch.autocast("yes"),
     "poptorch.autocast enabled must be a bool (True or False), got 'yes'"),
    (lambda: Net().autocast(1), "Net.autocast enabled must be a bool"),
])
def test_bad_policies_and_settings_raise(make, message):
    with pytest.raises(poptorch.Error) as raised:
        make()
    assert message in str(raised.value)
