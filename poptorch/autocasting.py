"""Automatic mixed-precision casting (features chapter "Automatic
mixed-precision casting").

Automatic casting is off until it is enabled for a model or part of it:
``model.autocast()`` (a method PopTorch adds to every ``torch.nn.Module``),
``@poptorch.autocast()`` on a function, or ``with poptorch.autocast():``
around a block. The innermost setting wins, so ``model.layer.autocast(False)``
turns it off again for ``layer`` and everything inside it.
``opts.Precision.autocastEnabled(False)`` turns it off for a whole model.

While it is enabled, each operation is typed by the casting policy
(``opts.Precision.autocastPolicy``, default ``poptorch.autocasting.default``):
``fp16`` operations compute in float16, ``fp32`` operations in float32,
``promote`` operations given float16 and float32 tensors compute in float32
and ``demote`` operations in float16. Operations in none of the sets keep
the half/float rule of ``Precision.halfFloatCasting``. Casting happens when
the model is compiled; a model run outside PopTorch is not affected.
"""
import functools
from typing import Any, Callable, TypeVar

import torch

from ._impl.precision import automatic_casting
from ._impl.precision.automatic_casting import Policy

__all__ = ["autocast", "Policy", "default"]

_Callable = TypeVar("_Callable", bound=Callable[..., Any])


def _check_enabled(where: str, enabled: Any) -> None:
    from .errors import Error
    if not isinstance(enabled, bool):
        raise Error(f"{where} enabled must be a bool (True or False), got "
                    f"{enabled!r}")


class autocast:
    """Enable (or, with ``enabled=False``, disable) automatic casting inside
    a ``with`` block or, used as a decorator, inside a function."""

    def __init__(self, enabled: bool = True) -> None:
        _check_enabled("poptorch.autocast", enabled)
        self.enabled = enabled

    def __enter__(self) -> "autocast":
        automatic_casting.enter_scope(self.enabled)
        return self

    def __exit__(self, *exception: Any) -> None:
        automatic_casting.exit_scope()

    def __call__(self, function: _Callable) -> _Callable:
        @functools.wraps(function)
        def with_autocast(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.enabled):
                return function(*args, **kwargs)
        return with_autocast  # type: ignore[return-value]


def _module_autocast(self: torch.nn.Module,
                     enabled: bool = True) -> torch.nn.Module:
    """Enable or disable automatic casting for this module and the modules
    it contains (unless they set their own); returns the module."""
    _check_enabled(f"{type(self).__name__}.autocast", enabled)
    automatic_casting.set_module_enabled(self, enabled)
    return self


torch.nn.Module.autocast = _module_autocast

#: The policy used unless ``Precision.autocastPolicy`` names another:
#: matrix products and convolutions in float16; exponentials, logarithms,
#: powers, softmax, normalisations, norms and losses in float32; operations
#: combining several tensors (``cat``, ``stack``, ``addcmul``, ``dot``, ...)
#: promoted to float32.
default: Policy = automatic_casting.DEFAULT_POLICY

