"""Hyper-parameters changed on the optimizer object without
``setOptimizer``.

A training model uses the hyper-parameters its optimizer had when the model
was compiled or given it with ``setOptimizer``; PopTorch requires
``setOptimizer`` to apply new values (a learning rate set in
``param_groups``, a scheduler's ``step()``). Changing them on the optimizer
alone therefore has no effect, as in PopTorch, and is reported once, so
that the schedule that did not happen does not go unnoticed.
"""
from typing import Any, Dict, List

import torch

from ..logger import warn_once


def _hyper_parameters(optimizer: torch.optim.Optimizer
                      ) -> List[Dict[str, Any]]:
    """Each param group's numeric settings, as Python numbers and tuples
    (a learning rate may be a tensor or a numpy number, betas a list)."""
    return [{key: number for key, number in
             ((key, _number(value)) for key, value in group.items()
              if key != "params") if number is not None}
            for group in optimizer.param_groups]


def _number(value: Any) -> Any:
    """``value`` as a Python number or a tuple of them, None when it is not
    numeric."""
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        numbers = tuple(_number(item) for item in value)
        return None if None in numbers else numbers
    return value if isinstance(value, (int, float)) else None


class GivenHyperParameters:
    """The hyper-parameters a training model was given."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._given = _hyper_parameters(optimizer)
        self._reported = False

    def report_changes(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once when ``optimizer``'s hyper-parameters differ from
        those given."""
        if self._reported:
            return
        now = _hyper_parameters(optimizer)
        for index, (given, current) in enumerate(zip(self._given, now)):
            changed = [key for key in given
                       if current.get(key, given[key]) != given[key]]
            if changed:
                key = changed[0]
                self._reported = True
                warn_once(
                    f"The optimizer's {key} in param group {index} changed "
                    f"from {given[key]} to {current[key]}, but the training "
                    "model keeps the hyper-parameters it was given: call "
                    "poptorch_model.setOptimizer(optimizer) after changing "
                    "them (after a learning-rate scheduler's step() too), as "
                    "PopTorch requires.")
                return
