"""PopTorch ops (API reference 11.3, and PopTorch 3.4's ``cond`` and
``dynamic_update``) on ordinary PyTorch devices.

``ipu_print_tensor``, ``nop`` and ``recomputationCheckpoint`` are identity
custom ops of the ``poptorch`` namespace (``torch.ops.poptorch.*``): a
traced graph keeps each as one node, and they differentiate in eager mode,
when a traced graph is replayed under autograd, and under ``torch.func``
transforms. The IPU tuning knobs (``set_available_memory``,
``set_overlap_for_input``/``output``, ``MultiConv``) validate their
arguments and say once, at INFO, that they have no effect here.

Programs that call PopTorch's operators directly find them with PopTorch's
schemas (see the end of this file):

* ``ipu_print_tensor(Tensor self, str title="", int print_gradient=1,
  int summarise_threshold=1000, int edge_items=3, int max_line_width=80,
  int digits=4, int float_format=0, str separator=" ",
  str open_bracket="[", str close_bracket="]") -> Tensor``: prints with
  PyTorch's print options set from the formatting arguments (0 turns
  summarising, line splitting and the digits off; ``float_format`` 0 auto,
  1 fixed, 2 scientific, 3 none); the separator and brackets are logged
  once, not applied;
* ``nop(Tensor self) -> Tensor``, ``recomputation_checkpoint(Tensor self)
  -> Tensor``;
* ``push_name_scope(str name) -> ()`` / ``pop_name_scope() -> ()``: what
  entering and leaving a ``NameScope`` do;
* ``begin_ipu_block(int stage_id, int phase_id, int ipu_id) -> ()``:
  ``Block.start(str(stage_id), ipu_id)`` (no IPU when ``ipu_id`` is
  negative; the execution strategy gives the phase); ``end_ipu_block() ->
  ()`` does nothing, as a block lasts until the next one begins;
* the tuning knobs, identities that validate and log once:
  ``set_available_memory(Tensor self, float proportion) -> Tensor``,
  ``set_matmul_serialization(Tensor matmul, str mode, int factor,
  bool keep_precision) -> Tensor`` (``mode`` one of PopTorch's
  ``"input_channels"``, ``"reducing_dim"``, ``"output_channels"``,
  ``"none"``) and ``optimizer_group(int group, Tensor[] inputs) -> ()``.
"""
import functools
import sys
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..enums import MatMulSerializationMode, MultiConvPlanType, OverlapMode
from ..errors import Error
from . import blocks, ctc_decoder, graphcore_ops, host_callbacks
from .logger import info_once


