"""LAMB: layer-wise adaptive moments (You et al. 2019, "Large Batch
Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2).

For each parameter tensor ``w`` (a "layer"), with gradient ``g``::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)   # bias_correction only
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    w = w - lr * phi(||w||) / ||u|| * u

with ``phi(z) = min(z, max_weight_norm)`` (no clamping when
``max_weight_norm`` is None) and a trust ratio of 1 when ``phi(||w||)`` or
``||u||`` is 0, so that ``max_weight_norm=0`` (which may differ between
param groups) turns the layer-wise adaptation off.
``poptorch.optim.LAMB`` corrects the bias by default (``optim.py`` says
why); ``bias_correction=False`` gives the biased version.
"""
import functools
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .adam import bias_corrections, first_and_second_moments
from .rule import (DEFAULT_ACCUM_TYPE, TensorNorms, TorchState, UpdateRule,
                   accum_type_of, add_scalar, add_scaled, cast, compute_dtypes,
                   dtypes_of, per_param, sorted_constants, stacked,
                   started_state, state_tensors, step_tensors,
                   whole_tensor_norms)


class LAMBRule(UpdateRule):
    """The LAMB update of poptorch.optim.LAMB."""

    state_names = ("exp_avg", "exp_avg_sq", "step")

    def __init__(self, *, bias_correction: bool, clamp_weight_norm: bool,
                 first_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE,
                 second_order_dtype: torch.dtype = DEFAULT_ACCUM_TYPE) -> None:
        self.bias_correction = bias_correction
        self.clamp_weight_norm = clamp_weight_norm
        self.first_order_dtype = first_order_dtype
        self.second_order_dtype = second_order_dtype
        self.constants = sorted_constants(
            bias_correction=bias_correction, clamp_weight_norm=clamp_weight_norm,
            first_order_dtype=first_order_dtype,
            second_order_dtype=second_order_dtype)
        self.hyper_names = ("lr", "beta1", "beta2", "eps", "weight_decay") + (
            ("max_weight_norm",) if clamp_weight_norm else ())

    def hyper_values(self, group: Mapping[str, Any]) -> Dict[str, float]:
        beta1, beta2 = group["betas"]
        values = {"lr": float(group["lr"]), "beta1": float(beta1),
                  "beta2": float(beta2), "eps": float(group["eps"]),
                  "weight_decay": float(group["weight_decay"])}
        if self.clamp_weight_norm:
            values["max_weight_norm"] = float(group["max_weight_norm"])
        return values

    def init_state(self, params: List[Tensor],
                   torch_state: List[TorchState]) -> Dict[str, List[Tensor]]:
        return {"exp_avg": state_tensors("exp_avg", params, torch_state,
                                         self.first_order_dtype),
                "exp_avg_sq": state_tensors("exp_avg_sq", params, torch_state,
                                            self.second_order_dtype),
                "step": step_tensors(params, torch_state)}

    def update(self, params: List[Tensor], grads: List[Tensor],
               state: Dict[str, List[Tensor]], hyper: Dict[str, Tensor],
               norms: Optional[TensorNorms] = None
               ) -> Tuple[List[Tensor], Dict[str, List[Tensor]]]:
        dtypes = compute_dtypes(params, grads, state["exp_avg"],
                                state["exp_avg_sq"])
        weights, grads = cast(params, dtypes), cast(grads, dtypes)
        exp_avg, exp_avg_sq = first_and_second_moments(
            grads, cast(state["exp_avg"], dtypes),
            cast(state["exp_avg_sq"], dtypes), hyper)
        steps = torch._foreach_add(state["step"], 1.0)
        update = self._adam_direction(exp_avg, exp_avg_sq, steps, hyper)
        update = add_scaled(update, weights, hyper["weight_decay"])
        step_sizes = hyper["lr"] * self._trust_ratios(
            weights, update, hyper, norms or whole_tensor_norms)
        new_weights = torch._foreach_sub(
            weights, torch._foreach_mul(update, per_param(step_sizes, like=update)))
        new_state = {"exp_avg": cast(exp_avg, dtypes_of(state["exp_avg"])),
                     "exp_avg_sq": cast(exp_avg_sq, dtypes_of(state["exp_avg_sq"])),
                     "step": steps}
        return cast(new_weights, dtypes_of(params)), new_state

    def _adam_direction(self, exp_avg: List[Tensor], exp_avg_sq: List[Tensor],
                        new_steps: List[Tensor], hyper: Dict[str, Tensor]
                        ) -> List[Tensor]:
        """``m_hat / (sqrt(v_hat) + eps)``."""
        if self.bias_correction:
            correction1, correction2 = bias_corrections(new_steps, hyper)
            exp_avg = torch._foreach_div(exp_avg,
                                         per_param(correction1, like=exp_avg))
            exp_avg_sq = torch._foreach_div(
                exp_avg_sq, per_param(correction2, like=exp_avg_sq))
        root = add_scalar(torch._foreach_sqrt(exp_avg_sq), hyper["eps"])
        return torch._foreach_div(exp_avg, root)

    def _trust_ratios(self, weights: List[Tensor], update: List[Tensor],
                      hyper: Dict[str, Tensor], norms: TensorNorms) -> Tensor:
        """Per param, ``phi(||w||) / ||u||``, or 1 where ``phi(||w||)`` or
        ``||u||`` is 0: ``max_weight_norm=0`` turns the layer-wise
        adaptation off for a param group (an Adam step scaled by ``lr``),
        as Optimum Graphcore's LAMB uses it for biases."""
        norm_dtype = functools.reduce(torch.promote_types, dtypes_of(weights),
                                      torch.float32)
        weight_norms = stacked(norms(weights, norm_dtype))
        update_norms = stacked(norms(update, norm_dtype))
        scaled_norms = weight_norms
        if self.clamp_weight_norm:
            scaled_norms = torch.clamp(weight_norms, max=hyper["max_weight_norm"])
        both_positive = (scaled_norms > 0) & (update_norms > 0)
        return torch.where(both_positive, scaled_norms / update_norms,
                           torch.ones_like(weight_norms))

    def export_state(self, params: List[Tensor],
                     state: Dict[str, List[Tensor]]) -> List[Dict[str, Tensor]]:
        return started_state(state, self.state_names)


def rule_for_group(group: Mapping[str, Any]) -> LAMBRule:
    """The LAMB rule for a poptorch.optim.LAMB param group."""
    return LAMBRule(
        bias_correction=bool(group["bias_correction"]),
        clamp_weight_norm=group["max_weight_norm"] is not None,
        first_order_dtype=accum_type_of(
            group, "first_order_momentum_accum_type"),
        second_order_dtype=accum_type_of(
            group, "second_order_momentum_accum_type"))
