"""Training models compute the same weights as plain PyTorch doing the same
D x G x R steps (docs/semantics.md, "One call of a wrapped model")."""
import copy
import functools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (BatchNormNet, assert_same_weights,
                      assert_trains_like_plain_pytorch, make_data,
                      make_images, options, reference_training)


@pytest.mark.parametrize("device_iterations,accumulation,replicas", [
    (1, 1, 1), (3, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)])
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean,
                                       poptorch.ReductionType.Sum])
def test_weights_match_plain_pytorch_loop(mlp, twin, device_iterations,
                                          accumulation, replicas, reduction):
    opts = options(device_iterations, accumulation, replicas)
    opts.Training.accumulationAndReplicationReductionType(reduction)
    model = poptorch.trainingModel(
        mlp, opts, torch.optim.SGD(mlp.parameters(), lr=0.05, momentum=0.9))
    reference = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    rows = 2 * device_iterations * accumulation * replicas
    for call in range(3):
        x, y = make_data(rows, seed=call)
        model(x, y)
        reference_training(twin, reference, (x, y), device_iterations,
                           accumulation, replicas,
                           mean=reduction == poptorch.ReductionType.Mean)
    assert_same_weights(mlp, twin)


def test_sum_reduction_scales_like_lr(mlp):
    """Sum with G = 2 and lr 0.01 equals G = 1 with lr 0.02 on the mean of
    the same micro-batch losses' gradients (docs/semantics.md)."""
    twin = copy.deepcopy(mlp)
    x, y = make_data(8)
    opts = options(1, 2)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Sum)
    summed = poptorch.trainingModel(mlp, opts,
                                    torch.optim.SGD(mlp.parameters(), lr=0.01))
    summed(x, y)
    reference = torch.optim.SGD(twin.parameters(), lr=0.02)
    reference_training(twin, reference, (x, y), 1, 2, 1, mean=True)
    assert_same_weights(mlp, twin)


def test_batchnorm_buffers_update_on_every_micro_batch():
    torch.manual_seed(0)
    net = BatchNormNet()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(2, 3), torch.optim.SGD(net.parameters(), lr=0.1))
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(2):
        x, y = make_images(2 * 2 * 3, seed=call)
        model(x, y)
        reference_training(twin, reference, (x, y), 2, 3)
    assert_same_weights(net, twin)
    assert int(net.bn.num_batches_tracked) == 12


def test_ten_iterations_once_equal_five_twice(mlp):
    twin = copy.deepcopy(mlp)
    x, y = make_data(20)
    poptorch.trainingModel(mlp, options(10))(x, y)
    model = poptorch.trainingModel(twin, options(5))
    model(x[:10], y[:10])
    model(x[10:], y[10:])
    assert_same_weights(mlp, twin)


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1,
                              nesterov=False, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9)),
    lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
], ids=["sgd", "nesterov", "adam", "amsgrad", "adamw", "rmsprop"])
def test_torch_optimizers_match_their_step(mlp, twin, make_optimizer):
    model = poptorch.trainingModel(mlp, options(3, 2),
                                   make_optimizer(mlp.parameters()))
    reference = make_optimizer(twin.parameters())
    for call in range(3):
        x, y = make_data(12, seed=call)
        model(x, y)
        reference_training(twin, reference, (x, y), 3, 2)
    assert_same_weights(mlp, twin, atol=1e-5)


def test_param_groups_keep_their_own_hyper_parameters(mlp, twin):
    def make(module):
        return torch.optim.SGD([
            {"params": module.fc1.parameters(), "lr": 0.1},
            {"params": module.fc2.parameters(), "lr": 0.01, "momentum": 0.5},
        ], lr=0.05)
    model = poptorch.trainingModel(mlp, options(2), make(mlp))
    reference = make(twin)
    x, y = make_data(8)
    model(x, y)
    reference_training(twin, reference, (x, y), 2)
    assert_same_weights(mlp, twin)


