"""Optimizer state types (user guide, "Accumulation types"): as in PopTorch,
``accum_type``, ``velocity_accum_type`` and the first- and second-order
momentum types default to float32 whatever the parameters' dtype, for
poptorch.optim and torch.optim optimizers alike. A float16 model keeps
float32 optimizer state and gradient sums; each update is computed in float32
and rounded to float16.

The float16 models train on two alternating batches, the second one blank in
its right part: there the last layer's weights get exactly zero gradients
every other step, where a float16 second moment that underflowed to zero
would leave ``eps`` alone to divide the first moment (the issue's NaNs).

Weights are compared with plain PyTorch doing the same (float16 forward and
backward, torch.optim updating float32 copies of the weights with float32
state, rounded to float16) at atol=rtol=1e-3: one float16 rounding step of
weights below 1. Resuming is compared bit for bit.
"""
import copy

import pytest
import torch

import poptorch
from conftest import checkpoint, options

P, T = poptorch.optim, torch.optim


class ConvClassifier(torch.nn.Module):
    """A small convolutional classifier (no convolution bias, so a blank
    image region gives exactly zero features)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, bias=False)
        self.fc = torch.nn.Linear(4 * 4 * 4, 2)

    def forward(self, x, y):
        out = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out, torch.nn.functional.cross_entropy(out, y)


def float16_model(seed=0):
    torch.manual_seed(seed)
    return ConvClassifier().half()


def alternating_batches(steps, rows=8, seed=0):
    """``steps`` float16 batches of ``rows`` images, stacked: batch A, then
    batch B whose columns 2 to 5 are blank, and so on."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, 1, 6, 6, generator=generator)
    y = torch.randint(0, 2, (2, rows), generator=generator)
    x[1, ..., 2:] = 0
    repeats = (steps + 1) // 2
    return (x.repeat(repeats, 1, 1, 1, 1)[:steps].flatten(0, 1).half(),
            y.repeat(repeats, 1)[:steps].flatten())


def training_model(module, optimizer, steps):
    """A training model running ``steps`` optimizer steps per call and
    returning every step's loss."""
    opts = options(steps)
    opts.outputMode(poptorch.OutputMode.All)
    return poptorch.trainingModel(module, opts, optimizer)


def state_dtypes(state_dict):
    """The dtypes of the state tensors (step counters excepted) in a state
    dict's ``"state"`` and, when there, its ``"device_state"``."""
    entries = list(state_dict["state"].values())
    entries += state_dict.get("poptorch", {}).get("device_state", {}).values()
    return {value.dtype for entry in entries
            for name, value in entry.items() if name != "step"}


# --- a float16 model trains at the default state types -----------------------

CONVERGING = {
    "sgd-momentum": lambda p: P.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: P.Adam(p, lr=1e-3),
    "adamw": lambda p: P.AdamW(p, lr=1e-3),
    "rmsprop": lambda p: P.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "lamb": lambda p: P.LAMB(p, lr=0.01),
    # the issue: float16 gradient sums, loss scaling, default moment types
    "adamw-float16-accum": lambda p: P.AdamW(p, lr=1e-3,
                                             accum_type=torch.float16,
                                             loss_scaling=1024),
}


@pytest.mark.parametrize("case", CONVERGING)
def test_a_float16_model_converges_with_float32_state(case):
    """40 steps: every loss is finite and batch A's loss falls by 10 % or
    more; the weights stay float16 and all optimizer state is float32."""
    module = float16_model()
    optimizer = CONVERGING[case](module.parameters())
    model = training_model(module, optimizer, 40)
    _, losses = model(*alternating_batches(40))
    assert torch.isfinite(losses).all()
    assert losses[-2] < 0.9 * losses[0]
    assert {p.dtype for p in module.parameters()} == {torch.float16}
    assert state_dtypes(optimizer.state_dict()) == {torch.float32}


# --- the update equals torch.optim's in float32 state ------------------------