def _check_tensor(function: str, argument: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise Error(f"{function}: {argument} must be a torch.Tensor, not "
                    f"{type(value).__name__}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_count(function: str, argument: str, value, minimum: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) \
            and value >= minimum:
        return value
    raise Error(f"{function}: {argument} must be an integer >= {minimum}, "
                f"not {value!r}")


def _do_nothing(*args) -> None:
    return None


def _define_identity_op(name: str, schema: str,
                        effect: Callable[..., None],
                        gradient: Callable[..., torch.Tensor],
                        check: Callable[..., None] = _do_nothing):
    """Define ``poptorch::<name>``, which checks its arguments with
    ``check(tensor, *args)`` (also when traced), runs
    ``effect(tensor, *args)`` and returns a copy of ``tensor``; under
    autograd its backward is ``gradient(grad, *args)``. The arguments a
    call leaves out are not passed on: the functions give them the schema's
    defaults."""

    def implementation(tensor, *args):
        check(tensor, *args)
        effect(tensor, *args)
        return tensor.clone()

    def fake(tensor, *args):
        check(tensor, *args)
        return torch.empty_like(tensor)

    op = torch.library.custom_op(f"poptorch::{name}", implementation,
                                 mutates_args=(), schema=schema)
    op.register_fake(fake)

    def setup_context(ctx, inputs, output):
        ctx.arguments = inputs[1:]

    def backward(ctx, grad):
        return (gradient(grad, *ctx.arguments),) + (None,) * len(ctx.arguments)

    op.register_autograd(backward, setup_context=setup_context)

    def batched(info, in_dims, tensor, *args):
        """Under vmap (vectorised replicas) the op applies to the whole
        batched tensor at once."""
        return op(tensor, *args), in_dims[0]

    op.register_vmap(batched)
    return op


def _tracks_gradients(tensor: torch.Tensor) -> bool:
    """``tensor.requires_grad``, read as torch answers it without the
    capture's modes (replicas' activations under vmap answer False: the
    ops' vmap rules apply there)."""
    with torch._C.DisableTorchFunction():
        return tensor.requires_grad


def _apply_identity_op(op, tensor: torch.Tensor, *args) -> torch.Tensor:
    """``op(tensor, *args)``; when a gradient must flow through, the op is
    applied to the detached tensor and joined to it by an exact identity
    (``where`` with an all-true mask). That form differentiates under
    ``torch.func`` transforms too, which refuse the autograd formulas of
    custom ops and ``autograd.Function``s when functionalizing."""
    if not (torch.is_grad_enabled() and _tracks_gradients(tensor)):
        return op(tensor, *args)
    keep = torch.ones_like(tensor, dtype=torch.bool)
    return torch.where(keep, tensor, op(tensor.detach(), *args))


#: The arguments of PopTorch's ``ipu_print_tensor`` op after the tensor and
#: its title, as (name, schema type, PopTorch's default).
_PRINT_FORMAT = (
    ("print_gradient", "int", 1),
    ("summarise_threshold", "int", 1000),
    ("edge_items", "int", 3),
    ("max_line_width", "int", 80),
    ("digits", "int", 4),
    ("float_format", "int", 0),
    ("separator", "str", " "),
    ("open_bracket", "str", "["),
    ("close_bracket", "str", "]"),
)
#: ``float_format``'s values, by number.
_FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")
_PRINT_SCHEMA = "(Tensor self, str title=\"\", {}) -> Tensor".format(
    ", ".join(f"{kind} {name}={default}" if kind == "int"
              else f'{kind} {name}="{default}"'
              for name, kind, default in _PRINT_FORMAT))


def _print_format(values: Sequence) -> Dict[str, object]:
    """The formatting arguments by name; PopTorch's defaults for the last
    ones when ``values`` stops short."""
    defaults = [default for _, _, default in _PRINT_FORMAT]
    return {name: value for (name, _, _), value in
            zip(_PRINT_FORMAT, list(values) + defaults[len(values):])}


def _check_print_arguments(tensor: torch.Tensor, title: str = "",
                           *values) -> None:
    function = "torch.ops.poptorch.ipu_print_tensor"
    chosen = _print_format(values)
    for name in ("summarise_threshold", "edge_items", "max_line_width",
                 "digits"):
        _check_count(function, name, chosen[name], 0)
    if chosen["float_format"] not in range(len(_FLOAT_FORMATS)):
        allowed = ", ".join(f"{number} ({name})"
                            for number, name in enumerate(_FLOAT_FORMATS))
        raise Error(f"{function}: float_format must be one of {allowed}, "
                    f"not {chosen['float_format']!r}")
    brackets = [chosen[name] for name in
                ("separator", "open_bracket", "close_bracket")]
    if brackets != [default for _, _, default in _PRINT_FORMAT[-3:]]:
        info_once(f"{function}: separator, open_bracket and close_bracket "
                  "are accepted but have no effect on this device: values "
                  "print as PyTorch prints tensors")


def _torch_print_options(chosen: Dict[str, object]) -> Dict[str, object]:
    """PyTorch's print options for PopTorch's formatting arguments (0 turns
    summarising, line splitting and the number of digits off)."""
    float_format = _FLOAT_FORMATS[chosen["float_format"]] \
        if chosen["digits"] else "none"
    return {"threshold": chosen["summarise_threshold"] or sys.maxsize,
            "edgeitems": chosen["edge_items"],
            "linewidth": chosen["max_line_width"] or sys.maxsize,
            "precision": chosen["digits"] or None,
            "sci_mode": {"fixed": False,
                         "scientific": True}.get(float_format)}


def _print_with_title(tensor: torch.Tensor, title: str = "",
                      *values) -> None:
    with torch._tensor_str.printoptions(
            **_torch_print_options(_print_format(values))):
        text = str(tensor.detach())
    print(f"{title}: {text}" if title else text, flush=True)


def _gradient_title(title: str) -> str:
    return f"{title}_gradient" if title else "gradient"


def _print_gradient(title: str, grad: torch.Tensor, *values) -> torch.Tensor:
    """Print ``grad`` after the gradient's title unless ``values`` (the
    formatting arguments) turn ``print_gradient`` off."""
    if not _print_format(values)["print_gradient"]:
        return grad
    return _apply_identity_op(_print_op, grad, _gradient_title(title), 0,
                              *values[1:])


def _pass_gradient(grad: torch.Tensor, *args) -> torch.Tensor:
    return grad


_print_op = _define_identity_op(
    "ipu_print_tensor", _PRINT_SCHEMA, _print_with_title,
    lambda grad, title="", *values: _print_gradient(title, grad, *values),
    check=_check_print_arguments)
_nop_op = _define_identity_op("nop", "(Tensor self) -> Tensor",
                              _do_nothing, _pass_gradient)
_checkpoint_op = _define_identity_op("recomputation_checkpoint",
                                     "(Tensor self) -> Tensor",
                                     _do_nothing, _pass_gradient)


def ipu_print_tensor(tensor: torch.Tensor, title: str = "") -> torch.Tensor:
    """Print the value of ``tensor`` (after ``title``) each time the op runs,
    and its gradient (after ``title + "_gradient"``) in the backward pass.

    The op is an identity: use the tensor it returns in place of the
    original, otherwise the print is optimised away with the unused
    result.
    """
    _check_tensor("ipu_print_tensor", "tensor", tensor)
    if not isinstance(title, str):
        raise Error(f"ipu_print_tensor: title must be a string, not "
                    f"{type(title).__name__}")
    printed = _apply_identity_op(_print_op, tensor, title)
    if printed.requires_grad:
        hook = functools.partial(_print_gradient, title)
        hook.prints_only = True         # no gradient hook to the stages
        printed.register_hook(hook)
    return printed


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """A no-operation: an identity that stays in the traced graph as its own
    node (``torch.ops.poptorch.nop``) instead of being folded away; useful
    for debugging."""
    _check_tensor("nop", "tensor", tensor)
    return _apply_identity_op(_nop_op, tensor)


def recomputationCheckpoint(*tensors: torch.Tensor
                            ) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Mark values to keep between the forward and backward passes: in the
    training of a model whose blocks form several stages, the rest of each
    stage's activations are recomputed in the backward pass
    (``_impl/staging/stages.py``).

    Returns the tensors (the same number and shapes): a tensor for a single
    tensor argument, else a list. Each goes through the op
    ``torch.ops.poptorch.recomputation_checkpoint`` so that a recomputation
    pass can find it; values are unchanged.
    """
    given_a_list = len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
    if given_a_list:
        tensors = tuple(tensors[0])
    if not tensors:
        raise Error("recomputationCheckpoint needs at least one tensor")
    for position, tensor in enumerate(tensors):
        _check_tensor("recomputationCheckpoint", f"tensor {position}", tensor)
    info_once("recomputationCheckpoint: training models whose blocks form "
              "several stages keep the checkpointed tensors and recompute the "
              "rest of each stage's activations in the backward pass; in "
              "other models the checkpoints change nothing")
    checkpointed = [_apply_identity_op(_checkpoint_op, tensor)
                    for tensor in tensors]
    return checkpointed if given_a_list or len(checkpointed) > 1 \
        else checkpointed[0]


def set_available_memory(tensor: torch.Tensor,
                         available_memory_proportion: float) -> torch.Tensor:
    """Set the proportion (0 to 1) of tile memory the operation producing
    ``tensor`` may use for temporary data. An IPU tuning knob: validated,
    without effect here. Returns ``tensor``."""
    _check_tensor("set_available_memory", "tensor", tensor)
    if not _is_number(available_memory_proportion) \
            or not 0.0 <= available_memory_proportion <= 1.0:
        raise Error("set_available_memory: available_memory_proportion must "
                    "be a number between 0.0 and 1.0, not "
                    f"{available_memory_proportion!r}")
    info_once("set_available_memory is accepted but has no effect on this "
              "device")
    return tensor


def _set_overlap(function: str, argument: str, tensors, mode: OverlapMode):
    if not isinstance(mode, OverlapMode):
        raise Error(f"{function}: mode must be a poptorch.OverlapMode "
                    f"({', '.join(OverlapMode.__members__)}), not {mode!r}")
    for leaf in pytree.tree_leaves(tensors):
        if not isinstance(leaf, torch.Tensor):
            raise Error(f"{function}: {argument} must be a tensor or tuples, "
                        "lists and dicts of tensors; found "
                        f"{type(leaf).__name__} {leaf!r}")
    info_once(f"{function} is accepted but has no effect on this device")
    return tensors


def set_overlap_for_input(input_tensors, mode: OverlapMode):
    """Set how the host-to-device copy of ``input_tensors`` (a tensor, or
    tuples, lists and dicts of tensors) overlaps computation. An IPU tuning
    knob: validated, without effect here. Returns ``input_tensors``."""
    return _set_overlap("set_overlap_for_input", "input_tensors",
                        input_tensors, mode)


def set_overlap_for_output(output_tensors, mode: OverlapMode):
    """Set how the device-to-host copy of ``output_tensors`` (a tensor, or
    tuples, lists and dicts of tensors) overlaps computation. An IPU tuning
    knob: validated, without effect here. Returns ``output_tensors``."""
    return _set_overlap("set_overlap_for_output", "output_tensors",
                        output_tensors, mode)


_SERIALIZED_DIMENSIONS = {
    MatMulSerializationMode.InputChannels: ("input channels (dimension m)",
                                            "lhs", -2),
    MatMulSerializationMode.ReducingDim: ("reducing dimension (dimension n)",
                                          "lhs", -1),
    MatMulSerializationMode.OutputChannels: ("output channels (dimension p)",
                                             "rhs", -1),
}


def _check_matmul_operands(lhs: torch.Tensor, rhs: torch.Tensor) -> None:
    _check_tensor("serializedMatMul", "lhs", lhs)
    _check_tensor("serializedMatMul", "rhs", rhs)
    if lhs.dim() < 2 or rhs.dim() < 2 or lhs.shape[-1] != rhs.shape[-2]:
        raise Error("serializedMatMul: lhs (..., m, n) and rhs (..., n, p) "
                    "must be matrices with matching n; got shapes "
                    f"{tuple(lhs.shape)} and {tuple(rhs.shape)}")


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor,
                     mode: MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``lhs @ rhs`` computed as ``factor`` smaller multiplications, one
    after the other, split along the dimension ``mode`` names (for lhs
    m x n and rhs n x p): ``InputChannels`` m, ``ReducingDim`` n (the partial
    products are summed), ``OutputChannels`` p, or ``Disabled`` (a plain
    matmul). ``factor`` must divide that dimension.

    With float16 inputs and ``keep_precision=True``, the additions of the
    ``ReducingDim`` forward pass and of the ``InputChannels`` backward pass
    happen in float32.
    """
    if not isinstance(mode, MatMulSerializationMode):
        raise Error("serializedMatMul: mode must be a "
                    "poptorch.MatMulSerializationMode ("
                    f"{', '.join(MatMulSerializationMode.__members__)}), "
                    f"not {mode!r}")
    if not isinstance(keep_precision, bool):
        raise Error("serializedMatMul: keep_precision must be a bool, not "
                    f"{keep_precision!r}")
    _check_matmul_operands(lhs, rhs)
    if mode == MatMulSerializationMode.Disabled:
        return torch.matmul(lhs, rhs)
    factor = _check_count("serializedMatMul", "factor", factor, 1)
    name, operand, dim = _SERIALIZED_DIMENSIONS[mode]
    size = (lhs if operand == "lhs" else rhs).shape[dim]
    if size % factor != 0:
        raise Error(f"serializedMatMul: factor {factor} does not divide the "
                    f"{name}, of size {size}, of {operand}; lhs has shape "
                    f"{tuple(lhs.shape)}, rhs {tuple(rhs.shape)}")
    upcast = keep_precision and lhs.dtype == torch.float16 \
        and mode != MatMulSerializationMode.OutputChannels
    left, right = (lhs.float(), rhs.float()) if upcast else (lhs, rhs)
    piece = size // factor
    if mode == MatMulSerializationMode.InputChannels:
        result = torch.cat([torch.matmul(rows, right)
                            for rows in left.split(piece, dim=-2)], dim=-2)
    elif mode == MatMulSerializationMode.OutputChannels:
        result = torch.cat([torch.matmul(left, columns)
                            for columns in right.split(piece, dim=-1)], dim=-1)
    else:
        partials = [torch.matmul(a, b) for a, b in
                    zip(left.split(piece, dim=-1), right.split(piece, dim=-2))]
        result = sum(partials[1:], partials[0])
    return result.to(lhs.dtype) if upcast else result


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor,
                  size: int, step: int) -> torch.Tensor:
    """``tensor`` sliced along ``dim`` from ``start`` (a tensor holding one
    integer, which may change from run to run) over ``size`` elements with
    ``step``: like ``tensor[start:start + size:step]`` along ``dim``.

    ``size`` and ``step`` are constant, so the result's shape is static and
    the op traces into a static graph (an ``index_select``). ``start + size``
    must not exceed the dimension; an index past it raises an indexing
    error when the graph runs.
    """
    first = _check_dim_and_start("dynamic_slice", "tensor", tensor, dim,
                                 start)
    size = _check_count("dynamic_slice", "size", size, 1)
    step = _check_count("dynamic_slice", "step", step, 1)
    if size > tensor.shape[dim]:
        raise Error(f"dynamic_slice: size {size} exceeds dimension {dim} of "
                    f"the tensor, of size {tensor.shape[dim]}")
    offsets = torch.arange(0, size, step, device=tensor.device)
    return torch.index_select(tensor, dim, first + offsets)


def _check_dim_and_start(function: str, argument: str, tensor: torch.Tensor,
                         dim: int, start: torch.Tensor) -> torch.Tensor:
    """Check ``dim`` (a dimension of ``tensor``, the argument
    ``argument``) and ``start``; ``start`` as a 0-d long tensor on the
    tensor's device."""
    _check_tensor(function, argument, tensor)
    if isinstance(dim, bool) or not isinstance(dim, int) \
            or not -tensor.dim() <= dim < tensor.dim():
        raise Error(f"{function}: dim must be an integer in "
                    f"[{-tensor.dim()}, {tensor.dim() - 1}] for a tensor of "
                    f"shape {tuple(tensor.shape)}, not {dim!r}")
    _check_tensor(function, "start", start)
    if start.numel() != 1 or start.dtype.is_floating_point \
            or start.dtype.is_complex or start.dtype == torch.bool:
        raise Error(f"{function}: start must be a tensor holding one "
                    f"integer; got dtype {start.dtype} and shape "
                    f"{tuple(start.shape)}")
    return start.to(device=tensor.device, dtype=torch.long).reshape(())


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int,
                   start: torch.Tensor, size: int) -> torch.Tensor:
    """``input`` with ``src`` written along ``dim`` from ``start`` (a tensor
    holding one integer, which may change from run to run) over ``size``
    elements: like ``input[start:start + size] = src`` along ``dim``, on a
    copy. The counterpart of ``dynamic_slice``.

    ``src`` has ``input``'s dtype and shape except ``size`` elements along
    ``dim``. The result is differentiable in ``input`` (whose gradient is
    zero where ``src`` was written) and in ``src``. ``start + size`` must
    not exceed the dimension; an index past it raises an indexing error
    when the graph runs.
    """
    first = _check_dim_and_start("dynamic_update", "input", input, dim,
                                 start)
    size = _check_count("dynamic_update", "size", size, 1)
    if size > input.shape[dim]:
        raise Error(f"dynamic_update: size {size} exceeds dimension {dim} of "
                    f"input, of size {input.shape[dim]}")
    _check_tensor("dynamic_update", "src", src)
    expected = input.shape[:dim % input.dim()] + (size,) \
        + input.shape[dim % input.dim() + 1:]
    if src.shape != expected or src.dtype != input.dtype:
        raise Error(f"dynamic_update: src must be a {input.dtype} tensor of "
                    f"shape {tuple(expected)} (input's shape with size {size}"
                    f" along dim {dim}); got {src.dtype} of shape "
                    f"{tuple(src.shape)}")
    indices = first + torch.arange(size, device=input.device)
    return input.index_copy(dim, indices, src)


