"""The worker process of an ``AsynchronousDataAccessor``.

The worker loads the dataset (see ``sharing``), then loops: it reads the
consumer's commands, and while an epoch runs and a ring-buffer slot is free
it takes the next batch of the epoch, writes it into the slot and reports it.
It blocks, without polling, whenever it has nothing to do (no epoch running,
or every slot full), and wakes up on a command or when the consumer process
dies, in which case it exits.

Epochs are numbered from 0 on both sides. Commands (consumer -> worker),
each a tuple whose first item is its kind: ``("start", epoch)`` begin epoch
``epoch`` unless it has begun already; ``("restart", generation, epoch,
batches, slot)`` the consumer left epoch ``epoch`` after ``batches``
batches, the last of them in ``slot``, which it frees: abandon what runs and
begin epoch ``epoch + 1``, tagging events with the new ``generation``;
``("free", slot)`` the consumer is done with a slot; ``("stop",)`` exit.

Events (worker -> consumer): ``("batch", generation, SlotMessage)``,
``("end", generation, number_of_batches)`` at the end of an epoch,
``("error", generation, ErrorReport)`` when the dataset raised (the epoch
stops there) and ``("fatal", generation, ErrorReport)`` when the worker cannot
go on (it exits after sending it). The generation counts restarts: it lets
the consumer drop what was loaded after the batch it left an epoch at.

With ``load_indefinitely`` the worker starts the next epoch as soon as one
ends, so it preloads across epoch boundaries; an epoch that yields no batch
or raises stops that, and the worker waits for the next "start".

Preloading must not change the random numbers an epoch draws. Reaching the
end of an epoch draws some (torch's ``RandomSampler`` draws a permutation it
does not use before it stops), and so may loading batches that the consumer
never takes. A torch ``DataLoader`` whose iteration the user leaves early
(``break``, or ``len(loader)`` calls of ``next()``) has drawn none of them
when the next epoch begins. So the worker records the state of the torch
random generators that loading uses after every batch, and on "restart"
puts back the state that followed the consumer's last batch: epoch ``k``
shuffles as the ``k``-th epoch of the torch ``DataLoader`` would, whatever
the worker had loaded ahead.

Like torch's DataLoader workers, the worker computes with one intra-op
thread and leaves Ctrl-C to the parent, which stops it. It starts with the
parent's random states (torch's, Python's ``random`` module's and numpy's
global generator's, taken when the accessor is built), so shuffling and
augmentations inside it follow the user's ``torch.manual_seed``,
``random.seed`` and ``numpy.random.seed``, whatever the sharing strategy.
"""
import multiprocessing
import multiprocessing.connection
import pickle
import random
import signal
import sys
import traceback
from collections import deque
from typing import Any, Deque, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch.utils.data import IterableDataset

from ...errors import Error
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
    random_states: "HostRandomStates"
    parent_start_method: Optional[str]


class HostRandomStates(NamedTuple):
    """The consumer's random states when the accessor is built: torch's,
    Python's ``random`` module's and, when the program imported numpy,
    numpy's global generator's."""
    torch_state: torch.Tensor
    python_state: tuple
    numpy_state: Optional[tuple]

    @classmethod
    def of_this_process(cls) -> "HostRandomStates":
        numpy = sys.modules.get("numpy")
        return cls(torch.get_rng_state(), random.getstate(),
                   numpy.random.get_state() if numpy is not None else None)

    def apply(self) -> None:
        """Give this process these states."""
        torch.set_rng_state(self.torch_state)
        random.setstate(self.python_state)
        if self.numpy_state is not None:
            import numpy
            numpy.random.set_state(self.numpy_state)


class ErrorReport(NamedTuple):
    """An exception raised in the worker, in a form that always pickles.
    ``headline`` is its type and message (``ValueError: ...``), or only the
    message for a ``poptorch.Error``, which the consumer raises as one."""
    headline: str
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
        headline = (str(error) if type(error) is Error else
                    f"{type(error).__qualname__}: {error}")
        return cls(headline, text, pickled)


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
    config.random_states.apply()
    _WorkerLoop(dataset, config, commands, events).run()