def reference_training(module, optimizer, shadows, x, y, steps):
    """Plain PyTorch with PopTorch's state types: the float16 module's
    gradients, an update of its float32 copies ``shadows`` by ``optimizer``
    (float32 state), rounded back into the module."""
    for x_step, y_step in zip(x.chunk(steps), y.chunk(steps)):
        module.zero_grad()
        module(x_step, y_step)[1].backward()
        with torch.no_grad():
            for shadow, param in zip(shadows, module.parameters()):
                shadow.copy_(param.float())
                shadow.grad = param.grad.float()
            optimizer.step()
            for shadow, param in zip(shadows, module.parameters()):
                param.copy_(shadow.half())


PAIRS = {
    "sgd-momentum": (lambda p: P.SGD(p, lr=0.05, momentum=0.9),
                     lambda p: T.SGD(p, lr=0.05, momentum=0.9)),
    "adam": (lambda p: P.Adam(p, lr=1e-3), lambda p: T.Adam(p, lr=1e-3)),
    "adamw": (lambda p: P.AdamW(p, lr=1e-3), lambda p: T.AdamW(p, lr=1e-3)),
    "rmsprop": (lambda p: P.RMSprop(p, lr=1e-3, momentum=0.5),
                lambda p: T.RMSprop(p, lr=1e-3, momentum=0.5)),
    # a torch.optim optimizer gets PopTorch's float32 state too
    "torch-adam": (lambda p: T.Adam(p, lr=1e-3), lambda p: T.Adam(p, lr=1e-3)),
}


@pytest.mark.parametrize("case", PAIRS)
def test_float16_updates_match_torch_with_float32_state(case):
    ours, theirs = PAIRS[case]
    module = float16_model()
    twin = copy.deepcopy(module)
    optimizer = ours(module.parameters())
    model = training_model(module, optimizer, 6)
    x, y = alternating_batches(6)
    model(x, y)
    shadows = [p.detach().float().requires_grad_() for p in twin.parameters()]
    reference_training(twin, theirs(shadows), shadows, x, y, 6)
    for param, expected in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-3, atol=1e-3)
    assert state_dtypes(optimizer.state_dict()) == {torch.float32}


# --- float32 state through state dicts ---------------------------------------

RESUMABLE = {
    "poptorch-adam": lambda p: P.Adam(p, lr=1e-3),
    # torch's load_state_dict casts the state to float16; that is undone
    "torch-adam": lambda p: T.Adam(p, lr=1e-3),
}


@pytest.mark.parametrize("compile_first", [False, True],
                         ids=["load-then-compile", "compile-then-load"])
@pytest.mark.parametrize("case", RESUMABLE)
def test_resuming_a_float16_model_is_bit_identical(case, compile_first):
    """A checkpoint after two calls holds float32 state; a new model and
    optimizer loading it make the third call exactly as the first model."""
    make = RESUMABLE[case]
    x, y = alternating_batches(6)
    calls = list(zip(x.chunk(3), y.chunk(3)))
    module = float16_model()
    optimizer = make(module.parameters())
    model = training_model(module, optimizer, 2)
    model(*calls[0])
    model(*calls[1])
    weights = checkpoint(model.state_dict())
    optimizer_state = checkpoint(optimizer.state_dict())
    assert state_dtypes(optimizer_state) == {torch.float32}
    model(*calls[2])

    resumed_module = float16_model(seed=1)
    resumed_optimizer = make(resumed_module.parameters())
    resumed = training_model(resumed_module, resumed_optimizer, 2)
    if compile_first:
        resumed(*calls[0])
    resumed.load_state_dict(weights)
    resumed_optimizer.load_state_dict(optimizer_state)
    resumed(*calls[2])
    for a, b in zip(module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)


def test_a_torch_optimizer_loaded_before_wrapping_warns_of_its_cast(
        poptorch_log):
    """torch's load_state_dict casts a float32 state to the float16
    parameters' dtype before any training model can undo it: the
    compilation says so (the resumed model trained from the narrowed state
    without a word). Loaded after wrapping, the cast is undone silently."""
    x, y = alternating_batches(4)
    module = float16_model()
    optimizer = T.Adam(module.parameters(), lr=1e-3)
    training_model(module, optimizer, 2)(x, y)
    optimizer_state = checkpoint(optimizer.state_dict())
    for load_first in (False, True):
        resumed_module = float16_model()
        resumed_optimizer = T.Adam(resumed_module.parameters(), lr=1e-3)
        if load_first:
            resumed_optimizer.load_state_dict(optimizer_state)
        resumed = training_model(resumed_module, resumed_optimizer, 2)
        if not load_first:
            resumed_optimizer.load_state_dict(optimizer_state)
        resumed(x, y)
        warned = ("state for torch.float16 parameters is torch.float16"
                  in poptorch_log.text)
        assert warned == load_first


