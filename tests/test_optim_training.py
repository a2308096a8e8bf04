"""PopTorch optimizer semantics inside training models (user guide,
"Optimizers"): every supported optimizer trained through trainingModel
against its torch counterpart, accumulation types and mean reduction
strategies, optimizer state in and out, variable and constant attributes,
automatic loss scaling, the optimizer state location, and bad input.

Weights are compared in fp32 with atol=1e-5 and rtol=1e-5 after 10 calls of
D = 2 steps (values of order 1; the captured update and torch.optim differ
only by float32 rounding, which accumulates over 20 steps) unless a test says
otherwise; resuming from state dicts is compared bit for bit. The parity
models use tanh (``SmoothMLP``): with ReLU, rounding differences of 1e-7 can
flip a unit across its kink after a few calls and make any comparison
meaningless. The parity matrix with gradient accumulation (G = 2) is marked
slow; G = 1 runs by default.
"""
import copy
import dataclasses
import io
import logging
import re

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (ClassifierMLP, assert_same_weights, checkpoint,
                      make_data, options, reference_training)
from poptorch._impl.optimizers import loss_scaling

ATOL = 1e-5
CALLS = 10


def train_both(model, twin, reference, device_iterations=2, accumulation=1,
               replicas=1, calls=CALLS, clip=None):
    """Run ``calls`` calls of ``model`` and the same steps of plain PyTorch
    on ``twin`` with ``reference`` (clipping gradients to ``clip``)."""
    rows = 2 * device_iterations * accumulation * replicas
    for call in range(calls):
        x, y = make_data(rows, seed=call)
        model(x, y)
        if clip is None:
            reference_training(twin, reference, (x, y), device_iterations,
                               accumulation, replicas)
        else:
            clipped_reference(twin, reference, (x, y), device_iterations,
                              accumulation, clip)


def clipped_reference(module, optimizer, inputs, device_iterations,
                      accumulation, clip):
    """``reference_training`` with ``clip_grad_norm_`` before each step."""
    splits = [t.unflatten(0, (device_iterations, accumulation, -1))
              for t in inputs]
    for d in range(device_iterations):
        optimizer.zero_grad()
        for g in range(accumulation):
            _, loss = module(*[s[d, g] for s in splits])
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()


class SmoothMLP(ClassifierMLP):
    """``ClassifierMLP`` with tanh: no ReLU kink for float32 rounding
    differences to flip over, so that long runs stay comparable."""

    def forward(self, x, y=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, self.loss(out, y)


def fresh_mlp(seed=0):
    torch.manual_seed(seed)
    return SmoothMLP()


@pytest.fixture
def pair():
    """Two identical smooth MLPs: the trained one and the reference."""
    return fresh_mlp(), fresh_mlp()


def snapshot(model):
    """Copies of the model's device weights and optimizer device state."""
    weights = [p.clone() for p in compiled_model(model).state.params]
    state = [t.clone() for t in compiled_model(model).state.optimizer]
    return weights, state


def assert_snapshot_equal(model, before):
    weights, state = snapshot(model)
    assert all(torch.equal(a, b) for a, b in zip(weights, before[0]))
    assert len(state) == len(before[1])
    assert all(torch.equal(a, b) for a, b in zip(state, before[1]))


# --- 1. every optimizer against its torch counterpart ------------------------

P = poptorch.optim
T = torch.optim
def _optimum_lamb(params):
    """Optimum Graphcore's LAMB recipe: the biases in a param group with
    max_weight_norm 0 (no layer-wise adaptation) and no weight decay,
    max_weight_norm a constant attribute."""
    params = list(params)
    optimizer = P.LAMB(
        [{"params": [p for p in params if p.dim() > 1],
          "weight_decay": 0.01},
         {"params": [p for p in params if p.dim() == 1],
          "weight_decay": 0.0, "max_weight_norm": 0.0}],
        lr=0.01, max_weight_norm=None, bias_correction=True)
    optimizer.variable_attrs.markAsConstant("max_weight_norm")
    return optimizer


PARITY = {
    "torch-sgd": (lambda p: T.SGD(p, lr=0.1), lambda p: T.SGD(p, lr=0.1)),
    "torch-sgd-momentum-wd": (
        lambda p: T.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01,
                        nesterov=True),
        lambda p: T.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01,
                        nesterov=True)),
    "torch-adam": (lambda p: T.Adam(p, lr=0.01, weight_decay=0.01),
                   lambda p: T.Adam(p, lr=0.01, weight_decay=0.01)),
    "torch-adamw": (lambda p: T.AdamW(p, lr=0.01),
                    lambda p: T.AdamW(p, lr=0.01)),
    # A non-default eps is a variable attribute (a runtime input).
    "torch-adam-eps": (lambda p: T.Adam(p, lr=0.01, eps=1e-6),
                       lambda p: T.Adam(p, lr=0.01, eps=1e-6)),
    "torch-rmsprop": (
        lambda p: T.RMSprop(p, lr=0.01, momentum=0.5, weight_decay=0.01),
        lambda p: T.RMSprop(p, lr=0.01, momentum=0.5, weight_decay=0.01)),
    "sgd": (lambda p: P.SGD(p, lr=0.1), lambda p: T.SGD(p, lr=0.1)),
    "sgd-separate-momentum-wd-ls": (
        lambda p: P.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                        weight_decay=0.01, loss_scaling=1024.0),
        lambda p: T.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                        weight_decay=0.01)),
    "sgd-combined-momentum-wd-ls": (
        lambda p: P.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01,
                        use_combined_accum=True, velocity_scaling=64.0,
                        loss_scaling=256.0),
        lambda p: T.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (lambda p: P.Adam(p, lr=0.01), lambda p: T.Adam(p, lr=0.01)),
    "adam-wd-eps-ls": (
        lambda p: P.Adam(p, lr=0.01, weight_decay=0.01, eps=1e-6,
                         loss_scaling=512.0),
        lambda p: T.Adam(p, lr=0.01, weight_decay=0.01, eps=1e-6)),
    "adamw-wd-ls": (
        lambda p: P.AdamW(p, lr=0.01, weight_decay=0.05, loss_scaling=128.0),
        lambda p: T.AdamW(p, lr=0.01, weight_decay=0.05)),
    "rmsprop": (lambda p: P.RMSprop(p, lr=0.01),
                lambda p: T.RMSprop(p, lr=0.01)),
    "rmsprop-momentum-wd-ls": (
        lambda p: P.RMSprop(p, lr=0.01, momentum=0.5, centered=True,
                            weight_decay=0.01, eps=1e-6, loss_scaling=64.0),
        lambda p: T.RMSprop(p, lr=0.01, momentum=0.5, centered=True,
                            weight_decay=0.01, eps=1e-6)),
    # LAMB has no torch.optim counterpart: the reference is LAMB.step() on
    # the host (loss_scaling has no effect there).
    "lamb-wd-eps-ls": (
        lambda p: P.LAMB(p, lr=0.01, weight_decay=0.01, eps=1e-6,
                         loss_scaling=32.0),
        lambda p: P.LAMB(p, lr=0.01, weight_decay=0.01, eps=1e-6)),
    "lamb-bias-correction-max-norm": (
        lambda p: P.LAMB(p, lr=0.01, bias_correction=True,
                         max_weight_norm=1.0),
        lambda p: P.LAMB(p, lr=0.01, bias_correction=True,
                         max_weight_norm=1.0)),
    "lamb-optimum-groups": (_optimum_lamb, _optimum_lamb),
}


