"""Lightning's ``self.log`` in the steps of a model that poptorch runs.

Lightning's IPU strategy (``lightning_graphcore.IPUStrategy``) wraps a
``LightningModule`` in a module whose ``forward`` calls its
``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step``,
and calls the poptorch model from inside the Lightning hook of that step.
A captured step runs its Python code once, at capture, with tensors that
hold no values, so a ``self.log(name, value, ...)`` made there would record
capture-time placeholders (on the IPU, values of the trace), and no value
at all on later calls.

While a model that holds a ``LightningModule`` is traced, each ``log`` call
of such a module (``log_dict`` calls ``log``) is recorded instead of run:
the logged tensor becomes an extra output of the step, a Python number
stays a constant. After every call of the model, the recorded calls are
made on the host with the call's values, in the order the step made them,
with their other arguments, so Lightning's ``on_step`` / ``on_epoch``
reductions, progress bar and loggers see what eager Lightning would log.
Where a call returns several micro-batches' values (``OutputMode.All``
with ``deviceIterations`` or replicas), a one-element logged value is
logged once per micro-batch, in the order of the call's outputs.

A ``torchmetrics.Metric`` passed to ``log`` is logged as it is on the
host: the updates the step made to it while traced are not kept
(``capture.capture_scope`` restores the module's attributes), so log
the tensor a metric returns rather than the metric object.
"""
import contextlib
import dataclasses
import functools
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from .capture import ModelCall

_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning_module_classes() -> Tuple[type, ...]:
    """``LightningModule`` of each Lightning package already imported
    (Lightning is never imported here)."""
    packages = (sys.modules.get(name) for name in _LIGHTNING_PACKAGES)
    classes = (getattr(package, "LightningModule", None)
               for package in packages)
    return tuple(cls for cls in classes if isinstance(cls, type))


def lightning_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The ``LightningModule``s among ``module`` and its sub-modules."""
    classes = _lightning_module_classes()
    if not classes:
        return []
    return [m for m in module.modules() if isinstance(m, classes)]


@dataclasses.dataclass
class _LogCall:
    """One ``self.log`` call of a traced step; ``value`` is None where the
    logged value is a tensor output of the step."""
    module: torch.nn.Module
    name: str
    value: object
    args: tuple
    kwargs: dict
    shape: Optional[torch.Size]

    def values(self, output: Optional[torch.Tensor]) -> List[object]:
        """The values to log for one call of the model, given the step
        output holding this call's tensor (None for a constant)."""
        if self.shape is None:
            return [self.value]
        plain = output.as_subclass(torch.Tensor)
        if self.shape.numel() == 1 and plain.numel() > 1:
            return [v.reshape(self.shape) for v in plain.reshape(-1)]
        return [plain]


@contextlib.contextmanager
def _recorded_logs(modules: Sequence[torch.nn.Module], calls: List[_LogCall],
                   tensors: List[torch.Tensor]) -> Iterator[None]:
    """``log`` of each of ``modules`` appends to ``calls`` (and the logged
    tensors to ``tensors``) in the block instead of logging."""
    for module in modules:
        module.log = functools.partial(_record, module, calls, tensors)
    try:
        yield
    finally:
        for module in modules:
            del module.log


def _record(module: torch.nn.Module, calls: List[_LogCall],
            tensors: List[torch.Tensor], name: str, value: object, *args,
            **kwargs) -> None:
    if isinstance(value, torch.Tensor):
        calls.append(_LogCall(module, name, None, args, kwargs, value.shape))
        tensors.append(value.detach())
    else:
        calls.append(_LogCall(module, name, value, args, kwargs, None))


@dataclasses.dataclass
class LoggingModelCall(ModelCall):
    """A ``ModelCall`` of a model holding ``LightningModule``s: the traced
    output is ``(the model's output, the tensors its steps logged)``."""
    _log_calls: List[_LogCall] = dataclasses.field(
        default_factory=list, init=False, repr=False)

    def __call__(self, params: Sequence[torch.Tensor],
                 buffers: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor]):
        calls: List[_LogCall] = []
        tensors: List[torch.Tensor] = []
        with _recorded_logs(lightning_modules(self.module), calls, tensors):
            output = super().__call__(params, buffers, inputs)
        self._log_calls = calls
        return output, tensors

    def replay(self, result) -> object:
        """The model's output of one call, after making the step's
        ``log`` calls on the host with the call's values."""
        output, tensors = result
        tensors = iter(tensors)
        for call in self._log_calls:
            tensor = next(tensors) if call.shape is not None else None
            for value in call.values(tensor):
                call.module.log(call.name, value, *call.args, **call.kwargs)
        return output


def model_call_class(module: torch.nn.Module) -> type:
    """``LoggingModelCall`` for a model holding a ``LightningModule``,
    else ``ModelCall``."""
    return LoggingModelCall if lightning_modules(module) else ModelCall


def logged_output(call: ModelCall, result) -> object:
    """The output of one call of the model that ``call`` captured, after
    its steps' ``log`` calls (for a ``LoggingModelCall``)."""
    if isinstance(call, LoggingModelCall):
        return call.replay(result)
    return result
