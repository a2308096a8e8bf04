"""poptorch.optim: constructors and defaults, variable/constant attributes,
PopTorch's extra attributes, the host step, and the update rules of the
PopTorch-only maths (SGD combined variant, AdamW without bias correction,
TensorFlow RMSprop, LAMB) against independent reference loops.

Comparisons are in fp32 with rtol=1e-6 and atol=1e-6 (values of order 1)
unless a test states otherwise.
"""
import copy
import inspect
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from poptorch import optim
from poptorch.errors import Error
from poptorch._impl.optimizers.plan import plan_optimizer

SHAPES = [(4, 3), (5,), (2, 2, 2)]
RTOL, ATOL = 1e-6, 1e-6


def initial_params(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_()
            for shape in SHAPES]


def gradient_sequence(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES]
            for _ in range(steps)]


def host_steps(optimizer, params, grad_sequence):
    for grads in grad_sequence:
        for param, grad in zip(params, grads):
            param.grad = grad.clone().to(param.dtype)
        optimizer.step()


def run_plan(optimizer, params, grad_sequence, hyper_changes=None):
    """Runs the plan's rules eagerly, as the executor does; ``hyper_changes``
    maps a step number to new hyper values for every group."""
    plan = plan_optimizer(optimizer, params)
    values = [p.detach().clone() for p in params]
    states = [g.rule.init_state([values[i] for i in g.indices],
                                [{} for _ in g.indices]) for g in plan.groups]
    hypers = [dict(g.hyper) for g in plan.groups]
    for step, grads in enumerate(grad_sequence):
        for index, group in enumerate(plan.groups):
            hypers[index].update((hyper_changes or {}).get(step, {}))
            hyper = {k: torch.tensor(v, dtype=torch.float64)
                     for k, v in hypers[index].items()}
            new_values, states[index] = group.rule.update(
                [values[i] for i in group.indices],
                [grads[i].to(values[i].dtype) for i in group.indices],
                states[index], hyper)
            for position, value in zip(group.indices, new_values):
                values[position] = value
    return plan, values, states


def assert_all_close(actual, expected, rtol=RTOL, atol=ATOL):
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)


# Constructors -----------------------------------------------------------------

SPEC_SIGNATURES = {
    optim.SGD: "params lr momentum dampening weight_decay nesterov maximize "
               "foreach differentiable loss_scaling velocity_scaling "
               "use_combined_accum accum_type velocity_accum_type max_grad_norm",
    optim.Adam: "params lr betas eps weight_decay amsgrad foreach maximize "
                "capturable differentiable fused loss_scaling accum_type "
                "first_order_momentum_accum_type second_order_momentum_accum_type "
                "max_grad_norm",
    optim.AdamW: "params lr betas eps weight_decay amsgrad maximize foreach "
                 "capturable loss_scaling bias_correction accum_type "
                 "first_order_momentum_accum_type "
                 "second_order_momentum_accum_type max_grad_norm",
    optim.RMSprop: "params lr alpha eps weight_decay momentum centered foreach "
                   "maximize differentiable loss_scaling accum_type "
                   "first_order_momentum_accum_type "
                   "second_order_momentum_accum_type use_tf_variant",
    optim.LAMB: "params lr betas eps weight_decay bias_correction loss_scaling "
                "max_weight_norm accum_type first_order_momentum_accum_type "
                "second_order_momentum_accum_type",
}


@pytest.mark.parametrize("cls", SPEC_SIGNATURES, ids=lambda c: c.__name__)
def test_constructor_arguments_follow_the_api_reference(cls):
    parameters = inspect.signature(cls.__init__).parameters
    assert list(parameters)[1:] == SPEC_SIGNATURES[cls].split()
    required = [name for name, p in parameters.items()
                if p.default is inspect.Parameter.empty and name != "self"]
    assert required == (["params", "lr"] if cls is optim.SGD else ["params"])
    assert all(p.default is None for name, p in parameters.items()
               if name not in ("self", "params") and p.default is not inspect.Parameter.empty)


