"""Argument checks of the option setters: each raises ``poptorch.Error``
naming the option, what was given and what is allowed."""
import enum
import os
from typing import Any, Optional, Tuple

from ...errors import Error

def invalid(what: str, expected: str, value: Any) -> Error:
    return Error(f"{what} must be {expected}, got {value!r}")


def check_bool(what: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise invalid(what, "a bool (True or False)", value)


def check_int(what: str, value: Any, minimum: Optional[int] = None,
              below: Optional[int] = None) -> None:
    expected = "an int"
    if minimum is not None:
        expected += f" >= {minimum}"
    if below is not None:
        expected += f" and < {below}"
    if (isinstance(value, bool) or not isinstance(value, int)
            or (minimum is not None and value < minimum)
            or (below is not None and value >= below)):
        raise invalid(what, expected, value)


def check_str(what: str, value: Any) -> None:
    if not isinstance(value, str):
        raise invalid(what, "a str", value)


def check_enum(what: str, value: Any, enum_class: type,
               allowed: Optional[Tuple[enum.Enum, ...]] = None) -> None:
    allowed = tuple(enum_class) if allowed is None else allowed
    if not isinstance(value, enum_class) or value not in allowed:
        names = ", ".join(f"poptorch.{enum_class.__name__}.{member.name}"
                          for member in allowed)
        raise invalid(what, f"one of {names}", value)


def path_or_none(what: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise invalid(what, "a path (str or os.PathLike) or None", value)
    return os.fspath(value)


def frozen_error(option: str) -> Error:
    return Error(
        f"Cannot call {option}(): these options are frozen because they were "
        "passed to a model or a DataLoader. Use options.clone() to get an "
        "unfrozen copy and change that one.")
