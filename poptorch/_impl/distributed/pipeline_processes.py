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

Every process of a pipeline must be called with the same inputs (checked on
each call). Under ``poprun``, ``poptorch.DataLoader`` gives the processes of
one replica the same data; otherwise it splits data by process, so
pipelines use ``auto_distributed_partitioning=False`` or split the data by
pipeline.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...errors import Error


class PipelineProcesses:
    """This process's place in the pipelines and their process groups."""

    def __init__(self, rank: int, size: int, stages: int) -> None:
        self.stages = stages
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

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def check_same_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise ``poptorch.Error`` in every process of the pipeline unless
        they all received the same call inputs (compared by sums)."""
        if not inputs:
            return
        fingerprint = torch.stack([value for tensor in inputs
                                   for value in _fingerprint(tensor)]).cpu()
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
        if self.pipelines == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, group=self.stage_group)
        if average:
            flat /= self.pipelines
        start = 0
        for grad in grads:
            grad.copy_(flat[start:start + grad.numel()].view_as(grad))
            start += grad.numel()

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
