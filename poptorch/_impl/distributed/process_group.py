"""This process's membership of the run's torch.distributed process group.

A process joins once (the first training model it compiles, or
``popdist.init()``): ``torch.distributed.init_process_group`` with gloo on
the CPU or NCCL on CUDA devices, rank = ``processId``, world size =
``numProcesses``, rendezvous through ``env://``. A process group the
program created itself is used as it is when its rank and size agree with
the options. Collectives are started asynchronously and waited for through
the ``FaultMonitor``, so a failed peer raises ``poptorch.Error`` instead of
hanging; gradient all-reduces and reduce-scatters are waited for later than
they start, so that they run while the step computes (``gradients.py``,
``sharding.py``).
"""
import atexit
import datetime
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...errors import Error
from ..logger import logger
from .environment import ProcessEnvironment
from .faults import FaultMonitor
from .state_service import StateService

_STORE_PREFIX = "poptorch"


class ProcessGroup:
    """The run's process group as this process sees it."""

    def __init__(self, environment: ProcessEnvironment,
                 device: torch.device) -> None:
        self.environment = environment
        self.device = device
        self.rank = environment.process_id
        self.size = environment.num_processes
        self.store = dist.PrefixStore(
            _STORE_PREFIX, dist.distributed_c10d._get_default_store())
        self.monitor = FaultMonitor(self.store, self.rank, self.size,
                                    environment.timeout,
                                    hosts_store=_hosts_store(self.rank))
        self.blocking = dist.get_backend() == "gloo"
        self._service = None
        #: The collectives started and not yet waited for, by kind and
        #: key: their work, fault-monitor sequence and result tensor.
        self._in_flight: Dict[Tuple[str, int], Tuple[
            dist.Work, int, Optional[torch.Tensor]]] = {}

    def _start(self, kind: str, key: int,
               issue: Callable[[], Tuple[dist.Work, Optional[torch.Tensor]]]
               ) -> None:
        """Start a collective of ``kind`` (``issue()``: its work and result
        tensor), to be waited for by ``_wait(kind, key)``."""
        if (kind, key) in self._in_flight:
            raise Error(f"Distributed run: {kind} {key} started twice "
                        "without waiting for it")
        sequence = self.monitor.start()
        work, result = issue()
        self._in_flight[kind, key] = (work, sequence, result)

    def _wait(self, kind: str, key: int,
              what: str) -> Optional[torch.Tensor]:
        """Wait for the collective ``_start`` began; its result tensor."""
        work, sequence, result = self._in_flight.pop((kind, key))
        self.monitor.wait(work, what, sequence, self.blocking)
        return result

    def start_all_reduce_(self, tensor: torch.Tensor, key: int) -> None:
        """Start summing ``tensor`` over the processes, in place; the
        operation runs in the background until ``finish_all_reduce_(key)``.
        """
        self._start("all-reduce", key,
                    lambda: (dist.all_reduce(tensor, async_op=True), None))

    def finish_all_reduce_(self, tensor: torch.Tensor, key: int,
                           average: bool, what: str) -> None:
        """Wait for the all-reduce ``key`` of ``tensor``; with ``average``,
        divide the sum by the number of processes."""
        self._wait("all-reduce", key, what)
        if average:
            tensor.div_(self.size)

    def start_reduce_scatter(self, flat: torch.Tensor, key: int) -> None:
        """Start summing ``flat`` over the processes, for this process's
        part of the sum (row ``rank`` of ``flat`` viewed as ``[size,
        -1]``); the operation runs in the background until
        ``finish_reduce_scatter(key)``. On gloo, whose reduce-scatter takes
        twice as long as its all-reduce of the same tensor (21 MB between
        two CPU processes: 49 ms against 21 ms), ``flat`` is all-reduced in
        place and the row taken from it."""
        def issue():
            if self.blocking:
                return dist.all_reduce(flat, async_op=True), None
            part = flat.new_empty(flat.numel() // self.size)
            return dist.reduce_scatter_single(part, flat, async_op=True), part

        self._start("reduce-scatter", key, issue)

    def finish_reduce_scatter(self, flat: torch.Tensor, key: int,
                              average: bool, what: str) -> torch.Tensor:
        """Wait for the reduce-scatter ``key`` of ``flat``; return this
        process's part of the sum (with ``average``, divided by the number
        of processes)."""
        part = self._wait("reduce-scatter", key, what)
        if part is None:
            part = flat.view(self.size, -1)[self.rank].clone()
        if average:
            part.div_(self.size)
        return part

    def all_gather(self, part: torch.Tensor, what: str) -> torch.Tensor:
        """The processes' ``part`` tensors, one after another in rank
        order, as one flat tensor."""
        sequence = self.monitor.start()
        work, whole = self._issue_all_gather(part)
        self.monitor.wait(work, what, sequence, self.blocking)
        return whole

    def start_all_gather(self, part: torch.Tensor, key: int) -> None:
        """Start gathering the processes' ``part`` tensors; the operation
        runs in the background until ``finish_all_gather(key)`` returns
        them, one after another in rank order, as one flat tensor."""
        self._start("all-gather", key, lambda: self._issue_all_gather(part))

    def finish_all_gather(self, key: int, what: str) -> torch.Tensor:
        """Wait for the all-gather ``key``; the gathered flat tensor."""
        return self._wait("all-gather", key, what)

    def _issue_all_gather(self, part: torch.Tensor
                          ) -> Tuple[dist.Work, torch.Tensor]:
        whole = part.new_empty(part.numel() * self.size)
        return (dist.all_gather_single(whole, part.reshape(-1),
                                       async_op=True), whole)

    def all_reduce_(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over the processes, in place."""
        sequence = self.monitor.start()
        work = dist.all_reduce(tensor, async_op=True)
        self.monitor.wait(work, what, sequence, self.blocking)

    def state_service(self) -> StateService:
        """The service that sends this process's rows of sharded optimizer
        state to others (``state_service.py``), started on the first call,
        which every process makes at the same point (it creates a process
        group)."""
        if self._service is None:
            self._service = StateService(self)
        return self._service

    def broadcast_(self, tensors: List[torch.Tensor], what: str) -> None:
        """Give every process process 0's values of ``tensors`` (in
        place)."""
        for tensor in tensors:
            sequence = self.monitor.start()
            work = dist.broadcast(tensor, src=0, async_op=True)
            self.monitor.wait(work, what, sequence, self.blocking)


_current: List[ProcessGroup] = []


def join(environment: ProcessEnvironment,
         device: torch.device) -> ProcessGroup:
    """This process's group, joining it on the first call."""
    if _current:
        group = _current[0]
        if (group.rank, group.size) != (environment.process_id,
                                        environment.num_processes):
            raise Error(
                f"This process already joined a distributed run as process "
                f"{group.rank} of {group.size}; options.Distributed now says "
                f"process {environment.process_id} of "
                f"{environment.num_processes}. Use the same "
                "options.Distributed settings for every model of a process.")
        return group
    if dist.is_initialized():
        check_existing_group(environment, device)
    else:
        _initialise(environment, device)
    group = ProcessGroup(environment, device)
    _current.append(group)
    logger.debug("Joined the distributed run as process %d of %d (%s)",
                 group.rank, group.size, dist.get_backend())
    return group


def current() -> ProcessGroup:
    if not _current:
        raise Error("This process has not joined a distributed run")
    return _current[0]


def _hosts_store(rank: int) -> bool:
    """Whether this process hosts the rendezvous store: process 0, unless
    torchrun's agent hosts it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower()
    return rank == 0 and agent not in ("1", "true")


def check_existing_group(environment: ProcessEnvironment,
                          device: torch.device) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (environment.process_id, environment.num_processes):
        raise Error(
            f"torch.distributed is already initialised as rank {rank} of "
            f"{size}, but options.Distributed says process "
            f"{environment.process_id} of {environment.num_processes}")
    backend = str(dist.get_backend())
    if device.type == "cpu" and "gloo" not in backend:
        raise Error(
            f"torch.distributed is already initialised with the {backend} "
            "backend, which cannot reduce the tensors of a model on the CPU "
            "(useIpuModel(True) or POPTORCH_IPU_MODEL=1 on a machine with "
            "GPUs); initialise it with gloo, or run the model on the GPU")


def _initialise(environment: ProcessEnvironment,
                device: torch.device) -> None:
    environment.export_rendezvous()
    timeout = _backend_timeout(environment, device)
    try:
        dist.init_process_group(
            ProcessEnvironment.backend(device), init_method="env://",
            rank=environment.process_id,
            world_size=environment.num_processes,
            timeout=datetime.timedelta(seconds=timeout))
    except Exception as error:
        raise Error(
            f"Distributed run: process {environment.process_id} of "
            f"{environment.num_processes} could not join the others at "
            f"{environment.master_addr}:{environment.master_port} within "
            f"{timeout:.0f} s ({type(error).__name__}: {error}). Check that "
            "every process was started with the same MASTER_ADDR/"
            "MASTER_PORT and process count.") from error
    leave_at_exit()


def _backend_timeout(environment: ProcessEnvironment,
                     device: torch.device) -> float:
    """The backend's own timeout: the run's for gloo, whose failures the
    fault monitor explains; beyond it for NCCL, whose watchdog would abort
    the process, so that the polling monitor speaks first."""
    if ProcessEnvironment.backend(device) == "gloo":
        return environment.timeout
    return 2 * environment.timeout + 10


def leave_at_exit() -> None:
    """Destroy the default process group when the interpreter exits."""
    atexit.register(_leave)


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
