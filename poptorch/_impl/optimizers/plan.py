"""Reading an optimizer object into an ``OptimizerPlan`` for the executor.

Supported: torch.optim.SGD, Adam, AdamW, RMSprop and poptorch.optim.SGD,
Adam, AdamW, RMSprop, LAMB (and subclasses of them, planned as the supported
class). Flags that do not change the maths (foreach, fused, capturable,
differentiable) are ignored.

Constant attributes (user guide "Constant attributes"): for poptorch.optim
optimizers, those ``variable_attrs`` marks constant plus the ones that are
always constant (accumulation types, ``use_combined_accum``); for torch.optim
optimizers, the constructor arguments left at their default value, except
``lr`` which is always variable. The executor refuses a new optimizer whose
``constant_attrs`` differ from the compiled one's. A poptorch.optim
optimizer's variable ``loss_scaling`` / ``max_grad_norm`` are listed in
``variable_globals``: the step takes them as runtime inputs.

``unexpected_attributes`` names param-group keys the optimizer's class does
not have (``setOptimizer`` warns about them once).
"""
import dataclasses
import functools
import inspect
import math
from typing import (Any, Callable, Dict, FrozenSet, Hashable, List, Mapping,
                    Optional, Sequence, Tuple)

import torch

from ...errors import Error
from ..logger import logger, warn_once
from . import adam, lamb, rmsprop, sgd
from .poptorch_optimizer import PoptorchOptimizer
from .rule import UpdateRule, accum_type_of

RuleFactory = Callable[[Mapping[str, Any]], UpdateRule]

#: Supported torch.optim classes and the rule of one of their param groups;
#: each poptorch.optim class names its own (``rule_for_group``).
TORCH_SUPPORTED: Dict[type, RuleFactory] = {
    torch.optim.SGD: sgd.rule_for_group,
    torch.optim.Adam: adam.rule_for_group,
    torch.optim.AdamW: adam.rule_for_group,
    torch.optim.RMSprop: rmsprop.rule_for_group,
}


def _rule_factory(klass: type) -> Optional[RuleFactory]:
    """The rule of one param group of optimizers of exactly ``klass``, None
    when ``klass`` is not a supported class."""
    if klass in TORCH_SUPPORTED:
        return TORCH_SUPPORTED[klass]
    if issubclass(klass, PoptorchOptimizer):
        return klass.__dict__.get("rule_for_group")
    return None


def _supported_names() -> List[str]:
    poptorch_classes = [klass for klass in _all_subclasses(PoptorchOptimizer)
                        if "rule_for_group" in klass.__dict__]
    return ([f"poptorch.optim.{klass.__name__}" for klass in poptorch_classes]
            + [f"torch.optim.{klass.__name__}" for klass in TORCH_SUPPORTED])


def _all_subclasses(klass: type) -> List[type]:
    found = []
    for sub in klass.__subclasses__():
        found += [sub] + _all_subclasses(sub)
    return found

