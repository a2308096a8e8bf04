"""``poptorch.DataLoader``: a torch ``DataLoader`` whose batches feed one
call of a PopTorch model.

One call of a wrapped model consumes ``combinedBatchSize`` samples:
``batch_size x device_iterations x gradient_accumulation x
(replication_factor / input_group_size)``. The loader yields batches of that
many consecutive samples, drops an incomplete final batch unless
``drop_last=False``, and in a distributed run gives each process a disjoint
part of the dataset (see ``partitioning``).

In ``DataLoaderMode.Sync`` it is exactly ``torch.utils.data.DataLoader(
dataset, batch_size=combinedBatchSize, ...)``: same batches, same order, same
collation (tensors, dicts, tuples, nesting), same use of workers and of
torch's random generator for shuffling. ``DataLoaderMode.Async`` and
``AsyncRebatched`` run that loader in an ``AsynchronousDataAccessor``.
"""
from typing import (Any, Dict, Iterable, Iterator, List, NamedTuple,
                    Optional, Sequence)

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

from ...enums import DataLoaderMode
from ...errors import Error
from ..batching import BatchLayout
from ..distributed.environment import instances_per_replica
from ..logger import info_once
from ..options.groups import freeze
from .async_accessor import AsynchronousDataAccessor
from .partitioning import DistributedPartitionSampler, ProcessShareIterable

_ACCESSOR_OPTIONS = ("buffer_size", "miss_sleep_time_in_ms",
                     "load_indefinitely", "early_preload", "sharing_strategy")


class DataLoader(torch.utils.data.DataLoader):
    """A torch ``DataLoader`` yielding batches of ``combinedBatchSize``
    samples: the data of one call of a model compiled with ``options``.

    * ``batch_size``: the micro-batch size S, the batch one replica
      processes in one step. ``None`` turns automatic batching off as in
      torch: each item of the dataset is passed on unchanged (it must
      already hold a whole model call's data) and ``combinedBatchSize`` is
      ``None``. This holds in every mode: the asynchronous modes pass the
      items on too (``AsyncRebatched`` then has no batches to build).
    * ``shuffle``: reshuffle every epoch. Outside a distributed run the
      order comes from torch's default generator (``torch.manual_seed``
      makes it reproducible) or from ``generator=`` in ``kwargs``.
    * ``drop_last``: drop the final batch if it holds fewer than
      ``combinedBatchSize`` samples (default ``True``). Has no effect when
      ``batch_size=None``.
    * ``auto_distributed_partitioning``: when ``options.Distributed``
      describes several processes, give each process a disjoint part of the
      dataset (shuffling then needs ``options.randomSeed(N)`` with the same
      N on every process). With ``False``, the dataset is used as given.
    * ``mode``: ``DataLoaderMode.Sync`` loads in the calling process;
      ``Async`` loads through an ``AsynchronousDataAccessor`` configured by
      ``async_options``; ``AsyncRebatched`` makes the torch workers load
      batches of ``rebatched_worker_size`` samples (default 1) and builds
      the combined batches in the accessor, so an iterable dataset split
      between workers loses only the final incomplete batch. For map-style
      datasets ``AsyncRebatched`` is the same as ``Async``.
    * ``batch_sampler``: yields the index lists of micro-batches; each
      combined batch concatenates ``device_iterations x
      gradient_accumulation x replicas`` consecutive ones (an incomplete
      group at the end is dropped when ``drop_last``). As in torch it
      excludes ``batch_size`` (leave it at 1), ``shuffle`` and ``sampler``.
    * ``num_workers``, ``persistent_workers`` and ``kwargs`` go to torch's
      ``DataLoader``.

    The ``options`` are frozen: set every option before building a
    ``DataLoader`` with them.
    """

    def __init__(self,
                 options: Any,
                 dataset: Dataset,
                 batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None,
                 num_workers: int = 0,
                 drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[Dict[str, Any]] = None,
                 rebatched_worker_size: Optional[int] = None,
                 batch_sampler: Optional[Iterable[Sequence[int]]] = None,
                 **kwargs: Any) -> None:
        mode = _to_mode(mode)
        settings = _read_options(options)
        _check_flags(shuffle, drop_last, auto_distributed_partitioning)
        _check_batching(batch_size, shuffle, batch_sampler, kwargs)
        plan = _plan_batches(mode, dataset, batch_size, batch_sampler,
                             drop_last, rebatched_worker_size,
                             settings.micro_batches_per_call)
        accessor_options = _accessor_options(mode, async_options)
        arguments = _TorchArguments(
            dataset=dataset, batch_size=batch_size, shuffle=bool(shuffle),
            num_workers=num_workers, drop_last=drop_last,
            persistent_workers=bool(persistent_workers),
            batch_sampler=batch_sampler,
            micro_batches_per_call=settings.micro_batches_per_call,
            distribution=_Distribution(settings,
                                       auto_distributed_partitioning),
            extra=kwargs)
        arguments.check_distribution()
        super().__init__(**arguments.build(plan.combined))
        self._options = options
        self._combined_batch_size = plan.combined
        self._mode = mode
        self._accessor: Optional[AsynchronousDataAccessor] = None
        if mode != DataLoaderMode.Sync:
            self._accessor = _start_accessor(arguments, plan,
                                             accessor_options)
        freeze(options)

    @property
    def combinedBatchSize(self) -> Optional[int]:
        """Total number of elements consumed from the dataset for a single
        execution of the model (``None`` when ``batch_size=None``, or when
        the ``batch_sampler`` has no ``batch_size`` attribute)."""
        return self._combined_batch_size

    @property
    def options(self) -> Any:
        """A reference to the options used to initialise this instance."""
        return self._options

    @property
    def mode(self) -> DataLoaderMode:
        """The ``DataLoaderMode`` this loader was built with."""
        return self._mode

    def terminate(self) -> None:
        """In an asynchronous mode, stop the worker process of the
        ``AsynchronousDataAccessor`` now; otherwise do nothing."""
        if self._accessor is not None:
            self._accessor.terminate()

    def __iter__(self) -> Iterator:
        if self._accessor is not None:
            return iter(self._accessor)
        return super().__iter__()

    def __len__(self) -> int:
        if self._accessor is not None:
            return len(self._accessor)
        return super().__len__()


