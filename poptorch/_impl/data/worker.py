"""The worker process of an ``AsynchronousDataAccessor``.

The worker loads the dataset (see ``sharing``), then loops: it reads the
consumer's commands, and while an epoch runs and a ring-buffer slot is free
it takes the next batch of the epoch, writes it into the slot and reports it.
It blocks, without polling, whenever it has nothing to do (no epoch running,
or every slot full), and wakes up on a command or when the consumer process
dies, in which case it exits.

Commands (consumer -> worker), each a tuple whose first item is its kind:
``("start", generation)`` run an epoch if none runs; ``("restart",
generation)`` abandon the running epoch and run a new one;
``("free", slot)`` the consumer is done with a slot; ``("stop",)`` exit.

Events (worker -> consumer): ``("batch", generation, SlotMessage)``,
``("end", generation, number_of_batches)`` at the end of an epoch,
``("error", generation, ErrorReport)`` when the dataset raised (the epoch
stops there) and ``("fatal", generation, ErrorReport)`` when the worker cannot
go on (it exits after sending it). The generation lets the consumer drop what
was loaded for an epoch it abandoned.

With ``load_indefinitely`` the worker starts the next epoch as soon as one
ends, so it preloads across epoch boundaries; an epoch that yields no batch
or raises stops that, and the worker waits for the next "start".

Like torch's DataLoader workers, the worker computes with one intra-op
thread and leaves Ctrl-C to the parent, which stops it. It starts with the
parent's torch random state (taken when the accessor is built), so shuffling
inside it follows the user's ``torch.manual_seed``.
"""
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import traceback
from collections import deque
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch.utils.data import IterableDataset

from .rebatching import rebatch
from .ring_buffer import SlotWriter
from .sharing import DatasetSource


class WorkerConfig(NamedTuple):
    """Everything the worker needs besides the dataset."""
    buffer_size: int
    load_indefinitely: bool
    early_preload: bool
    rebatched_size: Optional[int]
    rebatch_drop_last: bool
    items_are_batches: bool
    rng_state: torch.Tensor
    parent_start_method: Optional[str]


class ErrorReport(NamedTuple):
    """An exception raised in the worker, in a form that always pickles."""
    type_name: str
    message: str
    traceback_text: str
    pickled_exception: Optional[bytes]

    @classmethod
    def from_exception(cls, error: BaseException) -> "ErrorReport":
        """Describe ``error`` (with its traceback) for the consumer."""
        text = "".join(traceback.format_exception(error))
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
        except Exception:
            pickled = None
        return cls(type(error).__qualname__, str(error), text, pickled)


def run_worker(source: DatasetSource, config: WorkerConfig,
               commands: multiprocessing.connection.Connection,
               events: multiprocessing.connection.Connection) -> None:
    """Entry point of the worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    # A spawned or fork-server child starts with its own start method as
    # default; torch workers of a wrapped DataLoader must start as they
    # would in the parent (None: the platform's default).
    multiprocessing.set_start_method(config.parent_start_method, force=True)
    try:
        _serve(source, config, commands, events)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the consumer closed its pipes: it is stopping or gone


def _serve(source: DatasetSource, config: WorkerConfig,
           commands: multiprocessing.connection.Connection,
           events: multiprocessing.connection.Connection) -> None:
    try:
        dataset = source.load()
    except Exception as error:
        events.send(("fatal", 0, ErrorReport.from_exception(error)))
        return
    torch.set_rng_state(config.rng_state)
    _WorkerLoop(dataset, config, commands, events).run()


def epoch_items(dataset: Any) -> Iterator:
    """The items of one pass over ``dataset``: ``dataset[0 .. len-1]`` for
    a map-style torch dataset, ``iter(dataset)`` for anything else."""
    if (isinstance(dataset, torch.utils.data.Dataset)
            and not isinstance(dataset, IterableDataset)
            and hasattr(dataset, "__len__")):
        return (dataset[index] for index in range(len(dataset)))
    return iter(dataset)


class _WorkerLoop:
    """The command/load loop described in the module documentation."""

    def __init__(self, dataset: Any, config: WorkerConfig,
                 commands: multiprocessing.connection.Connection,
                 events: multiprocessing.connection.Connection) -> None:
        self._dataset = dataset
        self._config = config
        self._commands = commands
        self._events = events
        self._parent = multiprocessing.parent_process()
        self._writer = SlotWriter(config.buffer_size)
        self._free_slots = deque(range(config.buffer_size))
        self._generation = 0
        self._epoch: Optional[Iterator] = None
        self._batches_in_epoch = 0
        self._start_requested = config.early_preload
        self._stopping = False

    def run(self) -> None:
        while True:
            self._read_commands(wait=self._idle())
            if self._stopping:
                return
            if self._epoch is None:
                if self._start_requested:
                    self._begin_epoch()
            elif self._free_slots:
                self._load_next_batch()

    def _idle(self) -> bool:
        if self._epoch is None:
            return not self._start_requested
        return not self._free_slots

    def _read_commands(self, wait: bool) -> None:
        if wait:
            waitables = [self._commands]
            if self._parent is not None:
                waitables.append(self._parent.sentinel)
            ready = multiprocessing.connection.wait(waitables)
            if self._commands not in ready:
                self._stopping = True
                return
        while self._commands.poll():
            self._apply(self._commands.recv())

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "free":
            self._free_slots.append(command[1])
        elif kind == "start":
            if self._epoch is None:
                self._start_requested = True
                self._generation = command[1]
        elif kind == "restart":
            self._epoch = None
            self._start_requested = True
            self._generation = command[1]
        elif kind == "stop":
            self._stopping = True

    def _begin_epoch(self) -> None:
        self._start_requested = False
        self._batches_in_epoch = 0
        try:
            self._epoch = self._batches()
        except Exception as error:
            self._report_error(error)

    def _batches(self) -> Iterator:
        items = epoch_items(self._dataset)
        config = self._config
        if config.rebatched_size is None:
            return items
        return rebatch(items, config.rebatched_size, config.rebatch_drop_last,
                       config.items_are_batches)

    def _load_next_batch(self) -> None:
        try:
            batch = next(self._epoch)
            slot = self._free_slots[0]
            message = self._writer.write(slot, batch)
        except StopIteration:
            self._end_epoch()
            return
        except Exception as error:
            self._report_error(error)
            return
        self._free_slots.popleft()
        self._batches_in_epoch += 1
        self._events.send(("batch", self._generation, message))

    def _end_epoch(self) -> None:
        self._events.send(("end", self._generation, self._batches_in_epoch))
        self._epoch = None
        self._start_requested = (self._config.load_indefinitely
                                 and self._batches_in_epoch > 0)

    def _report_error(self, error: Exception) -> None:
        self._epoch = None
        self._events.send(
            ("error", self._generation, ErrorReport.from_exception(error)))
