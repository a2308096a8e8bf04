"""Weights between host and device (docs/semantics.md)."""
import copy
import pickle

import pytest
import torch
from torch.nn.utils import parametrize, prune

import poptorch
from poptorch._impl.device_state import DeviceState
from conftest import (ClassifierMLP, WithLoss, assert_same_weights,
                      assert_trains_like_plain_pytorch, make_data, options)


def _count_calls(monkeypatch, method: str) -> dict:
    """Count the calls of ``DeviceState.<method>`` (a copy between the
    module and a device)."""
    counter = {"copies": 0}
    original = getattr(DeviceState, method)

    def counting(self, module):
        counter["copies"] += 1
        original(self, module)

    monkeypatch.setattr(DeviceState, method, counting)
    return counter


@pytest.fixture
def count_copies_to_host(monkeypatch):
    return _count_calls(monkeypatch, "store_to_host")


def test_host_read_after_training_copies_back_once(mlp, count_copies_to_host):
    before = mlp.fc1.weight.detach().clone()
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(*make_data(4))
    assert count_copies_to_host["copies"] == 0
    after = mlp.fc1.weight.detach().clone()
    assert not torch.equal(before, after)
    assert count_copies_to_host["copies"] == 1
    list(mlp.parameters())
    mlp.state_dict()
    assert count_copies_to_host["copies"] == 1
    model(*make_data(4))
    mlp.state_dict()
    assert count_copies_to_host["copies"] == 2


def test_calling_the_module_on_host_uses_trained_weights(mlp, twin):
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    optimizer.zero_grad()
    twin(x, y)[1].backward()
    optimizer.step()
    torch.testing.assert_close(mlp(x), twin(x))


