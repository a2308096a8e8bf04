"""What ``Options``, its groups and ``TensorLocationSettings`` share:
stored values read back through read-only properties, freezing, copying,
``toDict()`` and printing."""
import copy
import enum
from typing import Any, Dict, Iterator, Tuple

import torch

from ...errors import Error
from .effects import announce_effect
from .validation import frozen_error

class Unset:
    """Marks a value that has not been set explicitly and comes from the
    environment when read."""

    def __repr__(self) -> str:
        return "<from environment>"

    def __reduce__(self) -> str:
        return "UNSET"

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Unset":
        return self


UNSET = Unset()


def read_only(name: str, doc: str) -> property:
    """A read-only property returning (a copy of) the stored value."""

    def read(self: "OptionsGroup") -> Any:
        value = self._values[name]
        return copy.copy(value) if isinstance(value, (list, dict)) else value

    return property(read, doc=doc)


class OptionsGroup:
    """Stored values, freezing, copying and printing shared by ``Options``,
    its groups and ``TensorLocationSettings``.

    ``_DEFAULTS`` maps each read-side property name to its default value;
    setters never mutate a stored list or dict in place, they store a new one.
    """
    _DISPLAY_NAME = ""
    _DEFAULTS: Dict[str, Any] = {}
    _GROUPS: Tuple[str, ...] = ()
    _SETTER_OF: Dict[str, str] = {}

    def __init__(self) -> None:
        self._values: Dict[str, Any] = copy.deepcopy(self._DEFAULTS)
        self._frozen = False

    def _apply_keywords(self, default_values: Dict[str, Any]) -> None:
        """Set initial values given as ``property_name=value`` keywords
        through the matching setters."""
        for name, value in default_values.items():
            if name not in self._SETTER_OF:
                allowed = ", ".join(self._SETTER_OF)
                raise Error(f"{self._DISPLAY_NAME}() got an unknown keyword "
                            f"{name!r}; allowed keywords: {allowed}")
            getattr(self, self._SETTER_OF[name])(value)

    def _store(self, option: str, **values: Any) -> Any:
        """Record already validated values for ``option``; return self."""
        if self._frozen:
            raise frozen_error(option)
        self._values.update(values)
        announce_effect(option)
        return self

    def _children(self) -> Iterator["OptionsGroup"]:
        for value in self._values.values():
            if isinstance(value, OptionsGroup):
                yield value
        for name in self._GROUPS:
            yield getattr(self, name)

    def _set_frozen(self, frozen: bool) -> None:
        self._frozen = frozen
        for child in self._children():
            child._set_frozen(frozen)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OptionsGroup":
        duplicate = type(self).__new__(type(self))
        memo[id(self)] = duplicate
        duplicate.__dict__.update(copy.deepcopy(self.__dict__, memo))
        duplicate._set_frozen(False)
        return duplicate

    def __copy__(self) -> "OptionsGroup":
        """Options have no useful shallow copy: copy.copy gives the same
        unfrozen deep copy as copy.deepcopy."""
        return copy.deepcopy(self)

    def _exported_names(self) -> Tuple[str, ...]:
        return tuple(self._DEFAULTS) + self._GROUPS

    def toDict(self) -> Dict[str, Any]:
        """Every option as plain JSON-serialisable values (nested dicts for
        groups, enums as ``"Enum.Member"``, dtypes as ``"torch.float16"``,
        other objects by ``repr``). Equal options give equal dicts."""
        return {name: plain(getattr(self, name))
                for name in self._exported_names()}

    def _reference(self) -> "OptionsGroup":
        """An object of the same type holding the built-in defaults."""
        return type(self)()

    def _changed_items(self, reference: "OptionsGroup",
                       prefix: str) -> Iterator[Tuple[str, str]]:
        for name in self._DEFAULTS:
            value = getattr(self, name)
            if value != getattr(reference, name):
                yield prefix + name, readable(value)
        for name in self._GROUPS:
            yield from getattr(self, name)._changed_items(
                getattr(reference, name), f"{prefix}{name}.")

    def __repr__(self) -> str:
        changed = self._changed_items(self._reference(), "")
        listed = ", ".join(f"{name}={value}" for name, value in changed)
        return f"{self._DISPLAY_NAME}({listed})"


def plain(value: Any) -> Any:
    if isinstance(value, OptionsGroup):
        return value.toDict()
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(item) for item in value), key=repr)
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def readable(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)):
        items = ", ".join(readable(item) for item in value)
        return f"[{items}]" if isinstance(value, list) else f"({items})"
    if isinstance(value, dict):
        items = ", ".join(f"{key!r}: {readable(item)}"
                          for key, item in value.items())
        return "{" + items + "}"
    return repr(value)


def freeze(group: OptionsGroup) -> None:
    """Forbid changes to ``group`` and its groups from now on (options
    given to a model or a DataLoader)."""
    group._set_frozen(True)


def set_stored(group: OptionsGroup, **values: Any) -> None:
    """Store ``values`` without their setters' checks (values read back
    from an exported file)."""
    group._values.update(values)


def copy_stored(target: OptionsGroup, source: OptionsGroup,
                names: Any) -> None:
    """Give ``target`` the values of ``source`` named ``names`` (those it
    holds)."""
    for name in names:
        if name in target._values:
            target._values[name] = source._values[name]
