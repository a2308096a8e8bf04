"""Build batches of a fixed number of rows from a stream of smaller pieces.

``AsynchronousDataAccessor(rebatched_size=N)`` (and
``DataLoader(mode=DataLoaderMode.AsyncRebatched)``) turn what the wrapped
dataset yields into batches of exactly ``N`` rows, in the worker process:

* items that are already batches (from a torch ``DataLoader`` with automatic
  batching) are concatenated along dimension 0 and cut every ``N`` rows, so
  the size of the pieces does not matter and no row is lost;
* items that are single samples (a dataset or any other iterable) are
  collated ``N`` at a time with torch's ``default_collate``.

The rows left at the end of an epoch form a smaller final batch, or are
dropped when ``drop_last`` is true. Batches may be tensors or any nesting of
dicts, lists, tuples and named tuples whose leaves are tensors.
"""
from typing import Any, Iterable, Iterator, List

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import default_collate

from ...errors import Error


def rebatch(items: Iterable, size: int, drop_last: bool,
            items_are_batches: bool) -> Iterator:
    """Batches of ``size`` rows built from ``items`` (see the module doc)."""
    if items_are_batches:
        return _concatenate_rows(items, size, drop_last)
    return _collate_samples(items, size, drop_last)


def _collate_samples(samples: Iterable, size: int,
                     drop_last: bool) -> Iterator:
    pending: List[Any] = []
    for sample in samples:
        pending.append(sample)
        if len(pending) == size:
            yield default_collate(pending)
            pending = []
    if pending and not drop_last:
        yield default_collate(pending)


def _concatenate_rows(batches: Iterable, size: int,
                      drop_last: bool) -> Iterator:
    pending: List[Any] = []
    pending_rows = 0
    for batch in batches:
        pending.append(batch)
        pending_rows += count_rows(batch)
        while pending_rows >= size:
            combined = _concatenate(pending)
            yield _take_rows(combined, 0, size)
            pending_rows -= size
            pending = [_take_rows(combined, size, pending_rows)
                       ] if pending_rows else []
    if pending_rows and not drop_last:
        yield _concatenate(pending)


def count_rows(batch: Any) -> int:
    """Size of dimension 0, the same for every tensor leaf of ``batch``."""
    leaves, _ = tree_flatten(batch)
    rows = set()
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            raise Error(
                "Rebatching needs every leaf of a batch to be a tensor with a "
                f"batch dimension, but a batch holds {_describe(leaf)}. "
                "Return tensors from the dataset, or do not use "
                "rebatched_size / DataLoaderMode.AsyncRebatched.")
        rows.add(leaf.shape[0])
    if len(rows) != 1:
        raise Error("Rebatching needs every tensor of a batch to have the "
                    f"same size in dimension 0, but got sizes {sorted(rows)}")
    return rows.pop()


def _concatenate(batches: List[Any]) -> Any:
    if len(batches) == 1:
        return batches[0]
    flat = [tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    if any(other_spec != spec for _, other_spec in flat[1:]):
        raise Error("Rebatching needs every batch to have the same structure "
                    f"but got {spec} and then a different one")
    columns = zip(*(leaves for leaves, _ in flat))
    return tree_unflatten([torch.cat(column) for column in columns], spec)


def _take_rows(batch: Any, start: int, length: int) -> Any:
    return tree_map(lambda tensor: tensor.narrow(0, start, length), batch)


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return "a 0-d tensor"
    return f"a {type(leaf).__name__} ({leaf!r:.40})"