#: torch.optim constructor arguments that do not change the maths.
MATHS_NEUTRAL_FLAGS = ("foreach", "fused", "capturable", "differentiable")


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One param group: its rule, the positions of its trainable params in
    the ``params`` list given to ``plan_optimizer``, and its hyper values."""
    rule: UpdateRule
    indices: Tuple[int, ...]
    hyper: Dict[str, float]


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """What the executor needs to trace and feed the optimizer update."""
    groups: Tuple[GroupPlan, ...]
    loss_scaling: float
    max_grad_norm: Optional[float]
    accum_dtype: Optional[torch.dtype]
    constant_attrs: Dict[str, Any]
    #: ``loss_scaling`` / ``max_grad_norm`` when they are variable attributes
    #: of a poptorch.optim optimizer (runtime inputs of the step).
    variable_globals: FrozenSet[str] = frozenset()
    #: The optimizer's param groups, those without trainable parameters
    #: included.
    param_group_count: int = 1

    def structure(self) -> Hashable:
        """Everything that changes the traced graph: each group's rule and
        constants, indices, hyper and state names; loss scaling and clipping
        on, off or variable; the accumulation dtype. Equal structures mean
        that only hyper-parameter values (and constant attributes, which the
        executor checks separately) differ."""
        groups = tuple((type(group.rule).__qualname__, group.rule.constants,
                        group.indices, group.rule.hyper_names,
                        group.rule.state_names) for group in self.groups)
        loss_scaling = ("variable" if "loss_scaling" in self.variable_globals
                        else self.loss_scaling != 1.0)
        clipping = ("variable" if "max_grad_norm" in self.variable_globals
                    else self.max_grad_norm is not None)
        return (groups, loss_scaling, clipping, self.accum_dtype)


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """The optimizer used when none is given: SGD with lr 0.01."""
    return torch.optim.SGD(params, lr=0.01)


def plan_optimizer(optimizer: torch.optim.Optimizer,
                   params: List[torch.nn.Parameter],
                   requires_grad: Optional[Sequence[bool]] = None
                   ) -> OptimizerPlan:
    """Read ``optimizer`` into a plan over ``params`` (the model's parameters).

    Params with ``requires_grad=False`` are left out (not updated); with
    ``requires_grad`` (each parameter's flag when a compiled step was
    traced: a change takes effect after ``destroy()``) those it says.
    Raises ``poptorch.Error`` for an unsupported optimizer class, an optimizer
    parameter that is not in ``params``, a negative or NaN learning rate, or
    invalid PopTorch extra attributes.
    """
    base = supported_base(type(optimizer))
    if isinstance(optimizer, PoptorchOptimizer):
        optimizer.check_param_groups()
    positions = {id(param): index for index, param in enumerate(params)}
    rule_for_group = _rule_factory(base)
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        indices = _trainable_indices(group, group_index, positions,
                                     requires_grad)
        _check_learning_rate(group, group_index)
        if indices:
            rule = rule_for_group(group)
            groups.append(GroupPlan(rule, indices, rule.hyper_values(group)))
    first = optimizer.param_groups[0]
    max_grad_norm = first.get("max_grad_norm", math.inf)
    return OptimizerPlan(
        groups=tuple(groups),
        loss_scaling=float(first.get("loss_scaling", 1.0)),
        max_grad_norm=float(max_grad_norm) if math.isfinite(max_grad_norm) else None,
        accum_dtype=_accum_dtype(optimizer),
        constant_attrs=_constant_attrs(optimizer, base),
        variable_globals=_variable_globals(optimizer),
        param_group_count=len(optimizer.param_groups))


def supported_base(optimizer_class: type) -> type:
    """The supported class ``optimizer_class`` is planned as (itself or its
    nearest supported base class)."""
    for klass in optimizer_class.__mro__:
        if _rule_factory(klass) is not None:
            break
    else:
        names = ", ".join(_supported_names())
        raise Error(f"Unsupported optimizer {optimizer_class.__module__}."
                    f"{optimizer_class.__qualname__}: the supported optimizers "
                    f"are {names}")
    if klass is not optimizer_class and _overrides_step(optimizer_class, klass):
        warn_once(f"{optimizer_class.__qualname__} overrides step(): its Python "
                  f"step code is not run on the device, which applies the "
                  f"{klass.__module__}.{klass.__name__} update instead")
    return klass


def _overrides_step(optimizer_class: type, base: type) -> bool:
    return inspect.unwrap(optimizer_class.step) is not inspect.unwrap(base.step)


def _trainable_indices(group: Mapping[str, Any], group_index: int,
                       positions: Dict[int, int],
                       requires_grad: Optional[Sequence[bool]]
                       ) -> Tuple[int, ...]:
    indices = []
    for position, param in enumerate(group["params"]):
        index = positions.get(id(param))
        if index is None:
            raise Error(f"Parameter {position} (shape {tuple(param.shape)}) of "
                        f"the optimizer's param group {group_index} is not a "
                        f"parameter of the model: the optimizer must be built "
                        f"from the wrapped model's parameters")
        if param.requires_grad if requires_grad is None \
                else requires_grad[index]:
            indices.append(index)
    return tuple(indices)


def _check_learning_rate(group: Mapping[str, Any], group_index: int) -> None:
    lr = group["lr"]
    try:
        value = float(lr)
    except (TypeError, ValueError):
        value = math.nan
    if math.isnan(value) or value < 0:
        raise Error(f"Invalid learning rate (lr) {lr!r} in param group "
                    f"{group_index}: it must be a number >= 0")


def _accum_dtype(optimizer: torch.optim.Optimizer) -> Optional[torch.dtype]:
    """The gradient accumulation dtype: ``accum_type`` (float32 when None or
    absent, as PopTorch), which SGD's combined variant ignores (its velocity
    tensor is the accumulator, in the parameters' dtype: None)."""
    groups = optimizer.param_groups
    combined = any(group.get("use_combined_accum") and group["momentum"] != 0
                   for group in groups)
    return None if combined else accum_type_of(groups[0], "accum_type")


def _plain(value: Any) -> Any:
    """A comparable value: tensors become numbers, sequences tuples."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return tuple(_plain(item) for item in value)
    return value


def _constant_attrs(optimizer: torch.optim.Optimizer, base: type) -> Dict[str, Any]:
    """Each constant attribute and its value in every param group."""
    if isinstance(optimizer, PoptorchOptimizer):
        names = [name for name in optimizer.variable_candidates
                 if optimizer.variable_attrs.isConstant(name)]
        names += [name for name in optimizer.extra_defaults
                  if name not in optimizer.variable_candidates]
    else:
        names = _torch_defaulted_arguments(optimizer, base)
    return {name: tuple(_plain(group.get(name)) for group in optimizer.param_groups)
            for name in names}


def _torch_defaulted_arguments(optimizer: torch.optim.Optimizer,
                               base: type) -> List[str]:
    """The constructor arguments of a torch.optim optimizer left at their
    default value (``lr`` excepted)."""
    signature = inspect.signature(base.__init__).parameters
    return [name for name, parameter in signature.items()
            if name in optimizer.defaults and name != "lr"
            and name not in MATHS_NEUTRAL_FLAGS
            and _plain(optimizer.defaults[name]) == _plain(parameter.default)]


def _variable_globals(optimizer: torch.optim.Optimizer) -> FrozenSet[str]:
    """The optimizer-wide attributes fed to the step at run time: those a
    poptorch.optim optimizer marks variable."""
    if not isinstance(optimizer, PoptorchOptimizer):
        return frozenset()
    return frozenset(name for name in ("loss_scaling", "max_grad_norm")
                     if name in optimizer.variable_candidates
                     and not optimizer.variable_attrs.isConstant(name))


#: Param-group keys that torch's learning-rate schedulers add.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum",
                            "base_momentum"})


@functools.lru_cache(maxsize=None)
def _known_group_keys(base: type) -> FrozenSet[str]:
    """The param-group keys an optimizer of class ``base`` is built with."""
    probe = base([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    return frozenset(probe.param_groups[0])


def unexpected_attributes(optimizer: torch.optim.Optimizer) -> List[str]:
    """Param-group attributes the optimizer's class does not have (they are
    ignored), apart from the ones learning-rate schedulers add."""
    known = _known_group_keys(supported_base(type(optimizer))) | SCHEDULER_KEYS
    return sorted({key for group in optimizer.param_groups for key in group
                   if key not in known})


def _families(plan: OptimizerPlan) -> str:
    """The optimizer families of a plan's groups (SGD, Adam, RMSprop,
    LAMB)."""
    return ", ".join(sorted({type(group.rule).__name__.replace("Rule", "")
                             for group in plan.groups}))


def _check_sgd_momentum_kept(old: OptimizerPlan,
                             new: OptimizerPlan) -> None:
    """Raise when an SGD group's momentum went from 0 to another value or
    back: the compiled update keeps a velocity or does not."""
    for index, (before, now) in enumerate(zip(old.groups, new.groups)):
        if (isinstance(before.rule, sgd.SGDRule)
                and isinstance(now.rule, sgd.SGDRule)
                and before.rule.momentum != now.rule.momentum):
            raise Error(
                f"setOptimizer: param group {index}'s SGD momentum changed "
                f"from {before.hyper.get('momentum', 0.0)} to "
                f"{now.hyper.get('momentum', 0.0)} after the model was "
                "compiled. SGD with momentum 0 is compiled as the simple "
                "variant, which keeps no velocity, and SGD with momentum "
                "keeps one: give the optimizer a non-zero momentum before "
                "compiling if it will change, or call destroy() and compile "
                "again.")


def _rule_settings_changed(old: OptimizerPlan, new: OptimizerPlan
                           ) -> List[str]:
    """The names of the update rules' settings (``nesterov``,
    ``centered``...) that differ between the groups of ``old`` and
    ``new``."""
    names = set()
    for before, after in zip(old.groups, new.groups):
        was, now = dict(before.rule.constants), dict(after.rule.constants)
        names |= {name for name in was.keys() | now.keys()
                  if was.get(name) != now.get(name)}
    return sorted(names)


def check_same_structure(old: OptimizerPlan, new: OptimizerPlan) -> None:
    """``setOptimizer``: raise unless ``new`` differs from ``old`` in
    variable values only."""
    old_families, new_families = _families(old), _families(new)
    if old_families != new_families:
        raise Error(f"setOptimizer: the optimizer family changed after the "
                    f"model was compiled ({old_families} at compilation, "
                    f"now {new_families}); call destroy() and compile again "
                    "to use another type of optimizer.")
    if old.param_group_count != new.param_group_count:
        raise Error(f"setOptimizer: the optimizer has "
                    f"{new.param_group_count} param groups, and had "
                    f"{old.param_group_count} when the model was compiled "
                    "(add_param_group after compilation): the compiled "
                    "update has each group's hyper-parameters and state. "
                    "Call destroy() and compile again (the new model "
                    "starts from the optimizer's state).")
    old_groups = [group.indices for group in old.groups]
    new_groups = [group.indices for group in new.groups]
    if old_groups != new_groups:
        raise Error(f"setOptimizer: the parameter groups changed after the "
                    f"model was compiled (parameter indices per group "
                    f"{old_groups} at compilation, now {new_groups}); use "
                    f"an optimizer with the same param groups, or call "
                    f"destroy() and compile again.")
    changed = sorted(name for name in set(old.constant_attrs) |
                     set(new.constant_attrs)
                     if old.constant_attrs.get(name) !=
                     new.constant_attrs.get(name))
    changed += [name for name in ("loss_scaling", "max_grad_norm")
                if name not in changed
                and name not in old.variable_globals | new.variable_globals
                and getattr(old, name) != getattr(new, name)]
    if changed:
        detail = f"the compile-time constant(s) {', '.join(changed)}"
    elif old.variable_globals != new.variable_globals:
        detail = ("which of loss_scaling / max_grad_norm are variable "
                  f"({sorted(old.variable_globals)} at compilation, now "
                  f"{sorted(new.variable_globals)})")
    elif old.structure() != new.structure():
        _check_sgd_momentum_kept(old, new)
        rule_settings = _rule_settings_changed(old, new)
        detail = (f"{', '.join(rule_settings)}, which choose(s) the update "
                  "rule compiled into the step even when given to the "
                  "constructor," if rule_settings else
                  "the optimizer type or its parameter groups")
    else:
        return
    raise Error(f"setOptimizer: {detail} changed after the model was "
                "compiled. Only variable attributes (such as lr) can change "
                "after compilation: for a poptorch.optim optimizer, those "
                "given to its constructor or marked with "
                "variable_attrs.markAsVariable(); for a torch.optim "
                "optimizer, those given a value other than their default (a "
                "scheduler such as OneCycleLR, which cycles betas or "
                "momentum, needs the poptorch.optim optimizer of the same "
                "name). Call destroy() and compile again to change the "
                "others.")


def report_unexpected_attributes(optimizer: torch.optim.Optimizer,
                                 relax: bool) -> None:
    """``setOptimizer``: warn once of param-group attributes the optimizer
    does not use (logged at DEBUG when ``relax``)."""
    unexpected = unexpected_attributes(optimizer)
    if not unexpected:
        return
    message = (f"Ignoring unexpected attribute(s) in the param groups of "
               f"{type(optimizer).__name__} given to setOptimizer: "
               f"{', '.join(unexpected)}")
    if relax:
        logger.debug(message)
    else:
        warn_once(message)
