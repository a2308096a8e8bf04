"""``PipelinedExecution``: the stages run as a micro-batch pipeline by
``torch.distributed.pipelining`` (training; inference runs stage after
stage, ``sequential_stages.py``).

Every stage is a ``PipelineStage``. In one process all the stages are local
to it and ``ScheduleInterleaved1F1B`` (which holds several stages per
process) orders their work: forwards of the first micro-batches fill the
pipeline, then each stage alternates one forward and one backward, and the
last backwards drain it. With one stage per process
(``distributed/pipeline_processes.py``), ``Schedule1F1B`` runs that order
with the stages working concurrently and passing activations and gradients
point to point. The G x R micro-batches of one optimizer step form one
schedule step.

The schedule needs a torch.distributed process group: when the process has
none, a single-process gloo group is created (logged at INFO); in a
multi-process run whose processes each run all the stages, a group of this
process alone. The schedule
sums the micro-batches' gradients into each parameter's ``.grad`` (no
scaling); the loss it differentiates is the model's loss scaled for the
step (loss scaling, reduction).
"""
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                          ScheduleInterleaved1F1B)

from ..distributed import process_group
from ..distributed.pipeline_processes import PipelineProcesses
from ..logger import info_once
from ..profiling.ranges import profile_range
from .stages import StageModule


def _local_group() -> Optional[dist.ProcessGroup]:
    """A group of this process alone for a schedule of all the stages (None:
    the default group, started here when there is none)."""
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            return None
        return dist.new_group([dist.get_rank()],
                              use_local_synchronization=True)
    info_once("Pipelined execution: torch.distributed.pipelining needs a "
              "process group; starting a single-process gloo group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    process_group.leave_at_exit()
    return None


class _TimedStage(PipelineStage):
    """A pipeline stage whose backward passes are ranges on the timeline
    (``stage k backward``; its forward passes are ``StageModule``'s)."""

    def backward_one_chunk(self, *args, **kwargs):
        with profile_range(f"stage {self.stage_index} backward"):
            return super().backward_one_chunk(*args, **kwargs)


class PipelineSchedule:
    """The stages of this process and the schedule that runs them: all the
    stages (``ScheduleInterleaved1F1B``), or with ``processes`` the one
    stage of this process in its pipeline (``Schedule1F1B``)."""

    def __init__(self, modules: List[StageModule], device: torch.device,
                 micro_batches: int,
                 processes: Optional[PipelineProcesses] = None) -> None:
        self._scale_loss: Optional[Callable] = None
        if processes is not None:
            module = modules[processes.stage]
            module.skip_effects_once = True
            stage = _TimedStage(module, processes.stage, len(modules),
                                device, group=processes.group)
            self._schedule = Schedule1F1B(stage, micro_batches,
                                          loss_fn=self._loss,
                                          scale_grads=False)
            return
        group = _local_group()
        stages = []
        for module in modules:
            module.skip_effects_once = True
            stages.append(_TimedStage(module, module.index, len(modules),
                                      device, group=group))
        self._schedule = ScheduleInterleaved1F1B(
            stages, micro_batches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output, target) -> torch.Tensor:
        return self._scale_loss(output[-1])

    def run(self, stacked: Dict[str, torch.Tensor], micro_batches: int,
            scale_loss: Callable) -> None:
        """One training step over the micro-batches stacked in ``stacked``
        (the stages' keyword arguments, first dimension: the micro-batch);
        ``scale_loss`` gives the loss to differentiate from the model's
        loss."""
        self._scale_loss = scale_loss
        try:
            self._schedule.step(target=torch.zeros(micro_batches),
                                return_outputs=False, **stacked)
        except RuntimeError as error:
            cause = error.__cause__
            if cause is None or "failed to run" not in str(error):
                raise
            # The model's own exception, which the pipelining schedule
            # wraps ("[Stage k] failed to run forward"), without the wrapper.
            cause.__suppress_context__ = True
            raise cause
