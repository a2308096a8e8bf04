"""Weights that forward pre-hooks compute from parameters and keep as plain
module attributes: ``torch.nn.utils.prune``'s ``weight = weight_orig *
weight_mask``, ``weight_norm``'s ``weight = g * v / |v|`` and
``spectral_norm``'s ``weight = weight_orig / sigma``.

PyTorch sets such an attribute each time the module runs, so after a
training step it holds the weights the step used. The compiled step runs on
the device and leaves the host's attribute as it was at compilation: a
program reading it after training (iterative magnitude pruning ranks the
weights by it, ``prune.global_unstructured`` too) would read stale weights.
After each training call the attributes are dropped from the modules
(``forget``), so that reading one goes through the module's hooked
``__getattr__``, which brings the trained weights to the host; the download
sets them again from the trained parameters (``refresh``)."""
from typing import Callable, Iterator, List, Tuple

import torch
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

Derived = Tuple[torch.nn.Module, str, Callable[[], torch.Tensor]]


def derived_weights(module: torch.nn.Module) -> List[Derived]:
    """(sub-module, attribute name, computation) of each weight the forward
    pre-hooks of the module and its sub-modules compute."""
    return [found for sub in module.modules() for found in _of(sub)]


def _of(module: torch.nn.Module) -> Iterator[Derived]:
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod):
            yield (module, hook._tensor_name,
                   lambda hook=hook: hook.apply_mask(module))
        elif isinstance(hook, WeightNorm):
            yield module, hook.name, lambda hook=hook: hook.compute_weight(
                module)
        elif isinstance(hook, SpectralNorm):
            yield module, hook.name, lambda hook=hook: hook.compute_weight(
                module, do_power_iteration=False)


def forget(derived: List[Derived]) -> None:
    """The device trained the weights these attributes derive from: drop
    them, so that the next read brings the trained weights to the host."""
    for module, name, _ in derived:
        module.__dict__.pop(name, None)


def refresh(derived: List[Derived]) -> None:
    """Set each derived weight from the host's parameters and buffers (after
    the trained weights reached the host), as the module's next run on the
    host would."""
    for module, name, compute in derived:
        module.__dict__[name] = compute()
