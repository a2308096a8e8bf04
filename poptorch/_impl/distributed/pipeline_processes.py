"""One pipeline stage per process: a training model whose blocks form K
stages, in an n-process run (n a multiple of K, ``replicationFactor(1)``),
runs as n / K pipelines of K processes. Process p runs stage p mod K of
pipeline p div K (pipeline ranks are consecutive, as ``poprun`` places a
replica's instances next to each other).

Each pipeline is a process group for ``torch.distributed.pipelining``'s
point-to-point transfers; the processes that run the same stage in
different pipelines form a group that all-reduces that stage's gradients.
After each call, the processes of a pipeline broadcast the weights,
optimizer state and buffers of the stage they own, so that every process
holds the whole trained model (for ``copyWeightsToHost``, checkpoints and
inference); they also share the last stage's outputs, so every process
returns them.

A weight that several stages read is updated by each of them: their
gradients of it are summed over the pipeline first, so the copies stay
equal. Gradient clipping (``max_grad_norm``) and automatic loss scaling
need statistics of every stage's gradients: the update graph sums them over
the pipeline (``poptorch::pipeline_sum_``, ``PartialGradients``).

A process of a pipeline that fails makes the others raise
``poptorch.Error`` naming it (``FaultMonitor.explaining``).

Every process of a pipeline must be called with the same inputs (checked on
each call). Under ``poprun``, ``poptorch.DataLoader`` gives the processes of
one replica the same data; otherwise it splits data by process, so
pipelines use ``auto_distributed_partitioning=False`` or split the data by
pipeline.
"""
import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...errors import Error
from ..optimizers.global_attributes import PartialGradients
from .faults import FaultMonitor

_numbers = itertools.count()
_pipelines: "weakref.WeakValueDictionary[int, PipelineProcesses]" = \
    weakref.WeakValueDictionary()


@torch.library.custom_op("poptorch::pipeline_sum_", mutates_args=("value",))
def _pipeline_sum_(value: torch.Tensor, pipeline: int) -> None:
    dist.all_reduce(value, group=_pipelines[pipeline].group)


@_pipeline_sum_.register_fake
def _pipeline_sum_fake(value: torch.Tensor, pipeline: int) -> None:
    return None


class PipelineProcesses:
    """This process's place in the pipelines and their process groups."""

    def __init__(self, rank: int, size: int, stages: int,
                 monitor: FaultMonitor, device: torch.device) -> None:
        self.stages = stages
        self.device = device
        self.monitor = monitor
        self.stage = rank % stages
        self.pipelines = size // stages
        first = rank - self.stage
        self.ranks = list(range(first, first + stages))
        self.group = None
        self.stage_group = None
        for pipeline in range(self.pipelines):
            group = dist.new_group(list(range(pipeline * stages,
                                              (pipeline + 1) * stages)))
            if pipeline * stages == first:
                self.group = group
        for stage in range(stages):
            group = dist.new_group([stage + pipeline * stages
                                    for pipeline in range(self.pipelines)])
            if stage == self.stage:
                self.stage_group = group
        self.number = next(_numbers)
        _pipelines[self.number] = self

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def check_same_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise ``poptorch.Error`` in every process of the pipeline unless
        they all received the same call inputs (compared by sums)."""
        if not inputs:
            return
        # On the model's device, which the run's collectives serve.
        fingerprint = torch.stack([value.to(self.device) for tensor in inputs
                                   for value in _fingerprint(tensor)])
        lowest, highest = fingerprint.clone(), fingerprint.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(lowest, highest):
            raise Error(
                f"Processes {self.ranks[0]} to {self.ranks[-1]} run the "
                "stages of one pipeline but were called with different "
                "inputs: every process of a pipeline must get the same data. "
                "Start the run with poprun (--num-instances a multiple of "
                "--num-replicas), whose poptorch.DataLoader splits data by "
                "replica, or pass auto_distributed_partitioning=False to "
                "poptorch.DataLoader (or split the data by pipeline, process "
                "id // number of stages).")

    def reduce_gradients_(self, grads: Sequence[torch.Tensor],
                          average: bool) -> None:
        """Sum (or average) this stage's gradients over the pipelines, in
        place."""
        if self.pipelines == 1:
            return
        _sum_in_place(grads, self.stage_group,
                      self.pipelines if average else 1)

    def sum_shared_gradients_(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum the gradients of weights that several stages read over the
        pipeline, in place (every process passes the same weights' gradients,
        zeros for those its stage does not read)."""
        _sum_in_place(grads, self.group)

    def partial_gradients(self, counted: Sequence[bool],
                          device: torch.device) -> PartialGradients:
        """The update of this stage's weights, totalling gradient
        statistics over the pipeline."""
        number = self.number

        def total(value: torch.Tensor) -> None:
            torch.ops.poptorch.pipeline_sum_(value, number)

        return PartialGradients(tuple(counted), total, device)

    def broadcast_from_owners(self, owned: Sequence[Sequence[torch.Tensor]]
                              ) -> None:
        """Give every process of the pipeline the values of ``owned[s]``
        held by the process of stage s (in place; one broadcast per stage
        and dtype)."""
        for stage, tensors in enumerate(owned):
            for group in _by_dtype(tensors):
                flat = torch.cat([t.reshape(-1) for t in group])
                dist.broadcast(flat, src=self.ranks[stage], group=self.group)
                _unflatten_into(flat, group)

    def share_outputs(self, recorded: Optional[List[List[torch.Tensor]]],
                      metas: Sequence[Tuple[torch.Size, torch.dtype]],
                      count: int, device: torch.device
                      ) -> List[List[torch.Tensor]]:
        """The last stage's outputs of ``count`` micro-batches, in every
        process of the pipeline (one broadcast per output)."""
        stacked = []
        for position, (shape, dtype) in enumerate(metas):
            if self.is_last:
                tensor = torch.stack([outputs[position]
                                      for outputs in recorded])
            else:
                tensor = torch.empty((count, *shape), dtype=dtype,
                                     device=device)
            dist.broadcast(tensor, src=self.ranks[-1], group=self.group)
            stacked.append(tensor)
        return [[tensor[index] for tensor in stacked]
                for index in range(count)]


def _fingerprint(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sum and the 2-norm of ``tensor``, in float64."""
    if tensor.is_floating_point():
        norm = torch.linalg.vector_norm(tensor, dtype=torch.float64)
    else:
        norm = tensor.double().square().sum().sqrt()
    return tensor.sum(dtype=torch.float64), norm


def _sum_in_place(tensors: Sequence[torch.Tensor], group,
                  divisor: int = 1) -> None:
    """Sum ``tensors`` over the processes of ``group`` (then divide by
    ``divisor``), in place: one collective per dtype, float16 and bfloat16
    summed in float32."""
    for same in _by_dtype(tensors):
        dtype = torch.promote_types(same[0].dtype, torch.float32)
        flat = torch.cat([t.reshape(-1).to(dtype) for t in same])
        dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat /= divisor
        _unflatten_into(flat, same)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor,
                    tensors: Sequence[torch.Tensor]) -> None:
    start = 0
    for tensor in tensors:
        tensor.copy_(flat[start:start + tensor.numel()].view_as(tensor))
        start += tensor.numel()
