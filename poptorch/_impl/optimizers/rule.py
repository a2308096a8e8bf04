"""The interface of a pure optimizer update, and the tensor-list helpers the
families share.

A training step is traced once into a static graph and run many times, so an
update rule is a pure function of tensors: it never reads a tensor value in
Python, never mutates its inputs and keeps no state between calls. Per-group
hyper-parameters arrive as 0-d tensors, float64 in training models
(changing them needs no re-trace); structural choices are Python constants
fixed when the rule is built. Updates use the out-of-place ``torch._foreach_*`` ops over a group's
tensor lists, so a group's update is a handful of graph nodes.

All tensors of one group (parameters, gradients, state) live on one device;
the hyper-parameter tensors live on that device too or are CPU scalars.

Hyper-parameter tensors may be float32 or float64; the per-step scalar maths
(``1 - beta``, bias corrections, step sizes) is done in their dtype and the
tensor maths in the widest dtype of each param, its gradient and its state;
the new param is cast back to the param's dtype and the new state to the
state's. torch.optim does the scalar maths in Python (double precision):
float64 hyper-parameters reproduce it to rounding, while float32 ones shift
values such as ``1 - 0.999`` by about 1e-5 relative.

State dtypes follow PopTorch: each state tensor has the dtype of its
accumulation type (``velocity_accum_type``,
``first_order_momentum_accum_type``, ``second_order_momentum_accum_type``),
float32 when the optimizer leaves it None or has no such attribute (a
torch.optim optimizer), whatever the params' dtype. So a float16 model keeps
float32 optimizer state, and its update is computed in float32 and rounded
to float16 once, as PopART does. float64 params (which IPUs never had) are
the exception: their state stays float64, never narrowed.
"""
import abc
import functools
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import torch
from torch import Tensor

from ...errors import Error

TorchState = Mapping[str, Any]
#: Per-tensor 2-norms of a list of tensors, computed in a dtype.
TensorNorms = Callable[[List[Tensor], torch.dtype], List[Tensor]]


def whole_tensor_norms(tensors: List[Tensor],
                       dtype: torch.dtype) -> List[Tensor]:
    """The 2-norm of each of ``tensors``, in ``dtype``."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


class UpdateRule(abc.ABC):
    """Pure update of one param group for one optimizer family."""

    #: Structural settings fixed at trace time (hashable, sorted by name).
    constants: Tuple[Tuple[str, Any], ...]
    #: Names of the numeric per-group hyper-parameters fed as 0-d tensors.
    hyper_names: Tuple[str, ...]
    #: Names of the per-parameter state tensors.
    state_names: Tuple[str, ...]

    @abc.abstractmethod
    def init_state(self, params: List[Tensor],
                   torch_state: List[TorchState]) -> Dict[str, List[Tensor]]:
        """Initial state for each param (on the param's device, dtype per the
        accumulation types); a non-empty ``torch_state[i]`` (the torch
        optimizer's ``state[p]``) is the starting point for that param."""

    @abc.abstractmethod
    def update(self, params: List[Tensor], grads: List[Tensor],
               state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor],
               norms: Optional["TensorNorms"] = None
               ) -> Tuple[List[Tensor], Dict[str, List[Tensor]]]:
        """New params and new state; pure; ``grads`` are already reduced
        (mean or sum) and unscaled. A rule that needs per-tensor norms
        (LAMB) computes them with ``norms`` when given: the tensors may be
        rows of the parameters (replicated tensor sharding) whose norms are
        those of the whole tensors; else ``whole_tensor_norms``."""

    @abc.abstractmethod
    def export_state(self, params: List[Tensor],
                     state: Dict[str, List[Tensor]]) -> List[Dict[str, Tensor]]:
        """Per-param state in torch.optim's format (the keys and meaning of
        torch's ``state[p]``; empty before the first update, like torch)."""

    @abc.abstractmethod
    def hyper_values(self, group: Mapping[str, Any]) -> Dict[str, float]:
        """The current values of ``hyper_names`` read from a param group."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.constants == other.constants

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, self.constants))

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={value!r}" for name, value in self.constants)
        return f"{type(self).__name__}({settings})"


def sorted_constants(**settings: Any) -> Tuple[Tuple[str, Any], ...]:
    """``settings`` as the sorted ``(name, value)`` tuple of ``constants``."""
    return tuple(sorted(settings.items()))


# State creation -------------------------------------------------------------

#: PopTorch's accumulation type where an optimizer leaves it open.
DEFAULT_ACCUM_TYPE = torch.float32


def accum_type_of(group: Mapping[str, Any], name: str) -> torch.dtype:
    """The accumulation type attribute ``name`` of a param group: its value,
    or PopTorch's default float32 when it is None or absent (torch.optim)."""
    value = group.get(name)
    return DEFAULT_ACCUM_TYPE if value is None else value


