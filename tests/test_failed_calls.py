"""A failed call never leaves a half-trained model (docs/failed_calls.md):
an exception inside the device loop, a floating-point exception
(``enableFloatingPointExceptions``) or Ctrl-C rolls the call back whole, and
the model trains on afterwards exactly like plain PyTorch from the state
before the failed call (weights compared at atol 1e-6 / rtol 1e-5)."""
import copy
import io
import os
import signal

import pytest
import torch

import poptorch
from poptorch._impl.executor import compiled_model
from conftest import (BatchNormNet, ClassifierMLP, TwoBlocksNet,
                      assert_same_weights, make_data, make_images, options,
                      reference_training)


def sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def adam(module):
    return poptorch.optim.Adam(module.parameters(), lr=0.01)


def device_state(model, optimizer):
    """Copies of everything a call may change on the device: weights and
    buffers (through the host copy), the optimizer state and the RNG."""
    model.copyWeightsToHost()
    return (copy.deepcopy(model.model.state_dict()),
            copy.deepcopy(optimizer.state_dict()), list(model.rng_state))


def assert_state_unchanged(model, optimizer, before):
    weights, optimizer, rng = device_state(model, optimizer)
    for name, value in before[0].items():
        assert torch.equal(weights[name], value), name
    assert _flat(optimizer) == _flat(before[1])
    assert rng == before[2]


def _flat(state_dict):
    """The optimizer state dict's tensors as lists (comparable with ==)."""
    return torch.utils._pytree.tree_map(
        lambda v: v.tolist() if isinstance(v, torch.Tensor) else v,
        state_dict)


def trained_pair(make_optimizer=sgd, iterations=3,
                 floating_point_exceptions=False, **extra):
    """A training model that took one good call, its plain-PyTorch twin
    taken to the same point, and the data layout."""
    torch.manual_seed(0)
    module = ClassifierMLP()
    twin = copy.deepcopy(module)
    optimizer = make_optimizer(module)
    opts = options(iterations, **extra)
    opts.Precision.enableFloatingPointExceptions(floating_point_exceptions)
    model = poptorch.trainingModel(module, opts, optimizer)
    reference = make_optimizer(twin)
    rows = iterations * extra.get("accumulation", 1) * \
        extra.get("replicas", 1) * 4
    good = make_data(rows)
    model(*good)
    layout = dict(device_iterations=iterations,
                  accumulation=extra.get("accumulation", 1),
                  replicas=extra.get("replicas", 1))
    reference_training(twin, reference, good, **layout)
    return model, optimizer, twin, reference, layout, rows


def assert_trains_on_like_pytorch(model, twin, reference, layout, rows):
    """After the failure, a good call gives what plain PyTorch gives from
    the state before the failed call."""
    good = make_data(rows, seed=7)
    model(*good)
    reference_training(twin, reference, good, **layout)
    assert_same_weights(model.model, twin)


# --- exceptions inside the device loop ------------------------------------

