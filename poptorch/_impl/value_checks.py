"""Checks of tensor values that PyTorch functions make in Python, left out
while a model is traced (``tracing_context.py``).

A graph of tensors without values cannot hold ``if torch.any(var < 0):
raise``; PopTorch's trace recorded the computation as it ran for the
example inputs, without the condition. While tracing,
``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) therefore computes
PyTorch's loss (the same variance shapes, the clamping of the variance to
``eps`` outside the gradient, the ``full`` constant and reductions)
without its check that no variance is negative; a negative variance is
clamped to ``eps`` like a small one.
"""
import math
from typing import Union

import torch

_REDUCTIONS = ("none", "mean", "sum")


def _variance_like(input: torch.Tensor,
                   var: Union[torch.Tensor, float]) -> torch.Tensor:
    """``var`` shaped to broadcast against ``input``: the same shape, one
    dimension short (one variance per row), or one dimension of size 1."""
    if not isinstance(var, torch.Tensor):
        return torch.full_like(input, float(var))
    if var.shape == input.shape:
        return var
    if var.shape == input.shape[:-1]:
        return var.unsqueeze(-1)
    mismatched = [v for i, v in zip(input.shape, var.shape) if i != v]
    if var.dim() == input.dim() and mismatched == [1]:
        return var
    raise ValueError("var is of incorrect size")


def gaussian_nll_loss(input: torch.Tensor, target: torch.Tensor,
                      var: Union[torch.Tensor, float], full: bool = False,
                      eps: float = 1e-6, reduction: str = "mean"
                      ) -> torch.Tensor:
    """The Gaussian negative log likelihood of ``target`` under means
    ``input`` and variances ``var``, as ``F.gaussian_nll_loss`` computes
    it, without its check of the variances' values."""
    var = _variance_like(input, var)
    if reduction not in _REDUCTIONS:
        raise ValueError(reduction + " is not valid")
    clamped = var.clone()
    with torch.no_grad():
        clamped.clamp_(min=eps)
    loss = 0.5 * (torch.log(clamped) + (input - target) ** 2 / clamped)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss
