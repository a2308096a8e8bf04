"""Batch normalisation with ``momentum=None`` (a cumulative moving average
of the batch statistics) in captured graphs.

PyTorch's ``_BatchNorm.forward`` turns ``momentum=None`` into the factor
``1 / float(num_batches_tracked)``, a read of a tensor's value that a
static graph cannot make. While a model is captured, such modules get a
``CumulativeMomentum`` instead (a float 0.0 that knows its module;
``capture_scope`` restores ``None`` afterwards), and ``CumulativeAverage``
replaces the ``F.batch_norm`` call that receives it by batch statistics
without running ones plus the cumulative update written in tensor
operations: ``running = (1 - f) * running + f * batch`` with
``f = 1 / num_batches_tracked`` and the unbiased batch variance, as
PyTorch's kernel updates them.
"""
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode


def batch_norm_arguments(input, running_mean, running_var, weight=None,
                         bias=None, training=False, momentum=0.1,
                         eps=1e-5) -> dict:
    """The arguments of an ``F.batch_norm`` call, by name."""
    return {"input": input, "running_mean": running_mean,
            "running_var": running_var, "weight": weight, "bias": bias,
            "training": training, "momentum": momentum, "eps": eps}


class CumulativeMomentum(float):
    """``momentum=None`` of a batch norm module while it is captured."""

    module: torch.nn.Module

    def __new__(cls, module: torch.nn.Module) -> "CumulativeMomentum":
        value = super().__new__(cls, 0.0)
        value.module = module
        return value


def mark_cumulative_modules(modules: Iterable[torch.nn.Module]) -> None:
    """Give each batch norm module with ``momentum=None`` its
    ``CumulativeMomentum`` (for the duration of a capture)."""
    for module in modules:
        if isinstance(module, _BatchNorm) and module.momentum is None:
            module.momentum = CumulativeMomentum(module)


class CumulativeAverage(TorchFunctionMode):
    """Runs ``F.batch_norm`` calls of marked modules in training with the
    cumulative moving average of their statistics."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            arguments = batch_norm_arguments(*args, **kwargs)
            if (isinstance(arguments["momentum"], CumulativeMomentum)
                    and arguments["training"]
                    and arguments["running_mean"] is not None):
                return _cumulative_batch_norm(**arguments)
        return func(*args, **kwargs)


def _cumulative_batch_norm(input: Tensor, running_mean: Tensor,
                           running_var: Optional[Tensor],
                           weight: Optional[Tensor], bias: Optional[Tensor],
                           training: bool, momentum: CumulativeMomentum,
                           eps: float) -> Tensor:
    factor = 1.0 / momentum.module.num_batches_tracked
    dims = [0] + list(range(2, input.dim()))
    variance, mean = torch.var_mean(input.detach(), dim=dims, correction=1)
    running_mean.mul_(1 - factor).add_(factor * mean)
    if running_var is not None:
        running_var.mul_(1 - factor).add_(factor * variance)
    return F.batch_norm(input, None, None, weight, bias, training, 0.0, eps)