@pytest.mark.parametrize("accumulation", [
    1, pytest.param(2, marks=pytest.mark.slow)], ids=["G1", "G2"])
@pytest.mark.parametrize("case", PARITY)
def test_optimizer_trains_like_its_torch_counterpart(case, accumulation):
    ours, theirs = PARITY[case]
    module, twin = fresh_mlp(), fresh_mlp()
    model = poptorch.trainingModel(module, options(2, accumulation),
                                   ours(module.parameters()))
    train_both(model, twin, theirs(twin.parameters()),
               accumulation=accumulation)
    assert_same_weights(module, twin, atol=ATOL)


def test_optimum_lamb_recipe_trains_the_biases(pair):
    """max_weight_norm 0 in the biases' param group turns LAMB's layer-wise
    adaptation off (a trust ratio of 1, as where the clamped weight norm
    is 0) rather than freezing the biases: after one call each bias moved
    by lr times its first Adam step, whose entries are +-1 (the
    bias-corrected m_hat / sqrt(v_hat) of one gradient, less eps)."""
    module, _ = pair
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    opts = poptorch.Options()
    model = poptorch.trainingModel(module, opts,
                                   _optimum_lamb(module.parameters()))
    model(*make_data(2, seed=0))
    for name, param in module.named_parameters():
        if param.dim() == 1:
            step = (before[name] - param.detach()).abs()
            torch.testing.assert_close(step, torch.full_like(step, 0.01),
                                       atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("ours,theirs", [
    (lambda p: P.SGD(p, lr=0.1, momentum=0.9, max_grad_norm=0.05),
     lambda p: T.SGD(p, lr=0.1, momentum=0.9)),
    (lambda p: P.Adam(p, lr=0.01, max_grad_norm=0.05, loss_scaling=8.0),
     lambda p: T.Adam(p, lr=0.01)),
], ids=["sgd", "adam"])
def test_max_grad_norm_clips_like_clip_grad_norm(ours, theirs):
    module, twin = fresh_mlp(), fresh_mlp()
    model = poptorch.trainingModel(module, options(2, 2),
                                   ours(module.parameters()))
    train_both(model, twin, theirs(twin.parameters()), accumulation=2,
               clip=0.05)
    assert_same_weights(module, twin, atol=ATOL)


# --- 2. accumulation types and mean reduction strategies ---------------------

class Regression(torch.nn.Module):
    """A linear layer with a squared-error loss whose gradients are of order
    ``scale`` (so that float16 buffers show their rounding)."""

    def __init__(self, features=64, outputs=16):
        super().__init__()
        self.fc = torch.nn.Linear(features, outputs)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y, reduction="sum")


def regression_data(rows, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, 64, generator=generator) * scale
    y = torch.rand(rows, 16, generator=generator) - 10.0
    return x, y


def micro_batch_gradients(module, x, y, micro_batches, dtype=torch.float32):
    """Each micro-batch's gradients of the module's parameters."""
    copy_ = copy.deepcopy(module).to(dtype)
    grads = []
    for xs, ys in zip(x.to(dtype).chunk(micro_batches),
                      y.to(dtype).chunk(micro_batches)):
        copy_.zero_grad()
        copy_(xs, ys)[1].backward()
        grads.append([p.grad.clone() for p in copy_.parameters()])
    return grads


def emulated_buffer(grads, strategy, dtype):
    """The spec's running buffer in ``dtype``, then the mean it gives."""
    buffers = [torch.zeros_like(g, dtype=dtype) for g in grads[0]]
    for k, step in enumerate(grads, start=1):
        for buffer, grad in zip(buffers, step):
            if strategy == poptorch.MeanReductionStrategy.Running:
                buffer += (grad.to(dtype) - buffer) / k
            else:
                buffer += grad.to(dtype)
    if strategy == poptorch.MeanReductionStrategy.Post:
        buffers = [b / len(grads) for b in buffers]
    return buffers