def _as_tensor_list(function: str, what: str, values) -> List[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)) and all(
            isinstance(value, torch.Tensor) for value in values):
        return list(values)
    raise Error(f"{function}: {what} must be a tensor or a list or tuple of "
                f"tensors, not {values!r}")


def _check_loop_carried(inputs: Sequence[torch.Tensor],
                        outputs: Sequence[torch.Tensor]) -> None:
    if len(outputs) != len(inputs):
        raise Error(f"for_loop: body takes {len(inputs)} tensor(s) but "
                    f"returned {len(outputs)}; it must return as many "
                    "tensors as it takes")
    for position, (before, after) in enumerate(zip(inputs, outputs)):
        if before.shape != after.shape or before.dtype != after.dtype:
            raise Error(f"for_loop: body output {position} is "
                        f"{after.dtype} {tuple(after.shape)} but input "
                        f"{position} is {before.dtype} "
                        f"{tuple(before.shape)}; they must match")


def for_loop(count: int, body: Callable[..., object],
             inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Run ``body`` ``count`` times, passing each iteration the tensors the
    previous one returned (``inputs`` for the first); return the last
    iteration's tensors as a list.

    ``body`` must return as many tensors as it takes, with the same shapes
    and dtypes. ``count`` is a Python int: a captured graph holds the
    iterations unrolled. The inputs are passed by value, as in PopTorch: an
    in-place operation of ``body`` never writes into the caller's tensors.
    """
    count = _check_count("for_loop", "count", count, 0)
    if not callable(body):
        raise Error(f"for_loop: body must be callable, not "
                    f"{type(body).__name__}")
    values = [value.clone()
              for value in _as_tensor_list("for_loop", "inputs", inputs)]
    for _ in range(count):
        outputs = _as_tensor_list("for_loop", "the value body returns",
                                  body(*values))
        _check_loop_carried(values, outputs)
        values = outputs
    return values


_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)


class _ConvolutionCounter(TorchFunctionMode):
    """Counts the convolutions called while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _CONVOLUTIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _check_proportion_below_one(value) -> bool:
    return _is_number(value) and 0.0 <= value < 1.0


def _check_partials_type(value) -> bool:
    return value in (torch.float16, torch.float32)


def _check_bool(value) -> bool:
    return isinstance(value, bool)


class MultiConv:
    """Combine the convolutions evaluated inside this scope into one
    multi-convolution.

    >>> with poptorch.MultiConv():
    ...     y = self.convA(x)
    ...     v = self.convB(u)

    The builder methods validate their values and return ``self``; a value
    given as a list must hold one entry per convolution run in the scope.
    This is an IPU tuning knob: the convolutions run as ordinary PyTorch
    convolutions.
    """

    def __init__(self) -> None:
        self._per_convolution: dict = {}
        self._counter: Optional[_ConvolutionCounter] = None

    def _set_per_convolution(self, method: str, value, check: Callable,
                             allowed: str) -> "MultiConv":
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or not all(check(v) for v in values):
            raise Error(f"MultiConv.{method}: expected {allowed}, or a list "
                        f"or tuple of them (one per convolution); got "
                        f"{value!r}")
        if isinstance(value, (list, tuple)):
            self._per_convolution[method] = len(values)
        else:
            self._per_convolution.pop(method, None)
        return self

    def availableMemoryProportions(self, value) -> "MultiConv":
        """The available memory proportion per convolution, each in
        [0, 1)."""
        return self._set_per_convolution("availableMemoryProportions", value,
                                         _check_proportion_below_one,
                                         "a number in [0, 1)")

    def partialsTypes(self, value) -> "MultiConv":
        """The partials type (torch.float16 or torch.float32) of each
        convolution."""
        return self._set_per_convolution("partialsTypes", value,
                                         _check_partials_type,
                                         "torch.float16 or torch.float32")

    def enableConvDithering(self, value) -> "MultiConv":
        """Enable per-convolution dithering."""
        return self._set_per_convolution("enableConvDithering", value,
                                         _check_bool, "a bool")

    def planType(self, value: MultiConvPlanType) -> "MultiConv":
        """Select the multi-convolution execution strategy."""
        if not isinstance(value, MultiConvPlanType):
            raise Error("MultiConv.planType: expected a "
                        "poptorch.MultiConvPlanType ("
                        f"{', '.join(MultiConvPlanType.__members__)}), got "
                        f"{value!r}")
        return self

    def perConvReservedTiles(self, value: int) -> "MultiConv":
        """Tiles to reserve for each convolution."""
        _check_count("MultiConv.perConvReservedTiles", "value", value, 0)
        return self

    def cycleBackOff(self, value: float) -> "MultiConv":
        """Cycle back-off proportion, a number between 0 and 1."""
        if not _is_number(value) or not 0.0 <= value <= 1.0:
            raise Error("MultiConv.cycleBackOff: expected a number between 0 "
                        f"and 1, got {value!r}")
        return self

    def __enter__(self) -> "MultiConv":
        info_once("poptorch.MultiConv is accepted but has no effect on this "
                  "device: its convolutions run as ordinary convolutions")
        self._counter = _ConvolutionCounter()
        self._counter.__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(exc_type, exc_value, traceback)
        if exc_type is not None:
            return
        for method, given in self._per_convolution.items():
            if given != counter.count:
                raise Error(f"MultiConv.{method}: {given} values were given "
                            f"for the {counter.count} convolution(s) run "
                            "inside the MultiConv; give one per convolution")


class CPU:
    """Run a host function in the middle of the model.

    >>> self.cpu = poptorch.CPU(self.myCpuOp, "MyCPUOp")
    >>> out = self.cpu(x)   # arguments are forwarded to myCpuOp

    As on an IPU, in an inference model the function runs on the host with
    the op's real tensors each time the op runs (it may read values, use
    NumPy or log); it also runs while the model is compiled, to learn the
    shapes of its results, which must not change (``host_callbacks.py``).
    Where gradients flow through the op (training, which PopTorch did not
    allow) it is traced inline like the rest of the model. Outside a
    poptorch model it is a plain call.
    """

    def __init__(self, layer_to_call: Callable, ID: str) -> None:
        if not callable(layer_to_call):
            raise Error("CPU: layer_to_call must be callable, not "
                        f"{type(layer_to_call).__name__}")
        if not isinstance(ID, str):
            raise Error(f"CPU: ID must be a string naming the op, not {ID!r}")
        self._layer_to_call = layer_to_call
        self._id = ID

    def __call__(self, *args, **kwargs):
        if (host_callbacks.capturing(args, kwargs)
                and not host_callbacks.needs_gradients(args, kwargs)):
            return host_callbacks.call_on_host(self._id, self._layer_to_call,
                                               args, kwargs)
        return self._layer_to_call(*args, **kwargs)

    def execute(self) -> None:
        """Implementation detail of IPU host callbacks, kept for
        compatibility. Does nothing: the graph's host callback operation
        runs the function."""

    def registerPersistentData(self) -> None:
        """Implementation detail of IPU host callbacks (registering the host
        buffers they read and write), kept for compatibility. Does nothing:
        the host callback operation passes the tensors itself."""


def _torch_operation(name: str, domain: str):
    """``torch.ops.<domain with dots as underscores>.<name>``, or None."""
    namespace = domain.replace(".", "_")
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def _registered_operation(function: str, name: str, domain: str):
    """The op ``custom_op`` calls as ``operation(inputs, attributes)``."""
    if domain == "ai.graphcore" and name in graphcore_ops.OPERATIONS:
        return graphcore_ops.OPERATIONS[name]
    operation = _torch_operation(name, domain)
    if operation is None:
        namespace = domain.replace(".", "_")
        raise Error(
            f"{function}: PopART custom ops are C++ libraries built against "
            "PopART and Poplar, which cannot be loaded on CPU or GPU devices. "
            f"Register the op as torch.ops.{namespace}.{name}, for instance "
            f"with torch.library.custom_op(\"{namespace}::{name}\", ...) "
            "(and register_autograd for training): poptorch.custom_op then "
            "calls it with the inputs and the attributes as keyword "
            "arguments")
    return lambda inputs, attributes: operation(*inputs, **attributes)


def custom_op(inputs, name: str, domain: str, domain_version: int,
              example_outputs, attributes=None) -> List[torch.Tensor]:
    """Apply the custom operation ``name`` of ``domain`` to ``inputs``.

    PopART's C++ custom ops cannot load on CPU or GPU devices, so the op
    must exist as a PyTorch operation of the same name, in the namespace
    named by the domain with its dots replaced by underscores (the op
    ``LeakyRelu`` of domain ``custom.ops`` is
    ``torch.ops.custom_ops.LeakyRelu``, registered for instance with
    ``torch.library.custom_op("custom_ops::LeakyRelu", ...)``). It is
    called with the inputs and the attributes as keyword arguments, and its
    outputs must have the types and shapes of ``example_outputs``.

    Built-in PopART ops of the ``ai.graphcore`` domain run as their
    PyTorch equivalents (``graphcore_ops.py`` lists them): ``Ctc`` (the CTC
    loss, ``ctc_loss.py``; inputs log_probs, targets, input_lengths,
    target_lengths; attributes ``blank``, ``reduction`` as a
    ``poptorch.ReductionType`` number and ``zeroInfinity``), ``Gelu``,
    ``Swish``, ``Round``, ``Atan2``, ``Scale``, ``Reverse``..."""
    function = f"poptorch.custom_op({name!r}, domain {domain!r})"
    operation = _registered_operation(function, name, domain)
    outputs = operation(list(inputs), dict(attributes or {}))
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    outputs = list(outputs)
    _check_like_examples(function, outputs, list(example_outputs))
    return outputs


def _check_like_examples(function: str, outputs: List[torch.Tensor],
                         examples: List[torch.Tensor]) -> None:
    described = [(tuple(t.shape), t.dtype) for t in outputs]
    expected = [(tuple(t.shape), t.dtype) for t in examples]
    if described != expected:
        raise Error(f"{function}: the op returned tensors of (shape, dtype) "
                    f"{described}, but example_outputs give {expected}")


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor,
                            blank: int = 0, beam_width: int = 100,
                            top_paths: int = 1) -> List[torch.Tensor]:
    """Decode ``probs`` (log probabilities, [input_length, batch_size,
    num_classes]) of inputs of ``lengths`` ([batch_size]) with a CTC prefix
    beam search of ``beam_width`` beams: the log probabilities
    [batch_size, top_paths], lengths [batch_size, top_paths] and labels
    [batch_size, top_paths, input_length] of the ``top_paths`` most likely
    paths, most likely first, each padded with ``blank`` past its length
    (``ctc_decoder.py``)."""
    function = "ctc_beam_search_decoder"
    _check_tensor(function, "probs", probs)
    _check_tensor(function, "lengths", lengths)
    if probs.dim() != 3 or not probs.is_floating_point():
        raise Error(f"{function}: probs must be a floating-point tensor of "
                    "shape [input_length, batch_size, num_classes], got "
                    f"{probs.dtype} of shape {tuple(probs.shape)}")
    if lengths.shape != probs.shape[1:2] or lengths.is_floating_point():
        raise Error(f"{function}: lengths must be an integer tensor of shape "
                    f"[batch_size] = [{probs.shape[1]}], got {lengths.dtype} "
                    f"of shape {tuple(lengths.shape)}")
    classes = probs.shape[2]
    _check_count(function, "blank", blank, 0)
    if blank >= classes:
        raise Error(f"{function}: blank must be a class index below "
                    f"num_classes ({classes}), not {blank}")
    _check_count(function, "beam_width", beam_width, 1)
    _check_count(function, "top_paths", top_paths, 1)
    if top_paths > beam_width:
        raise Error(f"{function}: top_paths ({top_paths}) must not exceed "
                    f"beam_width ({beam_width})")
    return list(ctc_decoder.ctc_beam_search_decoder(
        probs, lengths, blank, beam_width, top_paths))


