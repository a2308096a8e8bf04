"""Mapping of IPU concepts onto the devices we run on.

An "IPU" is a CUDA GPU when one is present; otherwise the model runs on the
CPU. ``Options.useIpuModel(True)`` (or ``POPTORCH_IPU_MODEL=1``) selects the
CPU even when a GPU exists, as the IPU Model stood in for hardware.
"""
import torch

from ..errors import Error


def select_device(use_ipu_model: bool) -> torch.device:
    """The device a model runs on: the first CUDA device, else the CPU."""
    if not use_ipu_model and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """True if at least ``num_ipus`` accelerators (CUDA GPUs) are present."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= num_ipus


def ipuHardwareVersion() -> int:
    """The hardware version of the available accelerator.

    A CUDA GPU reports version 2 (the Mk2 IPU generation, so programs passing
    this value to ``useOfflineIpuTarget`` keep working). Raises
    ``poptorch.Error`` when no accelerator is present, as PopTorch does.
    """
    if not ipuHardwareIsAvailable():
        raise Error("ipuHardwareVersion: no accelerator is available (no "
                    "CUDA GPU is present; models run on the CPU)")
    return 2
