"""The collective operations a captured training step calls, as opaque
``torch.ops.poptorch`` operators: each traces as one node (fake mode
computes only its result's shape) and runs on this process's group
(``process_group.current()``), waited for through the fault monitor, so a
failed peer raises ``poptorch.Error`` instead of hanging.

* ``all_reduce_start_`` / ``all_reduce_wait_``: a bucket of gradients
  summed (or averaged) over the processes, in place (``gradients.py``);
* ``reduce_scatter_start_`` / ``reduce_scatter_wait``: a bucket laid out
  as ``[n, K]`` summed over the n processes, each keeping its row
  (``sharding.py``);
* ``all_gather``: every process's ``[K]`` part, in rank order;
  ``gather_rows``: a sharded tensor whole from its rows;
* ``all_gather_start_`` / ``all_gather_wait``: a bucket of sharded
  weights' rows (``[K]``) gathered in the background, every process's in
  rank order (``weight_sharding.py`` cuts the whole weights from it);
* ``total_``: a tensor summed over the processes, in place;
* ``local_shard`` (no collective): this process's part of a tensor,
  flattened and padded with zeros to a multiple of n (row ``rank`` of
  ``[n, K]``).

Every process must run the collectives in the same order. Each operation
takes the step's ``token`` (an empty tensor, ``new_token``) and is marked
as writing it: a compiler keeps the writes of one tensor in the traced
order, where it would otherwise reorder independent operations (Inductor
does), and a process running a step compiled by one backend meets the
others running another's (tiered compilation switches each process on its
own). The start operations are also marked as writing their bucket, so
that nothing reuses the bucket's memory before their wait. The graph is
the same on every process (no rank in it), so the processes of a run share
one compiled step.
"""
import math
from typing import List

import torch

from ..profiling.ranges import profile_range
from . import process_group

#: The operators that start a collective in the background.
_STARTS = ("all_reduce_start_", "reduce_scatter_start_")


def is_start(node: torch.fx.Node) -> bool:
    """Whether a captured graph's ``node`` starts a gradient collective
    (an all-reduce or a reduce-scatter; the weights' all-gathers are
    placed by ``weight_sharding.py``)."""
    return any(node.target is getattr(torch.ops.poptorch, name).default
               for name in _STARTS)


@torch.library.custom_op("poptorch::all_reduce_start_",
                         mutates_args=("flat", "token"))
def _all_reduce_start_(flat: torch.Tensor, bucket: int,
                       token: torch.Tensor) -> None:
    with profile_range("all-reduce"):
        process_group.current().start_all_reduce_(flat, bucket)


@_all_reduce_start_.register_fake
def _all_reduce_start_fake(flat: torch.Tensor, bucket: int,
                           token: torch.Tensor) -> None:
    return None


@torch.library.custom_op("poptorch::all_reduce_wait_",
                         mutates_args=("flat", "token"))
def _all_reduce_wait_(flat: torch.Tensor, bucket: int, average: bool,
                      token: torch.Tensor) -> None:
    with profile_range("all-reduce wait"):
        process_group.current().finish_all_reduce_(
            flat, bucket, average, "the gradient all-reduce")


@_all_reduce_wait_.register_fake
def _all_reduce_wait_fake(flat: torch.Tensor, bucket: int, average: bool,
                          token: torch.Tensor) -> None:
    return None


@torch.library.custom_op("poptorch::reduce_scatter_start_",
                         mutates_args=("flat", "token"))
def _reduce_scatter_start_(flat: torch.Tensor, bucket: int,
                           token: torch.Tensor) -> None:
    with profile_range("reduce-scatter"):
        process_group.current().start_reduce_scatter(flat, bucket)


@_reduce_scatter_start_.register_fake
def _reduce_scatter_start_fake(flat: torch.Tensor, bucket: int,
                               token: torch.Tensor) -> None:
    return None


@torch.library.custom_op("poptorch::reduce_scatter_wait",
                         mutates_args=("token",))