class _BatchPlan(NamedTuple):
    """Batch sizes: of a model call, and of the torch workers when they
    differ (``rebatch``: the accessor then builds the combined batches)."""
    combined: Optional[int]
    rebatch: bool
    worker_batch_size: Optional[int]


class _Settings(NamedTuple):
    """What the loader reads from ``poptorch.Options``."""
    micro_batches_per_call: int
    process_id: int
    num_processes: int
    random_seed: Optional[int]


class _Distribution:
    """This process's place in a distributed run, if partitioning applies."""

    def __init__(self, settings: _Settings, auto_partitioning: bool) -> None:
        # Under poprun, the processes of one replica (one pipeline, a stage
        # each) read the same part of the data.
        span = instances_per_replica()
        if settings.num_processes % span:
            span = 1
        self.process_id = settings.process_id // span
        self.num_processes = settings.num_processes // span
        self.seed = settings.random_seed
        self.active = auto_partitioning and self.num_processes > 1


class _TorchArguments:
    """The arguments of the torch ``DataLoader`` doing the loading."""

    def __init__(self, dataset: Dataset, batch_size: Optional[int],
                 shuffle: bool, num_workers: int, drop_last: bool,
                 persistent_workers: bool,
                 batch_sampler: Optional[Iterable[Sequence[int]]],
                 micro_batches_per_call: int, distribution: _Distribution,
                 extra: Dict[str, Any]) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.persistent_workers = persistent_workers
        self.batch_sampler = batch_sampler
        self.micro_batches_per_call = micro_batches_per_call
        self.distribution = distribution
        self.extra = extra

    def check_distribution(self) -> None:
        """Reject what automatic partitioning cannot split, before any
        state changes."""
        if not self.distribution.active:
            return
        advice = ("or pass auto_distributed_partitioning=False and give each "
                  "process its own part of the data")
        if self.batch_sampler is not None or "sampler" in self.extra:
            raise Error("DataLoader: automatic distributed partitioning "
                        "cannot split a custom sampler or batch_sampler; "
                        f"remove it {advice}")
        if self.shuffle and self.distribution.seed is None:
            raise Error("DataLoader: shuffle=True in a distributed run needs "
                        "the same shuffle order on every process: call "
                        "options.randomSeed(N) with the same integer N on "
                        "all processes before building the DataLoader")
        if (not isinstance(self.dataset, IterableDataset)
                and not hasattr(self.dataset, "__len__")):
            raise Error("DataLoader: automatic distributed partitioning "
                        "needs the length of a map-style dataset; define "
                        f"__len__ {advice}")

    def build(self, torch_batch_size: Optional[int]) -> Dict[str, Any]:
        """Keyword arguments of a torch ``DataLoader`` whose batches hold
        ``torch_batch_size`` samples."""
        arguments = dict(self.extra, num_workers=self.num_workers,
                         persistent_workers=self.persistent_workers)
        arguments["dataset"] = self._dataset_for(torch_batch_size)
        if self.batch_sampler is not None:
            arguments["batch_sampler"] = GroupedBatchSampler(
                self.batch_sampler, self.micro_batches_per_call,
                self.drop_last)
            return arguments
        arguments["batch_size"] = torch_batch_size
        arguments["drop_last"] = (self.drop_last
                                  if torch_batch_size is not None else False)
        if self.distribution.active and not isinstance(
                self.dataset, IterableDataset):
            arguments["sampler"] = DistributedPartitionSampler(
                len(self.dataset), self.distribution.process_id,
                self.distribution.num_processes, self.shuffle,
                self.distribution.seed or 0)
        elif self.shuffle:
            arguments["shuffle"] = True
        return arguments

    def _dataset_for(self, torch_batch_size: Optional[int]) -> Dataset:
        if not (self.distribution.active
                and isinstance(self.dataset, IterableDataset)):
            return self.dataset
        return ProcessShareIterable(self.dataset,
                                    self.distribution.process_id,
                                    self.distribution.num_processes,
                                    torch_batch_size or 1, self.drop_last)


