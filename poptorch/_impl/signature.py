"""The input signature a model is compiled for, and the check that every later
call matches it (docs/semantics.md: changing an argument's dtype, shape or
structure after compilation is an error naming the argument).

Dict arguments are flattened by key, as PopTorch flattens them: a later call
whose dicts hold the compiled keys in another order, or whose dicts are of
another standard type (``dict``, ``OrderedDict``, ``defaultdict``), matches
the compiled call key by key. Other subclasses of ``dict``, which
``torch.utils._pytree`` does not know, reach ``forward`` as plain dicts;
returned by the model, they keep their type (``DictOfType``). Dataclass
instances and subclasses of ``tuple`` and ``list`` (not named tuples) are
flattened by field or item, as arguments and as outputs, and rebuilt as
their own types (``DataclassOfType``, ``SequenceOfType``). Other objects
holding tensors, and numpy arrays, are refused as arguments
(``CallArguments``); the capture refuses them as outputs.

A value whose type has a parser registered with
``poptorch.registerCustomArgParser`` is flattened by that parser
(``custom_args.py``): its tensors are named by the attribute holding them
(``batch.x``), and its plain attributes are compiled in."""
import copy
import dataclasses
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from ..errors import Error
from .custom_args import CustomArgument, has_parser
from .precision import double_inputs


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
    """One call's arguments bound to ``forward``'s parameters and flattened
    (``paths`` names each leaf; they are only worked out when asked for)."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict) -> None:
        signature = _signature(forward)
        bound = _bind(signature, args, kwargs)
        self.args, self.kwargs = flattenable((bound.args, bound.kwargs))
        self.leaves, self.spec = pytree.tree_flatten((self.args, self.kwargs))
        self._signature = signature
        self._paths: Optional[List[str]] = None
        converted = double_inputs.as_float32(self.leaves,
                                             lambda: self.paths, forward)
        if converted is not self.leaves:
            self.leaves = converted
            self.args, self.kwargs = flattenable(
                pytree.tree_unflatten(converted, self.spec))
        for position, leaf in enumerate(self.leaves):
            if _is_array(leaf):
                raise Error(
                    f"Argument '{self.paths[position]}' is a numpy array: "
                    "pass it as a tensor (torch.from_numpy(array)), so that "
                    "it is cut into micro-batches and may change between "
                    "calls.")
            if holds_tensors(leaf):
                raise Error(
                    f"Argument '{self.paths[position]}' is a "
                    f"{type(leaf).__name__} object holding tensors, which "
                    "cannot be cut into micro-batches. Pass its tensors in "
                    "tuples, lists, dicts or dataclasses, or register a "
                    "parser for its type with "
                    "poptorch.registerCustomArgParser.")

    def match_keys(self, spec: pytree.TreeSpec) -> bool:
        """Put the leaves in the order of ``spec`` when the arguments have
        its structure up to the order and standard type of their dicts
        (the dicts' keys matched by name); False when they do not."""
        try:
            leaves = spec.flatten_up_to((self.args, self.kwargs))
        except (ValueError, TypeError):
            return False
        if not all(pytree.tree_is_leaf(leaf) for leaf in leaves):
            return False
        self.leaves, self.spec = leaves, spec
        self.args, self.kwargs = flattenable(pytree.tree_unflatten(leaves,
                                                                   spec))
        self._paths = None
        return True

    @property
    def paths(self) -> List[str]:
        if self._paths is None:
            with_paths, _ = pytree.tree_flatten_with_path(
                (self.args, self.kwargs))
            names = _parameter_names(self._signature, len(self.args))
            self._paths = [_path_name(path, names) for path, _ in with_paths]
        return self._paths

    def tensor_positions(self) -> List[int]:
        return [i for i, leaf in enumerate(self.leaves)
                if isinstance(leaf, torch.Tensor)]

    def tensors(self) -> List[torch.Tensor]:
        """The call's tensors, in flattening order."""
        return [self.leaves[i] for i in self.tensor_positions()]


def _is_array(leaf: Any) -> bool:
    """A numpy array with dimensions (numpy scalars are plain constants)."""
    return (type(leaf).__module__ == "numpy"
            and getattr(leaf, "ndim", 0) > 0)


def holds_tensors(leaf: Any) -> bool:
    """Whether a leaf that is not a tensor keeps tensors in its attributes
    (a plain object grouping a batch or a result)."""
    return not isinstance(leaf, torch.Tensor) and any(
        isinstance(value, torch.Tensor)
        for value in getattr(leaf, "__dict__", {}).values())


def _unknown_dict(value: Any) -> bool:
    return (isinstance(value, dict)
            and type(value) not in pytree.SUPPORTED_NODES)


def _unknown_dataclass(value: Any) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value) not in pytree.SUPPORTED_NODES)