def _reduce_scatter_wait(flat: torch.Tensor, bucket: int, parts: int,
                         average: bool, token: torch.Tensor) -> torch.Tensor:
    with profile_range("reduce-scatter wait"):
        return process_group.current().finish_reduce_scatter(
            flat, bucket, average, "the gradient reduce-scatter")


@_reduce_scatter_wait.register_fake
def _reduce_scatter_wait_fake(flat: torch.Tensor, bucket: int, parts: int,
                              average: bool,
                              token: torch.Tensor) -> torch.Tensor:
    return flat.new_empty(flat.numel() // parts)


@torch.library.custom_op("poptorch::all_gather", mutates_args=("token",))
def _all_gather(part: torch.Tensor, parts: int,
                token: torch.Tensor) -> torch.Tensor:
    with profile_range("all-gather"):
        return process_group.current().all_gather(
            part, "the all-gather of the updated weights")


@_all_gather.register_fake
def _all_gather_fake(part: torch.Tensor, parts: int,
                     token: torch.Tensor) -> torch.Tensor:
    return part.new_empty(part.numel() * parts)


@torch.library.custom_op("poptorch::gather_rows", mutates_args=("token",))
def _gather_rows(rows: torch.Tensor, parts: int, shape: List[int],
                 token: torch.Tensor) -> torch.Tensor:
    whole = process_group.current().all_gather(
        rows, "the all-gather of the updated weights")
    return whole[:math.prod(shape)].view(shape)


@_gather_rows.register_fake
def _gather_rows_fake(rows: torch.Tensor, parts: int, shape: List[int],
                      token: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(shape)


@torch.library.custom_op("poptorch::all_gather_start_",
                         mutates_args=("flat", "token"))
def _all_gather_start_(flat: torch.Tensor, bucket: int,
                       token: torch.Tensor) -> None:
    with profile_range("all-gather"):
        process_group.current().start_all_gather(flat, bucket)


@_all_gather_start_.register_fake
def _all_gather_start_fake(flat: torch.Tensor, bucket: int,
                           token: torch.Tensor) -> None:
    return None


@torch.library.custom_op("poptorch::all_gather_wait",
                         mutates_args=("flat", "token"))
def _all_gather_wait(flat: torch.Tensor, bucket: int, parts: int,
                     token: torch.Tensor) -> torch.Tensor:
    with profile_range("all-gather wait"):
        return process_group.current().finish_all_gather(
            bucket, "the all-gather of the sharded weights")


@_all_gather_wait.register_fake
def _all_gather_wait_fake(flat: torch.Tensor, bucket: int, parts: int,
                          token: torch.Tensor) -> torch.Tensor:
    return flat.new_empty(flat.numel() * parts)


@torch.library.custom_op("poptorch::local_shard", mutates_args=())
def _local_shard(tensor: torch.Tensor, parts: int) -> torch.Tensor:
    rank = process_group.current().rank
    return padded_rows(tensor, parts)[rank].clone()


@_local_shard.register_fake
def _local_shard_fake(tensor: torch.Tensor, parts: int) -> torch.Tensor:
    return tensor.new_empty(shard_numel(tensor.numel(), parts))


@torch.library.custom_op("poptorch::total_", mutates_args=("value", "token"))
def _total_(value: torch.Tensor, token: torch.Tensor) -> None:
    process_group.current().all_reduce_(
        value, "the gradient statistics' all-reduce")


@_total_.register_fake
def _total_fake(value: torch.Tensor, token: torch.Tensor) -> None:
    return None


def new_token(like: torch.Tensor) -> torch.Tensor:
    """A step's token: an empty tensor on ``like``'s device that each of
    the step's collectives is marked as writing, in order."""
    return like.new_empty(0)


def shard_numel(numel: int, parts: int) -> int:
    """Elements of each of ``parts`` shards of a tensor of ``numel``."""
    return -(-numel // parts)


def padded_rows(tensor: torch.Tensor, parts: int) -> torch.Tensor:
    """``tensor`` flattened, padded with zeros to ``parts`` x k elements
    and viewed as ``[parts, k]``: row r is shard r."""
    flat = tensor.reshape(-1)
    padding = shard_numel(flat.numel(), parts) * parts - flat.numel()
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(parts, -1)
