"""``poptorch.AsynchronousDataAccessor``: load data in a separate process.

The accessor starts one worker process (see ``worker``) that iterates the
wrapped dataset or ``DataLoader`` and fills a ring buffer of ``buffer_size``
batches in shared memory (see ``ring_buffer``). Iterating the accessor hands
out the ready batches without copying them: a batch is a view of a slot of
the ring buffer, which the worker overwrites once the next batch is
requested. Clone any batch (``tensor.clone()``) that must outlive the next
step of the loop.

Iteration: each ``iter()`` is one epoch. With ``load_indefinitely=True``
(default) the worker starts the next epoch as soon as one ends, so the first
batches of the next epoch are already loaded when it begins; with ``False``
it loads an epoch only when an iterator asks for it. ``early_preload=True``
starts loading the first epoch when the accessor is built instead of at the
first ``iter()``. Calling ``iter()`` again before an epoch is finished starts
a new epoch from its beginning, as with a torch ``DataLoader``. Loading
ahead does not change the data: the epochs of a shuffling ``DataLoader``
come in the same orders as from the ``DataLoader`` itself, whether each
epoch is read to its end or left early (see ``worker``).

The worker stops on ``terminate()``, when the accessor is garbage collected,
at interpreter exit and when the parent process dies.
"""
import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import threading
import weakref
from typing import Any, Dict, NoReturn, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset

from ...enums import DataLoaderMode, SharingStrategy
from ...errors import Error
from ..logger import info_once, warn_once
from ..profiling.ranges import profile_range
from ..profiling.trace_events import WAIT_FOR_DATA
from .ring_buffer import SlotReader
from .sharing import DatasetSource, start_context, strategy_name
from .worker import ErrorReport, HostRandomStates, WorkerConfig, run_worker

_DEFAULT_MISS_SLEEP_TIME_IN_MS = 0.1
_STOP_TIMEOUT_S = 5.0


