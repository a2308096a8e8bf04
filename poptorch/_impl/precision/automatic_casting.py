"""The machinery of automatic mixed-precision casting (``poptorch.autocast``,
``Module.autocast``, ``poptorch.autocasting.Policy``; features chapter
"Automatic mixed-precision casting").

Where casting is enabled is a stack of scopes: each module call (through
global module hooks, while a model is captured) and each
``poptorch.autocast`` block pushes one. A scope may say whether casting is
enabled (the module's ``autocast`` setting, the block's ``enabled``) and
which policy set the module's class belongs to; the innermost scope that
says something decides.

``AutomaticCasting`` is a TorchFunctionMode active while ``forward`` is
captured. It sees each torch function the model calls (not the calls inside
a Python-level torch function such as ``F.multi_head_attention_forward``,
which take the type of the outer call), finds the call's policy set by
operation name (``torch.relu``, ``Tensor.relu`` and ``F.relu`` are all
``relu``), else from the innermost module scope, and casts the call's float
tensors. Writes (in-place operations, ``out=``), explicit conversions and
batch normalisation, whose float32 running statistics are updated in place,
are left as they are, as by the half/float rule (``half_casting.py``).
"""
import contextlib
import dataclasses
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ...errors import Error
from .half_casting import LEFT_AS_THEY_ARE, MIXED, mixed_dtypes, writes
from ..logger import warn_once

FP16, FP32, PROMOTE, DEMOTE = "fp16", "fp32", "promote", "demote"
_SETS = (FP16, FP32, PROMOTE, DEMOTE)

#: Dunder names of operators, by the operation they perform.
_OPERATOR_NAMES = {
    "radd": "add", "rsub": "sub", "rmul": "mul", "rmatmul": "matmul",
    "truediv": "div", "rtruediv": "div", "rpow": "pow",
    "floordiv": "floor_divide", "rfloordiv": "floor_divide",
}


