"""Where optimizer state lives between calls
(``opts.TensorLocations.setOptimizerLocation``).

With ``TensorLocationSettings().useOnChipStorage(False)`` on a CUDA device,
the optimizer state tensors (those with at least ``minElementsForOffChip``
elements) are kept in pinned host memory between calls: each call streams
them to the GPU before its first step and back to the host after its last,
so the GPU holds them only while the model runs. On a CPU device host memory
is the device memory: the setting is accepted and has no effect (logged once
at INFO).
"""
from typing import List, Optional

import torch
from torch import Tensor

from ..logger import info_once


class OptimizerStateLocation:
    """Moves optimizer state off the device between calls when asked to."""

    def __init__(self, settings: Optional[object],
                 device: torch.device) -> None:
        self.off_chip = settings is not None and settings.on_chip is False
        self.min_elements = (settings.min_elements_for_off_chip
                             if settings is not None else 0)
        if self.off_chip and device.type != "cuda":
            info_once("TensorLocations.setOptimizerLocation with "
                      "useOnChipStorage(False) has no effect on a CPU "
                      "device: optimizer state is already in host memory")

    def _moves(self, tensor: Tensor) -> bool:
        return tensor.numel() >= self.min_elements

    def to_device(self, tensors: List[Tensor],
                  device: torch.device) -> List[Tensor]:
        """The state on ``device`` for a call (asynchronous copies from
        pinned memory)."""
        if not self.off_chip or device.type != "cuda":
            return tensors
        return [t.to(device, non_blocking=True) for t in tensors]

    def to_host(self, tensors: List[Tensor]) -> List[Tensor]:
        """The state after a call: in pinned host memory when off chip
        (asynchronous copies, waited for once)."""
        moved = [_pinned_copy(t) if self.off_chip and t.is_cuda
                 and self._moves(t) else t for t in tensors]
        if any(t is not m for t, m in zip(tensors, moved)):
            torch.cuda.current_stream().synchronize()
        return moved


def _pinned_copy(tensor: Tensor) -> Tensor:
    host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
