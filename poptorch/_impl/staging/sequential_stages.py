"""``ShardedExecution`` and the phased strategies: the stages run one after
another for each micro-batch, the activations passed from stage to stage
(moved to the next stage's device when it has another one), then autograd
runs the backward pass in reverse order.

``SerialPhasedExecution`` / ``ParallelPhasedExecution`` run their phases in
order; the stages of a phase run one after another on a single device. With
a ``Liveness`` other than ``AlwaysLive``, the tensors a phase keeps for its
backward pass are moved to host memory after its forward pass and back when
the backward pass needs them (``torch.autograd.graph.save_on_cpu``), so the
device holds the activations of one phase at a time. Where the device is the
CPU, host and device memory are the same and this has no effect (logged
once).
"""
import contextlib
from typing import Callable, Dict, List, Optional

import torch

from ...enums import Liveness
from ..logger import info_once
from ..profiling.ranges import profile_range
from .stages import StageModule


class SequentialSchedule:
    """Stage after stage, one micro-batch at a time."""

    def __init__(self, modules: List[StageModule], device: torch.device,
                 liveness: Optional[Liveness] = None) -> None:
        self._modules = modules
        self._offload = liveness not in (None, Liveness.AlwaysLive)
        if self._offload and device.type == "cpu":
            info_once(f"Liveness.{liveness.name}: on a CPU device host and "
                      "device memory are the same, so phases keep their "
                      "tensors in place")
            self._offload = False

    def _phase_memory(self):
        if self._offload:
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def run(self, stacked: Dict[str, torch.Tensor], micro_batches: int,
            scale_loss: Optional[Callable] = None) -> None:
        """Forward (and, with ``scale_loss``, backward) passes of the
        micro-batches stacked in ``stacked`` (the stages' keyword
        arguments)."""
        for index in range(micro_batches):
            kwargs = {name: t[index:index + 1]
                      for name, t in stacked.items()}
            carried = ()
            for module in self._modules:
                with self._phase_memory():
                    carried = module(*carried, **kwargs)
            if scale_loss is not None:
                with profile_range("backward"):
                    scale_loss(carried[-1]).backward()