class ClosureClassifier(torch.nn.Module):
    """Reaches its layer through a closure, never through an attribute read
    of itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        layer = self.fc
        self.__dict__["classify"] = lambda x: layer(x)

    def forward(self, x, y=None):
        out = self.classify(x)
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def test_calling_a_module_that_reaches_its_layers_by_closure_is_current():
    torch.manual_seed(0)
    module = ClosureClassifier()
    reference = copy.deepcopy(module.fc)
    x, y = make_data(4)
    model = poptorch.trainingModel(module, options(), torch.optim.SGD(
        module.parameters(), lr=0.5))
    model(x, y)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    optimizer.step()
    torch.testing.assert_close(module(x), reference(x), rtol=0, atol=1e-6)


READS_OF_AN_INNER_MODULE = {
    "attribute": lambda net, x: net.fc.weight,
    "state_dict": lambda net, x: net.state_dict()["fc.weight"],
    "parameters": lambda net, x: list(net.parameters())[0],
    "sub-module state_dict": lambda net, x: net.fc.state_dict()["weight"],
    "call": lambda net, x: net(x),
}


@pytest.mark.parametrize("read", list(READS_OF_AN_INNER_MODULE.values()),
                         ids=list(READS_OF_AN_INNER_MODULE))
def test_a_sub_module_the_program_holds_reads_the_trained_weights(read):
    """``trainingModel(WithLoss(net))``, then ``net`` read directly."""
    torch.manual_seed(1)
    net = torch.nn.Sequential()
    net.add_module("fc", torch.nn.Linear(4, 3))
    reference = copy.deepcopy(net)
    x, y = make_data(8)
    model = poptorch.trainingModel(WithLoss(net), options(),
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    model(x, y)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    optimizer.step()
    torch.testing.assert_close(read(net, x), read(reference, x), rtol=0,
                               atol=1e-6)
    model.destroy()
    assert type(net) is torch.nn.Sequential
    assert type(net.fc) is torch.nn.Linear


def test_copy_weights_to_host_if_needed_reports_copies(mlp):
    model = poptorch.trainingModel(mlp, options())
    model(*make_data(4))
    assert model.copyWeightsToHostIfNeeded() is True
    assert model.copyWeightsToHostIfNeeded() is False


def test_inference_model_sees_newly_trained_weights(mlp):
    x, y = make_data(4)
    mlp.eval()
    inference = poptorch.inferenceModel(mlp)
    before = inference(x)
    training = poptorch.trainingModel(
        mlp, options(), torch.optim.SGD(mlp.parameters(), lr=0.5))
    training(x, y)
    after = inference(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, mlp(x))


def test_alternating_training_and_inference_copies_each_way_once(
        mlp, count_copies_to_host, monkeypatch):
    """A validation call after a training call copies the trained weights
    to the host once and to the inference device once."""
    loads = _count_calls(monkeypatch, "load_from_host")
    x, y = make_data(4)
    training = poptorch.trainingModel(
        mlp, options(), torch.optim.SGD(mlp.parameters(), lr=0.5))
    inference = poptorch.inferenceModel(mlp)
    training(x, y)
    inference(x)
    host, device = count_copies_to_host["copies"], loads["copies"]
    for _ in range(3):
        training(x, y)
        inference(x)
    assert count_copies_to_host["copies"] - host == 3
    assert loads["copies"] - device == 3


@pytest.mark.parametrize("wrapped", ["before training", "after training"])
def test_inference_compiled_after_training_starts_from_trained_weights(
        mlp, twin, wrapped):
    """An inference model whose first call comes after a training call
    compiles from the trained weights (equal to plain PyTorch's, atol
    1e-6), whether it was wrapped before or after the training model."""
    x, y = make_data(4)
    training = poptorch.trainingModel(
        mlp, options(), torch.optim.SGD(mlp.parameters(), lr=0.5))
    if wrapped == "before training":
        inference = poptorch.inferenceModel(mlp)
    training(x, y)
    if wrapped == "after training":
        inference = poptorch.inferenceModel(mlp)
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    reference.zero_grad()
    twin(x, y)[1].backward()
    reference.step()
    torch.testing.assert_close(inference(x), twin(x), atol=1e-6, rtol=0)


def test_host_changes_need_copy_weights_to_device(mlp, poptorch_log):
    """As in PopTorch; the call that runs without the change says so (a
    host-side EMA of the weights went unseen without a word)."""
    x, _ = make_data(2)
    model = poptorch.inferenceModel(mlp)
    before = model(x)
    assert "changed in place" not in poptorch_log.text
    with torch.no_grad():
        mlp.fc2.bias.add_(1.0)
    torch.testing.assert_close(model(x), before)
    assert ("['fc2.bias'] changed in place on the host since this inference "
            "model last copied its weights") in poptorch_log.text
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), before + 1.0)


def test_copy_weights_to_device_after_training_keeps_the_trained_weights(
        mlp, twin):
    """An upload while the device holds newer weights than the host first
    brings them to the host: the upload does not undo the training."""
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    for seed in range(2):
        x, y = make_data(4, seed=seed)
        model(x, y)
        model.copyWeightsToDevice()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        optimizer.step()
    assert_same_weights(mlp, twin)


def test_editing_weights_the_program_held_while_stale_is_an_error(
        mlp, twin):
    """Parameters held since before training (here the optimizer's) are the
    host's older copy until a read through the model: changing them and
    uploading is refused, naming them, and the device keeps its weights."""
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.5)
    model = poptorch.trainingModel(mlp, options(), optimizer)
    x, y = make_data(4)
    model(x, y)
    with torch.no_grad():
        optimizer.param_groups[0]["params"][0].clamp_(-0.01, 0.01)
    with pytest.raises(poptorch.Error, match=r"copyWeightsToDevice\(\): "
                       r"\['fc1.weight'\] changed on the host through "
                       "references"):
        model.copyWeightsToDevice()
    model.copyWeightsToHost()
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(twin(x), y).backward()
    reference.step()
    assert_same_weights(mlp, twin)


def test_uploading_weights_of_another_dtype_or_shape_is_an_error(mlp, twin):
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    x, y = make_data(4)
    model(x, y)
    mlp.half()
    with pytest.raises(poptorch.Error, match="parameter 'fc1.weight' is a "
                       "tensor of shape .* dtype torch.float16 but the model "
                       "was compiled for .* torch.float32"):
        model.copyWeightsToDevice()
    with pytest.raises(poptorch.Error, match=r"changed dtype after this "
                       r"model was compiled \('fc1.weight' is torch.float16,"
                       r" compiled as torch.float32"):
        model(x, y)
    mlp.float()
    model.copyWeightsToDevice()
    model(x, y)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        optimizer.step()
    assert_same_weights(mlp, twin, atol=1e-3)


def test_load_state_dict_reaches_the_device(mlp):
    x, _ = make_data(2)
    model = poptorch.inferenceModel(mlp)
    model(x)
    other = ClassifierMLP()
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(x), other(x))


def test_second_training_model_is_an_error_until_destroy(mlp):
    first = poptorch.trainingModel(mlp, options())
    with pytest.raises(poptorch.Error, match="already wrapped in a training"):
        poptorch.trainingModel(mlp, options())
    first.destroy()
    poptorch.trainingModel(mlp, options())(*make_data(2))


def test_a_refused_second_training_model_leaves_the_optimizer_linked(mlp):
    """The refusal changes nothing: the optimizer's state_dict() still
    reads the first model's trained state (a checkpoint keeps Adam's
    moments)."""
    optimizer = torch.optim.Adam(mlp.parameters(), lr=0.01)
    first = poptorch.trainingModel(mlp, options(), optimizer)
    with pytest.raises(poptorch.Error, match="already wrapped in a training"):
        poptorch.trainingModel(mlp, options(), optimizer)
    first(*make_data(2))
    state = optimizer.state_dict()["state"]
    assert sorted(state) == list(range(len(list(mlp.parameters()))))
    assert all(float(s["step"]) == 1.0 for s in state.values())


def test_destroy_keeps_trained_weights_and_recompiles(mlp, twin):
    x, y = make_data(2)
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(x, y)
    model.destroy()
    assert not model.isCompiled()
    reference = torch.optim.SGD(twin.parameters(), lr=0.5)
    reference.zero_grad()
    twin(x, y)[1].backward()
    reference.step()
    assert_same_weights(mlp, twin)
    with pytest.raises(poptorch.Error, match="destroyed"):
        model.copyWeightsToHost()
    with pytest.raises(poptorch.Error, match="destroyed"):
        model.copyWeightsToDevice()
    model(x, y)
    assert model.isCompiled()


def test_module_pickles_as_its_own_class_after_wrapping(mlp):
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(*make_data(4))
    restored = pickle.loads(pickle.dumps(mlp))
    assert type(restored) is ClassifierMLP
    assert_same_weights(restored, mlp)
    assert type(copy.deepcopy(mlp)) is ClassifierMLP


def test_layers_are_recognised_by_their_class_after_wrapping():
    """Code that tests a layer's class with == or a set (torch.ao's
    freeze_bn_stats, an initialisation applied by type) still finds the
    layers of a wrapped module: freezing QAT BatchNorm statistics works."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                              torch.nn.Linear(4, 3))
    model = poptorch.trainingModel(WithLoss(net), options(),
                                   torch.optim.SGD(net.parameters(), lr=0.5))
    model(*make_data(4))
    assert type(net[0]) == torch.nn.Linear  # noqa: E721
    assert type(net[1]) in {torch.nn.ReLU}
    assert {torch.nn.Linear: "found"}[type(net[2])] == "found"
    assert type(net[0]) != torch.nn.ReLU  # noqa: E721

    def fill_linear_biases(layer):
        if type(layer) == torch.nn.Linear:  # noqa: E721
            torch.nn.init.constant_(layer.bias, 0.25)

    net.apply(fill_linear_biases)
    assert all((layer.bias == 0.25).all() for layer in (net[0], net[2]))


