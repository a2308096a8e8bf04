"""What holds while a model is traced with fake tensors (``capture.trace``).

* torch's fake tensors log an operation that fails on its inputs, with
  torch's traceback, before raising; the failure reaches the user as
  torch's own exception with a note naming their source line
  (``compile_errors.py``), so that log is filtered out.
* Real tensors that ``forward`` reads besides its inputs, parameters and
  buffers (closure tensors, plain tensor attributes of modules) are
  constants of the graph. ``GraphConstants`` puts them on the device the
  model is captured for (``capture_device``), as PopTorch keeps every
  tensor of a model on the IPU (on a CPU device they are there already),
  and gives an operation that writes one a copy to write instead, so that
  neither the capture nor the graph changes the user's tensor: the graph
  starts every call from the value captured (``written_constants``), as
  PopTorch freezes such a tensor.
* ``torch.distributions`` checks its parameters and samples by default with
  Python conditions on tensor values (``if not valid.all(): raise``), which
  a graph of tensors without values cannot hold. Its default validation is
  off while tracing, as ``Distribution.set_default_validate_args(False)``
  sets it; a distribution created with ``validate_args=True`` still
  validates and fails with a hint (``compile_errors.py``). For the same
  reason ``F.gaussian_nll_loss`` skips its check that no variance is
  negative (``value_checks.py``).
* Parts of the model compiled with ``torch.compile`` run as they were
  written (dynamo's ``error_on_nested_fx_trace`` off: a compiled function
  met while tracing is inlined); the capture traces them into the model's
  graph, which the backend compiles whole.
* ``F.ctc_loss`` (``nn.CTCLoss``) runs as the static-shape CTC loss of
  ``ctc_loss.py``: PyTorch's kernel sizes its workspace by the targets'
  lengths, values a graph of fake tensors does not have.
* A random operation given a ``torch.Generator`` (``generator=``) raises
  ``poptorch.Error`` naming the line: the graph would hold the generator
  and draw on from its state at each step, where PyTorch draws from
  wherever the program left it (``_ExplicitGenerators``).
* ``Tensor.random_(from, to)`` runs as ``random_(to - from)`` plus
  ``from``, which draws the same numbers: the name of its operator,
  ``aten.random_.from``, is a Python keyword that torch's graph code
  cannot hold.
* The places where ``forward`` registers gradient hooks on tensors are
  recorded (``gradient_hooks_recorded``): the stages of a pipelined or
  sharded model cannot apply them, which is refused.
* A 0-d integer tensor used as an index (``table[action]``, ``w[i] =
  v``), whose value PyTorch reads, selects or writes one row with
  ``index_select`` / ``index_put_``, as PopTorch's tracer recorded such an
  index (``_getitem``, ``_setitem``).
* ``torch.bincount`` with ``minlength`` has ``minlength`` bins and
  ``F.one_hot`` needs ``num_classes`` (``data_dependent_ops.py``).
* ``nn.Transformer``, ``nn.TransformerEncoder`` and
  ``nn.MultiheadAttention`` take their regular path: PyTorch's fast path
  (``torch.backends.mha.set_fastpath_enabled``) is off, so no nested
  tensor is made from ``src_key_padding_mask`` (PyTorch first checks that
  the mask is left-aligned, reading its values), and an attention mask is
  causal only when ``is_causal=True`` says so (with ``is_causal=None``
  PyTorch compares the mask's values to a causal mask). The mask is then
  applied as given, which computes the same attention. Where eager
  PyTorch makes nested tensors (evaluation without gradients,
  ``enable_nested_tensor=True``), its output holds zeros at the padded
  positions; the captured output holds there what PyTorch's regular path
  computes (in training, or with gradients enabled), and equal values
  everywhere else.
"""
import contextlib
import contextvars
import logging
import traceback
from typing import ContextManager, Dict, Iterator, List, Optional, Tuple

import torch._dynamo
import torch.nn.functional as F
import torch.nn.modules.transformer as transformer_module
from torch.distributions import Distribution
from torch.overrides import TorchFunctionMode
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import Error
from . import traced_warnings
from .compile_errors import describe_frame, user_frame
from .ctc_loss import ctc_loss
from .data_dependent_ops import static_shape_operators
from .tensor_copies import deepcopy_as_clone
from .value_checks import gaussian_nll_loss

_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"
_COMPILED_PART_HOOKS = "Using `torch.compile\\(module\\)` when there are global hooks"


_device: contextvars.ContextVar = contextvars.ContextVar(
    "poptorch_capture_device", default=None)


@contextlib.contextmanager
def capture_device(device: torch.device) -> Iterator[None]:
    """Capture models for ``device`` in the block."""
    token = _device.set(device)
    try:
        yield
    finally:
        _device.reset(token)


_META = torch.device("meta")
_IN_PLACE_OPERATORS = frozenset(
    f"__i{name}__" for name in ("add", "sub", "mul", "truediv", "floordiv",
                                "mod", "pow", "matmul", "and", "or", "xor",
                                "lshift", "rshift")) | {"__setitem__"}