def test_set_optimizer_applies_lr_scheduler_without_recompiling(mlp, twin):
    """The scheduler steps after training calls as it does after
    ``optimizer.step()``: same learning rates, and no warning that
    ``lr_scheduler.step()`` came first."""
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference, 1, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):
            x, y = make_data(4, seed=call)
            model(x, y)
            scheduler.step()
            model.setOptimizer(optimizer)
            reference_training(twin, reference, (x, y), 2)
            reference_scheduler.step()
    steps = compiled_model(model).session.steps
    assert_same_weights(mlp, twin)
    assert compiled_model(model).session.steps is steps
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_a_schedule_without_set_optimizer_is_reported_once(mlp, twin,
                                                          poptorch_log):
    """As PopTorch requires setOptimizer, a scheduler stepping the optimizer
    alone changes nothing: training keeps the learning rate it was given,
    and the change is logged once, naming it and setOptimizer."""
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model = poptorch.trainingModel(mlp, options(), optimizer)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(3):
        x, y = make_data(4, seed=call)
        model(x, y)
        scheduler.step()
        reference_training(twin, reference, (x, y))
    assert_same_weights(mlp, twin)
    message = "The optimizer's lr in param group 0 changed from 0.1 to 0.05"
    assert poptorch_log.text.count(message) == 1
    assert "setOptimizer(optimizer)" in poptorch_log.text


@pytest.mark.parametrize("key, given, changed, described", [
    ("lr", 0.1, np.float32(0.25), "lr in param group 0 changed from 0.1 to "
     "0.25"),
    ("lr", torch.tensor(0.5), torch.tensor(0.25), "changed from 0.5 to 0.25"),
    ("betas", (0.9, 0.999), [0.5, 0.999], "betas in param group 0 changed "
     "from (0.9, 0.999) to (0.5, 0.999)")])
def test_hyper_parameters_of_other_types_changed_alone_are_reported(
        mlp, twin, poptorch_log, key, given, changed, described):
    """A numpy number, a tensor learning rate, betas as a list: the change
    is reported and the call trains with what the model was given (a value
    of another type raised KeyError, a tensor's change went unreported)."""
    settings = {"lr": 0.1, "betas": (0.9, 0.999), key: given}
    optimizer = torch.optim.Adam(mlp.parameters(), **settings)
    model = poptorch.trainingModel(mlp, options(), optimizer)
    reference = torch.optim.Adam(twin.parameters(), **settings)
    for call in range(2):
        x, y = make_data(4, seed=call)
        model(x, y)
        reference_training(twin, reference, (x, y))
        optimizer.param_groups[0][key] = changed
    assert_same_weights(mlp, twin)
    assert described in poptorch_log.text


def test_a_scheduler_stepped_before_any_training_call_still_warns(mlp):
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model = poptorch.trainingModel(mlp, options(2), optimizer)
    model.compile(*make_data(4))
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        scheduler.step()


def test_default_optimizer_is_sgd_with_lr_0_01(mlp, twin):
    x, y = make_data(4)
    poptorch.trainingModel(mlp)(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.01),
                       (x, y))
    assert_same_weights(mlp, twin)


def test_parameters_without_grad_are_not_updated(mlp, twin):
    mlp.fc1.weight.requires_grad_(False)
    twin.fc1.weight.requires_grad_(False)
    x, y = make_data(4)
    poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.1))(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y))
    assert_same_weights(mlp, twin)
    assert not mlp.fc1.weight.requires_grad


def test_a_learning_rate_set_after_freezing_a_compiled_layer_applies(
        mlp, twin):
    """Fine-tuning: a layer frozen after the model compiled keeps training
    until destroy() (the compiled step's parameters, as documented), and a
    learning rate changed through setOptimizer applies to all of them
    (the frozen layer made the parameter groups look changed)."""
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(mlp, options(), optimizer)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for call in range(2):
        inputs = make_data(4, seed=call)
        model(*inputs)
        reference_training(twin, reference, inputs)
        if call == 0:
            mlp.fc1.requires_grad_(False)
            for group in optimizer.param_groups + reference.param_groups:
                group["lr"] = 0.01
            model.setOptimizer(optimizer)
    assert_same_weights(mlp, twin)


def test_a_state_dict_loaded_through_a_destroyed_model_trains_next(mlp,
                                                                    twin):
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.1))
    model(*make_data(4, seed=0))
    model.destroy()
    model.load_state_dict(twin.state_dict())
    inputs = make_data(4, seed=1)
    model(*inputs)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       inputs)
    assert_same_weights(mlp, twin)