def one_sgd_step(module, strategy, accum_type, micro_batches, x, y,
                 loss_scaling=None):
    """The weight change of one optimizer step (SGD, lr 1) over
    ``micro_batches`` accumulated micro-batches: minus the reduced mean
    gradient."""
    before = [p.detach().clone() for p in module.parameters()]
    opts = options(1, micro_batches)
    if strategy is not None:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            strategy)
    extra = {} if loss_scaling is None else {"loss_scaling": loss_scaling}
    model = poptorch.trainingModel(module, opts, P.SGD(
        module.parameters(), lr=1.0, accum_type=accum_type, **extra))
    model(x, y)
    model.copyWeightsToHost()
    return [b - p.detach() for b, p in zip(before, module.parameters())]


STRATEGIES = [poptorch.MeanReductionStrategy.Post,
              poptorch.MeanReductionStrategy.Running]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_float16_accum_type_keeps_the_buffer_in_float16(strategy):
    torch.manual_seed(0)
    module = Regression()
    x, y = regression_data(8 * 4)
    grads = micro_batch_gradients(module, x, y, 8)
    expected = [b.float() for b in
                emulated_buffer(grads, strategy, torch.float16)]
    change = one_sgd_step(copy.deepcopy(module), strategy, torch.float16, 8,
                          x, y)
    for actual, wanted in zip(change, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-6)
    in_fp32 = emulated_buffer(grads, strategy, torch.float32)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(change, in_fp32))


def float16_errors(loss_scaling):
    """Per strategy, the distance of one float16-accumulated SGD step over
    32 micro-batches from the float64 mean gradient, and that gradient's
    norm."""
    torch.manual_seed(0)
    module = Regression()
    x, y = regression_data(32 * 2)
    exact = [sum(step[i] for step in micro_batch_gradients(
        module, x, y, 32, torch.float64)) / 32 for i in range(2)]
    errors = {}
    for strategy in STRATEGIES:
        change = one_sgd_step(copy.deepcopy(module), strategy, torch.float16,
                              32, x, y, loss_scaling=loss_scaling)
        errors[strategy] = sum(float((c.double() - e).norm())
                               for c, e in zip(change, exact))
    return errors, sum(float(e.norm()) for e in exact)


def test_running_mean_is_closer_to_float64_where_post_overflows():
    """Loss scaling 64 puts each micro-batch's gradients near 2500 (fine in
    float16); Post's float16 sum of 32 of them passes 65504 and becomes
    inf, while Running's buffer stays at the mean."""
    errors, norm = float16_errors(loss_scaling=64.0)
    assert errors[poptorch.MeanReductionStrategy.Post] == float("inf")
    assert errors[poptorch.MeanReductionStrategy.Running] < 2e-3 * norm


def test_strategies_round_alike_in_float16_without_overflow():
    """Without overflow both strategies round at the scale of the mean
    (Post's sum is k times larger but is divided by k): their errors are
    float16-sized and within a factor of two of each other."""
    errors, norm = float16_errors(loss_scaling=1.0)
    post = errors[poptorch.MeanReductionStrategy.Post]
    running = errors[poptorch.MeanReductionStrategy.Running]
    assert 1e-5 * norm < post < 2e-3 * norm
    assert 1e-5 * norm < running < 2e-3 * norm
    assert 0.5 < running / post < 2.0


@pytest.mark.parametrize("strategy", list(poptorch.MeanReductionStrategy),
                         ids=lambda s: s.name)
def test_every_strategy_equals_the_reference_in_float32(strategy):
    module, twin = fresh_mlp(), fresh_mlp()
    opts = options(2, 2, 2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    model = poptorch.trainingModel(module, opts, T.SGD(
        module.parameters(), lr=0.1, momentum=0.9))
    train_both(model, twin, T.SGD(twin.parameters(), lr=0.1, momentum=0.9),
               accumulation=2, replicas=2, calls=3)
    assert_same_weights(module, twin, atol=1e-6)


@pytest.mark.parametrize("accum_type,expected", [
    (torch.float16, poptorch.MeanReductionStrategy.Running),
    (torch.float32, poptorch.MeanReductionStrategy.Post),
    (None, poptorch.MeanReductionStrategy.Post)])
def test_default_strategy_follows_accum_type(accum_type, expected):
    torch.manual_seed(0)
    module = Regression()
    x, y = regression_data(8 * 4)
    default = one_sgd_step(copy.deepcopy(module), None, accum_type, 8, x, y)
    explicit = one_sgd_step(copy.deepcopy(module), expected, accum_type, 8,
                            x, y)
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))


def test_post_and_loss_is_deprecated(poptorch_log, mlp):
    opts = options(1, 2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.PostAndLoss)
    poptorch.trainingModel(mlp, opts)(*make_data(4))
    assert any("PostAndLoss is deprecated" in r.getMessage()
               for r in poptorch_log.records)


# --- 3. optimizer state in and out --------------------------------------------

RESUMABLE = {
    "sgd-momentum": lambda p: P.SGD(p, lr=0.05, momentum=0.9,
                                    dampening=0.1, weight_decay=0.01),
    "sgd-combined": lambda p: P.SGD(p, lr=0.05, momentum=0.9,
                                    use_combined_accum=True,
                                    velocity_scaling=32.0),
    "adam": lambda p: P.Adam(p, lr=0.01, weight_decay=0.01,
                             first_order_momentum_accum_type=torch.float16),
    # torch's own state dict, through its state dict hooks
    "torch-adam": lambda p: T.Adam(p, lr=0.01, weight_decay=0.01),
}


