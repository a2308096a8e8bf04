"""Machinery shared by the ``poptorch.optim`` classes: the constant/variable
attribute tracking, PopTorch's extra attributes (kept in every param group and
readable and settable on the optimizer), and a host ``step()`` that runs the
same update rule as the device.
"""
import math
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ...errors import Error
from . import optimizer_state
from .rule import UpdateRule, clip_grad_norm

#: dtypes accepted for the accumulation-type attributes (None: float32).
ACCUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Extra attributes whose value may differ between param groups.
PER_GROUP_EXTRAS = ("velocity_scaling", "max_weight_norm")


class VariableAttributes:
    """Track which optimizer attributes are variable or constant.

    A constant attribute is compiled into the program: changing it after the
    model has been compiled is an error. A variable one can be changed and
    applied with ``setOptimizer``. Accessible as ``optimizer.variable_attrs``
    on every ``poptorch.optim`` optimizer.
    """

    def __init__(self, variable_attributes: List[str],
                 allowed_attributes: List[str]) -> None:
        self._allowed = tuple(allowed_attributes)
        self._variable = set()
        for attr in variable_attributes:
            self.markAsVariable(attr)

    def isConstant(self, attr: str) -> bool:
        """Return True if the attribute is marked as constant."""
        self._check_known(attr)
        return attr not in self._variable

    def markAsConstant(self, attr: str) -> None:
        """Explicitly mark an attribute as constant."""
        self._check_known(attr)
        self._variable.discard(attr)

    def markAsVariable(self, attr: str) -> None:
        """Explicitly mark an attribute as variable."""
        self._check_known(attr)
        self._variable.add(attr)

    def _check_known(self, attr: str) -> None:
        if attr not in self._allowed:
            raise Error(f"Unknown optimizer attribute {attr!r}: the attributes "
                        f"that can be constant or variable are "
                        f"{', '.join(self._allowed)}")

    def __repr__(self) -> str:
        variable = [a for a in self._allowed if a in self._variable]
        constant = [a for a in self._allowed if a not in self._variable]
        return f"VariableAttributes(variable={variable}, constant={constant})"


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not math.isnan(value))


def _is_positive_number(value: Any) -> bool:
    return _is_number(value) and value > 0


def check_extra(owner: str, name: str, value: Any) -> None:
    """Raise a clear error if ``value`` is not valid for extra attribute
    ``name`` of optimizer ``owner``."""
    if name in ("loss_scaling", "velocity_scaling"):
        valid, allowed = (_is_positive_number(value) and math.isfinite(value),
                          "a finite number > 0")
    elif name == "max_grad_norm":
        valid, allowed = _is_positive_number(value), "a number > 0 (inf: no clipping)"
    elif name == "max_weight_norm":
        valid, allowed = (value is None
                          or (_is_number(value) and value >= 0),
                          "None (no clamping), 0 (no layer-wise adaptation) "
                          "or a number > 0")
    elif name.endswith("accum_type"):
        valid, allowed = (value is None or value in ACCUM_DTYPES,
                          "None or one of " + ", ".join(map(str, ACCUM_DTYPES)))
    else:
        valid, allowed = isinstance(value, bool), "True or False"
    if not valid:
        raise Error(f"{owner}: invalid {name} {value!r}; it must be {allowed}")