@pytest.mark.filterwarnings("ignore")  # torch.ao deprecation notices
def test_qat_batch_norm_statistics_freeze_after_wrapping():
    qat = torch.ao.nn.intrinsic.qat
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3),
                              torch.nn.BatchNorm2d(2), torch.nn.Flatten())
    net = torch.ao.quantization.fuse_modules_qat(net.train(), [["0", "1"]])
    net.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(net, inplace=True)
    x, y = torch.randn(2, 1, 4, 4), torch.tensor([0, 5])
    with torch.no_grad():
        net(x)
    model = poptorch.trainingModel(WithLoss(net), options(),
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    net.apply(qat.freeze_bn_stats)
    assert net[0].freeze_bn and not net[0].bn.training


def test_executor_round_trips_through_torch_save(mlp, tmp_path):
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(), torch.optim.SGD(
        mlp.parameters(), lr=0.5))
    model(x, y)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded, poptorch.PoplarExecutor)
    assert_same_weights(loaded.model, mlp)
    torch.testing.assert_close(loaded(x, y)[1], model(x, y)[1])


def test_detach_and_attach(mlp):
    model = poptorch.inferenceModel(mlp)
    x, _ = make_data(2)
    expected = model(x)
    assert model.isAttachedToDevice()
    model.detachFromDevice()
    assert not model.isAttachedToDevice()
    torch.testing.assert_close(model(x), expected)
    assert model.isAttachedToDevice()