def run_calls(model, first, count, rows=8):
    for call in range(first, first + count):
        model(*make_data(rows, seed=call))


def trained_mlp(make, opts, calls, rows=8):
    """A fresh MLP, its optimizer (``make``) and its training model, after
    ``calls`` calls of ``rows`` rows."""
    module = fresh_mlp()
    optimizer = make(module.parameters())
    model = poptorch.trainingModel(module, opts, optimizer)
    run_calls(model, 0, calls, rows)
    return module, optimizer, model


def momentum_sgd(params):
    return P.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("compile_first", [False, True],
                         ids=["load-then-compile", "compile-then-load"])
@pytest.mark.parametrize("case", RESUMABLE)
def test_resuming_from_state_dicts_is_bit_identical(case, compile_first):
    make = RESUMABLE[case]
    opts = options(2, 2)
    uninterrupted, _, _ = trained_mlp(make, opts, 3)
    _, saved_optimizer, saved = trained_mlp(make, opts, 2)
    weights = checkpoint(saved.state_dict())
    optimizer_state = checkpoint(saved_optimizer.state_dict())

    resumed_module = fresh_mlp(seed=1)
    optimizer = make(resumed_module.parameters())
    resumed = poptorch.trainingModel(resumed_module, opts, optimizer)
    if compile_first:
        run_calls(resumed, 10, 1)
    resumed.load_state_dict(weights)
    optimizer.load_state_dict(optimizer_state)
    run_calls(resumed, 2, 1)
    for a, b in zip(uninterrupted.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)


def _through_pickle(value):
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return torch.load(stream, weights_only=False)


def _wrapper_copy(model, optimizer, opts):
    """``torch.save`` of the training model, loaded: its module, and
    itself to train on."""
    copied = _through_pickle(model)
    return copied.model, copied


def _optimizer_copy(model, optimizer, opts):
    """A deepcopy of the module and of the optimizer (its parameters
    mapped onto the module's copies), wrapped in a new training model."""
    module, optimizer = copy.deepcopy((model.model, optimizer))
    return module, poptorch.trainingModel(module, opts, optimizer)


@pytest.mark.parametrize("copied", [_wrapper_copy, _optimizer_copy],
                         ids=["save-the-training-model", "deepcopy"])
@pytest.mark.parametrize("case", RESUMABLE)
def test_copies_of_a_trained_optimizer_hold_its_state(case, copied):
    """pickle and deepcopy keep the optimizer state the training model has
    (its momentum was lost, or an old state_dict()'s kept: a state dict
    read after the first call here), and a model trained from the copy
    goes on like the original."""
    make = RESUMABLE[case]
    opts = options(2, 2)
    uninterrupted, _, _ = trained_mlp(make, opts, 4)
    _, optimizer, model = trained_mlp(make, opts, 1)
    optimizer.state_dict()
    run_calls(model, 1, 1)
    module, resumed = copied(model, optimizer, opts)
    run_calls(resumed, 2, 2)
    for a, b in zip(uninterrupted.parameters(), module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", RESUMABLE)
def test_set_optimizer_with_a_loaded_new_optimizer_rolls_back(case):
    """Rolling back to a checkpoint with a new optimizer loading its state
    dict, given to the compiled model by setOptimizer: the next call goes on
    from the checkpoint's state (the device kept its own before)."""
    make = RESUMABLE[case]
    opts = options(2, 2)
    uninterrupted, _, _ = trained_mlp(make, opts, 3)
    rolled_back, optimizer, model = trained_mlp(make, opts, 2)
    weights = checkpoint(model.state_dict())
    optimizer_state = checkpoint(optimizer.state_dict())
    run_calls(model, 5, 2)
    new_optimizer = make(rolled_back.parameters())
    new_optimizer.load_state_dict(optimizer_state)
    model.load_state_dict(weights)
    model.setOptimizer(new_optimizer)
    run_calls(model, 2, 1)
    for a, b in zip(uninterrupted.parameters(), rolled_back.parameters()):
        assert torch.equal(a, b)


def test_set_optimizer_with_a_fresh_optimizer_keeps_the_device_state():
    """A new optimizer without a state of its own changes the
    hyper-parameters only (as in PopTorch): the momentum carries on."""
    uninterrupted, _, _ = trained_mlp(momentum_sgd, options(2), 3, rows=4)
    swapped, _, model = trained_mlp(momentum_sgd, options(2), 2, rows=4)
    model.setOptimizer(momentum_sgd(swapped.parameters()))
    run_calls(model, 2, 1, rows=4)
    for a, b in zip(uninterrupted.parameters(), swapped.parameters()):
        assert torch.equal(a, b)


def assert_same_torch_state(ours, theirs):
    """Two state dicts' ``"state"`` entries hold the same parameters, keys
    and values (atol ``ATOL``)."""
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(ours["state"][index][name], value,
                                       atol=ATOL, rtol=1e-5)


def test_a_torch_optimizer_state_dict_holds_the_device_state(pair):
    """A torch.optim optimizer trained by a model returns torch's own state
    dict, with the state the device holds: equal to torch's Adam after the
    same steps (atol 1e-5)."""
    mlp, twin = pair
    optimizer = T.AdamW(mlp.parameters(), lr=0.01)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = T.AdamW(twin.parameters(), lr=0.01)
    train_both(model, twin, reference, calls=2)
    ours, theirs = optimizer.state_dict(), reference.state_dict()
    assert set(ours) == {"state", "param_groups"}
    assert_same_torch_state(ours, theirs)


@pytest.mark.parametrize("make", [
    lambda p: T.Adam(p, lr=0.01), lambda p: P.Adam(p, lr=0.01),
    lambda p: P.SGD(p, lr=0.05, momentum=0.9)],
    ids=["torch-adam", "adam", "sgd-momentum"])
def test_host_steps_after_training_calls_go_on_from_the_device_state(
        pair, make):
    """A run finished on the host with the same optimizer, without
    destroy(): the host steps start from the trained state (Adam restarted
    from zero) and state_dict() shows the host's steps (it showed the
    device's older state)."""
    mlp, twin = pair
    optimizer = make(mlp.parameters())
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = make(twin.parameters())
    train_both(model, twin, reference, calls=1)
    for call in range(1, 3):
        data = make_data(2, seed=call)
        for net, stepped in ((mlp, optimizer), (twin, reference)):
            stepped.zero_grad()
            net(*data)[1].backward()
            stepped.step()
    assert_same_weights(mlp, twin, atol=ATOL)
    assert_same_torch_state(optimizer.state_dict(), reference.state_dict())


def test_state_dict_is_torch_format_with_device_extras(pair):
    mlp, twin = pair
    optimizer = P.Adam(mlp.parameters(), lr=0.01)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = T.Adam(twin.parameters(), lr=0.01)
    train_both(model, twin, reference, calls=3)
    ours, theirs = optimizer.state_dict(), reference.state_dict()
    assert set(ours) == {"state", "param_groups", "poptorch"}
    assert_same_torch_state(ours, theirs)
    extras = ours["poptorch"]
    assert extras["version"] == 1 and extras["loss_scale"] is None
    assert set(extras["device_state"][0]) == {"exp_avg", "exp_avg_sq", "step"}
    assert int(extras["device_state"][0]["step"]) == 6
    param = next(mlp.parameters())
    assert torch.equal(optimizer.state[param]["exp_avg"],
                       ours["state"][0]["exp_avg"])


def test_destroy_keeps_the_optimizer_state_for_the_next_compilation():
    uninterrupted, _, _ = trained_mlp(momentum_sgd, options(2), 3, rows=4)
    destroyed_module, _, destroyed = trained_mlp(momentum_sgd, options(2), 2,
                                                 rows=4)
    destroyed.destroy()
    run_calls(destroyed, 2, 1, rows=4)
    for a, b in zip(uninterrupted.parameters(), destroyed_module.parameters()):
        assert torch.equal(a, b)


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.Adam(params, lr=0.01),
    lambda params: P.SGD(params, lr=0.05, momentum=0.9)],
    ids=["torch-adam", "poptorch-sgd"])
