"""Training one model over several processes on torch.distributed.

With ``options.Distributed.numProcesses`` = n > 1, each process runs its
own R replicas (``replicationFactor`` is per process) on its part of the
data, and the n processes train one global model of n x R replicas:

1. compiling a training model joins the run's process group
   (``process_group.py``; rendezvous in ``environment.py``);
2. the processes check that they compile the same model with the same
   options (``consistency.py``) and take process 0's weights, buffers and
   optimizer state, so they start from one model;
3. each optimizer step all-reduces the gradients before the update
   (``gradients.py``), averaging for ``ReductionType.Mean``; with
   replicated tensor sharding each process keeps and updates rows of the
   optimizer state instead (``sharding.py``), and of the weights too
   (``weight_sharding.py``);
4. a process that fails makes the others raise ``poptorch.Error`` naming
   it, within the run's timeout (``faults.py``).

Inference models run independently in each process (no collective), so a
program may evaluate on one process only.
"""
import itertools
from typing import List, Optional, Sequence

import torch

from ...enums import ReductionType
from ...errors import Error
from . import consistency, process_group
from .environment import (ProcessEnvironment, warn_of_other_replica_count,
                          whole_replicas_per_instance)
from .gradients import GradientExchange
from .pipeline_processes import PipelineProcesses
from .sharding import ShardedExchange, Sharding, StatePlacement

_compilations = itertools.count()


def process_seed(options) -> Optional[int]:
    """The seed of this process's model random number generator: process
    i of an n-process run uses ``randomSeed + i`` (mod 2**64), so that the
    processes' random operations differ, as the replicas' do, and the run
    stays reproducible. None without a seed."""
    seed = options.random_seed
    if seed is None:
        return None
    return (seed + options.Distributed.processId) % 2**64


class TrainingProcesses:
    """A training model's part in the run: in an n-process run, its
    process group and how its optimizer state is sharded; in a one-process
    run, nothing to do."""

    def __init__(self, group: Optional[process_group.ProcessGroup]) -> None:
        self.group = group
        self.sharding: Optional[Sharding] = None

    def shard(self, options, trainable: Sequence[torch.Tensor],
              stage_per_process: bool, staged: bool
              ) -> Optional[StatePlacement]:
        """Decide how the optimizer state of the ``trainable`` parameters is
        kept (replicated tensor sharding, ``sharding.py``); return where it
        lives for ``OptimizerDeviceState`` (None: whole, one process).
        ``staged``: a multi-stage model, whose gradients are summed outside
        the captured steps, so its running gradient buffer stays whole."""
        processes = 1 if self.group is None else self.group.size
        self.sharding = Sharding.build(options, trainable, processes,
                                       stage_per_process, staged)
        if self.group is None:
            return None
        return StatePlacement(self.sharding, self.group)

    def exchange(self, reduction: ReductionType
                 ) -> Optional[GradientExchange]:
        """What the training steps do with the other processes: the
        gradient all-reduce, or the sharded update (None: one process)."""
        if self.group is None:
            return None
        average = reduction == ReductionType.Mean
        if self.sharding is not None:
            return ShardedExchange(self.sharding, average)
        return GradientExchange(average)

    def pipelines(self, stages: int) -> Optional[PipelineProcesses]:
        """For a model of ``stages`` stages whose processes each run one
        stage (``stage_processes``), this process's place in the pipelines
        (None: one process)."""
        if self.group is None:
            return None
        return PipelineProcesses(self.group.rank, self.group.size, stages,
                                 self.group.monitor, self.group.device)


def stage_processes(options) -> int:
    """How many processes the stages of a multi-stage model are spread
    over: in an n-process run, one stage per process (n), unless ``poprun``
    placed whole replicas in each instance; then, as in a one-process run,
    each process runs all the stages of its replicas (1)."""
    processes = options.Distributed.numProcesses
    if processes > 1 and whole_replicas_per_instance():
        return 1
    return processes


def start_training(options, state, micro: List[torch.Tensor],
                   grouped: bool, optimizer_plan) -> TrainingProcesses:
    """For a training model compiled with ``options`` and ``optimizer_plan``
    from the device ``state`` (weights and buffers) and the example
    micro-batch ``micro``: in an n-process run, join the run, check that
    every process compiles the same model with the same optimizer
    settings, and start from process 0's weights and buffers (the
    optimizer state follows, through ``TrainingProcesses.shard``'s
    placement)."""
    environment = ProcessEnvironment.from_options(options)
    if not environment.distributed:
        return TrainingProcesses(None)
    warn_of_other_replica_count(options.replication_factor)
    if grouped:
        raise Error("replicaGrouping is not supported in a distributed run "
                    "(options.Distributed.numProcesses = "
                    f"{environment.num_processes}): replica groups would "
                    "span processes")
    group = process_group.join(environment, state.device)
    names = {"parameter": state.param_names, "buffer": state.buffer_names,
             "input": [str(i) for i in range(len(micro))]}
    tensors = {"parameter": state.params, "buffer": state.buffers[0],
               "input": micro}
    consistency.check_same_everywhere(
        group, f"model{next(_compilations)}",
        consistency.describe(options, names, tensors, optimizer_plan))
    group.broadcast_(state.params + [b for buffers in state.buffers
                                     for b in buffers],
                     "the start-up weight broadcast")
    return TrainingProcesses(group)
