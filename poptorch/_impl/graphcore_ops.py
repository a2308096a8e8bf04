"""PopART's built-in operations of the ``ai.graphcore`` domain, as
``poptorch.custom_op(inputs, name, "ai.graphcore", ...)`` reaches them:
each runs as its PyTorch equivalent (captured like any other PyTorch
operation, and differentiable where PyTorch's is).

| op | inputs | attributes | PyTorch |
|---|---|---|---|
| ``Ctc`` | log_probs, targets, input_lengths, target_lengths | ``blank``, ``reduction``, ``zeroInfinity``, ``outDataType`` | ``F.ctc_loss`` (``ctc_loss.py``) |
| ``Gelu`` | x | | ``F.gelu(x, approximate="tanh")`` (PopART's Gelu is the tanh form; ``GeluErf`` the exact one) |
| ``GeluErf`` | x | | ``F.gelu(x)`` |
| ``Swish`` | x | | ``x * sigmoid(x)`` (``F.silu``) |
| ``Detach`` | x | | ``x.detach()`` |
| ``Nop`` | x | | ``x`` |
| ``Round`` | x | | ``torch.round`` |
| ``Expm1``, ``Log1p`` | x | | ``torch.expm1``, ``torch.log1p`` |
| ``Atan2`` | y, x | | ``torch.atan2(y, x)`` |
| ``Fmod``, ``Remainder`` | a, b | | ``torch.fmod``, ``torch.remainder`` |
| ``Scale`` | x | ``scale`` | ``x * scale`` |
| ``Reverse`` | x | ``dimensions`` | ``torch.flip(x, dimensions)`` |

A wrong number of inputs or an unknown attribute raises ``poptorch.Error``
naming the op. Other ``ai.graphcore`` ops have no PyTorch equivalent here:
``custom_op`` raises its usual error for them.
"""
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

from ..errors import Error
from . import ctc_loss

Operation = Callable[[Sequence[torch.Tensor], Dict[str, object]],
                     List[torch.Tensor]]


def _op(name: str, inputs: int, function: Callable,
        attributes: Sequence[str] = ()) -> Operation:
    """An op taking ``inputs`` tensors and the named ``attributes`` (all
    required), computed by ``function(*inputs, **attributes)``."""
    def run(given: Sequence[torch.Tensor],
            values: Dict[str, object]) -> List[torch.Tensor]:
        where = f"custom_op {name} (domain ai.graphcore)"
        if len(given) != inputs:
            raise Error(f"{where}: takes {inputs} input(s), got "
                        f"{len(given)}")
        if set(values) != set(attributes):
            raise Error(f"{where}: takes the attributes "
                        f"{sorted(attributes)}, got {sorted(values)}")
        return [function(*given, **values)]

    return run


OPERATIONS: Dict[str, Operation] = {
    "Ctc": ctc_loss.graphcore_ctc,
    "Gelu": _op("Gelu", 1, lambda x: F.gelu(x, approximate="tanh")),
    "GeluErf": _op("GeluErf", 1, F.gelu),
    "Swish": _op("Swish", 1, F.silu),
    "Detach": _op("Detach", 1, torch.Tensor.detach),
    "Nop": _op("Nop", 1, lambda x: x),
    "Round": _op("Round", 1, torch.round),
    "Expm1": _op("Expm1", 1, torch.expm1),
    "Log1p": _op("Log1p", 1, torch.log1p),
    "Atan2": _op("Atan2", 2, torch.atan2),
    "Fmod": _op("Fmod", 2, torch.fmod),
    "Remainder": _op("Remainder", 2, torch.remainder),
    "Scale": _op("Scale", 1, lambda x, scale: x * scale, ["scale"]),
    "Reverse": _op("Reverse", 1,
                   lambda x, dimensions: torch.flip(x, list(dimensions)),
                   ["dimensions"]),
}