class _GeneratorLoss(torch.nn.Module):
    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator = generator
        self.discriminator = discriminator

    def forward(self, z):
        score = self.discriminator(self.generator(z))
        return torch.nn.functional.binary_cross_entropy_with_logits(
            score, torch.ones_like(score))


class _DiscriminatorLoss(_GeneratorLoss):
    def forward(self, z, real):
        fake = self.discriminator(self.generator(z).detach())
        real = self.discriminator(real)
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        return poptorch.identity_loss(
            bce(fake, torch.zeros_like(fake)) +
            bce(real, torch.ones_like(real)), "none")


def _gan_parts(seed):
    torch.manual_seed(seed)
    return (torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4)),
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1)))


def test_training_models_of_modules_sharing_sub_modules_see_each_other():
    """A GAN: two training models wrap different modules holding the same
    generator and discriminator, each training one of them. Each call sees
    the weights the other model trained, and the host gets the newest of
    both, as in plain PyTorch."""
    generator, discriminator = _gan_parts(0)
    plain_generator, plain_discriminator = _gan_parts(0)
    g_model = poptorch.trainingModel(
        _GeneratorLoss(generator, discriminator), options(),
        torch.optim.SGD(generator.parameters(), lr=0.1))
    d_model = poptorch.trainingModel(
        _DiscriminatorLoss(generator, discriminator), options(),
        torch.optim.SGD(discriminator.parameters(), lr=0.1))
    g_plain = _GeneratorLoss(plain_generator, plain_discriminator)
    d_plain = _DiscriminatorLoss(plain_generator, plain_discriminator)
    g_optimizer = torch.optim.SGD(plain_generator.parameters(), lr=0.1)
    d_optimizer = torch.optim.SGD(plain_discriminator.parameters(), lr=0.1)
    for step in range(3):
        generator_input = torch.randn(4, 2, generator=torch.Generator()
                                      .manual_seed(step))
        real = torch.randn(4, 4, generator=torch.Generator()
                           .manual_seed(100 + step))
        d_loss = d_model(generator_input, real)
        d_optimizer.zero_grad()
        expected = d_plain(generator_input, real)
        expected.backward()
        d_optimizer.step()
        torch.testing.assert_close(d_loss, expected.detach())
        g_loss = g_model(generator_input)
        g_optimizer.zero_grad()
        expected = g_plain(generator_input)
        expected.backward()
        g_optimizer.step()
        torch.testing.assert_close(g_loss, expected.detach())
    d_model.copyWeightsToHost()   # its generator is older than g_model's
    assert_same_weights(generator, plain_generator)
    assert_same_weights(discriminator, plain_discriminator)