def _unknown_sequence(value: Any) -> bool:
    """A subclass of tuple or list that pytree does not know, or a
    ``torch.Size`` (which pytree rebuilds as a plain tuple)."""
    return (isinstance(value, (tuple, list))
            and (type(value) not in pytree.SUPPORTED_NODES
                 or type(value) is torch.Size)
            and not pytree.is_namedtuple_instance(value)
            and not pytree.is_structseq_instance(value))


def _replaced_node(value: Any) -> bool:
    return (_unknown_dict(value) or _unknown_dataclass(value)
            or _unknown_sequence(value) or has_parser(value))


def flattenable(tree: Any, keep_dict_types: bool = False) -> Any:
    """``tree`` as ``torch.utils._pytree`` is to flatten it: each dict of a
    type pytree does not know (a subclass of ``dict`` or ``OrderedDict``)
    as a plain dict, so that its values are flattened rather than taken as
    one leaf, or, with ``keep_dict_types`` (a model's outputs), as a
    ``DictOfType`` that unflattens to its own type again; each dataclass
    instance and each ``tuple`` or ``list`` subclass instance as a
    ``DataclassOfType`` or ``SequenceOfType``, which do too; each value of
    a type with a registered custom parser as a ``CustomArgument``,
    flattened by its parser."""
    def replace(value: Any) -> Any:
        if _unknown_dict(value):
            items = {key: flattenable(item, keep_dict_types)
                     for key, item in value.items()}
            return DictOfType(value, items) if keep_dict_types else items
        if _unknown_dataclass(value):
            return DataclassOfType(value, keep_dict_types)
        if _unknown_sequence(value):
            return SequenceOfType(value, keep_dict_types)
        if has_parser(value):
            return CustomArgument(value)
        return value

    return pytree.tree_map(replace, tree, is_leaf=_replaced_node)


class DictOfType:
    """A dict of a type pytree does not know (a Hugging Face
    ``ModelOutput``, a user's ``dict`` subclass) among a model's outputs:
    flattened as its values, unflattened as a shallow copy of the dict
    first returned, holding the new values (so its type, attributes and
    ``__setitem__`` behaviour are the model's). A type whose copy calls an
    ``__init__`` that needs arguments is made without ``__init__``, with
    the attributes of the dict returned."""

    def __init__(self, original: dict, items: Dict[Any, Any]) -> None:
        self.items = items
        self.template = _shallow_copy(original)
        for key in items:
            self.template[key] = None


def _shallow_copy(original: dict) -> dict:
    try:
        return copy.copy(original)
    except TypeError:
        made = type(original).__new__(type(original))
        made.update(original)
        made.__dict__.update(vars(original))
        return made


def _flatten_dict_of_type(node: DictOfType):
    return list(node.items.values()), (node.template, list(node.items))


def _unflatten_dict_of_type(values, context) -> dict:
    template, keys = context
    rebuilt = _shallow_copy(template)
    for key, value in zip(keys, values):
        rebuilt[key] = value
    return rebuilt


pytree.register_pytree_node(DictOfType, _flatten_dict_of_type,
                            _unflatten_dict_of_type)


class DataclassOfType:
    """A dataclass instance among a model's arguments or outputs: flattened
    as its fields' values, unflattened as a shallow copy of the first
    instance holding the new values (frozen dataclasses included), so its
    type and its other attributes are the model's. Two instances have the
    same structure when their types and field names are the same."""

    def __init__(self, original: Any, keep_dict_types: bool) -> None:
        names = [field.name for field in dataclasses.fields(original)]
        self.items = {name: flattenable(getattr(original, name),
                                        keep_dict_types)
                      for name in names}
        template = copy.copy(original)
        for name in names:
            object.__setattr__(template, name, None)
        self.template = _Template(template)