class AsynchronousDataAccessor:
    """Loads batches from ``dataset`` in a separate process, ahead of use.

    ``dataset`` is a torch ``Dataset``, a ``poptorch.DataLoader``, a torch
    ``DataLoader`` or any other Python iterable; each item it yields is one
    batch (unless ``rebatched_size`` is set). The worker process fills a ring
    buffer of ``buffer_size`` batches in shared memory and the accessor
    returns them in place: clone a batch you keep beyond the next step.

    * ``miss_sleep_time_in_ms``: in PopTorch, how long a worker with a full
      buffer sleeps before checking again. Here the worker sleeps until a
      slot is released, without polling, so the value is validated and has
      no effect.
    * ``load_indefinitely``: keep loading the next epoch as soon as one ends.
    * ``early_preload``: start loading when the accessor is built rather
      than at the first ``iter()``.
    * ``sharing_strategy``: how the dataset reaches the worker
      (``poptorch.SharingStrategy``).
    * ``rebatched_size``: return batches of exactly this many rows, built in
      the worker from what the dataset yields (samples, or the smaller
      batches of a ``DataLoader``). The remainder at the end of an epoch is
      dropped, unless the wrapped ``DataLoader`` has ``drop_last=False``, in
      which case it comes as a smaller final batch.
    """

    def __init__(
            self,
            dataset: Any,
            buffer_size: int = 3,
            miss_sleep_time_in_ms: float = _DEFAULT_MISS_SLEEP_TIME_IN_MS,
            load_indefinitely: bool = True,
            early_preload: bool = False,
            sharing_strategy: SharingStrategy = SharingStrategy.ForkServer,
            rebatched_size: Optional[int] = None) -> None:
        strategy = _validate_arguments(dataset, buffer_size,
                                       miss_sleep_time_in_ms,
                                       load_indefinitely, early_preload,
                                       sharing_strategy, rebatched_size)
        _check_poptorch_dataloader(dataset, rebatched_size)
        self._dataset = dataset
        self._rebatched_size = rebatched_size
        self._rebatch_drop_last = getattr(dataset, "drop_last", True)
        config = WorkerConfig(
            buffer_size, load_indefinitely, early_preload, rebatched_size,
            self._rebatch_drop_last, _yields_batches(dataset),
            HostRandomStates.of_this_process(),
            multiprocessing.get_start_method(allow_none=True))
        source = DatasetSource(dataset, strategy)
        self._worker = _WorkerHandle(source, config, strategy)
        self._reader = SlotReader(buffer_size)
        self._generation = 0
        self._epoch_index = 0
        self._epoch_open = early_preload
        self._consumed_in_epoch = 0
        self._held_slot: Optional[int] = None
        self._fatal: Optional[Error] = None
        self._sampler_epochs = _sampler_epochs(dataset)

    def __len__(self) -> int:
        if self._rebatched_size is None:
            return len(self._dataset)
        full, remainder = divmod(_rows_per_epoch(self._dataset),
                                 self._rebatched_size)
        return full + int(remainder > 0 and not self._rebatch_drop_last)

    def __iter__(self) -> "AsynchronousDataAccessor":
        self._check_usable()
        self._warn_of_set_epoch()
        if self._consumed_in_epoch > 0:
            self._restart_epoch()
        elif not self._epoch_open:
            self._worker.send(("start", self._epoch_index))
            self._epoch_open = True
        return self

    def _warn_of_set_epoch(self) -> None:
        """The worker loads with its own copy of the DataLoader's sampler:
        ``set_epoch`` called on the consumer's copy (torch's
        ``DistributedSampler``) does not reach it."""
        now = _sampler_epochs(self._dataset)
        changed = [name for name, epoch in now.items()
                   if epoch != self._sampler_epochs.get(name)]
        if changed:
            self._sampler_epochs = now
            warn_once(
                f"set_epoch() was called on the DataLoader's {changed[0]} "
                "after its asynchronous worker started: the worker process "
                "loads with its own copy of the sampler, which keeps the "
                "epoch it was given first, so every epoch repeats one "
                "order. Use poptorch.DataLoader's own split of the data "
                "between processes (shuffle=True with "
                "options.randomSeed(N), a new order each epoch), or "
                "DataLoaderMode.Sync.")

    def __next__(self) -> Any:
        """The next batch (a ``wait for data`` range on the timeline)."""
        with profile_range(WAIT_FOR_DATA):
            return self._next_batch()

    def _next_batch(self) -> Any:
        self._check_usable()
        if not self._epoch_open:
            iter(self)
        self._release_held_slot()
        while True:
            kind, generation, payload = self._receive()
            if kind == "fatal":
                self._fail(_error_from_report(
                    payload, self._worker.load_failure_context()))
            if generation != self._generation:
                if kind == "batch":
                    self._reader.note_layout(payload)
                    self._worker.send(("free", payload.slot))
                continue
            if kind == "batch":
                self._held_slot = payload.slot
                self._consumed_in_epoch += 1
                return self._reader.read(payload)
            self._close_epoch()
            if kind == "end":
                raise StopIteration
            raise _error_from_report(
                payload, "in the AsynchronousDataAccessor worker process")

    def __enter__(self) -> "AsynchronousDataAccessor":
        return self

    def __exit__(self, *exception_info) -> None:
        self.terminate()

    def terminate(self) -> None:
        """Stop the worker process now (a no-op if it already stopped)."""
        self._worker.stop()

    def _receive(self) -> tuple:
        try:
            return self._worker.receive()
        except Error as died:
            self._fail(died)

    def _fail(self, error: Error) -> NoReturn:
        """Stop for good: every later use raises ``error`` again."""
        self._fatal = error
        self._worker.stop()
        raise error

    def _check_usable(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._worker.stopped:
            raise Error("This AsynchronousDataAccessor was terminated; "
                        "create a new one to load more data")

    def _restart_epoch(self) -> None:
        """Leave the current epoch for the next one, dropping the batches
        that the worker loaded after the last one returned. The slot of
        that batch is freed by the same command, so that the worker loads
        nothing more before it restarts."""
        slot, self._held_slot = self._held_slot, None
        self._generation += 1
        self._worker.send(("restart", self._generation, self._epoch_index,
                           self._consumed_in_epoch, slot))
        self._epoch_index += 1
        self._consumed_in_epoch = 0
        self._epoch_open = True

    def _close_epoch(self) -> None:
        self._epoch_open = False
        self._consumed_in_epoch = 0
        self._epoch_index += 1

    def _release_held_slot(self) -> None:
        if self._held_slot is not None:
            self._worker.send(("free", self._held_slot))
            self._held_slot = None


class _WorkerHandle:
    """The worker process and the two pipes to it, owned by one accessor."""

    def __init__(self, source: DatasetSource, config: WorkerConfig,
                 strategy: SharingStrategy) -> None:
        context = start_context(strategy)
        commands_out, commands_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        self._strategy = strategy
        self._start_method = context.get_start_method()
        self._heard_from = False
        self._process = context.Process(
            target=run_worker,
            args=(source, config, commands_out, events_in),
            name="poptorch-async-data-worker",
            daemon=False)
        try:
            self._process.start()
        except Exception:
            source.discard()
            for connection in (commands_out, commands_in, events_out,
                               events_in):
                connection.close()
            raise
        source.worker_started()
        commands_out.close()
        events_in.close()
        self._commands = commands_in
        self._events = events_out
        self.pid = self._process.pid
        self._stopper = _register_stopper(self, self._process, commands_in,
                                          events_out, source)

    @property
    def stopped(self) -> bool:
        """Whether ``stop()`` ran (explicitly or by the finaliser)."""
        return not self._stopper.alive

    def send(self, command: tuple) -> None:
        """Send a command; a worker that is gone is reported on receive."""
        try:
            self._commands.send(command)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def receive(self) -> tuple:
        """The next event, or an ``Error`` as soon as the worker is gone."""
        while True:
            if self._events.poll():
                try:
                    event = self._events.recv()
                    self._heard_from = True
                    return event
                except (EOFError, ConnectionResetError):
                    raise self._died() from None
            ready = multiprocessing.connection.wait(
                [self._events, self._process.sentinel])
            if self._events not in ready:
                if not self._events.poll():
                    raise self._died()

    def stop(self) -> None:
        """Stop the worker process and release its resources."""
        self._stopper()

    def load_failure_context(self) -> str:
        """Where a failure to load the dataset happened, with advice."""
        return ("while the AsynchronousDataAccessor worker process loaded the "
                "dataset sent with sharing_strategy="
                f"{strategy_name(self._strategy)}; the accessor cannot be "
                "used any more. The worker must be able to import the "
                "dataset's class: define it at module level, outside "
                "`if __name__ == '__main__':`, or use SharingStrategy.Fork")

    def _died(self) -> Error:
        self._process.join(timeout=_STOP_TIMEOUT_S)
        code = self._process.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}")
        return Error(f"The AsynchronousDataAccessor worker process (pid "
                     f"{self.pid}, {strategy_name(self._strategy)}) {how} "
                     "while loading data; the accessor cannot be used any "
                     f"more{self._start_failure_hint(code)}")

    def _start_failure_hint(self, code: Optional[int]) -> str:
        """Why a worker started by running the main script again may have
        failed before it said anything."""
        if self._heard_from or code != 1 \
                or self._start_method not in ("spawn", "forkserver"):
            return ""
        return (f". A worker started with '{self._start_method}' runs the "
                "main script again before it starts (its traceback is "
                "printed above): keep the script's training code under "
                "`if __name__ == '__main__':`, as Python's multiprocessing "
                "requires, or use sharing_strategy=SharingStrategy.Fork")