def test_a_new_training_model_goes_on_from_its_optimizer_state(
        make_optimizer):
    """A program wrapping a new training model around the same optimizer
    every epoch (a GAN's loss modules made anew) trains as one model: the
    new model starts from the state the previous one left."""
    uninterrupted = fresh_mlp()
    run_calls(poptorch.trainingModel(uninterrupted, options(2), make_optimizer(
        uninterrupted.parameters())), 0, 3, rows=4)
    rewrapped = fresh_mlp()
    optimizer = make_optimizer(rewrapped.parameters())
    for epoch in range(3):
        model = poptorch.trainingModel(_Wrapper(rewrapped), options(2),
                                       optimizer)
        run_calls(model, epoch, 1, rows=4)
    for a, b in zip(uninterrupted.parameters(), rewrapped.parameters()):
        assert torch.equal(a, b)


@pytest.fixture
def trained_adam():
    module = fresh_mlp()
    optimizer = P.Adam(module.parameters(), lr=0.01)
    model = poptorch.trainingModel(module, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    return model, optimizer


def test_loading_a_torch_optim_state_dict_is_an_error(trained_adam):
    model, optimizer = trained_adam
    torch_state = T.Adam(model.model.parameters(), lr=0.5).state_dict()
    before = snapshot(model)
    with pytest.raises(poptorch.Error, match="no 'poptorch' entry"):
        optimizer.load_state_dict(torch_state)
    assert_snapshot_equal(model, before)
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_loading_a_torch_optim_state_dict_before_compiling_is_an_error(mlp):
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    poptorch.trainingModel(mlp, options(), optimizer)
    with pytest.raises(poptorch.Error, match="torch.optim state dict"):
        optimizer.load_state_dict(
            T.SGD(mlp.parameters(), lr=0.1, momentum=0.9).state_dict())


def test_unattached_poptorch_optimizer_refuses_torch_state_dicts(mlp):
    """As the spec's note says, and at once: loading it would leave param
    groups without the poptorch optimizer's own settings, which wrapping
    the optimizer later fails on."""
    reference = T.SGD(mlp.parameters(), lr=0.3, momentum=0.9)
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(poptorch.Error, match="not one from native PyTorch"):
        optimizer.load_state_dict(reference.state_dict())
    assert optimizer.param_groups[0]["lr"] == 0.1
    poptorch.trainingModel(mlp, options(2), optimizer)


class Wider(ClassifierMLP):
    def __init__(self):
        super().__init__(hidden=9)


@pytest.mark.parametrize("other", [
    Wider, lambda: torch.nn.Linear(4, 3)], ids=["shapes", "param-count"])
def test_state_dict_from_a_different_model_is_an_error(trained_adam, other):
    model, optimizer = trained_adam
    torch.manual_seed(1)
    module = other()
    if isinstance(module, ClassifierMLP):
        other_optimizer = P.Adam(module.parameters(), lr=0.01)
        other_model = poptorch.trainingModel(module, options(2),
                                             other_optimizer)
        run_calls(other_model, 0, 1, rows=4)
    else:
        other_optimizer = P.Adam(module.parameters(), lr=0.01)
    before = snapshot(model)
    with pytest.raises(poptorch.Error, match="different model"):
        optimizer.load_state_dict(other_optimizer.state_dict())
    assert_snapshot_equal(model, before)


def test_state_dict_changing_a_constant_is_refused_and_rolled_back(
        trained_adam):
    model, optimizer = trained_adam
    state = copy.deepcopy(optimizer.state_dict())
    state["param_groups"][0]["weight_decay"] = 0.5
    state["param_groups"][0]["lr"] = 0.5
    before = snapshot(model)
    with pytest.raises(poptorch.Error, match="weight_decay"):
        optimizer.load_state_dict(state)
    assert_snapshot_equal(model, before)
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert optimizer.param_groups[0]["weight_decay"] == 0.0


def test_state_dict_of_another_optimizer_type_is_an_error(trained_adam):
    model, optimizer = trained_adam
    module = fresh_mlp()
    sgd = P.SGD(module.parameters(), lr=0.1, momentum=0.9)
    run_calls(poptorch.trainingModel(module, options(2), sgd), 0, 1, rows=4)
    state = sgd.state_dict()
    state["param_groups"] = optimizer.state_dict()["param_groups"]
    before = snapshot(model)
    with pytest.raises(poptorch.Error, match="different optimizer"):
        optimizer.load_state_dict(state)
    assert_snapshot_equal(model, before)


# --- 4. setOptimizer: variable and constant attributes -------------------------

def test_variable_attributes_take_effect_without_recompiling(pair):
    mlp, twin = pair
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9,
                      loss_scaling=8.0, max_grad_norm=0.05)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = T.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    train_both(model, twin, reference, calls=2, clip=0.05)
    steps = compiled_model(model).session.steps
    optimizer.param_groups[0]["momentum"] = 0.5
    optimizer.loss_scaling = 32.0
    optimizer.max_grad_norm = 0.2
    model.setOptimizer(optimizer)
    reference.param_groups[0]["momentum"] = 0.5
    train_both(model, twin, reference, calls=2, clip=0.2)
    assert compiled_model(model).session.steps is steps
    assert model.current_loss_scale == 32.0
    assert_same_weights(mlp, twin, atol=ATOL)