class _Template:
    """An instance to copy, equal to any template of the same type."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Template)
                and type(other.instance) is type(self.instance))

    def __hash__(self) -> int:
        return hash(type(self.instance))

    def __repr__(self) -> str:
        return type(self.instance).__qualname__


def _flatten_dataclass_of_type(node: DataclassOfType):
    return list(node.items.values()), (node.template, list(node.items))


def _unflatten_dataclass_of_type(values, context) -> Any:
    template, names = context
    rebuilt = copy.copy(template.instance)
    for name, value in zip(names, values):
        object.__setattr__(rebuilt, name, value)
    return rebuilt


def _flatten_dataclass_with_keys(node: DataclassOfType):
    values, context = _flatten_dataclass_of_type(node)
    return ([(pytree.GetAttrKey(name), value)
             for name, value in zip(context[1], values)], context)


pytree.register_pytree_node(
    DataclassOfType, _flatten_dataclass_of_type,
    _unflatten_dataclass_of_type,
    flatten_with_keys_fn=_flatten_dataclass_with_keys)


class SequenceOfType:
    """A subclass of ``tuple`` or ``list`` (not a named tuple) among a
    model's arguments or outputs: flattened as its items, unflattened as an
    instance of its type holding the new items, with the attributes of the
    first instance."""

    def __init__(self, original: Any, keep_dict_types: bool) -> None:
        self.items = [flattenable(item, keep_dict_types) for item in original]
        self.template = _Template(original)


def _flatten_sequence_of_type(node: SequenceOfType):
    return list(node.items), node.template


def _unflatten_sequence_of_type(values, template: "_Template") -> Any:
    original = template.instance
    if isinstance(original, torch.Size):
        return torch.Size(values)
    if isinstance(original, tuple):
        rebuilt = tuple.__new__(type(original), values)
        if hasattr(original, "__dict__"):
            rebuilt.__dict__.update(vars(original))
        return rebuilt
    rebuilt = copy.copy(original)
    rebuilt[:] = values
    return rebuilt


def _flatten_sequence_with_keys(node: SequenceOfType):
    return ([(pytree.SequenceKey(index), item)
             for index, item in enumerate(node.items)], node.template)


pytree.register_pytree_node(
    SequenceOfType, _flatten_sequence_of_type, _unflatten_sequence_of_type,
    flatten_with_keys_fn=_flatten_sequence_with_keys)


@functools.lru_cache(maxsize=64)
def _function_signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def _signature(forward: Callable) -> inspect.Signature:
    """``inspect.signature(forward)``, worked out once per function."""
    function = getattr(forward, "__func__", None)
    if function is None or not inspect.isfunction(function):
        return inspect.signature(forward)
    signature = _function_signature(function)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]      # the bound instance
    return signature.replace(parameters=parameters)


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict):
    """The call's arguments with the defaults of those not given, except
    tensor defaults: ``forward`` reads those itself, whole, as in PyTorch
    (a constant of the graph, not an input cut into micro-batches)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise Error(f"The model's forward{signature} cannot take these "
                    f"arguments: {error}") from None
    given = set(bound.arguments)
    bound.apply_defaults()
    for name, value in list(bound.arguments.items()):
        if name not in given and pytree.tree_any(
                lambda leaf: isinstance(leaf, torch.Tensor), value):
            del bound.arguments[name]
    return bound


def _parameter_names(signature: inspect.Signature,
                     num_args: int) -> List[str]:
    parameters = signature.parameters.values()
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
        """Raise ``poptorch.Error`` naming the first argument that differs.
        A call whose dicts differ from the compiled ones in key order or
        standard dict type only is matched key by key: its leaves are put
        in the compiled order."""
        if call.spec != self.spec and not call.match_keys(self.spec):
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

    def fewer_rows(self, call: CallArguments) -> Optional[str]:
        """The first tensor argument of ``call`` (with the compiled
        structure) that has fewer rows in dimension 0 than compiled, and
        otherwise the compiled shape; else None."""
        if call.spec != self.spec:
            return None
        for path, expected, given in zip(self.paths, self.leaves, call.leaves):
            if (isinstance(expected, TensorLeaf) and
                    isinstance(given, torch.Tensor) and
                    given.dim() == len(expected.shape) > 0 and
                    given.shape[0] < expected.shape[0] and
                    tuple(given.shape[1:]) == expected.shape[1:]):
                return path
        return None

    @staticmethod
    def _structure(spec) -> str:
        """The arguments with ``*`` for each leaf; the spec itself when a
        custom parser cannot rebuild its type around ``*``."""
        try:
            return str(pytree.tree_unflatten(["*"] * spec.num_leaves, spec))
        except Exception:  # a custom parser's reconstruct needs tensors
            return str(spec)


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