@pytest.mark.parametrize("make_optimizer", [sgd, adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("layout", [{}, {"accumulation": 2},
                                    {"replicas": 2}],
                         ids=["D3", "D3-G2", "D3-R2"])
def test_an_out_of_range_class_at_iteration_2_of_3_rolls_the_call_back(
        make_optimizer, layout):
    model, optimizer, twin, reference, ref_layout, rows = trained_pair(
        make_optimizer, **layout)
    before = device_state(model, optimizer)
    x, y = make_data(rows, seed=3)
    y[rows // 3 + 1] = 5                 # the second device iteration
    # IndexError, or vmap's RuntimeError when the replicas run as one
    # computation: PyTorch's own exception either way.
    with pytest.raises((IndexError, RuntimeError),
                       match="out of bounds") as raised:
        model(x, y)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "device iteration 1 of 3" in notes
    assert "rolled back" in notes
    assert_state_unchanged(model, optimizer, before)
    assert_trains_on_like_pytorch(model, twin, reference, ref_layout, rows)


def assert_a_bad_label_rolls_back(net, make_inputs):
    """A call whose 10th of 12 labels is out of range leaves the model
    ``net`` trained for one call as it was."""
    optimizer = sgd(net)
    model = poptorch.trainingModel(net, options(3), optimizer)
    model(*make_inputs(12))
    before = device_state(model, optimizer)
    x, y = make_inputs(12, seed=1)
    y[9] = 4
    with pytest.raises(IndexError):
        model(x, y)
    assert_state_unchanged(model, optimizer, before)


def test_a_failed_call_changes_no_buffer():
    torch.manual_seed(0)
    assert_a_bad_label_rolls_back(BatchNormNet(), make_images)


class _TeacherStudent(ClassifierMLP):
    """A frozen teacher layer updated in forward as an EMA of ``fc1``."""

    def __init__(self):
        super().__init__()
        self.teacher = copy.deepcopy(self.fc1).requires_grad_(False)

    def forward(self, x, y):
        with torch.no_grad():
            self.teacher.weight.lerp_(self.fc1.weight, 0.5)
        out, loss = super().forward(x, y)
        return out, loss + self.teacher(x).pow(2).mean()


def test_a_failed_call_leaves_parameters_forward_writes_as_before():
    """The teacher's EMA steps before the failure are undone too."""
    torch.manual_seed(0)
    assert_a_bad_label_rolls_back(_TeacherStudent(), make_data)


# --- floating-point exceptions -----------------------------------------------

def nan_in_iteration(rows, iteration, iterations=3):
    x, y = make_data(rows, seed=3)
    x[iteration * rows // iterations] = float("nan")
    return x, y


def test_without_the_option_a_nan_input_trains_the_weights_to_nan():
    model, _, _, _, _, rows = trained_pair()
    model(*nan_in_iteration(rows, 1))
    model.copyWeightsToHost()
    assert torch.isnan(model.model.fc1.weight).any()


@pytest.mark.parametrize("layout", [{}, {"accumulation": 2},
                                    {"replicas": 2}],
                         ids=["D3", "D3-G2", "D3-R2"])
def test_a_nan_input_is_a_floating_point_exception_rolled_back(layout):
    model, optimizer, twin, reference, ref_layout, rows = trained_pair(
        adam, floating_point_exceptions=True, **layout)
    before = device_state(model, optimizer)
    with pytest.raises(poptorch.Error,
                       match="the loss.* is not finite in device iteration "
                             "1 of 3.*rolled back"):
        model(*nan_in_iteration(rows, 1))
    assert_state_unchanged(model, optimizer, before)
    assert_trains_on_like_pytorch(model, twin, reference, ref_layout, rows)


class SquareRoot(torch.nn.Module):
    """Its parameter's gradient is infinite at 0 while the loss is finite."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x) * torch.sqrt(self.scale)
        return out, torch.nn.functional.cross_entropy(out, y)


def test_the_first_non_finite_gradient_is_named():
    module = SquareRoot()
    model = poptorch.trainingModel(
        module, _fp_options(2), torch.optim.SGD(module.parameters(), lr=0.1))
    model(*make_data(8))
    with torch.no_grad():
        module.scale.zero_()
    model.copyWeightsToDevice()
    with pytest.raises(poptorch.Error,
                       match="the gradient of scale is not finite in device "
                             "iteration 0 of 2"):
        model(*make_data(8))


def _fp_options(iterations, **extra):
    opts = options(iterations, **extra)
    opts.Precision.enableFloatingPointExceptions(True)
    return opts


def test_an_update_that_overflows_names_the_weight():
    torch.manual_seed(0)
    module = ClassifierMLP()
    model = poptorch.trainingModel(
        module, _fp_options(2), torch.optim.SGD(module.parameters(),
                                                lr=1e39))
    with pytest.raises(poptorch.Error, match="the value of fc1.weight after "
                                             "the optimizer update"):
        model(*make_data(8))


def test_the_loss_of_a_vectorised_replica_is_named():
    torch.manual_seed(0)
    module = ClassifierMLP()
    model = poptorch.trainingModel(module, _fp_options(2, replicas=4),
                                   sgd(module))
    x, y = make_data(2 * 4 * 2)
    x[8 + 2 * 3] = float("inf")          # iteration 1, replica 3
    with pytest.raises(poptorch.Error,
                       match="the loss of replica 3 is not finite in device "
                             "iteration 1 of 2"):
        model(x, y)
    assert compiled_model(model).engine.replicas.path == "vectorised"


def test_automatic_loss_scaling_skips_overflowing_gradients_instead():
    torch.manual_seed(0)
    module = ClassifierMLP().half()
    opts = _fp_options(2)
    opts.Training.setAutomaticLossScaling(True)
    model = poptorch.trainingModel(
        module, opts, poptorch.optim.SGD(module.parameters(), lr=0.01,
                                         loss_scaling=2.0 ** 30))
    x, y = make_data(8)
    model(x.half(), y)
    assert model.current_loss_scale < 2.0 ** 30


def test_an_inference_output_that_is_not_finite_is_named():
    torch.manual_seed(0)
    model = poptorch.inferenceModel(ClassifierMLP(), _fp_options(3))
    x, _ = make_data(6)
    x[4] = float("nan")
    with pytest.raises(poptorch.Error, match="output 0 is not finite in "
                                             "device iteration 2 of 3"):
        model(x)


# --- interrupts -------------------------------------------------------------

_interrupt_at = [None]
_steps_run = [0]


@torch.library.custom_op("poptorch_tests::interrupt_at", mutates_args=())
def _interrupting_identity(x: torch.Tensor) -> torch.Tensor:
    """The identity; sends SIGINT to this process when the step counter
    reaches ``_interrupt_at``, as Ctrl-C would."""
    _steps_run[0] += 1
    if _steps_run[0] == _interrupt_at[0]:
        os.kill(os.getpid(), signal.SIGINT)
    return x.clone()


@_interrupting_identity.register_fake
def _(x):
    return torch.empty_like(x)


class Interruptible(ClassifierMLP):
    def forward(self, x, y):
        return super().forward(torch.ops.poptorch_tests.interrupt_at(x), y)


def test_ctrl_c_ends_the_call_between_two_steps_and_rolls_it_back(tmp_path):
    torch.manual_seed(0)
    module = Interruptible()
    twin = copy.deepcopy(module)
    optimizer = sgd(module)
    model = poptorch.trainingModel(module, options(50), optimizer)
    good = make_data(50 * 2)
    model(*good)
    reference = sgd(twin)
    reference_training(twin, reference, good, device_iterations=50)
    before = device_state(model, optimizer)
    _steps_run[0], _interrupt_at[0] = 0, 20
    with pytest.raises(KeyboardInterrupt) as raised:
        model(*make_data(50 * 2, seed=1))
    _interrupt_at[0] = None
    assert _steps_run[0] == 20           # no step ran after the interrupt
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "before the step of device iteration 20 of 50" in notes
    assert_state_unchanged(model, optimizer, before)
    checkpoint = io.BytesIO()
    torch.save({"model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, checkpoint)
    good = make_data(50 * 2, seed=2)
    model(*good)
    reference_training(twin, reference, good, device_iterations=50)
    assert_same_weights(module, twin)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --- multi-stage models -------------------------------------------------------

@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution,
                                      poptorch.PipelinedExecution])
def test_a_multi_stage_model_rolls_a_failed_call_back(strategy):
    torch.manual_seed(0)
    net = TwoBlocksNet()
    optimizer = sgd(net)
    opts = _fp_options(2, accumulation=3)
    opts.setExecutionStrategy(strategy(poptorch.AutoStage.SameAsIpu))
    model = poptorch.trainingModel(net, opts, optimizer)
    model(*make_data(2 * 3 * 4))
    before = device_state(model, optimizer)
    x, y = make_data(2 * 3 * 4, seed=1)
    y[13] = 7
    with pytest.raises(IndexError, match="out of bounds") as raised:
        model(x, y)
    assert "in device iteration 1 of 2 (an optimizer step through the " \
        "model's stages)" in "\n".join(raised.value.__notes__)
    assert_state_unchanged(model, optimizer, before)
    x, y = make_data(2 * 3 * 4, seed=1)
    x[15] = float("nan")
    with pytest.raises(poptorch.Error, match=r"the gradient of fc1.weight "
                                             r"\(stage 0\) is not finite in "
                                             "the optimizer step of device "
                                             "iteration 1"):
        model(x, y)
    assert_state_unchanged(model, optimizer, before)