#: The copies written during the capture in progress: id(copy) -> the
#: user's tensor, whose value the copy had before.
_written: contextvars.ContextVar = contextvars.ContextVar(
    "poptorch_written_constants", default=None)


#: The user's tensors the captures in progress read as constants: id ->
#: the tensor.
_read: contextvars.ContextVar = contextvars.ContextVar(
    "poptorch_read_constants", default=None)


@contextlib.contextmanager
def _collected(registry: contextvars.ContextVar
               ) -> Iterator[Dict[int, torch.Tensor]]:
    """A new dict that ``registry`` holds while the block runs."""
    found: Dict[int, torch.Tensor] = {}
    token = registry.set(found)
    try:
        yield found
    finally:
        registry.reset(token)


def written_constants() -> ContextManager[Dict[int, torch.Tensor]]:
    """In the block, collect the constants an operation wrote: {id of the
    copy written: the user's tensor, unchanged}."""
    return _collected(_written)


def read_constants() -> ContextManager[Dict[int, torch.Tensor]]:
    """In the block, collect the user's tensors that captures read as
    constants: {id: tensor}."""
    return _collected(_read)


class GraphConstants(TorchFunctionMode):
    """Each real tensor an operation reads is read as a copy on the
    capture's device, made once per capture (detached: a constant receives
    no gradient): the graph holds the value the tensor had when the model
    was compiled, whichever backend runs it, and the user's tensor is never
    written. Fake tensors, and the meta tensors they compute with, stay as
    they are."""

    def __init__(self) -> None:
        super().__init__()
        self._device: Optional[torch.device] = _device.get()
        self._copies: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _written_tensor(func, args, kwargs)
        if target is not None and _is_real(target):
            self._copy(target, target.device if self._device is None
                       else self._device, written=True)
        # torch.Size stays itself: pytree would rebuild it as a tuple,
        # which x.new(size) reads as data.
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, self._read, (args, kwargs),
            is_leaf=lambda value: isinstance(value, torch.Size))
        return func(*args, **kwargs)

    def _read(self, tensor: torch.Tensor) -> torch.Tensor:
        copied = self._copies.get(id(tensor))
        if copied is not None and copied[0] is tensor:
            return copied[1]
        if not _is_real(tensor):
            return tensor
        return self._copy(tensor, self._device or tensor.device,
                          written=False)

    def _copy(self, tensor: torch.Tensor, device: torch.device,
              written: bool) -> torch.Tensor:
        copied = self._copies.get(id(tensor))
        if copied is None or copied[0] is not tensor:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                # The original is kept so that its id is not reused.
                copied = (tensor, tensor.detach().to(device, copy=True))
            self._copies[id(tensor)] = copied
        registry = _written.get()
        if written and registry is not None:
            registry[id(copied[1])] = tensor
        read = _read.get()
        if read is not None:
            read.setdefault(id(tensor), tensor)
        return copied[1]


def _is_real(tensor: torch.Tensor) -> bool:
    return tensor.device != _META and not is_fake(tensor)


