"""The input signature a model is compiled for, and the check that every later
call matches it (semantics.md: changing an argument's dtype, shape or
structure after compilation is an error naming the argument)."""
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils import _pytree as pytree

from ..errors import Error


@dataclasses.dataclass(frozen=True)
class TensorLeaf:
    """A tensor argument: only its dtype and shape are compiled in."""
    dtype: torch.dtype
    shape: Tuple[int, ...]

    def describe(self) -> str:
        return f"a tensor of shape {tuple(self.shape)} and dtype {self.dtype}"


@dataclasses.dataclass(frozen=True)
class ConstantLeaf:
    """A non-tensor argument: its value is compiled into the graph."""
    value: Any

    def describe(self) -> str:
        return f"the value {self.value!r}"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return TensorLeaf(value.dtype, tuple(value.shape)).describe()
    return f"the value {value!r}"


class CallArguments:
    """One call's arguments bound to ``forward``'s parameters and flattened."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict) -> None:
        bound = _bind(forward, args, kwargs)
        self.args = bound.args
        self.kwargs = bound.kwargs
        with_paths, self.spec = pytree.tree_flatten_with_path(
            (self.args, self.kwargs))
        names = _parameter_names(forward, len(self.args))
        self.paths = [_path_name(path, names) for path, _ in with_paths]
        self.leaves = [leaf for _, leaf in with_paths]

    def tensor_positions(self) -> List[int]:
        return [i for i, leaf in enumerate(self.leaves)
                if isinstance(leaf, torch.Tensor)]


def _bind(forward: Callable, args: tuple, kwargs: dict):
    signature = inspect.signature(forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise Error(f"The model's forward{signature} cannot take these "
                    f"arguments: {error}") from None
    bound.apply_defaults()
    return bound


def _parameter_names(forward: Callable, num_args: int) -> List[str]:
    parameters = inspect.signature(forward).parameters.values()
    names: List[str] = []
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.extend(f"{parameter.name}[{i}]"
                         for i in range(num_args - len(names)))
        elif parameter.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return names


def _path_name(path: tuple, positional_names: List[str]) -> str:
    """Readable name of one flattened leaf, e.g. ``x`` or ``batch['image']``."""
    group, *rest = path
    first, *inner = rest
    if group.idx == 0:
        index = first.idx
        head = (positional_names[index] if index < len(positional_names)
                else f"args[{index}]")
    else:
        head = str(first.key)
    return head + "".join(str(key) for key in inner)


class InputSignature:
    """The structure, tensor shapes/dtypes and constants of the compiled call."""

    def __init__(self, call: CallArguments) -> None:
        self.spec = call.spec
        self.paths = call.paths
        self.leaves = [
            TensorLeaf(leaf.dtype, tuple(leaf.shape))
            if isinstance(leaf, torch.Tensor) else ConstantLeaf(leaf)
            for leaf in call.leaves
        ]

    def check(self, call: CallArguments) -> None:
        """Raise ``poptorch.Error`` naming the first argument that differs."""
        if call.spec != self.spec:
            raise Error(
                "The structure of the model's arguments changed after "
                f"compilation: expected {self._structure(self.spec)}, got "
                f"{self._structure(call.spec)}. Call destroy() on the model "
                "to compile it again for the new arguments.")
        for path, expected, given in zip(self.paths, self.leaves, call.leaves):
            if not _matches(expected, given):
                raise Error(
                    f"Argument '{path}' changed after compilation: expected "
                    f"{expected.describe()}, got {_describe_value(given)}. "
                    "Only tensor values may change between calls; call "
                    "destroy() on the model to compile it again.")

    @staticmethod
    def _structure(spec) -> str:
        return str(pytree.tree_unflatten(["*"] * spec.num_leaves, spec))


def _matches(expected, given) -> bool:
    if isinstance(expected, TensorLeaf):
        return (isinstance(given, torch.Tensor)
                and given.dtype == expected.dtype
                and tuple(given.shape) == expected.shape)
    if isinstance(given, torch.Tensor):
        return False
    try:
        return bool(given == expected.value) and type(given) is type(
            expected.value)
    except Exception:  # values whose == is not a plain bool
        return given is expected.value


def rebuild_call(spec, leaves: List[Any]) -> Tuple[tuple, Dict[str, Any]]:
    """(args, kwargs) from flattened leaves."""
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)