def test_loss_scaling_passed_to_the_constructor_is_a_runtime_input(mlp):
    optimizer = P.SGD(mlp.parameters(), lr=0.1, loss_scaling=8.0)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    model(*make_data(4))
    code = compiled_model(model).session.graphs["update"].code
    assert "8.0" not in code
    optimizer.loss_scaling = 16.0
    model.setOptimizer(optimizer)
    assert model.current_loss_scale == 16.0


@pytest.mark.parametrize("change,name", [
    (lambda o: o.param_groups[0].update(weight_decay=0.1), "weight_decay"),
    (lambda o: setattr(o, "loss_scaling", 4.0), "loss_scaling"),
    (lambda o: setattr(o, "max_grad_norm", 1.0), "max_grad_norm"),
    (lambda o: o.param_groups[0].update(nesterov=True), "nesterov"),
])
def test_changing_a_constant_attribute_is_an_error(mlp, change, name):
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    before = snapshot(model)
    change(optimizer)
    with pytest.raises(poptorch.Error, match=name):
        model.setOptimizer(optimizer)
    assert_snapshot_equal(model, before)


@pytest.mark.parametrize("make, change, message", [
    (lambda params: P.SGD(params, lr=0.1, momentum=0.5, nesterov=False),
     lambda o: o.param_groups[0].update(nesterov=True),
     "setOptimizer: nesterov, which choose(s) the update rule"),
    (lambda params: P.RMSprop(params, lr=0.1, centered=False),
     lambda o: o.param_groups[0].update(centered=True),
     "setOptimizer: centered, which choose(s) the update rule"),
    (lambda params: P.Adam(params, lr=0.1),
     lambda o: setattr(o, "loss_scaling", 4.0),
     "compile-time constant(s) loss_scaling changed"),
])
def test_a_changed_setting_is_named_once(mlp, make, change, message):
    """Settings given to the constructor that choose the update rule
    (nesterov, centered) are named, as constants are, and named once."""
    optimizer = make(mlp.parameters())
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    change(optimizer)
    with pytest.raises(poptorch.Error, match=re.escape(message)):
        model.setOptimizer(optimizer)


def test_another_optimizer_family_is_an_error_naming_both(mlp):
    model = poptorch.trainingModel(
        mlp, options(2), torch.optim.SGD(mlp.parameters(), lr=0.1))
    run_calls(model, 0, 1, rows=4)
    before = snapshot(model)
    with pytest.raises(poptorch.Error, match=r"optimizer family changed "
                       r"after the model was compiled \(SGD at compilation, "
                       r"now Adam\)"):
        model.setOptimizer(torch.optim.Adam(mlp.parameters()))
    assert_snapshot_equal(model, before)


def test_sgd_momentum_leaving_zero_is_an_error_saying_why(mlp):
    """Compiled with momentum 0, SGD is the simple variant: no velocity to
    give a new momentum."""
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.0)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    before = snapshot(model)
    optimizer.param_groups[0]["momentum"] = 0.9
    with pytest.raises(poptorch.Error, match=r"param group 0's SGD momentum "
                       r"changed from 0.0 to 0.9 .* keeps no velocity"):
        model.setOptimizer(optimizer)
    assert_snapshot_equal(model, before)


def test_mark_as_variable_before_compiling_makes_it_changeable(pair):
    mlp, twin = pair
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    optimizer.variable_attrs.markAsVariable("weight_decay")
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = T.SGD(twin.parameters(), lr=0.1, momentum=0.9,
                      weight_decay=0.0)
    train_both(model, twin, reference, calls=1)
    optimizer.param_groups[0]["weight_decay"] = 0.1
    model.setOptimizer(optimizer)
    reference.param_groups[0]["weight_decay"] = 0.1
    train_both(model, twin, reference, calls=1)
    assert_same_weights(mlp, twin, atol=ATOL)


