"""The gradient all-reduce inside the captured training step.

Between the reduction of a step's G x R local micro-batches and the
optimizer update, the update graph calls ``poptorch::all_reduce_`` on one
flat buffer per gradient dtype (one collective per dtype, not per weight).
The op is opaque to the graph: at run time it is a Python call into the
process group, which waits for the collective through the fault monitor,
so a failed peer raises ``poptorch.Error`` rather than hanging. With
``ReductionType.Mean`` the buffers are averaged over the n processes (each
holds its local G x R reduction, so the result is the mean over all
n x G x R micro-batches); with ``Sum`` they are added.

Splitting the update into separate "gradients" and "apply" graphs would do
the same with two graph calls per step; functional collectives traced into
the graph would wait inside C++ without the fault monitor.
"""
from typing import Callable, Dict, List

import torch

from . import process_group


@torch.library.custom_op("poptorch::all_reduce_", mutates_args=("flat",))
def _all_reduce_(flat: torch.Tensor, average: bool) -> None:
    process_group.current().all_reduce_(flat, average,
                                        "the gradient all-reduce")


@_all_reduce_.register_fake
def _all_reduce_fake(flat: torch.Tensor, average: bool) -> None:
    return None


def gradient_reducer(average: bool) -> Callable[[List[torch.Tensor]],
                                                List[torch.Tensor]]:
    """A function of the step's gradients, traced into the update graph,
    returning them summed (or averaged) over the processes."""

    def reduce(grads: List[torch.Tensor]) -> List[torch.Tensor]:
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for index, grad in enumerate(grads):
            by_dtype.setdefault(grad.dtype, []).append(index)
        reduced = list(grads)
        for positions in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in positions])
            torch.ops.poptorch.all_reduce_(flat, average)
            pieces = flat.split([grads[i].numel() for i in positions])
            for index, piece in zip(positions, pieces):
                reduced[index] = piece.view(grads[index].shape)
        return reduced

    return reduce
