"""The pure optimizer update rules and the optimizer plan.

Each rule is run eagerly on plain tensors, the way the executor runs it, and
compared with torch.optim's own ``step()`` on copies of the same parameters
and gradients (fp32, tolerance rtol=1e-6 and atol=1e-6: values and
intermediate terms are of order 1, so atol is 1e-6 relative to the tensors'
scale and covers float32 rounding differences near zero; hyper-parameters
fed as float64 0-d tensors, as torch.optim computes its scalars in Python
doubles).
"""
import logging
import math
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from poptorch.errors import Error
from poptorch._impl.logger import logger
from poptorch._impl.optimizers.plan import (default_optimizer,
                                            plan_optimizer)
from poptorch._impl.optimizers.rule import clip_grad_norm

SHAPES = [(4, 3), (5,), (2, 2, 2)]
RTOL, ATOL = 1e-6, 1e-6


def initial_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def gradient_sequence(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES]
            for _ in range(steps)]


def torch_steps(optimizer, params, grad_sequence):
    """torch.optim's own step() on ``params`` (tensors requiring grad)."""
    for grads in grad_sequence:
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()


def traced_update(rule, params, grads, state, hyper):
    """``rule.update`` traced with fake tensors, as the executor traces it."""
    def update(params, grads, state, hyper):
        return rule.update(params, grads, state, hyper)
    return make_fx(update, tracing_mode="fake")(params, grads, state, hyper)


def hyper_tensors(group_plan, dtype=torch.float64):
    return {name: torch.tensor(value, dtype=dtype)
            for name, value in group_plan.hyper.items()}


class RuleRunner:
    """Runs a plan's rules on plain tensors, group by group, as the executor
    does (one value per model parameter, state per group)."""

    def __init__(self, plan, params, torch_states=None, hyper_dtype=torch.float64):
        self.plan = plan
        self.values = [p.detach().clone() for p in params]
        torch_states = torch_states or [{} for _ in params]
        self.states = [group.rule.init_state(
            [self.values[i] for i in group.indices],
            [torch_states[i] for i in group.indices]) for group in plan.groups]
        self.hypers = [hyper_tensors(group, hyper_dtype) for group in plan.groups]

    def step(self, grads):
        for index, group in enumerate(self.plan.groups):
            new_values, self.states[index] = group.rule.update(
                [self.values[i] for i in group.indices],
                [grads[i] for i in group.indices],
                self.states[index], self.hypers[index])
            for position, value in zip(group.indices, new_values):
                self.values[position] = value

    def exported(self):
        """torch-format state per model parameter ({} where not planned)."""
        result = [{} for _ in self.values]
        for group, state in zip(self.plan.groups, self.states):
            params = [self.values[i] for i in group.indices]
            for position, exported in zip(group.indices,
                                          group.rule.export_state(params, state)):
                result[position] = exported
        return result


def assert_matches_torch(runner, optimizer, torch_params):
    for value, param in zip(runner.values, torch_params):
        torch.testing.assert_close(value, param.detach(), rtol=RTOL, atol=ATOL)
    for exported, param in zip(runner.exported(), torch_params):
        expected = optimizer.state[param]
        assert set(exported) == set(expected)
        for key, tensor in expected.items():
            torch.testing.assert_close(exported[key], tensor, rtol=RTOL, atol=ATOL)


