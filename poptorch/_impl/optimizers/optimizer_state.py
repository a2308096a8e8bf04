"""The optimizer state of a compiled training model, and a poptorch.optim
optimizer's ``state_dict()`` / ``load_state_dict()`` reading and writing it
(user guide, "Reading and writing optimizer state").

On the device the state is the flat list ``DeviceState.optimizer``: per param
group of the training layout, each state name's tensors in the group's
parameter order, then the automatic loss scaling state. ``OptimizerDeviceState``
converts between that list and per-parameter dictionaries.

A training model links its optimizer to itself (a weak reference). The
optimizer's ``state_dict()`` then returns the device state, and
``load_state_dict()`` writes a state dictionary back: to the device at once
when the model is compiled, else when it compiles. A training model that is
destroyed keeps its optimizer state the same way, for the next compilation.

The state dictionary is torch's (``"state"``: per parameter index, the keys of
torch's ``state[p]`` from the rules' ``export_state``; ``"param_groups"``)
plus the key ``"poptorch"``:

* ``"version"``: 1;
* ``"device_state"``: ``{parameter index: {state name: tensor}}``, the update
  rule's own state as the device keeps it: accumulation dtypes, step counters
  (SGD's too), the combined SGD variant's scaled velocity and its scale. Loading
  uses it, exactly, for the parameters it lists (``"state"`` for the others);
* ``"loss_scale"``, ``"good_steps"``: the automatic loss scale and its count of
  finite steps in a row (None without automatic loss scaling).

A state dictionary without the ``"poptorch"`` key (from a torch.optim
optimizer, say) cannot be loaded into a poptorch.optim optimizer used by a
training model.

A torch.optim optimizer keeps torch's own ``state_dict()``: state dict hooks
copy the device state into its ``state`` first, and ``load_state_dict()``
puts the loaded ``state`` on the device, so checkpoints of torch.optim
optimizers hold (and restore) the trained state.

``pickle`` and ``copy.deepcopy`` of an optimizer (``pickled_state``) copy
the device state into its ``state`` and keep the ``"poptorch"`` entry as a
state the copy brings to the next training model it is given to.

The state keeps its accumulation types (float32 by default, also for float16
parameters). torch's ``load_state_dict()`` casts each loaded state tensor to
its parameter's dtype; for optimizers of training models (and all
poptorch.optim optimizers) that cast is undone, so that a float16 model's
checkpoint resumes exactly. (torch's own host ``step()`` may refuse float32
state for a float16 parameter: torch.optim.Adam's does.) A torch.optim
optimizer loaded before it is given to a training model keeps torch's cast;
the compilation warns when it finds such a narrowed state.
"""
import dataclasses
import math
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor

from ...errors import Error
from ..logger import warn_once
from .global_attributes import GlobalAttributes

STATE_DICT_KEY = "poptorch"
FORMAT_VERSION = 1

_MODEL = "_poptorch_training_model"
_SAVED = "_poptorch_saved_state"
_HOOKED = "_poptorch_state_hooks"
_LOADING = "_poptorch_loading_state"
# Set on a torch.optim optimizer whose state dict was loaded while no
# compiled model used it (``_brings_state``).
_GIVEN = "_poptorch_given_state"

ParamState = Dict[str, Tensor]


