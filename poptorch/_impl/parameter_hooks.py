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
compiled again (``destroy()``, or a new wrapper); the change is reported
(``frozen_constants.py``).

The stages of a pipelined or sharded model run graphs without autograd
hooks, so a multi-stage training model with gradient hooks (on
parameters, modules' backward hooks, tensors in ``forward``) is refused;
so is a hook registered with ``register_post_accumulate_grad_hook``, which
reads ``param.grad`` that a compiled step never sets.
"""
from typing import List, Sequence

import torch
import torch.nn.modules.module as module_hooks

from ..errors import Error


def gradient_hooks(parameter: torch.Tensor) -> List:
    """The gradient hooks registered on ``parameter``."""
    return list((getattr(parameter, "_backward_hooks", None) or {}).values())


def hooked_parameters(module: torch.nn.Module) -> List[str]:
    """The names of ``module``'s parameters that have gradient hooks."""
    return [name for name, parameter in module.named_parameters()
            if gradient_hooks(parameter)]


def refuse_post_accumulate_grad_hooks(module: torch.nn.Module) -> None:
    """``poptorch.Error`` naming a parameter with a
    ``register_post_accumulate_grad_hook`` hook: the hook reads and writes
    ``param.grad`` (or steps the parameter, an optimizer in backward), and
    a compiled step keeps its gradients and updates inside its graph."""
    hooked = [name for name, parameter in module.named_parameters()
              if getattr(parameter, "_post_accumulate_grad_hooks", None)]
    if hooked:
        raise Error(
            f"The parameter '{hooked[0]}' has a hook registered with "
            "register_post_accumulate_grad_hook, which a training model "
            "cannot run: the compiled step keeps the gradients and applies "
            "the optimizer's update inside its graph, without setting "
            "param.grad. Use a gradient hook (param.register_hook) to "
            "change the gradient, or the optimizer to update the "
            "parameter.")


def gradient_hooks_of_model(module: torch.nn.Module,
                            tensor_places: Sequence[str]) -> List[str]:
    """Every gradient hook of a model, described: on parameters, modules'
    backward hooks (their own and global ones) and the tensors ``forward``
    registers hooks on (``tensor_places``, their source lines)."""
    found = [f"parameter '{name}'" for name in hooked_parameters(module)]
    found += [f"backward hooks of module '{name or type(sub).__name__}'"
              for name, sub in module.named_modules()
              if sub._backward_hooks or sub._backward_pre_hooks]
    if module_hooks._global_backward_hooks or \
            module_hooks._global_backward_pre_hooks:
        found.append("global module backward hooks")
    found += [f"Tensor.register_hook at {place}" for place in tensor_places]
    return found


def register_hooks(originals: Sequence[torch.Tensor],
                   substitutes: Sequence[torch.Tensor]) -> None:
    """Register each original parameter's gradient hooks on the tensor that
    stands for it, when that tensor requires gradients."""
    for original, substitute in zip(originals, substitutes):
        if substitute.requires_grad:
            for hook in gradient_hooks(original):
                substitute.register_hook(hook)