def test_parameters_frozen_between_wrapping_and_first_call_stay_frozen(
        mlp, twin):
    """The model compiles on its first call and reads requires_grad then,
    as PopTorch (a GAN freezing its discriminator after wrapping)."""
    model = poptorch.trainingModel(mlp, options(), torch.optim.Adam(
        mlp.parameters(), lr=0.1))
    mlp.fc1.requires_grad_(False)
    twin.fc1.requires_grad_(False)
    reference = torch.optim.Adam(twin.parameters(), lr=0.1)
    for call in range(2):
        x, y = make_data(4, seed=call)
        model(x, y)
        reference_training(twin, reference, (x, y))
    assert_same_weights(mlp, twin)


def test_dropout_is_random_per_call_and_reproducible_with_seed():
    class DropoutNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            out = torch.nn.functional.dropout(self.fc(x), 0.5, True)
            return out, poptorch.identity_loss(out.sum(), "none")

    def run(seed):
        torch.manual_seed(0)
        net = DropoutNet()
        model = poptorch.trainingModel(
            net, options(randomSeed=seed, outputMode=poptorch.OutputMode.All),
            torch.optim.SGD(net.parameters(), lr=0.0))
        x = torch.ones(2, 16)
        return model(x)[0], model(x)[0]

    first, second = run(7)
    assert not torch.equal(first, second)
    assert torch.equal(run(7)[0], first)
    assert not torch.equal(run(8)[0], first)
    kept = (first != 0).float().mean().item()
    assert 0.3 < kept < 0.7


class _Noise(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


class _LegacyNoise(torch.nn.Module):
    def forward(self, x):
        return x.new(x.size()).normal_(), x.new(x.shape).fill_(1.0)


def test_new_with_a_size_makes_a_tensor_of_that_shape():
    """``x.new(x.size())`` (an old VAE tutorial's noise) is a tensor of
    x's shape, as in PyTorch: the capture rebuilt the torch.Size as a
    tuple, which ``new`` read as data (one row of noise for every
    sample)."""
    noise, ones = poptorch.inferenceModel(_LegacyNoise())(torch.zeros(6, 2))
    assert noise.shape == ones.shape == (6, 2)
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(ones, torch.ones(6, 2))


class _IntegerNoise(torch.nn.Module):
    def __init__(self, shifted):
        super().__init__()
        self.shifted = shifted

    def forward(self, x):
        if self.shifted:
            return x + (torch.empty_like(x, dtype=torch.int64).random_(13)
                        - 3), torch.zeros(50, dtype=torch.int8).random_(70)
        return (x + torch.empty_like(x).random_(-3, 10),
                torch.zeros(50, dtype=torch.int8).random_(-35, to=35) + 35)


@pytest.mark.parametrize("replicas", [1, 2])
def test_random_between_two_bounds_draws_what_pytorch_draws(replicas):
    """``random_(from, to)`` (its operator's name is a Python keyword, which
    torch's graph code could not hold) draws the numbers of
    ``random_(to - from) + from``, as PyTorch's kernels do."""
    x = torch.zeros(2 * replicas, 300)
    opts = poptorch.Options().randomSeed(3).replicationFactor(replicas)
    bounded, floats = poptorch.inferenceModel(_IntegerNoise(False), opts)(x)
    shifted, ints = poptorch.inferenceModel(_IntegerNoise(True), opts)(x)
    assert torch.equal(bounded, shifted) and torch.equal(floats, ints)
    assert set(bounded.unique().tolist()) == set(range(-3, 10))
    assert ints.dtype == torch.int8
    torch.manual_seed(0)
    eager = torch.empty(4, 5).random_(-3, 10)
    torch.manual_seed(0)
    assert torch.equal(eager, torch.empty(4, 5, dtype=torch.int64)
                       .random_(13).float() - 3)


@pytest.mark.parametrize("value, described", [
    ([1, 2, 3], "a list of 3 items"), (None, "NoneType None"),
    ("abc", "str 'abc'")])
def test_a_bad_rng_state_is_refused_before_it_is_taken(value, described):
    model = poptorch.inferenceModel(_Noise(),
                                    poptorch.Options().randomSeed(5))
    x = torch.zeros(4, 3)
    model(x)
    state = model.rng_state
    with pytest.raises(poptorch.Error,
                       match=f"rng_state must be a list of {len(state)} "
                             f"integers.*got {described}"):
        model.rng_state = value
    assert model.rng_state == state
    following = model(x)
    model.rng_state = state
    assert torch.equal(model(x), following)


def test_without_seed_models_follow_the_host_seed_and_leave_its_generator():
    """Without randomSeed a model's numbers follow torch.manual_seed, and
    the host program then draws what it would without poptorch (a
    DataLoader's next shuffle)."""
    x = torch.zeros(4, 3)

    def run(seed):
        torch.manual_seed(seed)
        return poptorch.inferenceModel(_Noise())(x), torch.rand(5)

    noise, host = run(3)
    torch.manual_seed(3)
    assert torch.equal(host, torch.rand(5))
    assert torch.equal(run(3)[0], noise)
    assert not torch.equal(run(4)[0], noise)


def test_user_autograd_function_trains_with_its_own_backward():
    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.5

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = ScaledGradient.apply(self.fc(x))
            return out, torch.nn.functional.cross_entropy(out, y)

    torch.manual_seed(0)
    net = Net()
    twin = copy.deepcopy(net)
    x, y = make_data(8)
    poptorch.trainingModel(net, options(2), torch.optim.SGD(
        net.parameters(), lr=0.1))(x, y)
    reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.1),
                       (x, y), 2)
    assert_same_weights(net, twin)