@dataclasses.dataclass
class OptimizerDeviceState:
    """The optimizer state of one compiled training model. In an n-process
    run, ``placement`` (``distributed/sharding.py``'s ``StatePlacement``)
    starts it from process 0's values and, with replicated tensor
    sharding, keeps this process's rows of the sharded tensors: reading the
    state then gathers them from every process."""
    layout: Any                     # training_step.TrainingLayout
    host_params: List[torch.nn.Parameter]  # the trainable params, in order
    device_state: Any               # device_state.DeviceState (.optimizer)
    attributes: GlobalAttributes
    placement: Any = None           # None: one process, whole state
    #: The flat state entries that hold rows of a sharded tensor.
    row_entries: Set[int] = dataclasses.field(default_factory=set,
                                              init=False)
    #: The calls that have updated the state (``CompiledModel.run``).
    calls: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.placement is not None:
            self.placement.register(self)

    @property
    def _device(self) -> torch.device:
        return self.device_state.device

    def _trainable(self) -> List[Tensor]:
        """The trainable parameters, or tensors of their shape, dtype and
        device where this process keeps rows of them (sharded weights)."""
        params = self.device_state.whole_shaped_params()
        return [params[i] for i in self.layout.trainable]

    def hyper_values(self, plan) -> List[Tensor]:
        """The step's hyper-parameter inputs for ``plan``'s values."""
        return (self.layout.hyper_values(plan, self._device) +
                self.attributes.hyper_values(plan, self._device))

    # --- building the flat state -----------------------------------------
    def initial(self, optimizer: torch.optim.Optimizer, plan) -> List[Tensor]:
        """The state at compilation: a state dictionary loaded before (or
        kept by ``destroy``), else the optimizer's own ``state``."""
        flat = self._from_optimizer(optimizer, plan)
        _forget_given_state(optimizer)
        self._publish(flat)
        return flat

    def brought_by(self, optimizer: torch.optim.Optimizer, plan
                   ) -> Optional[List[Tensor]]:
        """The state that ``optimizer``, given to ``setOptimizer`` of the
        compiled model, brings (``take`` it after the other checks): a
        state dictionary loaded into it (or kept by ``destroy``), or the
        state of a torch.optim optimizer new to poptorch that has one (its
        own host steps, a state dictionary loaded into it). None when it
        brings none: the device's state carries on."""
        if not _brings_state(optimizer):
            return None
        return self._from_optimizer(optimizer, plan)

    def take(self, optimizer: torch.optim.Optimizer,
             flat: List[Tensor]) -> None:
        """Use the state ``brought_by(optimizer)`` from the next call."""
        _forget_given_state(optimizer)
        self.replace(flat)

    def _from_optimizer(self, optimizer: torch.optim.Optimizer, plan
                        ) -> List[Tensor]:
        saved = _saved_state(optimizer)
        positions = _position_indices(optimizer, self.host_params)
        torch_states = [optimizer.state.get(p, {}) for p in self.host_params]
        if _is_torch_optimizer(optimizer):
            _report_narrowed_state(torch_states, self.host_params)
        return self.build(torch_states, _by_position(saved, positions),
                          self.attributes.initial_state(plan, self._device,
                                                        saved),
                          broadcast=True)

    def build(self, torch_states: List[Mapping], saved: List[Optional[Mapping]],
              scale_state: List[Tensor], broadcast: bool = False
              ) -> List[Tensor]:
        """The flat state from per-position torch-format states, overridden
        by the exact ``saved`` device states where given, then the automatic
        loss scaling ``scale_state``; built one parameter at a time and
        placed (with ``broadcast``, process 0's values; rows of sharded
        tensors), so that no process holds more than one parameter's whole
        state beyond its own. Raises ``poptorch.Error`` before anything
        changes when they do not fit."""
        trainable = self._trainable()
        entries = self.layout.state_indices()
        states, rows = [], set()
        for group in self.layout.groups:
            names = group.rule.state_names
            state: Dict[str, List[Tensor]] = {name: [] for name in names}
            for position in group.positions:
                one = group.rule.init_state([trainable[position]],
                                            [torch_states[position]])
                if saved[position] is not None:
                    _override(one, saved[position], group.rule, 0,
                              self.host_params[position])
                tensors = self._placed(position, trainable[position],
                                       [one[n][0] for n in names], broadcast)
                for name, entry, (tensor, in_rows) in zip(
                        names, entries.get(position, []), tensors):
                    state[name].append(tensor)
                    if in_rows:
                        rows.add(entry)
            states.append(state)
        if broadcast and self.placement is not None:
            self.placement.broadcast_(scale_state)
        self.row_entries = rows
        return self.layout.flatten_state(states) + scale_state

    def _placed(self, position: int, param: Tensor, tensors: List[Tensor],
                broadcast: bool) -> List[Tuple[Tensor, bool]]:
        """The state ``tensors`` of the trainable ``param`` at ``position``
        as this process keeps them, each with whether it is rows of the
        whole."""
        if self.placement is None:
            return [(tensor, False) for tensor in tensors]
        if broadcast:
            self.placement.broadcast_(tensors)
        return [(self.placement.rows(tensor), True)
                if self.placement.shards(position, tensor, param)
                else (tensor, False) for tensor in tensors]

    def loaded_scale_state(self, extras: Mapping[str, Any]) -> List[Tensor]:
        """The automatic loss scaling state after loading ``extras``: its
        saved scale, else the current one."""
        if extras.get("loss_scale") is None:
            return list(self.device_state.optimizer[
                len(self.device_state.optimizer) -
                self.attributes.state_size:])
        return self.attributes.initial_state(None, self._device, extras)

    # --- reading it ---------------------------------------------------------
    def whole_state(self) -> List[Tensor]:
        """The flat state with every tensor whole: the rows of sharded
        tensors gathered from every process."""
        flat = list(self.device_state.optimizer)
        if not self.row_entries:
            return flat
        trainable = self._trainable()
        param_of = {index: trainable[position] for position, indices
                    in self.layout.state_indices().items()
                    for index in indices}
        entries = sorted(self.row_entries)
        wholes = self.placement.whole(self.calls,
                                      [flat[i] for i in entries],
                                      [param_of[i] for i in entries])
        for index, whole in zip(entries, wholes):
            flat[index] = whole
        return flat

    def placed(self, whole: List[Tensor]) -> List[Tensor]:
        """The flat state as this process keeps it from the ``whole`` flat
        state (``whole_state()``): the rows of sharded tensors."""
        return [self.placement.rows(tensor) if index in self.row_entries
                else tensor for index, tensor in enumerate(whole)]

    def per_param(self, flat: List[Tensor]) -> List[ParamState]:
        """Per trainable position, the rule's state tensors in the flat
        state ``flat`` (``whole_state()``, or this process's own)."""
        states: List[ParamState] = [{} for _ in self.host_params]
        for group, state in zip(self.layout.groups,
                                self.layout.unflatten_state(flat)):
            for j, position in enumerate(group.positions):
                states[position] = {name: state[name][j]
                                    for name in group.rule.state_names}
        return states

    def torch_format(self, flat: List[Tensor]) -> List[ParamState]:
        """Per trainable position, torch's ``state[p]`` (device tensors) of
        the whole flat state ``flat``."""
        exported: List[ParamState] = [{} for _ in self.host_params]
        trainable = self._trainable()
        for group, state in zip(self.layout.groups,
                                self.layout.unflatten_state(flat)):
            params = [trainable[p] for p in group.positions]
            for position, value in zip(group.positions,
                                       group.rule.export_state(params, state)):
                exported[position] = value
        return exported

    def scale_info(self) -> Dict[str, Any]:
        """Automatic loss scaling's current scale and finite-step count."""
        if self.attributes.automatic is None:
            return {"loss_scale": None, "good_steps": None}
        scale, good_steps = self.device_state.optimizer[-2:]
        return {"loss_scale": float(scale), "good_steps": int(good_steps)}

    def current_loss_scale(self, plan) -> float:
        """The loss scale the next step uses."""
        if self.attributes.automatic is None:
            return float(plan.loss_scaling)
        return self.scale_info()["loss_scale"]

    # --- writing it ----------------------------------------------------------
    def replace(self, flat: List[Tensor]) -> None:
        """Use ``flat`` (from ``build``) from the next call."""
        self.device_state.optimizer = flat
        self._publish(flat)

    def after_call(self, completed: bool) -> None:
        """A call ended: it updated the state (``completed``), or it failed
        and the state is as before."""
        self.calls += completed
        self._publish(self.device_state.optimizer)

    def _publish(self, flat: List[Tensor]) -> None:
        """Give the placement the rows in ``flat`` (other processes gather
        them)."""
        if self.row_entries:
            self.placement.publish(self.calls, [flat[index] for index
                                                in sorted(self.row_entries)])

    def apply_loss_scaling_change(self, old_plan, new_plan) -> None:
        """With automatic loss scaling, a new ``loss_scaling`` (set through
        ``setOptimizer``) becomes the current scale."""
        if (self.attributes.automatic is None
                or old_plan.loss_scaling == new_plan.loss_scaling):
            return
        flat = list(self.device_state.optimizer)
        flat[-2:] = self.attributes.automatic.initial_state(
            new_plan.loss_scaling, 0, self._device)
        self.device_state.optimizer = flat

    def store_on_optimizer(self, optimizer: torch.optim.Optimizer
                           ) -> Dict[str, Any]:
        """Copy the device state into ``optimizer.state`` (torch's format,
        next to each host parameter) and return the ``"poptorch"`` entry."""
        index_of = _param_indices(optimizer)
        device_state = {}
        flat = self.whole_state()
        for param, exported, raw in zip(self.host_params,
                                         self.torch_format(flat),
                                         self.per_param(flat)):
            if exported:
                optimizer.state[param] = _to_host(exported, param)
            else:
                optimizer.state.pop(param, None)
            device_state[index_of[id(param)]] = _to_host(raw, param)
        return dict(version=FORMAT_VERSION, device_state=device_state,
                    **self.scale_info())

    def keep_on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the state on the optimizer for a later compilation."""
        optimizer.__dict__[_SAVED] = self.store_on_optimizer(optimizer)


def _override(state: Dict[str, List[Tensor]], saved: Mapping[str, Any],
              rule, j: int, param: Tensor) -> None:
    """Put ``saved`` (one parameter's device state) at position ``j`` of a
    group's ``state``, in the dtype and on the device the rule uses."""
    if set(saved) != set(rule.state_names):
        raise Error(
            f"Cannot load the optimizer state dict: its device state for the "
            f"parameter of shape {tuple(param.shape)} has "
            f"{sorted(saved) or 'no state'} but {rule!r} keeps "
            f"{sorted(rule.state_names) or 'no state'}; the state dict comes "
            f"from a different optimizer or model")
    for name in rule.state_names:
        current = state[name][j]
        value = torch.as_tensor(saved[name])
        if value.shape != current.shape:
            raise Error(
                f"Cannot load the optimizer state dict: state '{name}' of "
                f"the parameter of shape {tuple(param.shape)} has shape "
                f"{tuple(value.shape)}, expected {tuple(current.shape)}; the "
                f"state dict comes from a different model")
        state[name][j] = value.detach().to(device=current.device,
                                           dtype=current.dtype, copy=True)


def _to_host(state: Mapping[str, Tensor], param: Tensor) -> ParamState:
    return {name: value.detach().to(param.device, copy=True)
            for name, value in state.items()}


def _keep_loaded_dtypes(optimizer: torch.optim.Optimizer,
                       state_dict: Mapping[str, Any]) -> None:
    """After torch's ``load_state_dict(state_dict)``: give back their loaded
    dtype to the state tensors that torch cast to their parameter's dtype."""
    saved_ids = [i for group in state_dict["param_groups"]
                 for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, param in zip(saved_ids, params):
        state = optimizer.state.get(param, {})
        for name, value in state_dict["state"].get(saved_id, {}).items():
            cast_value = state.get(name)
            if (isinstance(value, Tensor) and isinstance(cast_value, Tensor)
                    and value.dtype != cast_value.dtype == param.dtype):
                state[name] = value.detach().to(cast_value.device, copy=True)


def _param_indices(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """torch's state-dict index of each parameter (by ``id``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): index for index, p in enumerate(params)}


def _position_indices(optimizer: torch.optim.Optimizer,
                      host_params: List[Tensor]) -> List[int]:
    index_of = _param_indices(optimizer)
    return [index_of[id(p)] for p in host_params]


def _by_position(saved: Optional[Mapping], indices: List[int]
                 ) -> List[Optional[Mapping]]:
    device_state = (saved or {}).get("device_state") or {}
    return [device_state.get(index) for index in indices]


def _saved_state(optimizer: torch.optim.Optimizer) -> Optional[Dict]:
    return optimizer.__dict__.get(_SAVED)


def _is_torch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A torch.optim optimizer (poptorch.optim ones have their own state
    dictionaries)."""
    return type(optimizer).state_dict is torch.optim.Optimizer.state_dict


def _report_narrowed_state(torch_states: List[Mapping],
                           params: List[Tensor]) -> None:
    """Warn once when a torch.optim optimizer's state for float16 or
    bfloat16 parameters has their dtype: torch's ``load_state_dict`` casts
    a loaded state so, which loses the float32 values a poptorch
    checkpoint kept (before the optimizer is linked to a training model,
    nothing undoes the cast)."""
    narrowed = [param.dtype for state, param in zip(torch_states, params)
                if param.dtype in (torch.float16, torch.bfloat16)
                for name, value in state.items()
                if name != "step" and isinstance(value, Tensor)
                and value.dtype == param.dtype]
    if narrowed:
        warn_once(
            f"The torch.optim optimizer's state for {narrowed[0]} "
            f"parameters is {narrowed[0]}, which the training model keeps "
            "in float32 from now on. torch's load_state_dict() casts a "
            "loaded state to its parameter's dtype, losing the float32 "
            "values of a poptorch checkpoint: to resume exactly, load the "
            "optimizer's state dict after wrapping the model.")


def _brings_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds a state no training model has taken: a
    state dictionary loaded while no compiled model used it (or one that
    ``destroy`` kept), or, never linked to a model before, a state of its
    own."""
    held = optimizer.__dict__
    return (_SAVED in held or held.get(_GIVEN, False) or
            (not held.get(_HOOKED) and any(optimizer.state.values())))


def _forget_given_state(optimizer: torch.optim.Optimizer) -> None:
    optimizer.__dict__.pop(_SAVED, None)
    optimizer.__dict__.pop(_GIVEN, None)


# --- the link between an optimizer and its training model ---------------------

class ModelLink:
    """What a training model shows the optimizer it uses: the model itself
    (``setOptimizer`` when a state dict is loaded) and, while it is
    compiled, its optimizer device state. The model holds its link; the
    optimizer only refers to it weakly."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device_state: Optional[OptimizerDeviceState] = None


def link(optimizer: torch.optim.Optimizer, model_link: ModelLink) -> None:
    """Make ``optimizer``'s state dict read and write the linked model's
    state: through ``save_state_dict`` / ``load_state_dict`` for
    poptorch.optim optimizers, through torch's state dict hooks for
    torch.optim ones. The state of a compiled model the optimizer was
    linked to stays on the optimizer for the new model's compilation, as
    ``destroy()`` keeps it: a program that wraps a new training model around
    the same optimizer every epoch goes on from the trained state, as the
    optimizer of plain PyTorch does."""
    previous = _linked(optimizer)
    if previous is not None and previous is not model_link and \
            previous.device_state is not None:
        previous.device_state.keep_on_optimizer(optimizer)
    optimizer.__dict__[_MODEL] = weakref.ref(model_link)
    if _is_torch_optimizer(optimizer) and \
            not optimizer.__dict__.get(_HOOKED):
        optimizer.register_state_dict_pre_hook(device_state_to_host)
        optimizer.register_load_state_dict_pre_hook(_remember_loaded_state)
        optimizer.register_load_state_dict_post_hook(_loaded_state_to_device)
        optimizer.register_step_pre_hook(
            lambda stepped, args, kwargs: device_state_to_host(stepped))
        optimizer.register_step_post_hook(
            lambda stepped, args, kwargs: host_state_to_device(stepped))
        optimizer.__dict__["__getstate__"] = _torch_optimizer_pickled_state(
            weakref.ref(optimizer))
        optimizer.__dict__[_HOOKED] = True


def pickled_state(optimizer: torch.optim.Optimizer,
                  torch_state: Callable[[], Dict[str, Any]]
                  ) -> Dict[str, Any]:
    """What ``pickle`` and ``copy.deepcopy`` keep of ``optimizer``
    (``torch_state``: torch's ``__getstate__``): its state as the training
    model using it has it now, in torch's format in ``state``, and the
    device's own state, which the copy brings to the training model it is
    given to (as a state dict loaded into it would)."""
    extras = _current_extras(optimizer)
    state = dict(torch_state())
    if extras is not None:
        state[_SAVED] = extras
    return state


def _torch_optimizer_pickled_state(reference: "weakref.ref[Any]"
                                   ) -> Callable[[], Dict[str, Any]]:
    """A torch.optim optimizer's ``__getstate__`` (set on the instance,
    which pickle and copy look up first): ``pickled_state``."""
    def getstate() -> Dict[str, Any]:
        optimizer = reference()
        return pickled_state(optimizer, lambda: type(optimizer).__getstate__(
            optimizer))
    return getstate


def _current_extras(optimizer: torch.optim.Optimizer
                    ) -> Optional[Dict[str, Any]]:
    """The ``"poptorch"`` entry of ``optimizer``'s state now: the compiled
    training model's (its state copied into ``optimizer.state`` first),
    else the one kept on the optimizer, if any."""
    device = _compiled_state(optimizer)
    if device is not None:
        return device.store_on_optimizer(optimizer)
    return _saved_state(optimizer)


def device_state_to_host(optimizer: torch.optim.Optimizer) -> None:
    """Before an optimizer's ``state_dict()`` (a torch.optim one's) or host
    ``step()``: the state of the compiled training model using it, into
    ``optimizer.state``, so that a step on the host goes on from the
    trained state."""
    device = _compiled_state(optimizer)
    if device is not None:
        device.store_on_optimizer(optimizer)


def host_state_to_device(optimizer: torch.optim.Optimizer) -> None:
    """After a host ``step()`` (or a loaded state dict): the optimizer's
    state becomes the state of the compiled training model using it from
    the next call (the host's is the newer one)."""
    device = _compiled_state(optimizer)
    if device is not None:
        states = [optimizer.state.get(p, {}) for p in device.host_params]
        device.replace(device.build(states, [None] * len(states),
                                    device.loaded_scale_state({})))


def _remember_loaded_state(optimizer: torch.optim.Optimizer,
                           state_dict: Dict[str, Any]) -> None:
    """Before a torch.optim optimizer's ``load_state_dict()``: keep the
    state dict, whose dtypes torch's loading does not keep."""
    optimizer.__dict__[_LOADING] = state_dict


def _loaded_state_to_device(optimizer: torch.optim.Optimizer) -> None:
    """After a torch.optim optimizer's ``load_state_dict()``: its new
    ``optimizer.state``, in the loaded dtypes, becomes the compiled training
    model's state from the next call (a model compiled later reads it when
    it compiles)."""
    _keep_loaded_dtypes(optimizer, optimizer.__dict__.pop(_LOADING))
    if _compiled_state(optimizer) is None:
        optimizer.__dict__[_GIVEN] = True
    host_state_to_device(optimizer)


def unlink(optimizer: torch.optim.Optimizer, model_link: ModelLink) -> None:
    """Undo ``link`` if ``optimizer`` is linked to ``model_link``."""
    if _linked(optimizer) is model_link:
        del optimizer.__dict__[_MODEL]


def _linked(optimizer: torch.optim.Optimizer) -> Optional[ModelLink]:
    reference = optimizer.__dict__.get(_MODEL)
    return reference() if reference is not None else None


def linked_model(optimizer: torch.optim.Optimizer) -> Any:
    """The training model using ``optimizer``, or None."""
    model_link = _linked(optimizer)
    return model_link.model if model_link is not None else None


def _compiled_state(optimizer: torch.optim.Optimizer
                    ) -> Optional[OptimizerDeviceState]:
    """The device state of the compiled training model using
    ``optimizer``, or None."""
    model_link = _linked(optimizer)
    return model_link.device_state if model_link is not None else None


def save_state_dict(optimizer: torch.optim.Optimizer,
                    torch_state_dict: Callable[[], Dict]) -> Dict[str, Any]:
    """``optimizer.state_dict()``: torch's dictionary with the device state
    (when a compiled training model uses the optimizer) and the
    ``"poptorch"`` entry."""
    extras = dict(_current_extras(optimizer) or
                  dict(version=FORMAT_VERSION, device_state={},
                       loss_scale=None, good_steps=None))
    state_dict = torch_state_dict()
    state_dict[STATE_DICT_KEY] = extras
    return state_dict


def load_state_dict(optimizer: torch.optim.Optimizer,
                    state_dict: Mapping[str, Any],
                    torch_load: Callable[[Dict], None]) -> None:
    """``optimizer.load_state_dict()``: checks everything first, then loads
    torch's part, applies the hyper-parameters to the training model (as
    ``setOptimizer``) and writes the device state (at once when compiled,
    else at compilation). On any error the optimizer and the model are left
    as they were."""
    model = linked_model(optimizer)
    _check_state_dict(optimizer, state_dict)
    extras = state_dict[STATE_DICT_KEY]
    torch_part = {k: v for k, v in state_dict.items() if k != STATE_DICT_KEY}
    device = _compiled_state(optimizer)
    flat = None
    if device is not None:
        indices = _position_indices(optimizer, device.host_params)
        torch_states = [torch_part["state"].get(i, {}) for i in indices]
        flat = device.build(torch_states, _by_position(extras, indices),
                            device.loaded_scale_state(extras))
    backup = (optimizer.param_groups, optimizer.state)
    try:
        torch_load(torch_part)
        _keep_loaded_dtypes(optimizer, torch_part)
        if model is not None:
            model.setOptimizer(optimizer)
    except Exception:
        optimizer.param_groups, optimizer.state = backup
        raise
    if flat is not None:
        device.replace(flat)
    else:
        optimizer.__dict__[_SAVED] = extras


def _check_state_dict(optimizer: torch.optim.Optimizer,
                      state_dict: Mapping[str, Any]) -> None:
    """Raise ``poptorch.Error`` unless ``state_dict`` is a poptorch optimizer
    state dict that fits ``optimizer``'s parameters."""
    prefix = "Cannot load the optimizer state dict"
    extras = state_dict.get(STATE_DICT_KEY)
    if extras is None:
        raise Error(
            f"{prefix}: it has no '{STATE_DICT_KEY}' entry, so it does not "
            f"come from the state_dict() of a poptorch.optim optimizer. A "
            f"poptorch.optim optimizer can only load the state dict of such "
            f"an optimizer, not one from native PyTorch (a torch.optim "
            f"state dict lacks its hyper-parameters and the device state)")
    if not isinstance(extras, Mapping) or \
            extras.get("version") != FORMAT_VERSION:
        raise Error(f"{prefix}: its '{STATE_DICT_KEY}' entry must be a dict "
                    f"with version {FORMAT_VERSION}, got {extras!r:.200}")
    groups = state_dict.get("param_groups")
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = ([len(g.get("params", ())) for g in groups]
              if isinstance(groups, list) else None)
    if theirs != ours:
        raise Error(f"{prefix}: it has param groups of sizes {theirs} but the "
                    f"optimizer's param groups have sizes {ours}; the state "
                    f"dict comes from a different model or optimizer")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for source in ("state", "device_state"):
        entries = (state_dict if source == "state" else extras).get(source)
        _check_entries(source, entries or {}, params)
    _check_scale(extras)


def _check_entries(source: str, entries: Mapping, params: List[Tensor]) -> None:
    for index, entry in entries.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise Error(f"Cannot load the optimizer state dict: its '{source}' "
                        f"has an entry for parameter {index!r} but the "
                        f"optimizer has {len(params)} parameters")
        shape = params[index].shape
        for name, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and \
                    value.shape != shape:
                raise Error(
                    f"Cannot load the optimizer state dict: '{source}' of "
                    f"parameter {index} has '{name}' of shape "
                    f"{tuple(value.shape)} but the parameter has shape "
                    f"{tuple(shape)}; the state dict comes from a different "
                    f"model")


def _check_scale(extras: Mapping[str, Any]) -> None:
    scale, good_steps = extras.get("loss_scale"), extras.get("good_steps")
    if scale is not None and not (isinstance(scale, (int, float)) and
                                  math.isfinite(scale) and scale > 0):
        raise Error(f"Cannot load the optimizer state dict: 'loss_scale' must "
                    f"be None or a finite number > 0, got {scale!r}")
    if good_steps is not None and not (isinstance(good_steps, int)
                                       and good_steps >= 0):
        raise Error(f"Cannot load the optimizer state dict: 'good_steps' must "
                    f"be None or an integer >= 0, got {good_steps!r}")