class _Head(torch.nn.Module):
    """A classifier head over a body that other heads share."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc(torch.relu(self.body(x)))
        return out, torch.nn.functional.cross_entropy(out, y)


def _two_heads():
    torch.manual_seed(0)
    body = torch.nn.Linear(4, 8)
    heads = (_Head(body), _Head(body))
    plain = copy.deepcopy(heads)
    models = [poptorch.trainingModel(head, options(), torch.optim.SGD(
        head.parameters(), lr=0.1)) for head in heads]
    optimizers = [torch.optim.SGD(head.parameters(), lr=0.1)
                  for head in plain]
    return heads, plain, models, optimizers


def _step_both(model, plain, optimizer, x, y):
    loss = model(x, y)[1]
    optimizer.zero_grad()
    expected = plain(x, y)[1]
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach())


@pytest.mark.parametrize("event", ["destroy", "load_state_dict"])
def test_a_shared_body_follows_destroy_and_load_state_dict_of_another_head(
        event):
    """Two heads share a body. Head 0's last training reaches head 1
    after head 0 is destroyed (it was taken for a host edit and not
    loaded); a checkpoint loaded into head 0 after head 1 trained the body
    is what head 1 trains on next (head 1's device copy came back over
    it)."""
    heads, plain, models, optimizers = _two_heads()
    x, y = make_data(4, seed=0)
    checkpoint = copy.deepcopy(heads[0].state_dict())
    _step_both(models[1], plain[1], optimizers[1], x, y)
    if event == "destroy":
        _step_both(models[0], plain[0], optimizers[0], x, y)
        models[0].destroy()
    else:
        heads[0].load_state_dict(checkpoint)
        plain[0].load_state_dict(checkpoint)
    _step_both(models[1], plain[1], optimizers[1], x, y)
    models[1].copyWeightsToHost()
    assert_same_weights(heads[1], plain[1])


def _sgd_step(module, x, y, lr=0.5):
    """One plain PyTorch SGD step of ``module`` on (x, y)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    optimizer.zero_grad()
    module(x, y)[1].backward()
    optimizer.step()


@pytest.mark.parametrize("through", ["module", "sub-module"])
def test_loading_a_state_dict_into_the_module_after_training_is_kept(
        mlp, twin, through):
    """Rolling back to a checkpoint on the host (all of it, or one layer
    through a reference the program holds): the trained weights are not
    copied over it later, an inference model evaluates it and the training
    model's next call starts from it."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    expected = copy.deepcopy(twin)
    if through == "module":
        mlp.load_state_dict(twin.state_dict())
    else:
        layer = mlp.fc1
        layer.load_state_dict(twin.fc1.state_dict())
        _sgd_step(expected, x, y)
        expected.fc1.load_state_dict(twin.fc1.state_dict())
    assert_same_weights(mlp, expected)
    torch.testing.assert_close(poptorch.inferenceModel(mlp)(x), expected(x))
    model(x, y)
    _sgd_step(expected, x, y)
    assert_same_weights(mlp, expected)


def test_a_new_layer_assigned_after_training_keeps_its_own_weights(mlp, twin):
    """The trained weights of the layer it replaces are not copied into
    it; the rest of the module holds the trained weights."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    head = torch.nn.Linear(8, 3)
    fresh = copy.deepcopy(head.state_dict())
    mlp.fc2 = head
    _sgd_step(twin, x, y)
    twin.fc2.load_state_dict(fresh)
    assert_same_weights(mlp, twin)


