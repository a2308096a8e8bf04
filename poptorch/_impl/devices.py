"""Mapping of IPU concepts onto the devices we run on.

An "IPU" is a CUDA GPU when one is present; otherwise the model runs on the
CPU. ``Options.useIpuModel(True)`` (or ``POPTORCH_IPU_MODEL=1``) selects the
CPU even when a GPU exists, as the IPU Model stood in for hardware.
``POPTORCH_CPU_IS_IPU=1`` declares the CPU as IPU hardware to programs that
ask (``ipuHardwareIsAvailable``) without changing where models run.

In a run of several processes per host, each process takes the GPU of its
local rank (torchrun's ``LOCAL_RANK``, OpenMPI's
``OMPI_COMM_WORLD_LOCAL_RANK``) modulo the GPUs present, and makes it the
current CUDA device; a single process takes the current CUDA device.
"""
import os
from typing import Optional

import torch

from ..errors import Error

_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
_CPU_IS_IPU_VARIABLE = "POPTORCH_CPU_IS_IPU"


def select_device(use_ipu_model: bool) -> torch.device:
    """The device a model runs on: this process's CUDA device, else the
    CPU."""
    if use_ipu_model or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = _local_variable(_LOCAL_RANK_VARIABLES)
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def processes_share_a_gpu() -> bool:
    """Whether more processes run on this host (torchrun's
    ``LOCAL_WORLD_SIZE``, OpenMPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``) than it
    has GPUs, so that some of them use the same one."""
    local_size = _local_variable(_LOCAL_SIZE_VARIABLES)
    return (local_size is not None and torch.cuda.is_available()
            and local_size > torch.cuda.device_count())


def _local_variable(names) -> Optional[int]:
    """The value of the first of the environment variables ``names`` that
    is set."""
    for name in names:
        text = os.environ.get(name)
        if text is None or text == "":
            continue
        try:
            return int(text)
        except ValueError:
            raise Error(f"Environment variable {name} must hold an integer "
                        f"(this process's place on its host), got "
                        f"{text!r}") from None
    return None


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """True if at least ``num_ipus`` accelerators (CUDA GPUs) are present,
    or for any ``num_ipus`` when ``POPTORCH_CPU_IS_IPU=1`` declares the CPU
    as the hardware (it runs any number of replicas). Programs that refuse
    to start without IPU hardware, such as Lightning's ``IPUStrategy``,
    then run; models still run on the device ``select_device`` picks."""
    if _cpu_is_ipu():
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() >= num_ipus


def _cpu_is_ipu() -> bool:
    """Whether ``POPTORCH_CPU_IS_IPU`` declares the CPU as IPU hardware:
    ``1`` yes, ``0`` or unset no."""
    text = os.environ.get(_CPU_IS_IPU_VARIABLE, "")
    if text not in ("", "0", "1"):
        raise Error(f"Environment variable {_CPU_IS_IPU_VARIABLE} must be 1 "
                    f"(the CPU counts as IPU hardware) or 0, got {text!r}")
    return text == "1"


def ipuHardwareVersion() -> int:
    """The hardware version of the available accelerator.

    A CUDA GPU, or the CPU declared by ``POPTORCH_CPU_IS_IPU=1``, reports
    version 2 (the Mk2 IPU generation, so programs passing this value to
    ``useOfflineIpuTarget`` keep working). Raises ``poptorch.Error`` when no
    accelerator is present, as PopTorch does.
    """
    if not ipuHardwareIsAvailable():
        raise Error("ipuHardwareVersion: no accelerator is available (no "
                    "CUDA GPU is present and POPTORCH_CPU_IS_IPU is not 1; "
                    "models run on the CPU)")
    return 2