def _written_tensor(func, args, kwargs) -> Optional[torch.Tensor]:
    """The tensor an in-place operation (``add_``, ``+=``, ``x[i] = v``,
    ``out=``) writes, else None."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_OPERATORS or (
        name.endswith("_") and not name.endswith("__"))
    if in_place and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


class _MetaFailureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(
            "failed while attempting to run meta")


def _causal_when_told(mask: Optional[torch.Tensor],
                      is_causal: Optional[bool] = None,
                      size: Optional[int] = None) -> bool:
    """``_detect_is_causal_mask`` without reading ``mask``: causal only when
    ``is_causal`` is True."""
    return is_causal is True


@contextlib.contextmanager
def transformers_regular_path() -> Iterator[None]:
    """PyTorch's transformer layers without their fast path and causal-mask
    detection in the block."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    detect = transformer_module._detect_is_causal_mask
    torch.backends.mha.set_fastpath_enabled(False)
    transformer_module._detect_is_causal_mask = _causal_when_told
    try:
        yield
    finally:
        transformer_module._detect_is_causal_mask = detect
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _random_from_to(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``Tensor.random_(from, to)`` as ``random_(to - from)`` drawn into an
    int64 tensor plus ``from``, which PyTorch's kernels compute as they
    compute ``random_(from, to)`` (the draw modulo ``to - from``, plus
    ``from``): the graph's operation ``aten.random_.from`` has a Python
    keyword as its name, which torch's graph code cannot hold."""
    names = ("from", "to")
    bounds = dict(zip(names, args), **kwargs)
    if set(bounds) - {*names, "generator"} or len(args) > 2 or \
            bounds.get("to") is None or "from" not in bounds:
        return torch.Tensor.random_(tensor, *args, **kwargs)
    draws = torch.empty_like(tensor, dtype=torch.int64).random_(
        bounds["to"] - bounds["from"], generator=bounds.get("generator"))
    with torch.no_grad():
        return tensor.copy_(draws + bounds["from"])


def _integer_scalar(index) -> bool:
    """Whether ``index`` is a 0-d integer tensor (uint8 and bool tensors
    index as masks)."""
    return isinstance(index, torch.Tensor) and index.dim() == 0 and \
        not index.is_floating_point() and not index.is_complex() and \
        index.dtype not in (torch.bool, torch.uint8)


def _position(index: torch.Tensor, size: int) -> torch.Tensor:
    """``index`` as a one-element index along a dimension of ``size``
    (negative indices counted from the end)."""
    return torch.where(index < 0, index + size, index).reshape(1).long()


def _getitem(tensor: torch.Tensor, index) -> torch.Tensor:
    """``tensor[index]``; a 0-d integer tensor index selects along the first
    dimension with ``index_select``, as PopTorch's tracer recorded it,
    where PyTorch reads its value."""
    if not _integer_scalar(index) or tensor.dim() == 0:
        return torch.Tensor.__getitem__(tensor, index)
    return tensor.index_select(
        0, _position(index, tensor.shape[0])).squeeze(0)


def _setitem(tensor: torch.Tensor, index, value) -> None:
    """``tensor[index] = value``, with a 0-d integer tensor index as
    ``_getitem`` reads it (``index_put_`` of one row)."""
    if not _integer_scalar(index) or tensor.dim() == 0:
        torch.Tensor.__setitem__(tensor, index, value)
        return
    row = torch.as_tensor(value, dtype=tensor.dtype, device=tensor.device)
    tensor.index_put_((_position(index, tensor.shape[0]),),
                      row.expand(tensor.shape[1:]).unsqueeze(0))


#: Functions that run as another while a model is traced (see the module
#: documentation).
_SUBSTITUTES = {F.ctc_loss: ctc_loss, F.gaussian_nll_loss: gaussian_nll_loss,
                torch.Tensor.random_: _random_from_to,
                torch.Tensor.__getitem__: _getitem,
                torch.Tensor.__setitem__: _setitem}


class _Substitutes(TorchFunctionMode):
    """Calls of the functions of ``_SUBSTITUTES`` (``nn.CTCLoss``'s and
    ``nn.GaussianNLLLoss``'s included) run their substitutes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _SUBSTITUTES.get(func, func)(*args, **(kwargs or {}))


class _ExplicitGenerators(TorchFunctionMode):
    """A random operation given a ``torch.Generator`` raises
    ``poptorch.Error``: the graph would hold the generator object and draw
    on from its state at every step, where PyTorch draws from wherever the
    program left it (a generator seeded in ``forward`` gives the same
    numbers each time)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(kwargs.get("generator"), torch.Generator):
            location = describe_frame(user_frame(traceback.extract_stack()))
            raise Error(
                f"At {location}, forward passes a torch.Generator to "
                f"{getattr(func, '__name__', func)}: a compiled model draws "
                "its random numbers from its own generator "
                "(Options.randomSeed), and the numbers of a torch.Generator "
                "cannot be part of its graph. Drop the generator argument "
                "(opts.randomSeed(N) makes the numbers reproducible), or "
                "draw fixed numbers (a generator seeded in forward) once "
                "outside the model and register them as a buffer.")
        return func(*args, **kwargs)


class _GradientHooks(TorchFunctionMode):
    """Records where ``forward`` registers gradient hooks on tensors
    (``Tensor.register_hook``), except hooks that only print
    (``poptorch.ipu_print_tensor``'s, marked ``prints_only``)."""

    def __init__(self) -> None:
        super().__init__()
        self.places: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hook = args[1] if len(args) > 1 else kwargs.get("hook")
        if func is torch.Tensor.register_hook and \
                not getattr(hook, "prints_only", False):
            self.places.append(
                describe_frame(user_frame(traceback.extract_stack())))
        return func(*args, **kwargs)


@contextlib.contextmanager
def gradient_hooks_recorded() -> Iterator[List[str]]:
    """The places (source lines) where the trace registers gradient hooks on
    tensors, in a list filled as it runs."""
    with _GradientHooks() as recorder:
        yield recorder.places


@contextlib.contextmanager
def fake_tracing() -> Iterator[None]:
    """The context of one trace with fake tensors."""
    fake_tensor_log = logging.getLogger(_FAKE_TENSOR_LOG)
    meta_failures = _MetaFailureFilter()
    fake_tensor_log.addFilter(meta_failures)
    validate = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        # Automatic casting's global module hooks fire twice for a compiled
        # part, which torch warns of; its scopes stay balanced.
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False), \
                traced_warnings.tracing((_COMPILED_PART_HOOKS,)), \
                _Substitutes(), _ExplicitGenerators(), \
                static_shape_operators(), \
                transformers_regular_path(), deepcopy_as_clone():
            yield
    finally:
        Distribution.set_default_validate_args(validate)
        fake_tensor_log.removeFilter(meta_failures)