class _Checkpointed(torch.nn.Module):
    """Runs its middle layer under torch.utils.checkpoint; ``on_input``
    checkpoints it on the input rather than on the first layer's output
    (no input of the checkpoint requires a gradient)."""

    def __init__(self, reentrant=False, on_input=False):
        super().__init__()
        self.reentrant = reentrant
        self.on_input = on_input
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.cat([x, x], 1) if self.on_input else torch.relu(self.a(x))
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        out = self.c(h + self.a(x) if self.on_input else h)
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("replicas, path", [(1, "single"),
                                            (2, "sequential")])
def test_torch_checkpoint_recomputes_with_the_current_weights(replicas,
                                                               path):
    """torch.utils.checkpoint recomputes its function in the backward pass:
    over 2 optimizer steps per call it must read the weights of each step,
    not those the model was captured with (atol 1e-6 against plain
    PyTorch). vmap cannot recompute outside its scope, so replicas run one
    after another."""
    torch.manual_seed(0)
    net = _Checkpointed()
    twin = copy.deepcopy(net)
    model = poptorch.trainingModel(
        net, options(device_iterations=2, accumulation=2, replicas=replicas),
        torch.optim.SGD(net.parameters(), lr=0.5))
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    x, y = make_data(8 * replicas)
    model(x, y)
    reference_training(twin, reference, (x, y), device_iterations=2,
                       accumulation=2, replicas=replicas)
    assert_same_weights(net, twin, atol=1e-6)
    assert compiled_model(model).engine.replicas.path == path


class _CheckpointedDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1000))

    def forward(self, x):
        out = torch.utils.checkpoint.checkpoint(
            lambda x: F.dropout(self.weight * x, 0.5, self.training), x,
            use_reentrant=False)
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


def test_recomputed_dropout_keeps_the_forward_pass_mask():
    """As PyTorch's checkpoint restores the random generator's state, its
    recomputation draws the forward pass's dropout mask: the gradient is
    2 where the forward pass kept an element, 0 where it dropped one."""
    net = _CheckpointedDropout()
    model = poptorch.trainingModel(net, poptorch.Options().randomSeed(0),
                                   torch.optim.SGD(net.parameters(), lr=1.0))
    out, _ = model(torch.ones(1000))
    gradient = 1.0 - net.weight.detach()
    torch.testing.assert_close(gradient, (out != 0).float() * 2.0)


def _noise_written(kind, h):
    """Random numbers that an operator writes into a tensor it is given
    (rrelu's noise; as the checkpoint's output, torch 2.13's own
    non-reentrant checkpoint gets rrelu's gradient wrong, so a tanh
    follows)."""
    if kind == "rrelu":
        return torch.tanh(F.rrelu(h, 0.1, 0.5, training=True))
    if kind == "rrelu_":
        return torch.tanh(F.rrelu(h.clone(), 0.1, 0.5, training=True,
                                  inplace=True))
    mask = torch.empty_like(h)
    if kind == "bernoulli_out":
        torch.bernoulli(torch.full_like(h, 0.5), out=mask)
    else:
        torch.normal(torch.ones_like(h), 0.5, out=mask)
    return h * mask