def test_a_layer_replaced_after_training_needs_a_new_compilation(mlp, twin):
    """Turning the classifier into a feature extractor: a new inference
    model runs the module as it is now; the models compiled before refuse
    to run the old structure until destroy(), after which they compile the
    new one."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    validation = poptorch.inferenceModel(mlp)
    model(x, y)
    validation(x)
    mlp.fc2 = torch.nn.Identity()
    _sgd_step(twin, x, y)
    twin.fc2 = torch.nn.Identity()
    features = poptorch.inferenceModel(mlp)
    torch.testing.assert_close(features(x), twin(x))
    for compiled_before, data in ((model, (x, y)), (validation, (x,))):
        with pytest.raises(poptorch.Error, match="was replaced, added or "
                           "removed .* after this model was compiled.*"
                           "destroy()"):
            compiled_before(*data)
    validation.destroy()
    torch.testing.assert_close(validation(x), twin(x))
    model.destroy()
    assert_same_weights(mlp, twin)


def test_pruning_after_training_needs_a_new_compilation(mlp, twin):
    """torch.nn.utils.prune moves a weight to a new name without assigning
    an attribute: the compiled model refuses to run the old parameters (it
    trained the unpruned weight without a word); after destroy() and a new
    optimizer it trains the pruned model as PyTorch does."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    _sgd_step(twin, x, y)
    for net in (mlp, twin):
        prune.l1_unstructured(net.fc1, "weight", amount=0.5)
    with pytest.raises(poptorch.Error, match="replaced, added or removed "
                       r"\(torch.nn.utils.prune"):
        model(x, y)
    model.destroy()
    model.setOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    _sgd_step(twin, x, y)
    assert_same_weights(mlp, twin)


def test_iterative_pruning_ranks_the_trained_weights(mlp, twin):
    """The pruned weight PyTorch keeps as an attribute (weight_orig *
    weight_mask, set as the layer runs) is the trained one when read after
    training: the next round of magnitude pruning ranked the weights of the
    compilation; and the mask that round registers reaches the device
    (the device kept the old mask and copied it over the new one)."""
    x, y = make_data(4)
    for net in (mlp, twin):
        prune.l1_unstructured(net.fc1, "weight", amount=0.3)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    for _ in range(2):
        for _ in range(2):
            model(x, y)
            twin_optimizer.zero_grad()
            twin(x, y)[1].backward()
            twin_optimizer.step()
        with torch.no_grad():
            twin(x, y)
        for net in (mlp, twin):
            prune.l1_unstructured(net.fc1, "weight", amount=0.3)
        assert torch.equal(mlp.fc1.weight_mask, twin.fc1.weight_mask)
    model(x, y)
    twin_optimizer.zero_grad()
    twin(x, y)[1].backward()
    twin_optimizer.step()
    assert_same_weights(mlp, twin)


def test_a_buffer_registered_after_compilation_needs_a_new_compilation(
        mlp):
    """The compiled step cannot read a buffer registered after it was
    compiled (it was ignored without a word)."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    mlp.fc1.register_buffer("scale", torch.ones(1))
    with pytest.raises(poptorch.Error, match="buffer or sub-module of the "
                       "wrapped ClassifierMLP was replaced, added or removed"):
        model(x, y)


class _RotaryCache(torch.nn.Module):
    """A non-persistent buffer assigned by attribute, on the host and (as
    rotary-embedding caches do) in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.ones(4), persistent=False)

    def forward(self, x):
        self.cache = self.cache + 1
        return x * self.cache