# Two param groups with different hyper-parameter values for every case.
TORCH_CASES = {
    "sgd": lambda p: torch.optim.SGD(
        [{"params": p[:2]}, {"params": p[2:], "lr": 0.05}], lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(
        [{"params": p[:2]}, {"params": p[2:], "momentum": 0.5}],
        lr=0.1, momentum=0.9),
    "sgd_dampening_weight_decay": lambda p: torch.optim.SGD(
        [{"params": p[:2]}, {"params": p[2:], "dampening": 0.1}],
        lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05),
    "sgd_nesterov": lambda p: torch.optim.SGD(
        [{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.0}],
        lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
    "sgd_maximize": lambda p: torch.optim.SGD(
        [{"params": p[:2]}, {"params": p[2:], "momentum": 0.0}],
        lr=0.1, momentum=0.7, maximize=True),
    "adam": lambda p: torch.optim.Adam(
        [{"params": p[:2]}, {"params": p[2:], "betas": (0.8, 0.99)}], lr=0.01),
    "adam_weight_decay": lambda p: torch.optim.Adam(
        [{"params": p[:2]}, {"params": p[2:], "eps": 1e-3}],
        lr=0.01, weight_decay=0.1),
    "adam_amsgrad_maximize": lambda p: torch.optim.Adam(
        [{"params": p[:2]}, {"params": p[2:], "lr": 0.02}],
        lr=0.01, amsgrad=True, maximize=True),
    "adamw": lambda p: torch.optim.AdamW(
        [{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.2}], lr=0.01),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(
        [{"params": p[:2]}, {"params": p[2:], "lr": 0.003}],
        lr=0.01, amsgrad=True),
    "adam_decoupled_weight_decay": lambda p: torch.optim.Adam(
        [{"params": p[:2]}, {"params": p[2:], "lr": 0.003}],
        lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "rmsprop": lambda p: torch.optim.RMSprop(
        [{"params": p[:2]}, {"params": p[2:], "alpha": 0.9}], lr=0.01),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(
        [{"params": p[:2]}, {"params": p[2:], "eps": 1e-4}],
        lr=0.01, centered=True),
    "rmsprop_momentum": lambda p: torch.optim.RMSprop(
        [{"params": p[:2]}, {"params": p[2:], "momentum": 0.3}],
        lr=0.01, momentum=0.8),
    "rmsprop_centered_momentum_weight_decay_maximize": lambda p: torch.optim.RMSprop(
        [{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.0}],
        lr=0.01, centered=True, momentum=0.5, weight_decay=0.1, maximize=True),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_rule_matches_torch_optimizer_over_ten_steps(case):
    torch_params = [p.requires_grad_() for p in initial_params()]
    optimizer = TORCH_CASES[case](torch_params)
    runner = RuleRunner(plan_optimizer(optimizer, torch_params), initial_params())
    grad_sequence = gradient_sequence(10)
    torch_steps(optimizer, torch_params, grad_sequence)
    for grads in grad_sequence:
        runner.step(grads)
    assert_matches_torch(runner, optimizer, torch_params)


@pytest.mark.parametrize("case", ["sgd_momentum", "adam_amsgrad_maximize",
                                  "rmsprop_centered_momentum_weight_decay_maximize"])
def test_float32_hyper_parameters_stay_close_to_torch(case):
    # float32 hyper tensors round e.g. 1 - 0.999 by ~1e-5 relative, so the
    # moments differ from torch's by that much; params much less.
    torch_params = [p.requires_grad_() for p in initial_params()]
    optimizer = TORCH_CASES[case](torch_params)
    runner = RuleRunner(plan_optimizer(optimizer, torch_params),
                        initial_params(), hyper_dtype=torch.float32)
    grad_sequence = gradient_sequence(10)
    torch_steps(optimizer, torch_params, grad_sequence)
    for grads in grad_sequence:
        runner.step(grads)
    for value, param in zip(runner.values, torch_params):
        torch.testing.assert_close(value, param.detach(), rtol=1e-6, atol=1e-6)
    for exported, param in zip(runner.exported(), torch_params):
        for key, tensor in optimizer.state[param].items():
            torch.testing.assert_close(exported[key], tensor, rtol=5e-5, atol=1e-7)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_init_state_from_torch_state_continues_identically(case):
    torch_params = [p.requires_grad_() for p in initial_params()]
    optimizer = TORCH_CASES[case](torch_params)
    first, second = gradient_sequence(3), gradient_sequence(4, seed=2)
    torch_steps(optimizer, torch_params, first)
    runner = RuleRunner(plan_optimizer(optimizer, torch_params), torch_params,
                        torch_states=[optimizer.state[p] for p in torch_params])
    assert_matches_torch(runner, optimizer, torch_params)
    torch_steps(optimizer, torch_params, second)
    for grads in second:
        runner.step(grads)
    assert_matches_torch(runner, optimizer, torch_params)


def test_export_before_any_update_is_empty_like_torch():
    params = [p.requires_grad_() for p in initial_params()]
    for optimizer in (torch.optim.SGD(params, lr=0.1, momentum=0.9),
                      torch.optim.Adam(params), torch.optim.RMSprop(params)):
        runner = RuleRunner(plan_optimizer(optimizer, params), params)
        assert runner.exported() == [{}, {}, {}]


def _mutating_ops(graph_module):
    return [node.target for node in graph_module.graph.nodes
            if isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.is_mutable]


def _clone_tree(tree):
    return torch.utils._pytree.tree_map(lambda t: t.clone(), tree)


def _assert_tree_equal(actual, expected):
    flat_actual, spec_actual = torch.utils._pytree.tree_flatten(actual)
    flat_expected, spec_expected = torch.utils._pytree.tree_flatten(expected)
    assert spec_actual == spec_expected
    for a, b in zip(flat_actual, flat_expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_traced_update_matches_eager_and_leaves_inputs_unchanged(case):
    params = [p.requires_grad_() for p in initial_params()]
    plan = plan_optimizer(TORCH_CASES[case](params), params)
    for group in plan.groups:
        values = [params[i].detach().clone() for i in group.indices]
        state = group.rule.init_state(values, [{} for _ in values])
        hyper = hyper_tensors(group)
        traced = traced_update(group.rule, values,
                               [torch.ones_like(v) for v in values], state, hyper)
        assert _mutating_ops(traced) == []
        eager_state, traced_state = state, state
        eager_values, traced_values = values, values
        for grads in gradient_sequence(3):
            grads = [grads[i] for i in group.indices]
            inputs = (traced_values, grads, traced_state, hyper)
            before = _clone_tree(inputs)
            traced_values, traced_state = traced(*inputs)
            _assert_tree_equal(inputs, before)
            eager_values, eager_state = group.rule.update(
                eager_values, grads, eager_state, hyper)
            _assert_tree_equal((traced_values, traced_state),
                               (eager_values, eager_state))


@pytest.mark.parametrize("case", ["sgd_nesterov", "adam_amsgrad_maximize",
                                  "rmsprop_centered_momentum_weight_decay_maximize"])
def test_graph_size_does_not_grow_with_the_number_of_params(case):
    def node_count(count):
        params = [torch.randn(3, requires_grad=True) for _ in range(count)]
        group = plan_optimizer(TORCH_CASES[case](params), params).groups[1]
        values = [params[i].detach() for i in group.indices]
        assert len(values) == count - 2
        state = group.rule.init_state(values, [{} for _ in values])
        traced = traced_update(group.rule, values,
                               [torch.ones_like(v) for v in values], state,
                               hyper_tensors(group))
        return sum(1 for node in traced.graph.nodes
                   if node.op == "call_function" and node.target is not operator.getitem)

    assert node_count(4) == node_count(12)


def test_clip_grad_norm_matches_torch_and_is_pure():
    for max_norm in (0.5, 1e6):
        grads = gradient_sequence(1)[0]
        params = [torch.zeros(g.shape, requires_grad=True) for g in grads]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        before = _clone_tree(grads)
        clipped = clip_grad_norm(grads, torch.tensor(max_norm))
        _assert_tree_equal(grads, before)
        for ours, param in zip(clipped, params):
            torch.testing.assert_close(ours, param.grad, rtol=RTOL, atol=ATOL)
    assert math.isclose(torch.linalg.vector_norm(torch.cat(
        [g.flatten() for g in clip_grad_norm(gradient_sequence(1)[0], 0.5)])).item(),
        0.5, rel_tol=1e-5)


# The plan ---------------------------------------------------------------------

def test_plan_indices_follow_the_model_parameter_list():
    params = [p.requires_grad_() for p in initial_params()]
    optimizer = torch.optim.SGD([{"params": [params[2]]},
                                 {"params": [params[0], params[1]], "lr": 0.5}],
                                lr=0.1)
    plan = plan_optimizer(optimizer, params)
    assert [g.indices for g in plan.groups] == [(2,), (0, 1)]
    assert [g.hyper["lr"] for g in plan.groups] == [0.1, 0.5]
    assert plan.loss_scaling == 1.0 and plan.max_grad_norm is None
    assert plan.accum_dtype == torch.float32


def test_plan_leaves_out_frozen_parameters_and_empty_groups():
    params = [p.requires_grad_() for p in initial_params()]
    optimizer = torch.optim.SGD([{"params": params[:2]}, {"params": [params[2]]}],
                                lr=0.1)
    params[1].requires_grad_(False)
    params[2].requires_grad_(False)
    plan = plan_optimizer(optimizer, params)
    assert [g.indices for g in plan.groups] == [(0,)]


def test_plan_rejects_an_optimizer_parameter_not_in_the_model():
    params = [p.requires_grad_() for p in initial_params()]
    stranger = torch.zeros(7, requires_grad=True)
    optimizer = torch.optim.SGD([{"params": params}, {"params": [stranger]}], lr=0.1)
    with pytest.raises(Error, match=r"Parameter 0 \(shape \(7,\)\).*param group 1"):
        plan_optimizer(optimizer, params)


def test_plan_rejects_an_unsupported_optimizer_naming_the_supported_ones():
    params = [p.requires_grad_() for p in initial_params()]
    with pytest.raises(Error, match=r"Adagrad.*torch\.optim\.SGD.*poptorch\.optim\.LAMB"):
        plan_optimizer(torch.optim.Adagrad(params), params)


@pytest.mark.parametrize("lr", [-0.1, math.nan])
def test_plan_rejects_negative_or_nan_learning_rate_naming_the_group(lr):
    params = [p.requires_grad_() for p in initial_params()]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}],
                                lr=0.1)
    optimizer.param_groups[1]["lr"] = lr
    with pytest.raises(Error, match=rf"learning rate.*{lr}.*param group 1"):
        plan_optimizer(optimizer, params)


class _Collector(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def log_messages():
    handler = _Collector()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_subclass_overriding_step_warns_and_is_planned_as_its_base(log_messages):
    class StepLoggingSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    params = [p.requires_grad_() for p in initial_params()]
    plan = plan_optimizer(StepLoggingSGD(params, lr=0.1, momentum=0.9), params)
    assert plan.structure() == plan_optimizer(
        torch.optim.SGD(params, lr=0.1, momentum=0.9), params).structure()
    warnings = [m for level, m in log_messages if level == logging.WARNING]
    assert len(warnings) == 1 and "StepLoggingSGD" in warnings[0]
    assert "not run on the device" in warnings[0]


def test_subclass_keeping_torch_step_is_planned_without_warning(log_messages):
    class RenamedAdam(torch.optim.Adam):
        pass

    params = [p.requires_grad_() for p in initial_params()]
    plan = plan_optimizer(RenamedAdam(params, lr=0.01), params)
    assert type(plan.groups[0].rule).__name__ == "AdamRule"
    assert [m for level, m in log_messages if level == logging.WARNING] == []


def test_structure_is_equal_when_only_lr_changes_and_differs_for_nesterov():
    params = [p.requires_grad_() for p in initial_params()]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    before = plan_optimizer(optimizer, params)
    optimizer.param_groups[0]["lr"] = 0.01
    after_lr = plan_optimizer(optimizer, params)
    assert after_lr.structure() == before.structure()
    assert after_lr.groups[0].hyper["lr"] == 0.01
    optimizer.param_groups[0]["nesterov"] = True
    assert plan_optimizer(optimizer, params).structure() != before.structure()


def test_torch_optimizer_arguments_left_at_default_are_constant_except_lr():
    params = [p.requires_grad_() for p in initial_params()]
    plan = plan_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), params)
    assert plan.constant_attrs == {"dampening": (0,), "weight_decay": (0,),
                                   "nesterov": (False,), "maximize": (False,)}
    plan = plan_optimizer(torch.optim.Adam(params), params)
    assert "lr" not in plan.constant_attrs
    assert plan.constant_attrs["betas"] == ((0.9, 0.999),)


def test_default_optimizer_is_sgd_with_learning_rate_0_01():
    params = [p.requires_grad_() for p in initial_params()]
    optimizer = default_optimizer(params)
    assert type(optimizer) is torch.optim.SGD
    group = plan_optimizer(optimizer, params).groups[0]
    assert group.hyper == {"lr": 0.01, "weight_decay": 0.0}