def cond(condition: torch.Tensor, then_body: Callable[..., object],
         then_inputs: Sequence[torch.Tensor], else_body: Callable[..., object],
         else_inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """An on-device conditional: the tensors ``then_body(*then_inputs)``
    returns if ``condition`` (a tensor holding one boolean) is true, else
    those of ``else_body(*else_inputs)``, as a list.

    Both bodies run (a captured graph holds both) and each output is
    selected with ``torch.where``, so the condition never goes back to the
    host. The bodies must return the same number of tensors, with the same
    shapes and dtypes. In training, gradients flow through the selected
    outputs only: a parameter used by the branch not taken gets a zero
    gradient. The inputs are passed by value, as in ``for_loop``.
    """
    _check_tensor("cond", "condition", condition)
    if condition.numel() != 1 or condition.dtype != torch.bool:
        raise Error("cond: condition must be a tensor holding one boolean; "
                    f"got dtype {condition.dtype} and shape "
                    f"{tuple(condition.shape)}")
    branches = []
    for branch, body, inputs in (("then", then_body, then_inputs),
                                 ("else", else_body, else_inputs)):
        if not callable(body):
            raise Error(f"cond: {branch}_body must be callable, not "
                        f"{type(body).__name__}")
        values = [value.clone() for value in _as_tensor_list(
            "cond", f"{branch}_inputs", inputs)]
        branches.append(_as_tensor_list(
            "cond", f"the value {branch}_body returns", body(*values)))
    _check_same_branches(*branches)
    flag = condition.reshape(())
    return [torch.where(flag.to(taken.device), taken, other)
            for taken, other in zip(*branches)]


def _check_same_branches(then_outputs: List[torch.Tensor],
                         else_outputs: List[torch.Tensor]) -> None:
    if len(then_outputs) != len(else_outputs):
        raise Error(f"cond: then_body returned {len(then_outputs)} tensor(s) "
                    f"but else_body returned {len(else_outputs)}; both "
                    "branches must return the same number of tensors")
    for position, (then, other) in enumerate(zip(then_outputs,
                                                 else_outputs)):
        if then.shape != other.shape or then.dtype != other.dtype:
            raise Error(f"cond: output {position} of then_body is "
                        f"{then.dtype} {tuple(then.shape)} but output "
                        f"{position} of else_body is {other.dtype} "
                        f"{tuple(other.shape)}; both branches must return "
                        "the same shapes and dtypes")


# PopTorch's operators that programs call directly (torch.ops.poptorch.*),
# besides the graph-node ops ipu_print_tensor, nop and
# recomputation_checkpoint defined above. They run as Python when called
# (CompositeImplicitAutograd), so a traced graph keeps what they compute and
# no node of their own.
_LIBRARY = torch.library.Library("poptorch", "FRAGMENT")


def _define_python_op(schema: str, function: Callable) -> None:
    """Define the op ``poptorch::<schema>`` as ``function``."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, function, "CompositeImplicitAutograd")


def _define_python_identity_op(schema: str,
                               function: Callable[..., torch.Tensor]) -> None:
    """``_define_python_op`` for an op returning its first argument; under
    vmap it applies to the whole batched tensor at once."""
    _define_python_op(schema, function)

    def batched(info, in_dims, tensor, *args):
        return function(tensor, *args), in_dims[0]

    torch.library.register_vmap(f"poptorch::{schema.split('(', 1)[0]}",
                                batched, lib=_LIBRARY)


def _begin_ipu_block(stage_id: int, phase_id: int, ipu_id: int) -> None:
    """Begin the block named ``str(stage_id)`` on IPU ``ipu_id`` (none when
    negative), as ``Block.start`` does; the execution strategy places it."""
    info_once("torch.ops.poptorch.begin_ipu_block begins the block named by "
              "its stage_id, placed by the execution strategy; phase_id has "
              "no effect")
    blocks.start_ipu_block(stage_id, ipu_id)


def _end_ipu_block() -> None:
    """Nothing to do: a block lasts until the next one begins."""


_SERIALIZATION_MODES = ("input_channels", "reducing_dim", "output_channels",
                        "none")


def _set_matmul_serialization(matmul: torch.Tensor, mode: str, factor: int,
                              keep_precision: bool) -> torch.Tensor:
    """Accept a serialization plan for the matrix product ``matmul``: an IPU
    tuning knob, without effect here (``serializedMatMul`` computes a
    serialized product). Returns ``matmul``."""
    function = "torch.ops.poptorch.set_matmul_serialization"
    if mode not in _SERIALIZATION_MODES:
        raise Error(f"{function}: mode must be one of "
                    f"{', '.join(map(repr, _SERIALIZATION_MODES))}, not "
                    f"{mode!r}")
    _check_count(function, "factor", factor, 0)
    info_once(f"{function} is accepted but has no effect on this device")
    return matmul


def _optimizer_group(group: int, inputs: List[torch.Tensor]) -> None:
    """Accept PopTorch's marking of ``inputs`` as the optimizer param group
    ``group``: the param groups here are those of the optimizer."""
    function = "torch.ops.poptorch.optimizer_group"
    _check_count(function, "group", group, 0)
    info_once(f"{function} is accepted but has no effect: each parameter "
              "belongs to the optimizer param group that holds it")


def _no_output_under_vmap(info, in_dims, group, inputs):
    _optimizer_group(group, inputs)
    return None, None


_define_python_op("push_name_scope(str name) -> ()", blocks.push_name_scope)
_define_python_op("pop_name_scope() -> ()", blocks.pop_name_scope)
_define_python_op("begin_ipu_block(int stage_id, int phase_id, int ipu_id) "
                  "-> ()", _begin_ipu_block)
_define_python_op("end_ipu_block() -> ()", _end_ipu_block)
_define_python_op("optimizer_group(int group, Tensor[] inputs) -> ()",
                  _optimizer_group)
torch.library.register_vmap("poptorch::optimizer_group",
                            _no_output_under_vmap, lib=_LIBRARY)
_define_python_identity_op(
    "set_available_memory(Tensor self, float proportion) -> Tensor",
    set_available_memory)
_define_python_identity_op(
    "set_matmul_serialization(Tensor matmul, str mode, int factor, "
    "bool keep_precision) -> Tensor", _set_matmul_serialization)