def storage_dtype(param: Tensor, accum_type: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of a state tensor: the accumulation type, or the param's
    when None (SGD's combined velocity, which has no accumulation type).
    float64 params, which IPUs never had, keep float64 state."""
    if accum_type is None or param.dtype == torch.float64:
        return param.dtype
    return accum_type


def state_tensors(name: str, params: Sequence[Tensor],
                  torch_state: Sequence[TorchState],
                  accum_type: Optional[torch.dtype],
                  fill: float = 0.0) -> List[Tensor]:
    """One state tensor per param: a copy of ``torch_state[i][name]`` when it
    is there, else a tensor like the param filled with ``fill``."""
    tensors = []
    for index, (param, given) in enumerate(zip(params, torch_state)):
        dtype = storage_dtype(param, accum_type)
        value = given.get(name)
        if value is None:
            tensors.append(torch.full_like(param, fill, dtype=dtype))
            continue
        value = torch.as_tensor(value).detach()
        if value.shape != param.shape:
            raise Error(f"Optimizer state '{name}' of parameter {index} has "
                        f"shape {tuple(value.shape)} but the parameter has "
                        f"shape {tuple(param.shape)}")
        tensors.append(value.to(device=param.device, dtype=dtype, copy=True))
    return tensors


def step_tensors(params: Sequence[Tensor],
                 torch_state: Sequence[TorchState]) -> List[Tensor]:
    """One 0-d float32 step counter per param: torch's ``state[p]["step"]``,
    or 0 for a param with no torch state."""
    return [torch.tensor(float(torch.as_tensor(given.get("step", 0.0)).item()),
                         dtype=torch.float32, device=param.device)
            for param, given in zip(params, torch_state)]


def has_started(step: Tensor) -> bool:
    """Whether a param has been updated at least once (host side only)."""
    return bool(step.item() > 0)


def started_state(state: Dict[str, List[Tensor]],
                  names: Sequence[str]) -> List[Dict[str, Tensor]]:
    """Per param, copies of its ``names`` state tensors, or an empty dict for
    a param never updated (torch creates the state on the first step)."""
    return [{name: state[name][index].clone() for name in names}
            if has_started(step) else {}
            for index, step in enumerate(state["step"])]


# Dtypes ---------------------------------------------------------------------

def compute_dtypes(*tensor_lists: Sequence[Tensor]) -> List[torch.dtype]:
    """Per param, the widest dtype among its tensors in ``tensor_lists``: the
    update is computed in it and the results are cast back for storage."""
    return [functools.reduce(torch.promote_types, (t.dtype for t in tensors))
            for tensors in zip(*tensor_lists)]


def cast(tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> List[Tensor]:
    """``tensors`` converted to ``dtypes`` (no graph node where they match)."""
    return [t if t.dtype == dtype else t.to(dtype)
            for t, dtype in zip(tensors, dtypes)]


def dtypes_of(tensors: Sequence[Tensor]) -> List[torch.dtype]:
    return [t.dtype for t in tensors]


# Tensor-list arithmetic -----------------------------------------------------

def is_zero_constant(value: Any) -> bool:
    """Whether ``value`` is a compile-time constant (a Python number) that is
    zero, so the operation it scales can be left out of the graph."""
    return not isinstance(value, (Tensor, list)) and value == 0


def in_dtype_of(tensors: Sequence[Tensor], value: Any) -> Any:
    """A 0-d tensor ``value`` converted once to the dtype of ``tensors``, so
    that a foreach operation does not convert it again for every tensor.
    Python numbers (constant attributes) and lists pass unchanged."""
    if isinstance(value, Tensor) and tensors and value.dtype != tensors[0].dtype:
        return value.to(tensors[0].dtype)
    return value


def add_scalar(tensors: List[Tensor], value: Union[float, Tensor]
               ) -> List[Tensor]:
    """``tensors + value`` for a number or a 0-d tensor. A tensor goes
    through the ``Tensor`` overload: ``torch._foreach_add`` would take it as
    a Scalar and read its value on the host (which capture refuses)."""
    if isinstance(value, Tensor):
        return list(torch.ops.aten._foreach_add.Tensor(
            list(tensors), in_dtype_of(tensors, value)))
    return list(torch._foreach_add(tensors, value))


def add_scaled(base: List[Tensor], other: List[Tensor],
               scale: Union[float, Tensor, List[Tensor]]) -> List[Tensor]:
    """``base + other * scale`` with a number, a 0-d tensor or one 0-d tensor
    per item; a constant zero scale adds nothing."""
    if is_zero_constant(scale):
        return list(base)
    return torch._foreach_add(
        base, torch._foreach_mul(other, in_dtype_of(other, scale)))


def sub_scaled(base: List[Tensor], other: List[Tensor],
               scale: Union[float, Tensor, List[Tensor]]) -> List[Tensor]:
    """``base - other * scale``."""
    if is_zero_constant(scale):
        return list(base)
    return torch._foreach_sub(
        base, torch._foreach_mul(other, in_dtype_of(other, scale)))


def lerp(start: List[Tensor], end: List[Tensor], weight: Tensor) -> List[Tensor]:
    """``start + (end - start) * weight`` (torch's ``lerp`` with a tensor weight)."""
    return add_scaled(start, torch._foreach_sub(end, start), weight)


def decay_average(average: List[Tensor], values: List[Tensor],
                  decay: Tensor) -> List[Tensor]:
    """``average * decay + values**2 * (1 - decay)`` (a second moment)."""
    squares = torch._foreach_mul(values, values)
    return add_scaled(torch._foreach_mul(average, in_dtype_of(average, decay)),
                      squares, 1 - decay)


def per_param(scalars: Tensor,
              like: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
    """A 1-D tensor of per-param scalars as a list of 0-d tensors, converted
    once to the dtype of the tensors ``like`` when given."""
    if like:
        scalars = scalars.to(like[0].dtype)
    return list(torch.unbind(scalars))


def stacked(scalars: Sequence[Tensor], like: Optional[Tensor] = None) -> Tensor:
    """Per-param 0-d tensors as one 1-D tensor (one node for their maths),
    in the dtype of ``like`` (a hyper-parameter) when given."""
    vector = torch.stack(list(scalars))
    if like is None:
        return vector
    return vector.to(like.dtype if isinstance(like, Tensor) else torch.float64)


# Gradient clipping ----------------------------------------------------------

def clip_grad_norm(grads: List[Tensor],
                   max_norm: Union[float, Tensor]) -> List[Tensor]:
    """Gradients scaled so that their global 2-norm is at most ``max_norm``.

    Pure version of ``torch.nn.utils.clip_grad_norm_``: the total norm is the
    norm of the per-tensor norms, the scale is
    ``min(max_norm / (total_norm + 1e-6), 1)``.
    """
    if not grads:
        return []
    norm_dtype = functools.reduce(torch.promote_types, dtypes_of(grads))
    norms = torch._foreach_norm(grads, 2, dtype=norm_dtype)
    return clip_to_norm(grads, max_norm,
                        torch.linalg.vector_norm(stacked(norms)))


def clip_to_norm(grads: List[Tensor], max_norm: Union[float, Tensor],
                 total_norm: Tensor) -> List[Tensor]:
    """``grads`` scaled by ``min(max_norm / (total_norm + 1e-6), 1)``."""
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    return list(torch._foreach_mul(grads, scale)) if grads else []