class GroupedBatchSampler(Sampler[List[int]]):
    """Concatenates ``group`` consecutive index lists of ``batch_sampler``:
    one list of the result is one combined batch."""

    def __init__(self, batch_sampler: Iterable[Sequence[int]], group: int,
                 drop_last: bool) -> None:
        super().__init__()
        self.batch_sampler = batch_sampler
        self.group = group
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[List[int]]:
        combined: List[int] = []
        count = 0
        for indices in self.batch_sampler:
            combined.extend(indices)
            count += 1
            if count == self.group:
                yield combined
                combined, count = [], 0
        if count and not self.drop_last:
            yield combined

    def __len__(self) -> int:
        full, remainder = divmod(len(self.batch_sampler), self.group)
        return full + int(remainder > 0 and not self.drop_last)


def _to_mode(mode: Any) -> DataLoaderMode:
    if not isinstance(mode, bool):
        try:
            return DataLoaderMode(mode)
        except ValueError:
            pass
    allowed = ", ".join(f"DataLoaderMode.{m.name}" for m in DataLoaderMode)
    raise Error(f"DataLoader: mode must be one of {allowed}, got {mode!r}")


def _read_options(options: Any) -> _Settings:
    """The values the loader needs; D x G x R / input_group_size is the
    number of micro-batches in one model call."""
    try:
        layout = BatchLayout.from_options(options)
        settings = _Settings(0, options.Distributed.processId,
                             options.Distributed.numProcesses,
                             options.random_seed)
    except AttributeError as error:
        raise Error("DataLoader: options must be a poptorch.Options, got "
                    f"{type(options).__name__} ({error})") from None
    if layout.replicas % layout.input_group_size != 0:
        raise Error(f"DataLoader: options.replication_factor "
                    f"({layout.replicas}) must be a multiple of the input "
                    f"group size ({layout.input_group_size})")
    return settings._replace(micro_batches_per_call=layout.micro_batches)


def _check_flags(shuffle: Any, drop_last: Any,
                 auto_distributed_partitioning: Any) -> None:
    if shuffle is not None and not isinstance(shuffle, bool):
        raise Error(f"DataLoader: shuffle must be a bool or None, got "
                    f"{shuffle!r}")
    for name, value in (("drop_last", drop_last),
                        ("auto_distributed_partitioning",
                         auto_distributed_partitioning)):
        if not isinstance(value, bool):
            raise Error(f"DataLoader: {name} must be a bool, got {value!r}")


