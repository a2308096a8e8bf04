"""Reading option settings from a config file and from the
``POPTORCH_DEFAULT_OPTIONS`` environment variable.

A config file (``Options.loadFromFile``) holds one option call per line,
written as in Python without the ``options.`` prefix::

    deviceIterations(4)
    Training.gradientAccumulation(2)
    outputMode(poptorch.OutputMode.EveryN, 2)   # comments are allowed
    TensorLocations.setActivationLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    setExecutionStrategy(poptorch.ShardedExecution())

As PopTorch strips each line, whitespace at the start of a line is ignored.
The file is parsed with :mod:`ast` and never executed: only calls of known
option methods are accepted, and their arguments may only be literals,
``poptorch.<Enum>.<Member>``, ``torch.<dtype>`` or the construction of one
of the vocabulary's classes (``poptorch.TensorLocationSettings()``, the
execution strategies, ``poptorch.Stage(...)``, ``poptorch.Phase(...)``)
followed by a chain of its allowed methods.

``POPTORCH_DEFAULT_OPTIONS`` holds a JSON object mapping option paths to
values, for example ``{"deviceIterations": 4, "outputMode": ["EveryN", 2]}``.
A JSON list is passed as positional arguments; enum arguments may be written
by member name (``"All"`` or ``"OutputMode.All"``) or by number, dtypes as
strings (``"torch.half"``) and tensor location settings as an object of
``TensorLocationSettings`` keyword arguments.

This module knows nothing about particular options: the caller describes
what may be called with a :class:`Vocabulary`.
"""
import ast
import enum
import inspect
import json
import os
import re
import typing
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Tuple

import torch

from ... import enums
from ...errors import Error

DEFAULT_OPTIONS_VARIABLE = "POPTORCH_DEFAULT_OPTIONS"


class ConfigFileError(Error):
    """An options file line or a ``POPTORCH_DEFAULT_OPTIONS`` entry that
    cannot be parsed or applied. The message says where it comes from."""


class Vocabulary(NamedTuple):
    """What option files and ``POPTORCH_DEFAULT_OPTIONS`` may use.

    ``option_paths``: callable option paths such as ``"deviceIterations"``
    or ``"Training.gradientAccumulation"``; ``constructors``: the classes
    files may build in an argument, written ``poptorch.<Class>(...)``, each
    with the methods that may be chained on the object built;
    ``settings_class``: the class a JSON object stands for in
    ``POPTORCH_DEFAULT_OPTIONS`` (``TensorLocationSettings``).
    """
    option_paths: FrozenSet[str]
    constructors: Dict[type, FrozenSet[str]]
    settings_class: type


class OptionCall(NamedTuple):
    """One option call to apply: ``path(*args, **kwargs)``; ``origin`` says
    where it was written, for error messages."""
    path: str
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    origin: str


class _Unsupported(Exception):
    """A construct that option files do not allow (reported with the line)."""


def resolve_option(options: Any, path: str) -> Callable[..., Any]:
    """The bound method of ``options`` that ``path`` names (for example
    ``"Training.gradientAccumulation"``)."""
    target = options
    for name in path.split("."):
        target = getattr(target, name)
    return target


def apply_calls(options: Any, calls: List[OptionCall]) -> None:
    """Call each option method; an error names the call's origin."""
    for call in calls:
        method = resolve_option(options, call.path)
        try:
            method(*call.args, **call.kwargs)
        except (Error, TypeError) as error:
            raise ConfigFileError(f"{call.origin}: {error}") from error


# --- Config files ---

#: Whitespace at the start of a line, which PopTorch strips from each line
#: of an options file (continuation lines of a call may be indented too).
_LEADING_WHITESPACE = re.compile(r"^[ \t\f]+", re.MULTILINE)


def read_config_file(filepath: Any,
                     vocabulary: Vocabulary) -> List[OptionCall]:
    """Parse an options file into option calls without executing it."""
    path = os.fspath(filepath)
    try:
        with open(path, encoding="utf-8") as config:
            source = config.read()
    except OSError as error:
        raise ConfigFileError(
            f"Cannot read options file {path}: {error.strerror}") from error
    source = _LEADING_WHITESPACE.sub("", source)
    lines = source.splitlines()
    try:
        module = ast.parse(source, filename=path)
    except SyntaxError as error:
        raise ConfigFileError(_located(
            path, error.lineno or 1, lines,
            f"invalid syntax ({error.msg})")) from error
    return [_statement_to_call(statement, path, lines, vocabulary)
            for statement in module.body]


def _located(path: str, lineno: int, lines: List[str], reason: str) -> str:
    text = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    return f"{path}, line {lineno}: {reason}: {text}"


