"""Scaled dot-product attention on the vectorised replica path
(``replicas.py``).

Under ``torch.func.vmap`` PyTorch has no batching rule for its fused CPU
attention kernel (``_scaled_dot_product_flash_attention_for_cpu``): it
runs the kernel once per replica, in a loop, and warns about the
performance drop. While the vectorised forward pass is traced, attention
on CPU tensors therefore runs as PyTorch's reference formulation of the
same function (``aten._scaled_dot_product_attention_math``: matrix
products, the mask, a softmax and dropout; a boolean mask made additive
first, as the public function does), whose operations have batching
rules, so the replicas' attention is one batched computation. Its results
equal the fused kernel's up to rounding. CUDA attention is left to
PyTorch.

Two routes lead there: a ``TorchFunctionMode`` sees the model's own calls
of ``F.scaled_dot_product_attention``; calls made inside another torch
function (``F.multi_head_attention_forward``, used by
``nn.MultiheadAttention`` and the transformer layers) run with every mode
set aside, so for the duration of the trace ``torch.nn.functional``'s
``scaled_dot_product_attention``, which that function looks up when it
runs, is the routing function.
"""
import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

_FUSED = F.scaled_dot_product_attention


def _attention(query: Tensor, key: Tensor, value: Tensor,
               attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: Optional[float] = None,
               enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention``, by its reference formulation on
    the CPU."""
    if query.device.type != "cpu":
        return _FUSED(query, key, value, attn_mask, dropout_p, is_causal,
                      scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # As the public function does before any kernel: True attends.
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype) \
            .masked_fill(attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
        enable_gqa=enable_gqa)[0]


class _RouteAttention(TorchFunctionMode):
    """The model's own ``F.scaled_dot_product_attention`` calls ->
    ``_attention``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _FUSED:
            return _attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def batched_attention() -> Iterator[None]:
    """While tracing the vectorised forward pass: CPU attention runs as
    operations vmap batches."""
    F.scaled_dot_product_attention = _attention
    try:
        with _RouteAttention():
            yield
    finally:
        F.scaled_dot_product_attention = _FUSED