class _CheckpointedNoise(torch.nn.Module):
    def __init__(self, kind, checkpointed):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.kind = kind
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.fc(x)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(
                functools.partial(_noise_written, self.kind), h,
                use_reentrant=False)
        else:
            h = _noise_written(self.kind, h)
        return poptorch.identity_loss(h.square().sum(), reduction="sum")


@pytest.mark.parametrize("kind", ["rrelu", "rrelu_", "bernoulli_out",
                                  "normal_out"])
def test_recomputation_writes_the_noise_an_operator_wrote(kind):
    """Operators that write their random numbers into a tensor (rrelu's
    noise, ``out=``, in place) write the forward pass's numbers again when
    recomputed: a checkpoint trains as the same model without it (the
    replay wrote the first argument, leaving the noise unset)."""
    weights = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = _CheckpointedNoise(kind, checkpointed)
        model = poptorch.trainingModel(
            net, poptorch.Options().randomSeed(0),
            torch.optim.SGD(net.parameters(), lr=0.01))
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
        weights.append(net.fc.weight.detach().clone())
    torch.testing.assert_close(weights[1], weights[0])


@pytest.mark.parametrize("on_input", [False, True])
def test_reentrant_torch_checkpoint_trains_like_plain_pytorch(on_input):
    """torch's default checkpoint (use_reentrant=True, which only recomputes
    under an eager .backward()) was refused; it trains as in PyTorch, where
    a checkpoint whose inputs need no gradient gives none to its layers."""
    torch.manual_seed(0)
    net = _Checkpointed(reentrant=True, on_input=on_input)
    twin = copy.deepcopy(net)
    initial = net.b.weight.detach().clone()
    model = poptorch.trainingModel(net, options(accumulation=2),
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    x, y = make_data(8)
    for _ in range(2):
        model(x, y)
        reference_training(twin, torch.optim.SGD(twin.parameters(), lr=0.5),
                           (x, y), accumulation=2)
    assert_same_weights(net, twin, atol=1e-6)
    assert torch.equal(net.b.weight, initial) == on_input


class _SparseEmbeddings(torch.nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 4, sparse=sparse)
        self.bag = torch.nn.EmbeddingBag(20, 4, mode="mean", sparse=sparse)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, ids, y):
        features = torch.cat([self.embedding(ids).mean(1), self.bag(ids)], 1)
        out = self.out(features)
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_embeddings_train_with_dense_gradients(optimizer):
    """sparse=True layers train as with sparse=False (plain SGD: the same
    update as PyTorch's sparse gradients) and keep their setting."""
    torch.manual_seed(0)
    net = _SparseEmbeddings()
    reference = copy.deepcopy(net)
    if optimizer == "adam":   # torch's Adam refuses sparse gradients
        reference.embedding.sparse = reference.bag.sparse = False

    def make(params):
        return (torch.optim.SGD(params, lr=0.5) if optimizer == "sgd"
                else torch.optim.Adam(params, lr=0.1))

    model = poptorch.trainingModel(net, poptorch.Options().deviceIterations(2),
                                   make(net.parameters()))
    torch_optimizer = make(reference.parameters())
    ids, y = torch.randint(0, 20, (8, 5)), torch.randint(0, 2, (8,))
    model(ids, y)
    reference_training(reference, torch_optimizer, (ids, y),
                       device_iterations=2)
    model.copyWeightsToHost()
    assert_same_weights(net, reference, atol=1e-6)
    assert net.embedding.sparse and net.bag.sparse