def test_non_persistent_buffers_are_assigned_as_in_pytorch():
    """torch checks that register_buffer takes ``persistent`` when such a
    buffer is assigned; the wrapped module's method hid its signature."""
    net = _RotaryCache()
    reference = copy.deepcopy(net)
    model = poptorch.inferenceModel(net, options(deviceIterations=2))
    x = torch.randn(4, 4)
    torch.testing.assert_close(model(x), torch.cat(
        [reference(part) for part in x.chunk(2)]))
    net.cache = torch.full((4,), 5.0)
    reference.cache = torch.full((4,), 5.0)
    assert "cache" not in net.state_dict()
    torch.testing.assert_close(model(x), torch.cat(
        [reference(part) for part in x.chunk(2)]))


def test_weight_norm_and_spectral_norm_weights_read_after_training():
    """weight_norm and spectral_norm keep the weight they compute as an
    attribute too: read after training, it is the trained one."""
    torch.manual_seed(0)
    mlp, twin = ClassifierMLP(), ClassifierMLP()
    for net in (mlp, twin):
        torch.nn.utils.weight_norm(net.fc1)
        torch.nn.utils.spectral_norm(net.fc2)
    twin.load_state_dict(mlp.state_dict())
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    _sgd_step(twin, x, y)
    with torch.no_grad():
        twin.eval()(x)
    torch.testing.assert_close(mlp.fc1.weight, twin.fc1.weight)
    torch.testing.assert_close(mlp.fc2.weight, twin.fc2.weight)


class _HalfMask(torch.nn.Module):
    def forward(self, weight):
        return weight * torch.tensor([1.0, 0.0, 1.0, 0.0])


def test_parametrizations_are_removed_from_a_wrapped_module(mlp, twin):
    """torch.nn.utils.parametrize edits its layer's class itself: a
    parametrized layer keeps its class while wrapped, so that
    remove_parametrizations works (it crashed) and leaves the trained
    weights."""
    x, y = make_data(4)
    for net in (mlp, twin):
        parametrize.register_parametrization(net.fc1, "weight", _HalfMask())
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    _sgd_step(twin, x, y)
    for net in (mlp, twin):
        parametrize.remove_parametrizations(net.fc1, "weight")
    assert type(mlp.fc1) is torch.nn.Linear
    assert_same_weights(mlp, twin)


def test_requires_grad_changed_after_compilation_is_reported_once(
        mlp, twin, poptorch_log):
    """The compiled step keeps training what it compiled for (as a graph
    compiled on the first call does), and says so."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    mlp.fc1.requires_grad_(False)
    model(x, y)
    model(x, y)
    for _ in range(3):
        _sgd_step(twin, x, y)
    assert_same_weights(mlp, twin)
    warnings = [record.getMessage() for record in poptorch_log.records
                if "requires_grad" in record.getMessage()]
    assert len(warnings) == 1 and "destroy()" in warnings[0]


def test_weights_changed_while_detached_are_used_after_attaching(mlp, twin):
    """Attaching copies the host's weights to the device, as PopTorch
    does."""
    x, y = make_data(4)
    model = poptorch.trainingModel(mlp, options(),
                                   torch.optim.SGD(mlp.parameters(), lr=0.5))
    model(x, y)
    model.detachFromDevice()
    with torch.no_grad():
        mlp.fc2.weight.mul_(0.5)
    model.attachToDevice()
    model(x, y)
    _sgd_step(twin, x, y)
    with torch.no_grad():
        twin.fc2.weight.mul_(0.5)
    _sgd_step(twin, x, y)
    assert_same_weights(mlp, twin)


class _AliasedBlock(torch.nn.Module):
    """One sub-module under two names (``self.alias = self.block``, the
    T5 pattern of an embedding shared by encoder and decoder)."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(4, 4)
        self.alias = self.block
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.out(self.alias(torch.tanh(self.block(x))))
        return out, torch.nn.functional.cross_entropy(out, y)


def test_a_sub_module_under_two_names_keeps_its_host_weights():
    """The host module holds real, trained weights after the calls (the
    trace's tensors used to stay in it), equal to plain PyTorch's."""
    assert_trains_like_plain_pytorch(_AliasedBlock, lr=0.5)
