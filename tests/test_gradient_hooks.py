"""Gradient hooks and custom backward functions see each micro-batch's own
gradient, as in plain PyTorch, whatever the replication factor and the
gradient accumulation: hooks on activations (``Tensor.register_hook``,
module backward hooks), hooks on parameters, and ``autograd.Function``s
with vmap rules whose backward is not linear in the incoming gradient."""
import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import assert_same_weights, make_data, options

CLIP = 0.02


def clip(gradient):
    return gradient.clamp(-CLIP, CLIP)


class ClipGradient(torch.autograd.Function):
    """Identity forward; the incoming gradient clipped (not linear)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, gradient):
        return clip(gradient)


class Hooked(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.hidden = torch.nn.Linear(4, 6)
        self.out = torch.nn.Linear(6, 3)
        if kind == "module":
            self.out.register_full_backward_hook(
                lambda module, grad_in, grad_out: (clip(grad_in[0]),))
        if kind == "parameter":
            self.hidden.weight.register_hook(clip)

    def forward(self, x, y):
        h = torch.tanh(self.hidden(x))
        if self.kind == "tensor" and h.requires_grad:
            h.register_hook(clip)
        if self.kind == "function":
            h = ClipGradient.apply(h)
        logits = self.out(h)
        return logits, F.cross_entropy(logits, y)


def _reference_step(model, optimizer, x, y, micro_batches):
    """One plain-PyTorch optimizer step: each micro-batch's backward pass
    starts from its own loss, the gradients' mean is applied."""
    optimizer.zero_grad()
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        model(xs, ys)[1].backward()
    for parameter in model.parameters():
        parameter.grad /= micro_batches
    optimizer.step()


@pytest.mark.parametrize("kind", ["tensor", "module", "parameter",
                                  "function"])
@pytest.mark.parametrize("accumulation,replicas", [(1, 2), (2, 2), (2, 1)])
def test_hooks_apply_to_each_micro_batch(kind, accumulation, replicas):
    torch.manual_seed(0)
    net, twin = Hooked(kind), Hooked(kind)
    twin.load_state_dict(net.state_dict())
    model = poptorch.trainingModel(
        net, options(accumulation=accumulation, replicas=replicas),
        torch.optim.SGD(net.parameters(), lr=0.5))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    micro_batches = accumulation * replicas
    for seed in range(2):
        x, y = make_data(4 * micro_batches, seed=seed)
        model(x, y)
        _reference_step(twin, optimizer, x, y, micro_batches)
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


class _PopTorchOps(torch.nn.Module):
    """PopTorch's identity ops on an activation, which read
    requires_grad themselves."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        h = torch.tanh(self.hidden(x))
        h = poptorch.recomputationCheckpoint(poptorch.nop(
            poptorch.set_available_memory(h, 0.3)))
        logits = self.out(h)
        return logits, F.cross_entropy(logits, y)


def test_poptorch_ops_keep_replicas_vectorised():
    """Their own reads of requires_grad do not send the replicas to the
    sequential path, and the model trains as plain PyTorch."""
    torch.manual_seed(0)
    net, twin = _PopTorchOps(), _PopTorchOps()
    twin.load_state_dict(net.state_dict())
    model = poptorch.trainingModel(net, options(replicas=2),
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    x, y = make_data(8)
    model(x, y)
    _reference_step(twin, optimizer, x, y, 2)
    assert compiled_model(model).engine.replicas.path == "vectorised"
    model.copyWeightsToHost()
    assert_same_weights(net, twin)


class _TwoStages(Hooked):
    """``Hooked`` with its output layer as a second stage."""

    def __init__(self, kind):
        super().__init__(kind)
        poptorch.BeginBlock(self.out, ipu_id=1)


@pytest.mark.parametrize("kind, found", [
    ("tensor", "Tensor.register_hook at File"),
    ("module", "backward hooks of module 'out'"),
    ("parameter", "parameter 'hidden.weight'")])
@pytest.mark.parametrize("strategy", [poptorch.PipelinedExecution,
                                      poptorch.ShardedExecution])
def test_gradient_hooks_in_several_stages_are_refused(kind, found,
                                                      strategy):
    """The stages trained without them, in silence."""
    net = _TwoStages(kind)
    opts = options(accumulation=4).setExecutionStrategy(strategy())
    model = poptorch.trainingModel(net, opts)
    with pytest.raises(poptorch.Error, match=f"runs as several stages.*"
                       f"{found}"):
        model(*make_data(16))


def test_printing_a_gradient_in_several_stages_is_not_refused():
    class Printed(_TwoStages):
        def forward(self, x, y):
            h = poptorch.ipu_print_tensor(torch.tanh(self.hidden(x)), "h")
            logits = self.out(h)
            return logits, F.cross_entropy(logits, y)

    torch.manual_seed(0)
    net = Printed(None)
    model = poptorch.trainingModel(net, options(accumulation=4))
    model(*make_data(16))


@pytest.mark.parametrize("stages", [1, 2])
def test_global_module_hooks_see_the_users_modules_only(stages):
    """A global forward hook (an activation logger that scales every
    module's outputs) runs on the user's modules when the model is
    captured, and never on the compiled step or its stages (it ran on
    them at every call and scaled the step's outputs, which trained
    wrongly)."""
    seen = set()

    def scale(module, args, output):
        seen.add(type(module).__name__)
        return torch.utils._pytree.tree_map(
            lambda t: t * 0.5 if torch.is_floating_point(t) else t, output)

    torch.manual_seed(0)
    net = Hooked(None) if stages == 1 else _TwoStages(None)
    twin = Hooked(None)
    twin.load_state_dict(net.state_dict())
    handle = torch.nn.modules.module.register_module_forward_hook(scale)
    try:
        model = poptorch.trainingModel(net, options(accumulation=4),
                                       torch.optim.SGD(net.parameters(),
                                                       lr=0.5))
        optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
        for seed in range(2):
            x, y = make_data(16, seed=seed)
            model(x, y)
            _reference_step(twin, optimizer, x, y, 4)
        assert "Linear" in seen
        assert not seen & {"GraphModule", "StageModule"}
    finally:
        handle.remove()
    assert_same_weights(net, twin)


def test_post_accumulate_grad_hooks_are_refused():
    """The hook (an optimizer in backward, a gradient zeroed after
    accumulation) was ignored, and the parameter trained without it."""
    net = Hooked(None)
    net.out.weight.register_post_accumulate_grad_hook(
        lambda parameter: parameter.grad.zero_())
    model = poptorch.trainingModel(net, options())
    with pytest.raises(poptorch.Error, match="'out.weight' has a hook "
                       "registered with register_post_accumulate_grad_hook"):
        model(*make_data(4))
