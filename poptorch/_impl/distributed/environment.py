"""Where this process sits in a distributed run, and how processes meet.

The process id and count are ``options.Distributed.processId`` /
``numProcesses`` (from OpenMPI's ``OMPI_COMM_WORLD_RANK`` /
``OMPI_COMM_WORLD_SIZE`` by default, else torchrun's ``RANK`` /
``WORLD_SIZE``, or ``configureProcessId``). The processes meet at the
rendezvous store of torch.distributed's ``env://`` method:
``MASTER_ADDR`` / ``MASTER_PORT`` as set by torchrun and ``poprun``; when
unset (OpenMPI, ``configureProcessId``) they default to ``127.0.0.1`` and
29500, which suits processes on one host; set them to the address of
process 0's host for several hosts.

``POPTORCH_DISTRIBUTED_TIMEOUT`` (seconds, default 60) bounds every wait for
other processes: joining, start-up checks and each gradient all-reduce.
"""
import dataclasses
import os

import torch

from ...errors import Error
from ..devices import processes_share_a_gpu
from ..logger import info_once, warn_once

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
TIMEOUT_VARIABLE = "POPTORCH_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class ProcessEnvironment:
    """This process's id, the process count and the rendezvous."""
    process_id: int
    num_processes: int
    master_addr: str
    master_port: int
    timeout: float

    @staticmethod
    def for_process(process_id: int,
                    num_processes: int) -> "ProcessEnvironment":
        """Process ``process_id`` of ``num_processes``; the rendezvous and
        timeout come from the environment."""
        return ProcessEnvironment(
            process_id=process_id, num_processes=num_processes,
            master_addr=os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
            master_port=_port(), timeout=timeout_from_environment())

    @staticmethod
    def from_options(options) -> "ProcessEnvironment":
        """From ``options.Distributed`` and the environment."""
        return ProcessEnvironment.for_process(
            options.Distributed.processId, options.Distributed.numProcesses)

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    @staticmethod
    def backend(device: torch.device) -> str:
        """NCCL for CUDA devices, gloo for the CPU, and gloo (which also
        reduces CUDA tensors) when processes of this host share a GPU,
        which NCCL refuses."""
        if device.type != "cuda":
            return "gloo"
        if processes_share_a_gpu():
            info_once("Distributed run: more processes than GPUs on this "
                      "host, so some share a GPU; NCCL needs one GPU per "
                      "process, gradients are all-reduced with gloo")
            return "gloo"
        return "nccl"

    def export_rendezvous(self) -> None:
        """Set ``MASTER_ADDR`` / ``MASTER_PORT`` for ``env://`` when the
        launcher did not."""
        os.environ.setdefault("MASTER_ADDR", self.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.master_port))


def _port() -> int:
    text = os.environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise Error(f"The environment variable MASTER_PORT must hold a port "
                    f"number (1 to 65535), got {text!r}")
    return port


def timeout_from_environment() -> float:
    """Seconds from ``POPTORCH_DISTRIBUTED_TIMEOUT`` (default 60)."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise Error(f"The environment variable {TIMEOUT_VARIABLE} must hold "
                    f"a number of seconds > 0, got {text!r}")
    return value


def whole_replicas_per_instance() -> bool:
    """Whether ``poprun`` started this process with whole replicas in each
    instance (no more instances than replicas)."""
    return "POPDIST_NUM_INSTANCES" in os.environ and \
        instances_per_replica() == 1


def instances_per_replica() -> int:
    """How many consecutive processes each replica spans under ``poprun``
    (more instances than replicas: one pipeline stage per instance); 1
    otherwise."""
    try:
        instances = int(os.environ.get("POPDIST_NUM_INSTANCES", "1"))
        replicas = int(os.environ.get("POPDIST_NUM_TOTAL_REPLICAS", "1"))
    except ValueError:
        return 1
    if replicas < 1 or instances <= replicas or instances % replicas:
        return 1
    return instances // replicas


def warn_of_other_replica_count(replication_factor: int) -> None:
    """Under ``poprun`` with whole replicas in each instance, warn once
    when the model's ``replicationFactor`` is not the instance's share of
    ``--num-replicas`` (plain ``poptorch.Options()`` keeps 1): the run then
    trains another number of replicas than asked for."""
    if not whole_replicas_per_instance():
        return
    try:
        local = int(os.environ["POPDIST_NUM_LOCAL_REPLICAS"])
        instances = int(os.environ["POPDIST_NUM_INSTANCES"])
    except (KeyError, ValueError):
        return
    if replication_factor != local:
        warn_once(
            f"poprun started {instances} instances of {local} replica(s) "
            f"each, but the model's replicationFactor is "
            f"{replication_factor}: the run trains "
            f"{replication_factor * instances} replicas. "
            "popdist.poptorch.Options() sets the instance's replicas "
            "(popdist.getNumLocalReplicas()).")