def epoch_items(dataset: Any) -> Iterator:
    """The items of one pass over ``dataset``: ``dataset[0 .. len-1]`` for
    a map-style torch dataset, ``iter(dataset)`` for anything else."""
    if (isinstance(dataset, torch.utils.data.Dataset)
            and not isinstance(dataset, IterableDataset)
            and hasattr(dataset, "__len__")):
        return (dataset[index] for index in range(len(dataset)))
    return iter(dataset)


_BatchKey = Tuple[int, int]  # (epoch, number of batches loaded in it)


def _random_generators(dataset: Any) -> List[torch.Generator]:
    """The torch generators that loading ``dataset`` draws from: torch's
    default generator and, for a torch ``DataLoader``, the ``generator`` of
    the loader and of its samplers (each generator once)."""
    found = {id(torch.default_generator): torch.default_generator}
    pending = [dataset]
    seen = set()
    while pending:
        owner = pending.pop()
        if id(owner) in seen or not isinstance(
                owner, (torch.utils.data.DataLoader,
                        torch.utils.data.Sampler)):
            continue
        seen.add(id(owner))
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
        pending.extend(getattr(owner, name, None)
                       for name in ("sampler", "batch_sampler"))
    return list(found.values())


class _RandomStates:
    """The states of ``generators`` after each of the last ``capacity``
    batches loaded, to go back to one of them."""

    def __init__(self, generators: List[torch.Generator],
                 capacity: int) -> None:
        self._generators = generators
        self._recorded: Deque[Tuple[_BatchKey, List[torch.Tensor]]] = deque(
            maxlen=capacity)

    def record(self, key: _BatchKey) -> None:
        """Record the current states as those after batch ``key``."""
        self._recorded.append(
            (key, [generator.get_state() for generator in self._generators]))

    def restore(self, key: _BatchKey) -> None:
        """Put back the states recorded after batch ``key`` and forget all
        records: they belong to batches loaded after it."""
        states = dict(self._recorded)[key]
        for generator, state in zip(self._generators, states):
            generator.set_state(state)
        self._recorded.clear()


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
        self._epoch_index = -1
        self._batches_in_epoch = 0
        self._requested_epoch: Optional[int] = (0 if config.early_preload
                                                else None)
        # The batches loaded after the consumer's last one each hold one
        # of the other buffer_size - 1 slots.
        self._random_states = _RandomStates(_random_generators(dataset),
                                            config.buffer_size)
        self._stopping = False

    def run(self) -> None:
        while True:
            self._read_commands(wait=self._idle())
            if self._stopping:
                return
            if self._epoch is None:
                if self._requested_epoch is not None:
                    self._begin_epoch()
            elif self._free_slots:
                self._load_next_batch()

    def _idle(self) -> bool:
        if self._epoch is None:
            return self._requested_epoch is None
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
            self._start(command[1])
        elif kind == "restart":
            self._restart(*command[1:])
        elif kind == "stop":
            self._stopping = True

    def _start(self, epoch: int) -> None:
        """Begin ``epoch`` unless it has begun (with ``load_indefinitely``
        the worker begins the next epoch by itself)."""
        if epoch > self._epoch_index:
            self._requested_epoch = epoch

    def _restart(self, generation: int, epoch: int, batches: int,
                 slot: Optional[int]) -> None:
        """The consumer left ``epoch`` after ``batches`` batches and freed
        ``slot``: drop what was loaded since, go back to the random state
        that followed that batch and begin the next epoch."""
        if slot is not None:
            self._free_slots.append(slot)
        self._random_states.restore((epoch, batches))
        self._generation = generation
        self._epoch = None
        self._epoch_index = epoch
        self._requested_epoch = epoch + 1

    def _begin_epoch(self) -> None:
        self._epoch_index = self._requested_epoch
        self._requested_epoch = None
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
        self._random_states.record(
            (self._epoch_index, self._batches_in_epoch))
        self._events.send(("batch", self._generation, message))

    def _end_epoch(self) -> None:
        self._events.send(("end", self._generation, self._batches_in_epoch))
        self._epoch = None
        if self._config.load_indefinitely and self._batches_in_epoch > 0:
            self._requested_epoch = self._epoch_index + 1

    def _report_error(self, error: Exception) -> None:
        self._epoch = None
        self._events.send(
            ("error", self._generation, ErrorReport.from_exception(error)))