class GroupAttribute:
    """An extra attribute read and set on the optimizer: setting it sets it in
    every param group; reading it gives the first group's value."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: Optional["PoptorchOptimizer"], owner: type) -> Any:
        if optimizer is None:
            return self
        if optimizer.param_groups:
            return optimizer.param_groups[0][self.name]
        return optimizer.defaults[self.name]

    def __set__(self, optimizer: "PoptorchOptimizer", value: Any) -> None:
        check_extra(type(optimizer).__name__, self.name, value)
        optimizer.defaults[self.name] = value
        for group in optimizer.param_groups:
            group[self.name] = value


class PoptorchOptimizer:
    """Mixin for the poptorch.optim classes (placed before the torch class)."""

    #: The extra attributes of the class and their defaults.
    extra_defaults: ClassVar[Dict[str, Any]] = {}
    #: Attributes that can be marked as variable (the others are constant).
    variable_candidates: ClassVar[Tuple[str, ...]] = ()
    #: Builds the update rule of a param group.
    rule_for_group: ClassVar[Callable[[Mapping[str, Any]], UpdateRule]]

    param_groups: List[Dict[str, Any]]
    defaults: Dict[str, Any]
    state: Dict[Tensor, Dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("extra_defaults", {}):
            setattr(cls, name, GroupAttribute(name))

    def _prepare(self, arguments: Dict[str, Any]) -> Dict[str, Any]:
        """Validate the constructor ``arguments`` (None: the default), set
        ``variable_attrs`` and return the arguments for the torch class."""
        owner = type(self).__name__
        if arguments.get("amsgrad"):
            raise Error(f"{owner}: amsgrad=True is not supported (AMSGrad is "
                        f"not supported by PopTorch's optimizers); use "
                        f"amsgrad=False")
        extras = {name: default if arguments.get(name) is None else arguments[name]
                  for name, default in self.extra_defaults.items()}
        for name, value in extras.items():
            check_extra(owner, name, value)
        self._constructor_extras = extras
        passed = {name for name in self.variable_candidates
                  if arguments.get(name) is not None}
        self.variable_attrs = VariableAttributes(
            sorted(passed | {"lr"}), list(self.variable_candidates))
        return {name: value for name, value in arguments.items()
                if value is not None and name not in extras}

    def _finish(self) -> None:
        """After the torch constructor: the extras become optimizer defaults."""
        self.defaults.update(self._constructor_extras)

    def _extra_default(self, name: str) -> Any:
        if name in self.defaults:
            return self.defaults[name]
        return self._constructor_extras[name]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group; PopTorch's extra attributes default to the
        optimizer's and, except ``velocity_scaling``, must equal the other
        groups' values."""
        for name in self.extra_defaults:
            param_group.setdefault(name, self._extra_default(name))
            check_extra(type(self).__name__, name, param_group[name])
        if self.param_groups:
            self._check_same_extras(self.param_groups[0], param_group,
                                    len(self.param_groups))
        super().add_param_group(param_group)

    def check_param_groups(self) -> None:
        """Raise a clear error if the param groups' extra attributes are
        invalid or differ between groups, or if a group asks for AMSGrad."""
        owner = type(self).__name__
        for index, group in enumerate(self.param_groups):
            for name in self.extra_defaults:
                check_extra(owner, name, group.get(name))
            self._check_same_extras(self.param_groups[0], group, index)
            if group.get("amsgrad"):
                raise Error(f"{owner}: param group {index} has amsgrad=True; "
                            f"AMSGrad is not supported by PopTorch's "
                            f"optimizers")

    def _check_same_extras(self, first: Mapping[str, Any],
                           group: Mapping[str, Any], index: int) -> None:
        for name in self.extra_defaults:
            if name in PER_GROUP_EXTRAS or group.get(name) == first.get(name):
                continue
            raise Error(
                f"{type(self).__name__}: {name} must be the same in every "
                f"param group, but param group 0 has {first.get(name)!r} and "
                f"param group {index} has {group.get(name)!r}; set it on the "
                f"optimizer instead (optimizer.{name} = value)")

    def __getstate__(self) -> Dict[str, Any]:
        """What pickle and copy keep: torch's state, the variable
        attributes and the state of the training model using the optimizer
        (``optimizer_state.pickled_state``)."""
        state = optimizer_state.pickled_state(self, super().__getstate__)
        state["variable_attrs"] = self.variable_attrs
        return state

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict plus the ``"poptorch"`` entry. When a training
        model uses the optimizer, the state is read from the device (and
        copied into ``self.state``); see ``optimizer_state.py`` for the keys."""
        return optimizer_state.save_state_dict(self, super().state_dict)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()``. When a training model
        uses the optimizer, its hyper-parameters apply as with
        ``setOptimizer`` and its state is written to the device for the next
        call; a state dict without the ``"poptorch"`` entry (from
        torch.optim) or from another model raises ``poptorch.Error``."""
        optimizer_state.load_state_dict(self, state_dict, super().load_state_dict)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform a single optimization step (parameter update) on the host,
        with the same update as on the device.

        ``loss_scaling`` has no effect here: the loss is scaled only inside a
        training model, where the gradients are unscaled before the update.
        A finite ``max_grad_norm`` clips the gradients of all the groups
        together, as ``torch.nn.utils.clip_grad_norm_`` would, without
        modifying ``.grad``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_param_groups()
        optimizer_state.device_state_to_host(self)
        gradients = self._host_gradients()
        for group in self.param_groups:
            params = [p for p in group["params"] if p in gradients]
            if params:
                self._host_group_step(group, params,
                                      [gradients[p] for p in params])
        optimizer_state.host_state_to_device(self)
        return loss

    def _host_gradients(self) -> Dict[Tensor, Tensor]:
        """The gradient of each param that has one, clipped when asked."""
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise Error(f"{type(self).__name__} does not support sparse "
                        f"gradients")
        max_norm = self.param_groups[0].get("max_grad_norm", math.inf)
        if math.isfinite(max_norm):
            grads = clip_grad_norm(grads, max_norm)
        return dict(zip(params, grads))

    def _host_group_step(self, group: Mapping[str, Any], params: List[Tensor],
                         grads: List[Tensor]) -> None:
        rule = type(self).rule_for_group(group)
        device = params[0].device
        hyper = {name: torch.tensor(value, dtype=torch.float64, device=device)
                 for name, value in rule.hyper_values(group).items()}
        state = rule.init_state(params, [self.state[p] for p in params])
        new_params, new_state = rule.update(params, grads, state, hyper)
        for param, new_param in zip(params, new_params):
            param.copy_(new_param)
        for param, exported in zip(params, rule.export_state(new_params, new_state)):
            self.state[param] = exported

