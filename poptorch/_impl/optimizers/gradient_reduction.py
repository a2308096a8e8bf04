"""How the gradients of the G x R micro-batches of one optimizer step are
combined (``Training.accumulationAndReplicationReductionType``,
``Training.setMeanAccumulationAndReplicationReductionStrategy`` and the
optimizers' ``accum_type``).

The running gradient buffer has the dtype ``accum_type``: float32 unless
the optimizer sets another, whatever the parameter's dtype (PopTorch's
default), or the parameter's dtype for SGD's combined variant; each
micro-batch's gradients are cast to it when added.
``ReductionType.Sum`` keeps the sum. ``ReductionType.Mean`` divides by the
number of micro-batches, when the ``MeanReductionStrategy`` says:

* ``Post``: the buffer keeps the sum, divided by G x R at the end;
* ``Running``: the buffer is kept as the current mean,
  ``acc_k = acc_{k-1} + (g_k - acc_{k-1}) / k``, so it never grows beyond the
  largest micro-batch gradient (preferred for float16 buffers);
* ``PostAndLoss`` (deprecated): the loss is divided by R before the backward
  pass, the buffer keeps the sum, divided by G at the end.

The default is ``Running`` when ``accum_type`` is float16, else ``Post``.
With a single micro-batch per step there is no buffer and nothing to divide.
"""
import dataclasses
from typing import List, Optional

import torch
from torch import Tensor

from ...enums import MeanReductionStrategy, ReductionType
from ..logger import warn_once
from .rule import cast, in_dtype_of


def default_strategy(accum_dtype: Optional[torch.dtype]
                     ) -> MeanReductionStrategy:
    """The spec's default: Running for a float16 ``accum_type``, else Post."""
    if accum_dtype == torch.float16:
        return MeanReductionStrategy.Running
    return MeanReductionStrategy.Post


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """The running gradient buffer of a training step and its reduction."""
    accumulation: int                    # G
    replicas: int                        # R
    reduction: ReductionType
    strategy: MeanReductionStrategy
    accum_dtype: Optional[torch.dtype]   # None: each parameter's dtype
                                         # (SGD's combined variant)

    @staticmethod
    def build(training_options, accumulation: int, replicas: int,
              accum_dtype: Optional[torch.dtype]) -> "GradientReduction":
        """From ``opts.Training`` and the optimizer plan's ``accum_dtype``."""
        strategy = (training_options
                    .mean_accumulation_and_replication_reduction_strategy)
        if strategy is None:
            strategy = default_strategy(accum_dtype)
        reduction = training_options.accumulation_and_replication_reduction_type
        if (strategy == MeanReductionStrategy.PostAndLoss
                and reduction == ReductionType.Mean):
            warn_once("MeanReductionStrategy.PostAndLoss is deprecated: use "
                      "Running or Post")
        return GradientReduction(accumulation, replicas, reduction, strategy,
                                 accum_dtype)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step (G x R)."""
        return self.accumulation * self.replicas

    @property
    def accumulates(self) -> bool:
        """Whether a step has a running gradient buffer (G x R > 1)."""
        return self.micro_batches > 1

    def _mean_with(self, strategy: MeanReductionStrategy) -> bool:
        return (self.accumulates and self.reduction == ReductionType.Mean
                and self.strategy == strategy)

    @property
    def keeps_running_mean(self) -> bool:
        return self._mean_with(MeanReductionStrategy.Running)

    def loss_factor(self) -> float:
        """The loss multiplier before the backward pass (PostAndLoss: 1/R)."""
        if self._mean_with(MeanReductionStrategy.PostAndLoss):
            return 1.0 / self.replicas
        return 1.0

    def divisor(self) -> float:
        """What the step's combined gradients are divided by."""
        if self._mean_with(MeanReductionStrategy.Post):
            return float(self.micro_batches)
        if self._mean_with(MeanReductionStrategy.PostAndLoss):
            return float(self.accumulation)
        return 1.0

    def buffer_dtype(self, param: Tensor) -> torch.dtype:
        """The dtype ``param``'s gradients are combined in: the accumulation
        type, or the param's for SGD's combined variant (None) and for
        float64 params, which keep float64 gradients."""
        if self.accum_dtype is None or param.dtype == torch.float64:
            return param.dtype
        return self.accum_dtype

    def start(self, params: List[Tensor]) -> List[Tensor]:
        """The buffer before a step's first micro-batch: zeros in the
        accumulation dtype, then (Running) a 0-d float32 micro-batch count."""
        zeros = [torch.zeros_like(p, dtype=self.buffer_dtype(p))
                 for p in params]
        if self.keeps_running_mean:
            device = params[0].device if params else torch.device("cpu")
            zeros.append(torch.zeros((), dtype=torch.float32, device=device))
        return zeros

    def in_buffer_dtypes(self, running: List[Tensor],
                         grads: List[Tensor]) -> List[Tensor]:
        """``grads`` cast to the dtypes of the ``running`` buffer that they
        are added to."""
        return cast(grads, [b.dtype for b in running[:len(grads)]])

    def add(self, running: List[Tensor], grads: List[Tensor]) -> List[Tensor]:
        """The buffer after one more micro-batch's ``grads``. A sum is added
        in place (the device loop zeroes the buffer for each optimizer
        step), as torch accumulates ``.grad``; with one micro-batch per step
        the gradients are written into it; a running mean is computed
        anew."""
        buffers = running[:len(grads)]
        grads = self.in_buffer_dtypes(running, grads)
        if not self.accumulates:
            torch._foreach_copy_(buffers, grads)
            return buffers
        if not self.keeps_running_mean:
            torch._foreach_add_(buffers, grads)
            return buffers
        count = running[-1] + 1
        differences = torch._foreach_sub(grads, buffers)
        steps = torch._foreach_div(differences, in_dtype_of(differences, count))
        return list(torch._foreach_add(buffers, steps)) + [count]

    def gradients(self, running: List[Tensor]) -> List[Tensor]:
        """The gradient buffers of a full buffer (without the count)."""
        if self.keeps_running_mean:
            return running[:-1]
        return running