def operation_name(function: Any) -> str:
    """The name a policy knows an operation by: ``torch.relu``,
    ``Tensor.relu`` and ``F.relu`` are ``relu``; ``Tensor.__matmul__`` and
    ``__rmatmul__`` are ``matmul``."""
    name = getattr(function, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return _OPERATOR_NAMES.get(name, name)


def entry_name(entry: Any) -> str:
    """How a policy entry is shown: a module class by its name, an
    operation by ``operation_name``."""
    if isinstance(entry, type):
        return entry.__name__
    return operation_name(entry)


def _check_entry(argument: str, entry: Any) -> None:
    if isinstance(entry, type):
        if not issubclass(entry, torch.nn.Module):
            raise Error(f"Policy {argument}: {entry!r} is a class but not a "
                        "torch.nn.Module subclass; entries must be "
                        "torch.nn.Module classes or torch operations")
    elif not callable(entry) or not operation_name(entry):
        raise Error(f"Policy {argument}: {entry!r} is neither a "
                    "torch.nn.Module class nor a torch operation")


class Policy:
    """A casting policy: four sets of torch.nn.Module classes and/or torch
    operations, ``fp16`` (typed as float16), ``fp32`` (typed as float32),
    ``promote`` (promoted to float32 when given float16 and float32
    tensors) and ``demote`` (demoted to float16 when given both)."""

    def __init__(self, fp16: Optional[Iterable[Any]] = None,
                 fp32: Optional[Iterable[Any]] = None,
                 promote: Optional[Iterable[Any]] = None,
                 demote: Optional[Iterable[Any]] = None) -> None:
        given = {FP16: fp16, FP32: fp32, PROMOTE: promote, DEMOTE: demote}
        self._operations: Dict[str, str] = {}
        self._modules: List[Tuple[type, str]] = []
        for kind, entries in given.items():
            if isinstance(entries, (str, bytes)) or (
                    entries is not None and not hasattr(entries, "__iter__")):
                raise Error(f"Policy {kind} must be a list of torch.nn.Module "
                            f"classes and torch operations, got {entries!r}")
            for entry in entries or ():
                self._add(kind, entry)

    def _add(self, kind: str, entry: Any) -> None:
        _check_entry(kind, entry)
        earlier = self.kind_of(entry)
        if earlier is not None and earlier != kind:
            raise Error(f"Policy: {entry_name(entry)} is in both {earlier} "
                        f"and {kind}; an entry may be in one set only")
        if isinstance(entry, type):
            self._modules.append((entry, kind))
        else:
            self._operations[operation_name(entry)] = kind

    def kind_of(self, entry: Any) -> Optional[str]:
        """The set ``entry`` (a module class or an operation) belongs to."""
        if isinstance(entry, type):
            return next((kind for cls, kind in self._modules if cls is entry),
                        None)
        return self._operations.get(operation_name(entry))

    def module_kind(self, module: torch.nn.Module) -> Optional[str]:
        """The set of the first listed class that ``module`` is an instance
        of."""
        return next((kind for cls, kind in self._modules
                     if isinstance(module, cls)), None)

    def operation_kind(self, function: Any) -> Optional[str]:
        """The set of the operation ``function``."""
        return self._operations.get(operation_name(function))

    def names(self, kind: str) -> List[str]:
        """The names of the entries of one set, sorted."""
        modules = [cls.__name__ for cls, k in self._modules if k == kind]
        operations = [name for name, k in self._operations.items()
                      if k == kind]
        return sorted(modules) + sorted(operations)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        sets = ", ".join(f"{kind}=[{', '.join(self.names(kind))}]"
                         for kind in _SETS)
        return f"Policy({sets})"


def _functions(*names: str) -> List[Any]:
    """Named stand-ins for torch operations (a policy keeps names only)."""
    return [getattr(torch, name, None) or getattr(torch.nn.functional, name)
            for name in names]


DEFAULT_POLICY = Policy(
    fp16=_functions(
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "linear", "matmul", "mm", "bmm",
        "mv", "addmm", "addmv", "addr", "addbmm", "baddbmm", "einsum",
        "chain_matmul", "prelu", "scaled_dot_product_attention",
        "multi_head_attention_forward"),
    fp32=_functions(
        "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "pow", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
        "softplus", "softmax", "log_softmax", "logsumexp", "cumsum",
        "cumprod", "prod", "layer_norm", "group_norm", "norm", "dist",
        "cdist", "pdist", "renorm", "cosine_similarity", "cross_entropy",
        "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "multi_margin_loss", "triplet_margin_loss"),
    promote=_functions(
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
        "tensordot", "cat", "stack", "index_put", "scatter_add"))


# --- Where casting is enabled ---

@dataclasses.dataclass
class _Scope:
    enabled: Optional[bool]
    kind: Optional[str] = None


_scopes: List[_Scope] = []

_MODULE_SETTING = "_poptorch_autocast"


def enter_scope(enabled: bool) -> None:
    """Open a ``poptorch.autocast(enabled)`` block."""
    _scopes.append(_Scope(enabled))


def exit_scope() -> None:
    """Close the innermost ``poptorch.autocast`` block."""
    _scopes.pop()


def set_module_enabled(module: torch.nn.Module, enabled: bool) -> None:
    """Record ``module.autocast(enabled)``."""
    setattr(module, _MODULE_SETTING, enabled)


def current_scopes() -> List[_Scope]:
    """The open scopes, outermost first."""
    return list(_scopes)


@contextlib.contextmanager
def scopes_as(scopes: List[_Scope]) -> Iterator[None]:
    """Run the block with ``scopes`` open (those of a forward pass that
    the block runs again)."""
    saved = list(_scopes)
    _scopes[:] = scopes
    try:
        yield
    finally:
        _scopes[:] = saved


def _innermost(attribute: str) -> Any:
    return next((getattr(scope, attribute) for scope in reversed(_scopes)
                 if getattr(scope, attribute) is not None), None)


# --- Casting ---

def _cast_all(values: Any, source: torch.dtype, target: torch.dtype) -> Any:
    return pytree.tree_map_only(
        torch.Tensor,
        lambda tensor: tensor.to(target) if tensor.dtype == source else tensor,
        values)


_SLOW_ON_CPU = (
    "Automatic casting computes operations in float16 on the CPU, where "
    "float16 arithmetic runs far slower than float32 (a matrix product can "
    "take 100 times as long): it reproduces the numerics of the IPU "
    "program, not its speed. Disable it with "
    "opts.Precision.autocastEnabled(False) to train in float32.")


def _warn_if_on_cpu(values: Any) -> None:
    if any(leaf.device.type == "cpu" for leaf in pytree.tree_leaves(values)
           if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32):
        warn_once(_SLOW_ON_CPU)


def _cast(kind: str, values: Any) -> Any:
    if kind == FP16:
        _warn_if_on_cpu(values)
        return _cast_all(values, torch.float32, torch.float16)
    if kind == FP32:
        return _cast_all(values, torch.float16, torch.float32)
    if mixed_dtypes(values) != MIXED:
        return values
    if kind == PROMOTE:
        return _cast_all(values, torch.float16, torch.float32)
    return _cast_all(values, torch.float32, torch.float16)


class AutomaticCasting(TorchFunctionMode):
    """Casts the float tensors of each call where automatic casting is
    enabled, following ``policy``; module calls open scopes while the mode
    is active."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        self._hooks: List[Any] = []
        self._depth = 0

    def __enter__(self) -> "AutomaticCasting":
        module_hooks = torch.nn.modules.module
        self._hooks = [
            module_hooks.register_module_forward_pre_hook(self._enter_module),
            module_hooks.register_module_forward_hook(self._exit_module,
                                                      always_call=True)]
        self._depth = len(_scopes)
        return super().__enter__()

    def __exit__(self, *exception: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        del _scopes[self._depth:]
        super().__exit__(*exception)

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        _scopes.append(_Scope(getattr(module, _MODULE_SETTING, None),
                              self.policy.module_kind(module)))

    def _exit_module(self, module: torch.nn.Module, args: Any,
                     output: Any) -> None:
        _scopes.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (_innermost("enabled") and func not in LEFT_AS_THEY_ARE
                and not writes(func, kwargs)):
            kind = self.policy.operation_kind(func) or _innermost("kind")
            if kind is not None:
                args, kwargs = _cast(kind, (args, kwargs))
        return func(*args, **kwargs)
