"""Gradient hooks registered on the model's parameters
(``param.register_hook(fn)``).

The captured step computes gradients for tensors that stand for the
parameters, not for the parameters themselves, so the hooks are registered
again on those tensors while the step is traced: the graph applies each
hook to its parameter's gradient of every micro-batch, before the
gradients of the G x R micro-batches are combined, as in PyTorch, where a
hook sees each ``backward()`` call's gradient, and in DDP, where it sees the
replica's own gradient before the all-reduce. Replicas run on the
sequential path when a parameter has hooks (``replication/replicas.py``):
on the vectorised path the parameter's gradient is already the replicas'
sum. Hooks registered after the model is compiled take effect when it is
compiled again (``destroy()``, or a new wrapper).
"""
from typing import List, Sequence

import torch


def gradient_hooks(parameter: torch.Tensor) -> List:
    """The gradient hooks registered on ``parameter``."""
    return list((getattr(parameter, "_backward_hooks", None) or {}).values())


def hooked_parameters(module: torch.nn.Module) -> List[str]:
    """The names of ``module``'s parameters that have gradient hooks."""
    return [name for name, parameter in module.named_parameters()
            if gradient_hooks(parameter)]


def register_hooks(originals: Sequence[torch.Tensor],
                   substitutes: Sequence[torch.Tensor]) -> None:
    """Register each original parameter's gradient hooks on the tensor that
    stands for it, when that tensor requires gradients."""
    for original, substitute in zip(originals, substitutes):
        if substitute.requires_grad:
            for hook in gradient_hooks(original):
                substitute.register_hook(hook)