def _error_from_report(report: ErrorReport, where: str) -> Error:
    error = Error(f"{report.headline} (raised {where})\n"
                  f"Worker traceback:\n{report.traceback_text}")
    original = _unpickle_exception(report.pickled_exception)
    error.__cause__ = original
    error.__suppress_context__ = True
    return error


def _unpickle_exception(pickled: Optional[bytes]) -> Optional[BaseException]:
    if pickled is None:
        return None
    try:
        return pickle.loads(pickled)
    except Exception:
        return None


_STOPPERS_LOCK = threading.Lock()
_LIVE_STOPPERS: Dict[int, weakref.finalize] = {}


def _register_stopper(owner: Any, process, commands, events,
                      source: DatasetSource) -> weakref.finalize:
    """A finaliser stopping the worker, run by ``stop()``, by garbage
    collection or at interpreter exit (whichever comes first)."""
    key = id(process)
    stopper = weakref.finalize(owner, _stop_worker, key, os.getpid(),
                               process, commands, events, source)
    stopper.atexit = False
    with _STOPPERS_LOCK:
        _LIVE_STOPPERS[key] = stopper
    return stopper


def _stop_worker(key: int, owner_pid: int, process, commands, events,
                 source: DatasetSource) -> None:
    with _STOPPERS_LOCK:
        _LIVE_STOPPERS.pop(key, None)
    if os.getpid() != owner_pid:
        return
    try:
        commands.send(("stop",))
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass
    events.close()
    process.join(timeout=_STOP_TIMEOUT_S)
    if process.is_alive():
        process.terminate()
        process.join(timeout=_STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    commands.close()
    source.discard()


def _stop_all_workers() -> None:
    with _STOPPERS_LOCK:
        stoppers = list(_LIVE_STOPPERS.values())
    for stopper in stoppers:
        stopper()


# Registered after multiprocessing.util's exit handler, so it runs before
# it: that handler joins non-daemonic children such as the workers.
atexit.register(_stop_all_workers)


def _validate_arguments(dataset: Any, buffer_size: int,
                        miss_sleep_time_in_ms: float, load_indefinitely: bool,
                        early_preload: bool, sharing_strategy: SharingStrategy,
                        rebatched_size: Optional[int]) -> SharingStrategy:
    if not hasattr(dataset, "__iter__") and not hasattr(dataset,
                                                        "__getitem__"):
        raise Error("AsynchronousDataAccessor: dataset must be a Dataset, a "
                    "DataLoader or another iterable, got "
                    f"{type(dataset).__name__}")
    _require_int("buffer_size", buffer_size, minimum=1)
    if rebatched_size is not None:
        _require_int("rebatched_size", rebatched_size, minimum=1)
    for name, value in (("load_indefinitely", load_indefinitely),
                        ("early_preload", early_preload)):
        if not isinstance(value, bool):
            raise Error(f"AsynchronousDataAccessor: {name} must be a bool, "
                        f"got {value!r}")
    if (isinstance(miss_sleep_time_in_ms, bool)
            or not isinstance(miss_sleep_time_in_ms, (int, float))
            or miss_sleep_time_in_ms < 0):
        raise Error("AsynchronousDataAccessor: miss_sleep_time_in_ms must be "
                    f"a number >= 0, got {miss_sleep_time_in_ms!r}")
    if miss_sleep_time_in_ms != _DEFAULT_MISS_SLEEP_TIME_IN_MS:
        info_once("AsynchronousDataAccessor: miss_sleep_time_in_ms has no "
                  "effect here: the worker waits for a free buffer slot "
                  "without polling and resumes as soon as one is released")
    try:
        return SharingStrategy(sharing_strategy)
    except ValueError:
        allowed = ", ".join(f"SharingStrategy.{s.name}"
                            for s in SharingStrategy)
        raise Error("AsynchronousDataAccessor: sharing_strategy must be one "
                    f"of {allowed}, got {sharing_strategy!r}") from None


def _require_int(name: str, value: Any, minimum: int) -> None:
    if (isinstance(value, bool) or not isinstance(value, int)
            or value < minimum):
        raise Error(f"AsynchronousDataAccessor: {name} must be an integer >= "
                    f"{minimum}, got {value!r}")


def _check_poptorch_dataloader(dataset: Any,
                               rebatched_size: Optional[int]) -> None:
    if not isinstance(getattr(dataset, "mode", None), DataLoaderMode):
        return  # not a poptorch.DataLoader, which has a DataLoaderMode
    if dataset.mode != DataLoaderMode.Sync:
        raise Error("AsynchronousDataAccessor: the poptorch.DataLoader given "
                    "already loads asynchronously (mode=DataLoaderMode."
                    f"{dataset.mode.name}); give it mode=DataLoaderMode.Sync "
                    "or iterate it directly")
    if (isinstance(dataset.dataset, IterableDataset) and not dataset.drop_last
            and dataset.combinedBatchSize is not None
            and rebatched_size is None):
        raise Error("AsynchronousDataAccessor: a poptorch.DataLoader over an "
                    "IterableDataset with drop_last=False needs "
                    "rebatched_size (each torch worker ends with a smaller "
                    "batch); set rebatched_size, or use drop_last=True")


def _yields_batches(dataset: Any) -> bool:
    """Whether the items of ``dataset`` are batches (a torch DataLoader
    with automatic batching) rather than single samples."""
    return (isinstance(dataset, torch.utils.data.DataLoader)
            and dataset.batch_sampler is not None)


def _sampler_epochs(dataset: Any) -> Dict[str, Any]:
    """The ``epoch`` of each sampler of a torch DataLoader that takes
    ``set_epoch``, by attribute path (``sampler``,
    ``batch_sampler.sampler``)."""
    found = {}
    for path in ("sampler", "batch_sampler", "batch_sampler.sampler"):
        owner = dataset
        for name in path.split("."):
            owner = getattr(owner, name, None)
        if callable(getattr(owner, "set_epoch", None)):
            found[path] = getattr(owner, "epoch", None)
    return found


def _rows_per_epoch(dataset: Any) -> int:
    """Number of samples one pass over ``dataset`` yields: exact for
    map-style data behind a torch ``BatchSampler``, ``len(dataset)`` (an
    estimate, as in torch) for iterable data behind a DataLoader."""
    if not isinstance(dataset, torch.utils.data.DataLoader):
        return len(dataset)
    if not _yields_batches(dataset):
        return len(dataset)
    if isinstance(dataset.dataset, IterableDataset):
        return len(dataset.dataset)
    batches = dataset.batch_sampler
    if not isinstance(batches, BatchSampler):
        raise TypeError("AsynchronousDataAccessor: the number of rebatched "
                        "batches is unknown when the DataLoader uses a "
                        f"custom batch_sampler ({type(batches).__name__})")
    samples = len(batches.sampler)
    if batches.drop_last:
        return samples - samples % batches.batch_size
    return samples