@pytest.mark.parametrize("ours, theirs", [
    (lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (optim.Adam, torch.optim.Adam),
    (optim.AdamW, torch.optim.AdamW),
    (optim.RMSprop, torch.optim.RMSprop),
])
def test_arguments_left_as_none_take_torch_defaults(ours, theirs):
    params = initial_params()
    our_group, their_group = ours(params).param_groups[0], theirs(params).param_groups[0]
    for key, value in their_group.items():
        if key != "params":
            assert our_group[key] == value, key


def test_lamb_documented_defaults():
    optimizer = optim.LAMB(initial_params())
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert optimizer.bias_correction is True
    assert optimizer.max_weight_norm is None and optimizer.loss_scaling == 1.0


def test_extra_attribute_defaults_are_readable():
    params = initial_params()
    sgd = optim.SGD(params, lr=0.1)
    assert (sgd.loss_scaling, sgd.velocity_scaling, sgd.use_combined_accum,
            sgd.accum_type, sgd.velocity_accum_type, sgd.max_grad_norm) == \
        (1.0, 1.0, False, torch.float32, torch.float32, math.inf)
    assert optim.AdamW(params).bias_correction is True
    assert optim.RMSprop(params).use_tf_variant is False
    adam = optim.Adam(params, first_order_momentum_accum_type=torch.float16)
    assert adam.first_order_momentum_accum_type == torch.float16
    assert adam.param_groups[0]["first_order_momentum_accum_type"] == torch.float16


@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_amsgrad_is_not_supported(cls):
    with pytest.raises(Error, match="amsgrad=True is not supported"):
        cls(initial_params(), amsgrad=True)
    optimizer = cls(initial_params())
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(Error, match="AMSGrad is not supported"):
        plan_optimizer(optimizer, [p for g in optimizer.param_groups for p in g["params"]])


@pytest.mark.parametrize("arguments, message", [
    (dict(loss_scaling=-1.0), "invalid loss_scaling -1.0; it must be a finite number > 0"),
    (dict(velocity_scaling=0.0), "invalid velocity_scaling 0.0"),
    (dict(accum_type=torch.int32), "invalid accum_type torch.int32; it must be None or one of"),
    (dict(use_combined_accum="yes"), "invalid use_combined_accum 'yes'; it must be True or False"),
    (dict(max_grad_norm=-2.0), "invalid max_grad_norm -2.0"),
])
def test_invalid_extra_attribute_is_a_clear_error(arguments, message):
    with pytest.raises(Error, match=message):
        optim.SGD(initial_params(), lr=0.1, **arguments)


def test_lamb_rejects_invalid_hyper_parameters():
    with pytest.raises(Error, match=r"LAMB: invalid lr -1.0 \(must be >= 0\), betas"):
        optim.LAMB(initial_params(), lr=-1.0, betas=(0.9, 1.5))


# Variable and constant attributes ---------------------------------------------

def test_attributes_passed_to_the_constructor_are_variable_others_constant():
    optimizer = optim.SGD(initial_params(), lr=0.01, momentum=0.9, loss_scaling=2.0)
    attrs = optimizer.variable_attrs
    assert not attrs.isConstant("lr")
    assert not attrs.isConstant("momentum")
    assert not attrs.isConstant("loss_scaling")
    assert attrs.isConstant("dampening")
    assert attrs.isConstant("velocity_scaling")


def test_lr_is_variable_even_when_left_at_its_default():
    assert not optim.Adam(initial_params()).variable_attrs.isConstant("lr")
    assert optim.Adam(initial_params()).variable_attrs.isConstant("eps")


def test_mark_as_constant_and_variable_change_the_plan_constants():
    params = initial_params()
    optimizer = optim.Adam(params, lr=0.01, weight_decay=0.1)
    optimizer.variable_attrs.markAsConstant("lr")
    optimizer.variable_attrs.markAsVariable("eps")
    optimizer.variable_attrs.markAsConstant("weight_decay")
    constants = plan_optimizer(optimizer, params).constant_attrs
    assert constants["lr"] == (0.01,) and constants["weight_decay"] == (0.1,)
    assert "eps" not in constants
    assert constants["first_order_momentum_accum_type"] == (torch.float32,)


def test_unknown_attribute_is_a_clear_error():
    attrs = optim.RMSprop(initial_params()).variable_attrs
    with pytest.raises(Error, match="Unknown optimizer attribute 'betas'.*lr, alpha"):
        attrs.isConstant("betas")
    with pytest.raises(Error, match="'accum_type'"):
        attrs.markAsVariable("accum_type")
    with pytest.raises(Error, match="'foo'"):
        optim.VariableAttributes(["foo"], ["lr"])


def test_variable_attributes_on_its_own():
    attrs = optim.VariableAttributes(["lr"], ["lr", "momentum"])
    assert not attrs.isConstant("lr") and attrs.isConstant("momentum")
    attrs.markAsVariable("momentum")
    attrs.markAsConstant("lr")
    assert attrs.isConstant("lr") and not attrs.isConstant("momentum")


# Extra attributes across param groups -----------------------------------------

def test_setting_an_extra_attribute_on_the_optimizer_sets_every_group():
    params = initial_params()
    optimizer = optim.SGD([{"params": params[:1]}, {"params": params[1:]}],
                          lr=0.1, loss_scaling=4.0)
    assert [g["loss_scaling"] for g in optimizer.param_groups] == [4.0, 4.0]
    optimizer.loss_scaling = 2.0
    assert [g["loss_scaling"] for g in optimizer.param_groups] == [2.0, 2.0]
    assert plan_optimizer(optimizer, params).loss_scaling == 2.0
    with pytest.raises(Error, match="invalid loss_scaling"):
        optimizer.loss_scaling = math.nan


def test_extra_attributes_must_match_across_groups_except_velocity_scaling():
    params = initial_params()
    optimizer = optim.SGD([{"params": params[:1], "velocity_scaling": 4.0},
                           {"params": params[1:]}], lr=0.1, momentum=0.9,
                          use_combined_accum=True)
    plan = plan_optimizer(optimizer, params)
    assert [g.hyper["velocity_scaling"] for g in plan.groups] == [4.0, 1.0]
    optimizer.param_groups[1]["loss_scaling"] = 8.0
    with pytest.raises(Error, match="loss_scaling must be the same in every param "
                                    "group.*group 0 has 1.0 and param group 1 has 8.0"):
        plan_optimizer(optimizer, params)


def test_adding_a_group_with_a_different_extra_attribute_is_refused():
    params = initial_params()
    optimizer = optim.Adam(params[:1], max_grad_norm=1.0)
    with pytest.raises(Error, match="max_grad_norm must be the same"):
        optimizer.add_param_group({"params": params[1:], "max_grad_norm": 2.0})
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": params[1:]})
    assert optimizer.param_groups[1]["max_grad_norm"] == 1.0


def test_plan_of_a_poptorch_optimizer_carries_its_extra_attributes():
    params = initial_params()
    plan = plan_optimizer(optim.Adam(params, loss_scaling=64.0, max_grad_norm=0.5,
                                     accum_type=torch.float16), params)
    assert (plan.loss_scaling, plan.max_grad_norm, plan.accum_dtype) == \
        (64.0, 0.5, torch.float16)
    combined = plan_optimizer(optim.SGD(params, lr=0.1, momentum=0.9,
                                        use_combined_accum=True,
                                        accum_type=torch.float16), params)
    assert combined.accum_dtype is None


def test_deepcopy_keeps_variable_attributes_and_extras():
    optimizer = optim.LAMB(initial_params(), max_weight_norm=5.0)
    optimizer.variable_attrs.markAsConstant("lr")
    clone = copy.deepcopy(optimizer)
    assert clone.variable_attrs.isConstant("lr")
    assert not clone.variable_attrs.isConstant("max_weight_norm")
    assert clone.max_weight_norm == 5.0


# Host step --------------------------------------------------------------------

HOST_CASES = {
    "sgd": (lambda p: optim.SGD([{"params": p[:2]}, {"params": p[2:], "lr": 0.05}],
                                lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda p: torch.optim.SGD([{"params": p[:2]}, {"params": p[2:], "lr": 0.05}],
                                      lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov_loss_scaled": (
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, loss_scaling=1024.0),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    "adam": (lambda p: optim.Adam([{"params": p[:2]}, {"params": p[2:], "betas": (0.5, 0.9)}],
                                  lr=0.01, weight_decay=0.1, loss_scaling=8.0),
             lambda p: torch.optim.Adam([{"params": p[:2]}, {"params": p[2:], "betas": (0.5, 0.9)}],
                                        lr=0.01, weight_decay=0.1)),
    "adamw": (lambda p: optim.AdamW(p, lr=0.01, maximize=True),
              lambda p: torch.optim.AdamW(p, lr=0.01, maximize=True)),
    "rmsprop": (lambda p: optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
                lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
}


@pytest.mark.parametrize("case", HOST_CASES)
def test_host_step_matches_torch_and_ignores_loss_scaling(case):
    ours, theirs = HOST_CASES[case]
    our_params, their_params = initial_params(), initial_params()
    our_optimizer, their_optimizer = ours(our_params), theirs(their_params)
    grad_sequence = gradient_sequence(10)
    host_steps(our_optimizer, our_params, grad_sequence)
    host_steps(their_optimizer, their_params, grad_sequence)
    assert_all_close(our_params, their_params)
    for ours_p, theirs_p in zip(our_params, their_params):
        expected = their_optimizer.state[theirs_p]
        assert set(our_optimizer.state[ours_p]) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(our_optimizer.state[ours_p][key], value,
                                       rtol=RTOL, atol=ATOL)


def test_host_step_clips_the_global_gradient_norm_like_torch():
    our_params, their_params = initial_params(), initial_params()
    ours = optim.SGD(our_params, lr=0.1, momentum=0.9, max_grad_norm=0.5)
    theirs = torch.optim.SGD(their_params, lr=0.1, momentum=0.9)
    for grads in gradient_sequence(5):
        for ours_p, theirs_p, grad in zip(our_params, their_params, grads):
            ours_p.grad, theirs_p.grad = grad.clone(), grad.clone()
        ours.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(our_params, grads))
        torch.nn.utils.clip_grad_norm_(their_params, 0.5)
        theirs.step()
    assert_all_close(our_params, their_params)


def test_host_state_dict_round_trip_continues_identically():
    params, resumed_params = initial_params(), initial_params()
    optimizer = optim.Adam(params, lr=0.01)
    host_steps(optimizer, params, gradient_sequence(3))
    with torch.no_grad():
        for resumed, param in zip(resumed_params, params):
            resumed.copy_(param)
    resumed = optim.Adam(resumed_params, lr=0.01)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    more = gradient_sequence(3, seed=5)
    host_steps(optimizer, params, more)
    host_steps(resumed, resumed_params, more)
    assert_all_close(resumed_params, params, rtol=0, atol=0)


# SGD combined variant and velocity scaling -----------------------------------

def test_combined_sgd_matches_torch_when_velocity_scaling_changes():
    params, torch_params = initial_params(), initial_params()
    optimizer = optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.2,
                          nesterov=False, weight_decay=0.01,
                          use_combined_accum=True, velocity_scaling=128.0)
    reference = torch.optim.SGD(torch_params, lr=0.1, momentum=0.9, dampening=0.2,
                                weight_decay=0.01)
    grad_sequence = gradient_sequence(10)
    plan, values, states = run_plan(optimizer, params, grad_sequence,
                                    hyper_changes={5: {"velocity_scaling": 1 / 64}})
    host_steps(reference, torch_params, grad_sequence)
    assert_all_close(values, torch_params)
    group = plan.groups[0]
    velocities = [reference.state[p]["momentum_buffer"] for p in torch_params]
    assert_all_close([v / 64 for v in velocities], states[0]["scaled_velocity"])
    exported = group.rule.export_state(values, states[0])
    assert_all_close([e["momentum_buffer"] for e in exported], velocities)


def test_combined_sgd_with_nesterov_matches_torch():
    params, torch_params = initial_params(), initial_params()
    optimizer = optim.SGD(params, lr=0.05, momentum=0.8, nesterov=True,
                          use_combined_accum=True, velocity_scaling=3.0)
    reference = torch.optim.SGD(torch_params, lr=0.05, momentum=0.8, nesterov=True)
    grad_sequence = gradient_sequence(10)
    _, values, _ = run_plan(optimizer, params, grad_sequence)
    host_steps(reference, torch_params, grad_sequence)
    assert_all_close(values, torch_params)


def test_combined_sgd_ignores_velocity_accum_type_and_separate_uses_it():
    params = initial_params()
    combined = plan_optimizer(optim.SGD(params, lr=0.1, momentum=0.9,
                                        use_combined_accum=True,
                                        velocity_accum_type=torch.float16), params)
    separate = plan_optimizer(optim.SGD(params, lr=0.1, momentum=0.9,
                                        velocity_accum_type=torch.float16), params)
    values = [p.detach() for p in params]
    combined_state = combined.groups[0].rule.init_state(values, [{}] * 3)
    separate_state = separate.groups[0].rule.init_state(values, [{}] * 3)
    assert {t.dtype for t in combined_state["scaled_velocity"]} == {torch.float32}
    assert {t.dtype for t in separate_state["momentum_buffer"]} == {torch.float16}


# Reference loops (written from the papers' / TensorFlow's equations) ---------

def adam_without_bias_correction_reference(params, grad_sequence, lr, betas, eps,
                                           weight_decay):
    beta1, beta2 = betas
    weights = [p.detach().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    for grads in grad_sequence:
        for i, grad in enumerate(grads):
            weights[i] = weights[i] * (1 - lr * weight_decay)
            m[i] = beta1 * m[i] + (1 - beta1) * grad
            v[i] = beta2 * v[i] + (1 - beta2) * grad * grad
            weights[i] = weights[i] - lr * m[i] / (v[i].sqrt() + eps)
    return weights, m, v


def test_adamw_without_bias_correction_matches_reference():
    params = initial_params()
    optimizer = optim.AdamW(params, lr=0.01, weight_decay=0.1, bias_correction=False)
    grad_sequence = gradient_sequence(10)
    _, values, states = run_plan(optimizer, params, grad_sequence)
    weights, m, v = adam_without_bias_correction_reference(
        params, grad_sequence, 0.01, (0.9, 0.999), 1e-8, 0.1)
    assert_all_close(values, weights)
    assert_all_close(states[0]["exp_avg"], m)
    assert_all_close(states[0]["exp_avg_sq"], v)
    host_params = initial_params()
    host_steps(optim.AdamW(host_params, lr=0.01, weight_decay=0.1,
                           bias_correction=False), host_params, grad_sequence)
    assert_all_close(host_params, weights)


def tf_rmsprop_reference(params, grad_sequence, lr, alpha, eps, momentum, centered):
    weights = [p.detach().clone() for p in params]
    mean_square = [torch.ones_like(w) for w in weights]
    mean_grad = [torch.zeros_like(w) for w in weights]
    moment = [torch.zeros_like(w) for w in weights]
    for grads in grad_sequence:
        for i, grad in enumerate(grads):
            mean_square[i] = alpha * mean_square[i] + (1 - alpha) * grad * grad
            if centered:
                mean_grad[i] = alpha * mean_grad[i] + (1 - alpha) * grad
                denominator = (mean_square[i] - mean_grad[i] ** 2 + eps).sqrt()
            else:
                denominator = (mean_square[i] + eps).sqrt()
            if momentum:
                moment[i] = momentum * moment[i] + lr * grad / denominator
                weights[i] = weights[i] - moment[i]
            else:
                weights[i] = weights[i] - lr * grad / denominator
    return weights, mean_square, moment


@pytest.mark.parametrize("momentum, centered", [(0.0, False), (0.7, False), (0.7, True)])
def test_tensorflow_rmsprop_matches_reference(momentum, centered):
    params = initial_params()
    optimizer = optim.RMSprop(params, lr=0.01, alpha=0.9, eps=1e-3,
                              momentum=momentum, centered=centered,
                              use_tf_variant=True)
    grad_sequence = gradient_sequence(10)
    _, values, states = run_plan(optimizer, params, grad_sequence)
    weights, mean_square, moment = tf_rmsprop_reference(
        params, grad_sequence, 0.01, 0.9, 1e-3, momentum, centered)
    assert_all_close(values, weights)
    assert_all_close(states[0]["square_avg"], mean_square)
    if momentum:
        assert_all_close(states[0]["momentum_buffer"], moment)
    host_params = initial_params()
    host_steps(optim.RMSprop(host_params, lr=0.01, alpha=0.9, eps=1e-3,
                             momentum=momentum, centered=centered,
                             use_tf_variant=True), host_params, grad_sequence)
    assert_all_close(host_params, weights)


def lamb_reference(params, grad_sequence, lr, betas, eps, weight_decay,
                   bias_correction, max_weight_norm):
    """LAMB, Algorithm 2 of You et al. 2019, one layer (tensor) at a time."""
    beta1, beta2 = betas
    weights = [p.detach().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    for t, grads in enumerate(grad_sequence, start=1):
        for i, grad in enumerate(grads):
            m[i] = beta1 * m[i] + (1 - beta1) * grad
            v[i] = beta2 * v[i] + (1 - beta2) * grad * grad
            m_hat = m[i] / (1 - beta1 ** t) if bias_correction else m[i]
            v_hat = v[i] / (1 - beta2 ** t) if bias_correction else v[i]
            ratio = m_hat / (v_hat.sqrt() + eps)
            update = ratio + weight_decay * weights[i]
            weight_norm = float(weights[i].norm())
            update_norm = float(update.norm())
            phi = weight_norm if max_weight_norm is None else min(weight_norm, max_weight_norm)
            trust = phi / update_norm if phi > 0 and update_norm > 0 else 1.0
            weights[i] = weights[i] - lr * trust * update
    return weights, m, v


LAMB_CASES = {
    "default_bias_corrected": dict(),
    "no_bias_correction": dict(bias_correction=False),
    "clamped_weight_norm": dict(max_weight_norm=1.5, weight_decay=0.1),
    "no_weight_decay": dict(weight_decay=0.0, betas=(0.8, 0.99)),
    # Optimum Graphcore's group for biases: no layer-wise adaptation.
    "adaptation_off": dict(max_weight_norm=0.0, weight_decay=0.0),
}


@pytest.mark.parametrize("case", LAMB_CASES)
def test_lamb_matches_paper_reference(case):
    arguments = dict(lr=0.01, **LAMB_CASES[case])
    params = initial_params()
    with torch.no_grad():
        params[1].zero_()  # ||w|| = 0 on the first step: trust ratio 1
    optimizer = optim.LAMB(params, **arguments)
    group = optimizer.param_groups[0]
    grad_sequence = gradient_sequence(10)
    plan, values, states = run_plan(optimizer, params, grad_sequence)
    weights, m, v = lamb_reference(
        params, grad_sequence, group["lr"], group["betas"], group["eps"],
        group["weight_decay"], group["bias_correction"], group["max_weight_norm"])
    assert_all_close(values, weights)
    assert_all_close(states[0]["exp_avg"], m)
    assert_all_close(states[0]["exp_avg_sq"], v)
    host_params = [p.detach().clone().requires_grad_() for p in params]
    host_steps(optim.LAMB(host_params, **arguments), host_params, grad_sequence)
    assert_all_close(host_params, weights)


def test_lamb_refuses_a_negative_max_weight_norm():
    with pytest.raises(Error, match="invalid max_weight_norm -1.0"):
        optim.LAMB(initial_params(), max_weight_norm=-1.0)


def test_lamb_weight_norm_clamping_changes_the_update():
    params = initial_params()
    grad_sequence = gradient_sequence(3)
    _, clamped, _ = run_plan(optim.LAMB(params, lr=0.1, max_weight_norm=0.1),
                             params, grad_sequence)
    _, free, _ = run_plan(optim.LAMB(params, lr=0.1), params, grad_sequence)
    assert not torch.allclose(clamped[0], free[0], rtol=1e-3)


# Traced rules -----------------------------------------------------------------

TRACED_CASES = {
    "sgd_combined": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                        use_combined_accum=True, velocity_scaling=8.0),
    "adamw_no_bias_correction_fp16_moments": lambda p: optim.AdamW(
        p, bias_correction=False, first_order_momentum_accum_type=torch.float16),
    "rmsprop_tf": lambda p: optim.RMSprop(p, momentum=0.5, centered=True,
                                          use_tf_variant=True),
    "lamb_clamped": lambda p: optim.LAMB(p, max_weight_norm=2.0, bias_correction=True),
}


@pytest.mark.parametrize("case", TRACED_CASES)
def test_traced_poptorch_rule_matches_eager_without_touching_inputs(case):
    params = initial_params()
    group = plan_optimizer(TRACED_CASES[case](params), params).groups[0]
    values = [p.detach().clone() for p in params]
    state = group.rule.init_state(values, [{}] * 3)
    hyper = {k: torch.tensor(v, dtype=torch.float64) for k, v in group.hyper.items()}

    def update(params, grads, state, hyper):
        return group.rule.update(params, grads, state, hyper)

    traced = make_fx(update, tracing_mode="fake")(
        values, [torch.ones_like(v) for v in values], state, hyper)
    assert not any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
                   for n in traced.graph.nodes)
    eager = (values, state)
    current = (values, state)
    for grads in gradient_sequence(3):
        inputs = (current[0], grads, current[1], hyper)
        before = torch.utils._pytree.tree_map(torch.clone, inputs)
        current = traced(*inputs)
        for a, b in zip(*(torch.utils._pytree.tree_leaves(x) for x in (inputs, before))):
            assert torch.equal(a, b)
        eager = group.rule.update(eager[0], grads, eager[1], hyper)
        for a, b in zip(*(torch.utils._pytree.tree_leaves(x) for x in (current, eager))):
            assert a.dtype == b.dtype and torch.equal(a, b)


# Accumulation types -----------------------------------------------------------

def _state_bytes(state):
    return sum(t.element_size() * t.numel() for name, tensors in state.items()
               if name != "step" for t in tensors)


@pytest.mark.parametrize("make, names", [
    (lambda p, d: optim.SGD(p, lr=0.1, momentum=0.9, velocity_accum_type=d),
     {"momentum_buffer"}),
    (lambda p, d: optim.Adam(p, first_order_momentum_accum_type=d,
                             second_order_momentum_accum_type=d),
     {"exp_avg", "exp_avg_sq"}),
    (lambda p, d: optim.RMSprop(p, momentum=0.5, centered=True,
                                first_order_momentum_accum_type=d,
                                second_order_momentum_accum_type=d),
     {"square_avg", "momentum_buffer", "grad_avg"}),
    (lambda p, d: optim.LAMB(p, first_order_momentum_accum_type=d,
                             second_order_momentum_accum_type=d),
     {"exp_avg", "exp_avg_sq"}),
])
def test_float16_state_has_half_the_bytes_and_stays_close(make, names):
    params = initial_params()
    grad_sequence = gradient_sequence(5)
    _, half_values, half_states = run_plan(make(params, torch.float16), params,
                                           grad_sequence)
    _, full_values, full_states = run_plan(make(params, None), params, grad_sequence)
    half, full = half_states[0], full_states[0]
    for name in names:
        assert {t.dtype for t in half[name]} == {torch.float16}
        assert {t.dtype for t in full[name]} == {torch.float32}
    assert _state_bytes(half) * 2 == _state_bytes(full)
    assert {t.dtype for t in half_values} == {torch.float32}
    # float16 keeps ~3 decimal digits of the state.
    assert_all_close(half_values, full_values, rtol=1e-2, atol=1e-3)


def test_mixed_accum_types_keep_each_state_dtype():
    params = initial_params()
    _, _, states = run_plan(optim.Adam(params, first_order_momentum_accum_type=torch.float16,
                                       second_order_momentum_accum_type=torch.float32),
                            params, gradient_sequence(2))
    assert {t.dtype for t in states[0]["exp_avg"]} == {torch.float16}
    assert {t.dtype for t in states[0]["exp_avg_sq"]} == {torch.float32}


def test_float16_params_with_float32_state_keep_their_dtype():
    params = initial_params(dtype=torch.float16)
    _, values, states = run_plan(optim.Adam(params, lr=0.01,
                                            first_order_momentum_accum_type=torch.float32,
                                            second_order_momentum_accum_type=torch.float32),
                                 params, gradient_sequence(3))
    assert {v.dtype for v in values} == {torch.float16}
    assert {t.dtype for t in states[0]["exp_avg"]} == {torch.float32}
    reference = [p.detach().float().requires_grad_() for p in params]
    host_steps(torch.optim.Adam(reference, lr=0.01), reference, gradient_sequence(3))
    assert_all_close([v.float() for v in values], reference, rtol=1e-3, atol=1e-3)
