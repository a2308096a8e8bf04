"""Arguments of custom types (PopTorch 3.4): ``ICustomArgParser`` and
``registerCustomArgParser``.

A model's arguments are flattened into tensors and constants
(``signature.py``). A value whose type has a registered parser becomes one
node of that flattening (``CustomArgument``): its children are the tensors
``yieldTensors`` gives, which are cut into micro-batches along dimension 0
like any tensor argument, then the value's plain attributes (``None``,
booleans, numbers, strings and enums), which are compiled in like any
non-tensor argument. ``forward`` receives, for each micro-batch,
``reconstruct(original, tensor_iterator)``: ``original`` is the value of the
call that compiled the model and the iterator gives the micro-batch's
tensors in the order ``yieldTensors`` gave them.

Parsers are looked up by the exact type of a value. Only PopTorch's own
flattening uses them: ``torch.utils._pytree`` and the data loaders see the
value as one object (an ``AsynchronousDataAccessor`` sends it to the
consumer whole, its tensors in shared memory).
"""
import abc
import dataclasses
import enum
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from ..errors import Error

_PARSERS: Dict[type, "ICustomArgParser"] = {}


class ICustomArgParser(abc.ABC):
    """How PopTorch finds the tensors of a custom argument type and rebuilds
    a value of it around other tensors (register one with
    ``poptorch.registerCustomArgParser``)."""

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:
        """Yield every tensor of ``struct``, always in the same order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any,
                    tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """A value like ``original_structure`` whose tensors are taken, in
        the order ``yieldTensors`` yields them, from ``tensor_iterator``."""


def registerCustomArgParser(arg_type: type,
                            parser: Optional[ICustomArgParser]) -> None:
    """Use ``parser`` (an ``ICustomArgParser`` instance) for the model
    arguments whose type is exactly ``arg_type``, replacing any parser
    registered for it before; ``None`` removes the type's parser."""
    if not isinstance(arg_type, type):
        raise Error("registerCustomArgParser: arg_type must be a class, got "
                    f"{arg_type!r}")
    if arg_type in (tuple, list, dict) or issubclass(arg_type,
                                                    torch.Tensor):
        raise Error(f"registerCustomArgParser: arg_type must be a custom "
                    f"type, got {arg_type.__name__}, which PopTorch "
                    "flattens itself")
    if parser is None:
        _PARSERS.pop(arg_type, None)
        return
    if not isinstance(parser, ICustomArgParser):
        raise Error(f"registerCustomArgParser: the parser for "
                    f"{arg_type.__name__} must be an instance of "
                    f"poptorch.ICustomArgParser or None, got {parser!r}")
    _PARSERS[arg_type] = parser


def has_parser(value: Any) -> bool:
    """Whether ``value``'s type has a registered parser."""
    return type(value) in _PARSERS


class CustomArgument:
    """A value of a type with a registered parser, as a node of
    ``torch.utils._pytree`` (see the module documentation)."""
    __slots__ = ("value", "parser")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.parser = _PARSERS[type(value)]


class _Context:
    """What the flattening of a ``CustomArgument`` keeps besides its
    children. Two contexts are equal when their values have the same type,
    tensor count and attribute names: the value itself is only used to
    rebuild the argument."""

    def __init__(self, node: CustomArgument, keys: Tuple[Any, ...],
                 num_tensors: int) -> None:
        self.original = node.value
        self.parser = node.parser
        self.keys = keys
        self.num_tensors = num_tensors

    def _identity(self) -> tuple:
        return type(self.original), self.keys, self.num_tensors

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, _Context)
                and self._identity() == other._identity())

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return f"{type(self.original).__name__}{list(map(str, self.keys))}"


@dataclasses.dataclass(frozen=True)
class TensorKey:
    """Names a yielded tensor that is not an attribute of the value."""
    index: int

    def __str__(self) -> str:
        return f"<tensor {self.index}>"


def _attributes(value: Any) -> Dict[str, Any]:
    if dataclasses.is_dataclass(value):
        return {field.name: getattr(value, field.name)
                for field in dataclasses.fields(value)}
    return dict(getattr(value, "__dict__", {}))


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str,
                                               enum.Enum))


def _flatten_with_keys(node: CustomArgument
                       ) -> Tuple[List[Tuple[Any, Any]], _Context]:
    tensors = list(node.parser.yieldTensors(node.value))
    attributes = _attributes(node.value)
    names = {id(item): name for name, item in attributes.items()
             if isinstance(item, torch.Tensor)}
    children = [(pytree.GetAttrKey(names[id(tensor)]) if id(tensor) in names
                 else TensorKey(index), tensor)
                for index, tensor in enumerate(tensors)]
    children += [(pytree.GetAttrKey(name), item)
                 for name, item in attributes.items() if _is_plain(item)]
    keys = tuple(key for key, _ in children)
    return children, _Context(node, keys, len(tensors))


def _flatten(node: CustomArgument) -> Tuple[List[Any], _Context]:
    children, context = _flatten_with_keys(node)
    return [child for _, child in children], context


def _unflatten(children: List[Any], context: _Context) -> Any:
    """The user's value (not a ``CustomArgument``) around the tensors among
    ``children``."""
    tensors = iter(list(children)[:context.num_tensors])
    return context.parser.reconstruct(context.original, tensors)


pytree.register_pytree_node(CustomArgument, _flatten, _unflatten,
                            flatten_with_keys_fn=_flatten_with_keys)