def test_mark_as_constant_makes_a_passed_attribute_fixed(mlp):
    optimizer = P.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    optimizer.variable_attrs.markAsConstant("momentum")
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    optimizer.param_groups[0]["momentum"] = 0.5
    with pytest.raises(poptorch.Error, match="momentum"):
        model.setOptimizer(optimizer)


def test_unexpected_attributes_are_warned_about_once(poptorch_log, mlp):
    optimizer = P.SGD(mlp.parameters(), lr=0.1)
    model = poptorch.trainingModel(mlp, options(), optimizer)
    optimizer.param_groups[0]["my_setting"] = 3
    optimizer.param_groups[0]["initial_lr"] = 0.1
    model.setOptimizer(optimizer)
    model.setOptimizer(optimizer)
    records = [r for r in poptorch_log.records
               if "unexpected attribute" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "my_setting" in records[0].getMessage()
    assert "initial_lr" not in records[0].getMessage()


def test_relaxed_attribute_checks_log_at_debug(poptorch_log, mlp):
    poptorch_log.set_level(logging.DEBUG, logger="poptorch")
    optimizer = P.SGD(mlp.parameters(), lr=0.1)
    model = poptorch.trainingModel(
        mlp, options().relaxOptimizerAttributesChecks(), optimizer)
    optimizer.param_groups[0]["my_setting"] = 3
    model.setOptimizer(optimizer)
    records = [r for r in poptorch_log.records
               if "unexpected attribute" in r.getMessage()]
    assert records and all(r.levelno == logging.DEBUG for r in records)


# --- 5. automatic loss scaling -------------------------------------------------

def automatic_options(device_iterations=1):
    opts = options(device_iterations)
    opts.Training.setAutomaticLossScaling(True)
    return opts


def test_automatic_loss_scaling_starts_from_loss_scaling_or_default(mlp):
    with_value = poptorch.trainingModel(
        mlp, automatic_options(), P.SGD(mlp.parameters(), lr=0.1,
                                        loss_scaling=128.0))
    assert with_value.current_loss_scale == 128.0
    with_value.destroy()
    default = poptorch.trainingModel(mlp, automatic_options(),
                                     T.SGD(mlp.parameters(), lr=0.1))
    assert default.current_loss_scale == loss_scaling.SETTINGS.initial_scale


def test_overflowing_step_is_skipped_and_the_scale_backs_off():
    module = fresh_mlp().half()
    optimizer = P.SGD(module.parameters(), lr=0.1, momentum=0.9,
                      loss_scaling=2.0 ** 40)
    model = poptorch.trainingModel(module, automatic_options(), optimizer)
    initial = [p.detach().clone() for p in module.parameters()]
    x, y = make_data(2)
    model(x.half(), y)
    assert all(torch.equal(a, b) for a, b in zip(initial,
                                                 module.parameters()))
    assert optimizer.state_dict()["state"] == {}
    assert model.current_loss_scale == 2.0 ** 39


def reference_automatic_scaling(module, inputs, scale, lr, steps,
                                growth_interval):
    """Plain PyTorch doing automatic loss scaling with float16 weights: the
    scaled loss's gradients in float16, unscaled in float32, SGD in float32
    stored in float16; a non-finite gradient skips the step and halves the
    scale. Returns the scale after ``steps`` steps."""
    good = 0
    x, y = inputs
    for step in range(steps):
        module.zero_grad()
        _, loss = module(x[step:step + 1], y[step:step + 1])
        (loss.float() * scale).half().backward()
        grads = [p.grad.float() / scale for p in module.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            with torch.no_grad():
                for p, g in zip(module.parameters(), grads):
                    p.copy_((p.float() - lr * g).half())
            good += 1
            if good == growth_interval:
                scale, good = scale * 2, 0
        else:
            scale, good = scale / 2, 0
    return scale


def test_automatic_loss_scaling_matches_the_documented_rule(monkeypatch):
    monkeypatch.setattr(loss_scaling, "SETTINGS", dataclasses.replace(
        loss_scaling.SETTINGS, growth_interval=3))
    module = fresh_mlp().half()
    twin = copy.deepcopy(module)
    model = poptorch.trainingModel(module, automatic_options(16), P.SGD(
        module.parameters(), lr=0.1, loss_scaling=2.0 ** 20))
    x, y = make_data(16)
    model(x.half(), y)
    scale = reference_automatic_scaling(twin, (x.half(), y), 2.0 ** 20, 0.1,
                                        16, 3)
    assert model.current_loss_scale == scale
    assert 2.0 ** 10 < scale < 2.0 ** 20
    assert_same_weights(module, twin, atol=1e-3)


def test_scale_grows_after_the_growth_interval(monkeypatch, mlp):
    monkeypatch.setattr(loss_scaling, "SETTINGS", dataclasses.replace(
        loss_scaling.SETTINGS, growth_interval=3))
    model = poptorch.trainingModel(mlp, automatic_options(), P.SGD(
        mlp.parameters(), lr=0.01, loss_scaling=4.0))
    scales = []
    for call in range(7):
        model(*make_data(2, seed=call))
        scales.append(model.current_loss_scale)
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_automatic_loss_scale_is_saved_and_loaded(mlp):
    module = mlp.half()
    optimizer = P.SGD(module.parameters(), lr=0.1, loss_scaling=2.0 ** 40)
    model = poptorch.trainingModel(module, automatic_options(), optimizer)
    x, y = make_data(2)
    model(x.half(), y)
    state = optimizer.state_dict()
    assert state["poptorch"]["loss_scale"] == 2.0 ** 39
    assert state["poptorch"]["good_steps"] == 0
    other = fresh_mlp().half()
    other_optimizer = P.SGD(other.parameters(), lr=0.1,
                            loss_scaling=2.0 ** 40)
    other_model = poptorch.trainingModel(other, automatic_options(),
                                         other_optimizer)
    other_optimizer.load_state_dict(state)
    other_model(x.half(), y)
    assert other_model.current_loss_scale == 2.0 ** 38


def test_automatic_loss_scaling_keeps_fp32_training_unchanged(pair):
    """With no overflow, the dynamic scale changes nothing but rounding;
    the captured steps never read a tensor on the host (no device sync)."""
    mlp, twin = pair
    opts = automatic_options(2)
    opts.Training.gradientAccumulation(2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Running)
    model = poptorch.trainingModel(mlp, opts, P.Adam(
        mlp.parameters(), lr=0.01, eps=1e-6, max_grad_norm=10.0))
    train_both(model, twin, T.Adam(twin.parameters(), lr=0.01, eps=1e-6),
               accumulation=2, calls=3, clip=10.0)
    assert_same_weights(mlp, twin, atol=ATOL)
    for graph in compiled_model(model).session.graphs.values():
        assert not any("_local_scalar_dense" in str(node.target)
                       for node in graph.graph.nodes)


# --- 6. optimizer state location ------------------------------------------------

def off_chip_options():
    opts = options(2)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    return opts


def test_off_chip_optimizer_state_on_cpu_trains_the_same(poptorch_log,
                                                         pair):
    mlp, twin = pair
    model = poptorch.trainingModel(mlp, off_chip_options(), T.Adam(
        mlp.parameters(), lr=0.01))
    train_both(model, twin, T.Adam(twin.parameters(), lr=0.01), calls=2)
    assert_same_weights(mlp, twin, atol=ATOL)
    messages = [r.getMessage() for r in poptorch_log.records
                if "setOptimizerLocation" in r.getMessage()]
    assert len(messages) == 1 and "no effect on a CPU" in messages[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_off_chip_optimizer_state_lives_in_pinned_host_memory_on_cuda():
    on_chip_module, off_chip_module = fresh_mlp(), fresh_mlp()
    on_chip = poptorch.trainingModel(on_chip_module, options(2), P.Adam(
        on_chip_module.parameters(), lr=0.01))
    off_chip = poptorch.trainingModel(off_chip_module, off_chip_options(),
                                      P.Adam(off_chip_module.parameters(),
                                             lr=0.01))
    for call in range(3):
        on_chip(*make_data(4, seed=call))
        off_chip(*make_data(4, seed=call))
        state = compiled_model(off_chip).state.optimizer
        assert all(t.device.type == "cpu" and t.is_pinned() for t in state)
        assert all(t.is_cuda
                   for t in compiled_model(on_chip).state.optimizer)
    for a, b in zip(on_chip_module.parameters(),
                    off_chip_module.parameters()):
        assert torch.equal(a, b)


# --- 7. bad input ----------------------------------------------------------------

@pytest.fixture
def trained_sgd():
    module = fresh_mlp()
    optimizer = P.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(module, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    return model, optimizer


@pytest.mark.parametrize("lr", [-0.1, float("nan")])
def test_bad_learning_rate_in_set_optimizer_is_an_error(trained_sgd, lr):
    model, optimizer = trained_sgd
    before = snapshot(model)
    optimizer.param_groups[0]["lr"] = lr
    with pytest.raises(poptorch.Error, match="Invalid learning rate"):
        model.setOptimizer(optimizer)
    assert_snapshot_equal(model, before)
    optimizer.param_groups[0]["lr"] = 0.1
    run_calls(model, 1, 1, rows=4)


def test_mismatched_param_groups_are_an_error(trained_sgd):
    model, _ = trained_sgd
    module = model.model
    before = snapshot(model)
    regrouped = P.SGD([{"params": module.fc1.parameters()},
                       {"params": module.fc2.parameters()}], lr=0.1,
                      momentum=0.9)
    with pytest.raises(poptorch.Error, match="has 2 param groups, and had "
                       "1 when the model was compiled"):
        model.setOptimizer(regrouped)
    assert_snapshot_equal(model, before)


def test_a_group_added_after_compilation_is_named_in_the_error(mlp):
    """Gradual unfreezing with add_param_group: the error names the groups
    (it listed every constant attribute as changed)."""
    for param in mlp.fc1.parameters():
        param.requires_grad_(False)
    optimizer = P.AdamW(mlp.fc2.parameters(), lr=0.01)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    model(*make_data(4))
    before = snapshot(model)
    for param in mlp.fc1.parameters():
        param.requires_grad_(True)
    optimizer.add_param_group({"params": list(mlp.fc1.parameters()),
                               "lr": 0.001})
    with pytest.raises(poptorch.Error, match=r"add_param_group after "
                       r"compilation.*destroy\(\)"):
        model.setOptimizer(optimizer)
    assert_snapshot_equal(model, before)


def test_amsgrad_is_an_error(mlp):
    with pytest.raises(poptorch.Error, match="amsgrad"):
        P.Adam(mlp.parameters(), amsgrad=True)
    optimizer = P.Adam(mlp.parameters(), lr=0.01)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    run_calls(model, 0, 1, rows=4)
    before = snapshot(model)
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(poptorch.Error, match="AMSGrad is not supported"):
        model.setOptimizer(optimizer)
    assert_snapshot_equal(model, before)