def host_adam_steps(optimizer, params, grads):
    for grad in grads:
        for param, value in zip(params, grad):
            param.grad = value
        optimizer.step()


def test_the_host_step_keeps_float32_state_through_a_state_dict():
    """poptorch.optim's host step() on float16 params keeps float32 state,
    and loading its state dict keeps it float32 (torch's loading would cast
    it to float16): the resumed steps equal the uninterrupted ones."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(5, generator=generator).half()
    grads = [[torch.randn(5, generator=generator).half() * 1e-3]
             for _ in range(3)]
    uninterrupted = [torch.nn.Parameter(start.clone())]
    host_adam_steps(P.Adam(uninterrupted, lr=1e-3), uninterrupted, grads)

    saved = [torch.nn.Parameter(start.clone())]
    saved_optimizer = P.Adam(saved, lr=1e-3)
    host_adam_steps(saved_optimizer, saved, grads[:2])
    state = checkpoint(saved_optimizer.state_dict())
    assert state_dtypes(state) == {torch.float32}
    resumed = [torch.nn.Parameter(saved[0].detach().clone())]
    optimizer = P.Adam(resumed, lr=1e-3)
    optimizer.load_state_dict(state)
    assert optimizer.state[resumed[0]]["exp_avg_sq"].dtype == torch.float32
    host_adam_steps(optimizer, resumed, grads[2:])
    assert torch.equal(uninterrupted[0], resumed[0])


# --- the gradient sum of a float16 model -------------------------------------

def one_accumulated_step(x, y, accum_type=None):
    """A float16 model's weights after one SGD step (lr 1) over 8
    accumulated micro-batches: the default, or ``accum_type`` with the
    Post mean."""
    module = float16_model()
    opts = options(1, 8)
    extra = {}
    if accum_type is not None:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Post)
        extra["accum_type"] = accum_type
    model = poptorch.trainingModel(module, opts, P.SGD(
        module.parameters(), lr=1.0, **extra))
    model(x, y)
    model.copyWeightsToHost()
    return [p.detach().clone() for p in module.parameters()]


def test_a_float16_model_sums_gradients_in_float32_by_default():
    """The default gradient buffer is float32 with the Post mean (the
    default for any buffer but a float16 one), not float16."""
    x, y = alternating_batches(8, rows=2)
    default = one_accumulated_step(x, y)
    in_float32 = one_accumulated_step(x, y, torch.float32)
    in_float16 = one_accumulated_step(x, y, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(default, in_float32))
    assert not all(torch.equal(a, b) for a, b in zip(default, in_float16))


# --- float64 models are never narrowed --------------------------------------

@pytest.mark.parametrize("make_optimizer", [
    lambda params: T.Adam(params, lr=0.01),
    lambda params: P.SGD(params, lr=0.1, momentum=0.9)],
    ids=["torch-Adam", "poptorch-SGD"])
def test_a_float64_model_keeps_float64_state_and_gradients(make_optimizer):
    """float64 params (which IPUs never had) keep float64 state and
    gradient sums: training equals plain PyTorch in float64 (atol 1e-12)."""
    torch.manual_seed(0)
    module = ConvClassifier().double()
    twin = copy.deepcopy(module)
    x, y = alternating_batches(4)
    x = x.double()
    optimizer = make_optimizer(module.parameters())
    opts = options(2, accumulation=2)
    poptorch.trainingModel(module, opts, optimizer)(x, y)
    reference = make_optimizer(twin.parameters())
    for step in range(2):
        reference.zero_grad()
        for micro in (2 * step, 2 * step + 1):
            rows = slice(8 * micro, 8 * micro + 8)
            (twin(x[rows], y[rows])[1] / 2).backward()
        reference.step()
    for mine, theirs in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=0)
    assert state_dtypes(optimizer.state_dict()) == {torch.float64}