def _check_batching(batch_size: Any, shuffle: Optional[bool],
                    batch_sampler: Any, kwargs: Dict[str, Any]) -> None:
    if batch_size is not None and (isinstance(batch_size, bool)
                                   or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise Error("DataLoader: batch_size must be a positive integer or "
                    f"None, got {batch_size!r}")
    if batch_sampler is None:
        return
    if batch_size != 1 or shuffle or kwargs.get("sampler") is not None:
        raise Error("DataLoader: batch_sampler is mutually exclusive with "
                    "batch_size, shuffle and sampler (as in torch): leave "
                    f"batch_size at 1 (got {batch_size!r}), shuffle unset "
                    f"(got {shuffle!r}) and sampler unset")


def _plan_batches(mode: DataLoaderMode, dataset: Dataset,
                  batch_size: Optional[int], batch_sampler: Any,
                  drop_last: bool, rebatched_worker_size: Any,
                  micro_batches_per_call: int) -> _BatchPlan:
    combined = _combined_batch_size(batch_size, batch_sampler,
                                    micro_batches_per_call)
    iterable = isinstance(dataset, IterableDataset)
    rebatch = (mode == DataLoaderMode.AsyncRebatched and iterable
               and combined is not None)
    if mode == DataLoaderMode.AsyncRebatched and combined is None:
        info_once("DataLoader: mode=DataLoaderMode.AsyncRebatched builds no "
                  "batches when batching is off (batch_size=None): the "
                  "dataset's items are passed on as in DataLoaderMode.Async")
    if (mode == DataLoaderMode.Async and iterable and not drop_last
            and combined is not None):
        raise Error("DataLoader: mode=DataLoaderMode.Async with an "
                    "IterableDataset and drop_last=False would give a "
                    "smaller batch at the end of every torch worker's "
                    "stream; use mode=DataLoaderMode.AsyncRebatched, which "
                    "returns the remainder as one final batch")
    worker_size = _worker_batch_size(mode, rebatch, rebatched_worker_size,
                                     combined)
    return _BatchPlan(combined, rebatch, worker_size)


def _start_accessor(arguments: _TorchArguments, plan: _BatchPlan,
                    accessor_options: Dict[str, Any]
                    ) -> AsynchronousDataAccessor:
    """An accessor running the synchronous loader in its worker process."""
    inner = torch.utils.data.DataLoader(**arguments.build(
        plan.worker_batch_size if plan.rebatch else plan.combined))
    return AsynchronousDataAccessor(
        inner, rebatched_size=plan.combined if plan.rebatch else None,
        **accessor_options)


def _combined_batch_size(batch_size: Optional[int], batch_sampler: Any,
                         factor: int) -> Optional[int]:
    if batch_sampler is not None:
        micro_batch = getattr(batch_sampler, "batch_size", None)
        return None if micro_batch is None else micro_batch * factor
    if batch_size is None:
        return None
    return batch_size * factor


def _worker_batch_size(mode: DataLoaderMode, rebatch: bool,
                       rebatched_worker_size: Any,
                       combined: Optional[int]) -> Optional[int]:
    """Batch size of the torch workers: ``rebatched_worker_size`` (default
    1) when rebatching, else the combined batch size."""
    if rebatched_worker_size is None:
        return 1 if rebatch else combined
    if combined is None:
        raise Error("DataLoader: rebatched_worker_size needs a batch_size "
                    "(batch_size=None turns batching off)")
    if (isinstance(rebatched_worker_size, bool)
            or not isinstance(rebatched_worker_size, int)
            or not 1 <= rebatched_worker_size <= combined):
        raise Error("DataLoader: rebatched_worker_size must be an integer "
                    f"from 1 to the combined batch size ({combined}), got "
                    f"{rebatched_worker_size!r}")
    if rebatch:
        return rebatched_worker_size
    if mode != DataLoaderMode.AsyncRebatched:
        info_once("DataLoader: rebatched_worker_size only applies to "
                  "mode=DataLoaderMode.AsyncRebatched; it has no effect here")
    else:
        info_once("DataLoader: rebatched_worker_size has no effect with a "
                  "map-style dataset (AsyncRebatched is the same as Async)")
    return combined


def _accessor_options(mode: DataLoaderMode,
                      async_options: Optional[Dict[str, Any]]
                      ) -> Dict[str, Any]:
    if async_options is None:
        return {}
    if not isinstance(async_options, dict):
        raise Error("DataLoader: async_options must be a dict of "
                    "AsynchronousDataAccessor arguments, got "
                    f"{type(async_options).__name__}")
    unknown = sorted(set(async_options) - set(_ACCESSOR_OPTIONS))
    if unknown:
        raise Error(f"DataLoader: unknown async_options {unknown}; allowed "
                    f"keys are {list(_ACCESSOR_OPTIONS)} (the DataLoader "
                    "sets rebatched_size itself)")
    if mode == DataLoaderMode.Sync and async_options:
        info_once("DataLoader: async_options have no effect with "
                  "mode=DataLoaderMode.Sync")
    return dict(async_options)