def _statement_to_call(statement: ast.stmt, path: str, lines: List[str],
                       vocabulary: Vocabulary) -> OptionCall:
    try:
        option_path, args, kwargs = _parse_statement(statement, vocabulary)
    except _Unsupported as reason:
        raise ConfigFileError(
            _located(path, statement.lineno, lines, str(reason))) from None
    except Error as error:
        raise ConfigFileError(_located(
            path, statement.lineno, lines, error.message)) from error
    text = lines[statement.lineno - 1].strip()
    return OptionCall(option_path, args, kwargs,
                      f"{path}, line {statement.lineno}: {text}")


def _parse_statement(statement: ast.stmt, vocabulary: Vocabulary
                     ) -> Tuple[str, Tuple[Any, ...], Dict[str, Any]]:
    if not (isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Call)):
        raise _Unsupported(
            "expected one option call such as deviceIterations(4)")
    call = statement.value
    option_path = _option_path(call.func)
    if option_path not in vocabulary.option_paths:
        raise _Unsupported(f"unknown option {option_path!r}")
    args, kwargs = _call_arguments(call, vocabulary)
    return option_path, args, kwargs


def _option_path(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        parts = [node.id]
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        parts = [node.value.id, node.attr]
    else:
        raise _Unsupported(
            "expected an option method or Group.method, such as "
            "deviceIterations or Training.gradientAccumulation")
    _reject_private(parts)
    return ".".join(parts)


def _reject_private(parts: List[str]) -> None:
    private = [part for part in parts if part.startswith("_")]
    if private:
        raise _Unsupported(f"private name {private[0]!r} is not allowed")


def _call_arguments(call: ast.Call, vocabulary: Vocabulary
                    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    if any(isinstance(arg, ast.Starred) for arg in call.args):
        raise _Unsupported("*arguments are not allowed")
    if any(keyword.arg is None for keyword in call.keywords):
        raise _Unsupported("**arguments are not allowed")
    args = tuple(_value(arg, vocabulary) for arg in call.args)
    kwargs = {keyword.arg: _value(keyword.value, vocabulary)
              for keyword in call.keywords}
    return args, kwargs


_PLAIN_CONSTANTS = (bool, int, float, str, type(None))


def _value(node: ast.expr, vocabulary: Vocabulary) -> Any:
    """The value of an argument expression, evaluated without executing
    anything."""
    if isinstance(node, ast.Constant) and isinstance(node.value,
                                                     _PLAIN_CONSTANTS):
        return node.value
    if _is_signed_number(node):
        return -node.operand.value if isinstance(
            node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [_value(item, vocabulary) for item in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_value(item, vocabulary) for item in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(key, vocabulary): _value(value, vocabulary)
                for key, value in zip(node.keys, node.values)}
    if isinstance(node, ast.Attribute):
        return _named_constant(node)
    if isinstance(node, ast.Call):
        return _constructed(node, vocabulary)
    raise _Unsupported(f"unsupported argument {ast.unparse(node)!r}")


def _is_signed_number(node: ast.expr) -> bool:
    return (isinstance(node, ast.UnaryOp)
            and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float))


def _dotted_name(node: ast.expr) -> List[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _Unsupported(f"unsupported expression {ast.unparse(node)!r}")
    parts.append(node.id)
    parts.reverse()
    _reject_private(parts)
    return parts


def _named_constant(node: ast.Attribute) -> Any:
    """``poptorch.<Enum>.<Member>`` or ``torch.<dtype>``."""
    parts = _dotted_name(node)
    if len(parts) == 3 and parts[0] == "poptorch":
        enum_class = _enum_class(parts[1])
        if enum_class is not None and parts[2] in enum_class.__members__:
            return enum_class[parts[2]]
    if len(parts) == 2 and parts[0] == "torch":
        dtype = _dtype(parts[1])
        if dtype is not None:
            return dtype
    raise _Unsupported(
        f"unsupported name {'.'.join(parts)!r}: only "
        "poptorch.<Enum>.<Member> and torch.<dtype> are allowed")


def _enum_class(name: str) -> Any:
    candidate = vars(enums).get(name)
    if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
        return candidate
    return None


def _dtype(name: str) -> Any:
    candidate = vars(torch).get(name)
    return candidate if isinstance(candidate, torch.dtype) else None


def _constructed(node: ast.Call, vocabulary: Vocabulary) -> Any:
    """``poptorch.<Class>(...)`` followed by a chain of the methods allowed
    on it, built by calling them."""
    chained = []
    while (isinstance(node.func, ast.Attribute)
           and isinstance(node.func.value, ast.Call)):
        chained.append(node)
        node = node.func.value
    cls = _constructor(node, vocabulary)
    built = _called(cls, node, vocabulary)
    for call in reversed(chained):
        method_name = call.func.attr
        _reject_private([method_name])
        if method_name not in vocabulary.constructors[cls]:
            raise _Unsupported(
                f"unknown {cls.__name__} method {method_name!r}")
        _called(getattr(built, method_name), call, vocabulary)
    return built


def _constructor(node: ast.Call, vocabulary: Vocabulary) -> type:
    """The vocabulary class that ``node`` calls as ``poptorch.<Class>``."""
    classes = {cls.__name__: cls for cls in vocabulary.constructors}
    parts = _dotted_name(node.func)
    if len(parts) == 2 and parts[0] == "poptorch" and parts[1] in classes:
        return classes[parts[1]]
    allowed = ", ".join(f"poptorch.{name}()" for name in sorted(classes))
    raise _Unsupported(f"unsupported call {ast.unparse(node)!r}: the calls "
                       f"allowed in an argument are {allowed}")


def _called(function: Callable[..., Any], call: ast.Call,
            vocabulary: Vocabulary) -> Any:
    args, kwargs = _call_arguments(call, vocabulary)
    try:
        return function(*args, **kwargs)
    except TypeError as error:
        raise _Unsupported(f"{ast.unparse(call.func)}(): {error}") from None


# --- POPTORCH_DEFAULT_OPTIONS ---

def read_default_options(options: Any, vocabulary: Vocabulary
                         ) -> List[OptionCall]:
    """Option calls described by ``POPTORCH_DEFAULT_OPTIONS`` (none when it
    is unset or empty)."""
    text = os.environ.get(DEFAULT_OPTIONS_VARIABLE, "")
    if not text.strip():
        return []
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigFileError(
            f"{DEFAULT_OPTIONS_VARIABLE} is not valid JSON ({error}): "
            f"{text!r}") from error
    if not isinstance(entries, dict):
        raise ConfigFileError(
            f"{DEFAULT_OPTIONS_VARIABLE} must be a JSON object mapping option "
            f"paths to values, such as {{\"deviceIterations\": 4}}, got "
            f"{text!r}")
    return [_default_option_call(options, path, value, vocabulary)
            for path, value in entries.items()]


def _default_option_call(options: Any, path: str, value: Any,
                         vocabulary: Vocabulary) -> OptionCall:
    origin = f"{DEFAULT_OPTIONS_VARIABLE} key {path!r}"
    if path not in vocabulary.option_paths:
        known = ", ".join(sorted(vocabulary.option_paths))
        raise ConfigFileError(
            f"{origin}: unknown option; known options are: {known}")
    args = value if isinstance(value, list) else [value]
    method = resolve_option(options, path)
    try:
        converted = _convert_json_arguments(method, args, vocabulary)
    except ValueError as error:
        raise ConfigFileError(f"{origin}: {error}") from None
    return OptionCall(path, tuple(converted), {}, origin)


def _convert_json_arguments(method: Callable[..., Any], args: List[Any],
                            vocabulary: Vocabulary) -> List[Any]:
    """Turn JSON values into the enum members, dtypes and settings objects
    that the method's parameter annotations ask for."""
    function = getattr(method, "__func__", method)
    hints = typing.get_type_hints(function)
    parameters = list(inspect.signature(method).parameters.values())
    return [_convert_json_value(arg, _argument_hint(index, parameters, hints),
                                vocabulary)
            for index, arg in enumerate(args)]


def _argument_hint(index: int, parameters: List[inspect.Parameter],
                   hints: Dict[str, Any]) -> Any:
    """Annotation of the parameter receiving positional argument ``index``
    (None when there is none)."""
    for position, parameter in enumerate(parameters):
        if (position == index
                or parameter.kind is inspect.Parameter.VAR_POSITIONAL):
            return hints.get(parameter.name)
    return None


def _convert_json_value(value: Any, hint: Any, vocabulary: Vocabulary) -> Any:
    candidates = (typing.get_args(hint)
                  if typing.get_origin(hint) is typing.Union else (hint,))
    for candidate in candidates:
        if (isinstance(candidate, type) and issubclass(candidate, enum.Enum)
                and isinstance(value, (str, int))
                and not isinstance(value, bool)):
            return _enum_member(candidate, value)
        if candidate is torch.dtype and isinstance(value, str):
            return _dtype_from_string(value)
        if candidate is vocabulary.settings_class and isinstance(value, dict):
            return vocabulary.settings_class(**value)
    return value


def _enum_member(enum_class: Any, value: Any) -> Any:
    allowed = ", ".join(
        f"{member.name} ({member.value})" for member in enum_class)
    if isinstance(value, int):
        try:
            return enum_class(value)
        except ValueError:
            raise ValueError(f"{value} is not a {enum_class.__name__} number; "
                             f"allowed: {allowed}") from None
    name = value.split(".", 1)[1] if value.startswith(
        enum_class.__name__ + ".") else value
    if name not in enum_class.__members__:
        raise ValueError(f"{value!r} is not a {enum_class.__name__} member; "
                         f"allowed: {allowed}")
    return enum_class[name]


def _dtype_from_string(value: str) -> torch.dtype:
    name = value[len("torch."):] if value.startswith("torch.") else value
    dtype = None if name.startswith("_") else _dtype(name)
    if dtype is None:
        raise ValueError(f"{value!r} is not a torch dtype such as "
                         "'torch.float' or 'torch.half'")
    return dtype