class _FunctionalSparse(torch.nn.Module):
    """Sparse gradients asked for by functional calls, not by a module."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(20, 4))
        self.out = torch.nn.Linear(12, 2)
        self.sparse = True

    def forward(self, ids, y):
        embedded = F.embedding(ids, self.table, sparse=self.sparse).mean(1)
        bag = F.embedding_bag(ids, self.table, mode="sum",
                              sparse=self.sparse)
        gathered = torch.gather(self.table, 0, ids[:, :4],
                                sparse_grad=self.sparse)
        out = self.out(torch.cat([embedded, bag, gathered], 1))
        return out, F.cross_entropy(out, y)


def test_functional_sparse_gradients_train_with_dense_gradients():
    """F.embedding, F.embedding_bag and torch.gather asked for sparse
    gradients train as with dense ones (plain SGD: the same update)."""
    torch.manual_seed(0)
    net = _FunctionalSparse()
    reference = copy.deepcopy(net)
    reference.sparse = False   # torch cannot add these sparse gradients
    model = poptorch.trainingModel(net, poptorch.Options().deviceIterations(2),
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    ids, y = torch.randint(0, 20, (8, 5)), torch.randint(0, 2, (8,))
    model(ids, y)
    reference_training(reference, torch.optim.SGD(reference.parameters(),
                                                  lr=0.5),
                       (ids, y), device_iterations=2)
    model.copyWeightsToHost()
    assert_same_weights(net, reference, atol=1e-6)


class _Features(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 6)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _WithPreparedPart(torch.nn.Module):
    """A part prepared for plain PyTorch: scripted, traced or compiled."""

    def __init__(self, prepare):
        super().__init__()
        self.features = prepare(_Features())
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.head(self.features(x))
        return out, torch.nn.functional.cross_entropy(out, y)


PREPARED = {
    "script": torch.jit.script,
    "trace": lambda part: torch.jit.trace(part, torch.randn(2, 4)),
    "compile": torch.compile,
}


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("prepare", list(PREPARED.values()),
                         ids=list(PREPARED))
def test_scripted_traced_and_compiled_parts_are_captured(prepare):
    """TorchScript and torch.compile parts trace into the model's graph
    (a compiled part runs as written; the backend compiles the whole
    step) and train like the plain module."""
    torch.manual_seed(0)
    net = _WithPreparedPart(prepare)
    reference = _WithPreparedPart(lambda part: part)
    reference.load_state_dict({name.replace("_orig_mod.", ""): value
                               for name, value in net.state_dict().items()})
    model = poptorch.trainingModel(net, poptorch.Options().deviceIterations(2),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = make_data(8)
    model(x, y)
    reference_training(reference, optimizer, (x, y), device_iterations=2)
    model.copyWeightsToHost()
    trained = {name.replace("_orig_mod.", ""): value
               for name, value in net.state_dict().items()}
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-6,
                                   rtol=1e-5)


class WrittenIntoZeros(torch.nn.Module):
    """Activations written into a tensor made in ``forward``: a padded
    batch (``pad_sequence``), a hand-written recurrence filling its output
    step by step."""

    def __init__(self, kind):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x, y):
        if self.kind == "pad_sequence":
            parts = [self.fc(x[:2]), self.fc(x[2:])[:1]]
            out = torch.nn.utils.rnn.pad_sequence(parts).sum(0)
        else:
            out = torch.zeros(x.shape[0], 6)
            state = torch.zeros(x.shape[0], 4)
            for step in range(2):
                state = torch.tanh(self.fc(x) + state)
                out[:, 2 * step:2 * step + 2] = state[:, :2]
            out = out[:, :3]
        return out, torch.nn.functional.cross_entropy(out[:, :3],
                                                      y[:out.shape[0]])


@pytest.mark.parametrize("kind", ["pad_sequence", "filled_step_by_step"])
def test_gradients_reach_weights_through_writes_into_new_tensors(kind):
    """The loss reads the new tensor, which the graph's edges do not link
    to the values written into it: the weights were left out of the
    trainable set and never moved, silently."""
    assert_trains_like_plain_pytorch(lambda: WrittenIntoZeros(kind), lr=0.5)


class WrittenAfterTheLoss(torch.nn.Module):
    """``probe``'s output is written into the tensor after the loss has
    read it: the loss does not depend on ``probe``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.probe = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        scratch = torch.zeros(x.shape[0], 3)
        scratch += self.fc(x)
        loss = torch.nn.functional.cross_entropy(scratch, y)
        scratch.copy_(self.probe(x))
        return scratch, loss


def test_a_write_after_the_loss_read_its_tensor_trains_nothing_more():
    """As in PyTorch, ``probe`` gets no gradient, so weight decay leaves it
    alone."""
    torch.manual_seed(0)
    net, twin = WrittenAfterTheLoss(), WrittenAfterTheLoss()
    twin.load_state_dict(net.state_dict())
    model = poptorch.trainingModel(net, options(), torch.optim.SGD(
        net.parameters(), lr=0.5, weight_decay=0.1))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5, weight_decay=0.1)
    x, y = make_data(4)
    model(x, y)
    reference_training(twin, optimizer, (x, y))
    assert_same_weights(net, twin)
