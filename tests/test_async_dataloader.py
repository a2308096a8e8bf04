"""Asynchronous data loading: AsynchronousDataAccessor and DataLoader in
DataLoaderMode.Async / AsyncRebatched. Batches must equal the synchronous
loader's; errors, dead workers and shutdown must be reported or cleaned up
and never hang."""
import ctypes
import faulthandler
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import numpy
import pytest
import torch
from torch.utils.data import (Dataset, IterableDataset, TensorDataset,
                              get_worker_info)

from poptorch._impl.data import AsynchronousDataAccessor, DataLoader
from poptorch.enums import DataLoaderMode, SharingStrategy
from poptorch.errors import Error
from poptorch.options import Options
from conftest import assert_same_batches

REPO = Path(__file__).resolve().parent.parent
WORKER_NAME = "poptorch-async-data-worker"
Pair = namedtuple("Pair", ["left", "right"])


class SampleDataset(Dataset):
    """Sample ``i`` holds the value ``i``: a tensor, or a nested structure
    of dicts, tuples, lists and a named tuple."""

    def __init__(self, length, nested=False):
        self.length = length
        self.nested = nested

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        x = torch.full((3,), float(index))
        if not self.nested:
            return x
        y = torch.tensor(index)
        return {"pair": Pair(x, [y, y * 2]), "id": (y,)}


class RangeStream(IterableDataset):
    """Samples ``0 .. length-1`` split between torch workers in contiguous
    runs, like torch's documented example."""

    def __init__(self, length):
        super().__init__()
        self.length = length

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(torch.arange(self.length))
        per_worker = -(-self.length // info.num_workers)
        first = info.id * per_worker
        return iter(torch.arange(first, min(first + per_worker,
                                            self.length)))


class FailingDataset(SampleDataset):
    """Raises on sample 3."""

    def __getitem__(self, index):
        if index == 3:
            raise ValueError(f"sample {index} is corrupt")
        return super().__getitem__(index)


class CrashingDataset(SampleDataset):
    """The worker process dies on sample 2 (segmentation fault)."""

    def __getitem__(self, index):
        if index == 2:
            faulthandler.disable()
            ctypes.string_at(0)
        return super().__getitem__(index)


class CountingDataset(SampleDataset):
    """Counts the samples loaded, in a counter shared between processes."""

    def __init__(self, length):
        super().__init__(length)
        self.loaded = multiprocessing.get_context("fork").Value("i", 0)

    def __getitem__(self, index):
        with self.loaded.get_lock():
            self.loaded.value += 1
        return super().__getitem__(index)


class CopyOnPickleDataset(Dataset):
    """Pickles a copy of its data: a tensor created while pickling."""

    def __init__(self):
        self.x = torch.arange(48.).reshape(24, 2)

    def __getstate__(self):
        return {"x": self.x.clone()}

    def __setstate__(self, state):
        self.x = state["x"]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index]


class RandomFeatureDataset(CountingDataset):
    """Counts the samples loaded; sample ``i`` holds ``i`` and a value drawn
    from torch's default generator when it is loaded."""

    def __getitem__(self, index):
        return torch.stack([super().__getitem__(index)[0], torch.rand(())])


class HostRandomDataset(Dataset):
    """Sample ``i``: ``i`` and a draw of each host generator (torch's,
    Python's ``random``, numpy's), as augmentations make."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item(),
                             random.random(), float(numpy.random.rand())],
                            dtype=torch.float64)


def make_options(device_iterations=1, replicas=1, process=None):
    opts = Options().deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    if process is not None:
        opts.randomSeed(5)
        opts.Distributed.configureProcessId(*process)
    return opts


def cloned(batches):
    return [torch.utils._pytree.tree_map(torch.clone, batch)
            for batch in batches]


def values(batches):
    return [batch.flatten().long().tolist() if batch.dim() == 1 else
            batch[:, 0].long().tolist() for batch in batches]


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def worker_processes():
    return {p for p in multiprocessing.active_children()
            if p.name == WORKER_NAME}


def fork_accessor(dataset, **arguments):
    return AsynchronousDataAccessor(
        dataset, sharing_strategy=SharingStrategy.Fork, **arguments)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_map_style_batches_equal_sync(nested, num_workers):
    dataset = SampleDataset(45, nested)
    opts = dict(batch_size=2, num_workers=num_workers)
    sync = DataLoader(make_options(2, replicas=2), dataset, **opts)
    loader = DataLoader(make_options(2, replicas=2), dataset,
                        mode=DataLoaderMode.Async, **opts)
    expected = list(sync)
    assert len(loader) == len(sync) == 5
    for _ in range(2):
        assert_same_batches(cloned(loader), expected)
    loader.terminate()


@pytest.mark.parametrize("mode", [DataLoaderMode.Async,
                                  DataLoaderMode.AsyncRebatched])
def test_async_iterable_with_workers_equals_sync(mode):
    opts = dict(batch_size=3, num_workers=2,
                async_options={"sharing_strategy": SharingStrategy.Fork})
    sync = list(DataLoader(make_options(2), RangeStream(48), **opts))
    loader = DataLoader(make_options(2), RangeStream(48), mode=mode, **opts)
    if mode == DataLoaderMode.Async:
        assert_same_batches(cloned(loader), sync)
    else:
        rows = torch.cat(cloned(loader))
        assert sorted(rows.tolist()) == sorted(torch.cat(sync).tolist())
    loader.terminate()


def test_async_shuffle_follows_the_torch_seed_at_construction():
    dataset = SampleDataset(40)
    torch.manual_seed(11)
    sync = list(DataLoader(make_options(2), dataset, batch_size=4,
                           shuffle=True))
    torch.manual_seed(11)
    loader = DataLoader(make_options(2), dataset, batch_size=4, shuffle=True,
                        mode=DataLoaderMode.Async)
    assert_same_batches(cloned(loader), sync)
    loader.terminate()


def test_async_distributed_parts_equal_sync_parts():
    for process in range(2):
        arguments = dict(batch_size=2, shuffle=True)
        sync = DataLoader(make_options(process=(process, 2)),
                          SampleDataset(21), **arguments)
        loader = DataLoader(
            make_options(process=(process, 2)), SampleDataset(21),
            mode=DataLoaderMode.Async,
            async_options={"sharing_strategy": SharingStrategy.Fork},
            **arguments)
        for _ in range(2):
            assert values(cloned(loader)) == values(sync)
        loader.terminate()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_rebatching_keeps_samples_plain_worker_batching_drops():
    """7 workers, combined batch 4, 100 samples: each worker's 14 or 15
    samples end with an incomplete batch that plain batching drops."""
    arguments = dict(batch_size=4, num_workers=7,
                     async_options={"sharing_strategy": SharingStrategy.Fork})
    plain = DataLoader(make_options(), RangeStream(100),
                       mode=DataLoaderMode.Async, **arguments)
    rebatched = DataLoader(make_options(), RangeStream(100),
                           mode=DataLoaderMode.AsyncRebatched, **arguments)
    plain_rows = torch.cat(cloned(plain))
    rebatched_batches = cloned(rebatched)
    assert len(plain_rows) == 80
    assert [len(batch) for batch in rebatched_batches] == [4] * 25
    assert sorted(torch.cat(rebatched_batches).tolist()) == list(range(100))
    plain.terminate()
    rebatched.terminate()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_rebatched_batches_are_torch_stream_cut_into_combined_batches():
    dataset = RangeStream(30)
    stream = torch.cat(list(torch.utils.data.DataLoader(
        dataset, batch_size=1, num_workers=3)))
    loader = DataLoader(
        make_options(device_iterations=2), dataset, batch_size=4,
        num_workers=3, mode=DataLoaderMode.AsyncRebatched,
        async_options={"sharing_strategy": SharingStrategy.Fork})
    assert values(cloned(loader)) == [stream[i:i + 8].tolist()
                                      for i in (0, 8, 16)]
    loader.terminate()


@pytest.mark.parametrize("worker_size", [None, 3])
def test_rebatched_without_drop_last_returns_the_remainder_last(worker_size):
    loader = DataLoader(
        make_options(), RangeStream(23), batch_size=5, drop_last=False,
        mode=DataLoaderMode.AsyncRebatched,
        rebatched_worker_size=worker_size,
        async_options={"sharing_strategy": SharingStrategy.Fork})
    batches = cloned(loader)
    assert [len(batch) for batch in batches] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat(batches), torch.arange(23))
    loader.terminate()


def test_async_iterable_without_drop_last_needs_rebatching():
    with pytest.raises(Error, match="use mode=DataLoaderMode.AsyncRebatched"):
        DataLoader(make_options(), RangeStream(10), drop_last=False,
                   mode=DataLoaderMode.Async)


class ReadyBatches(IterableDataset):
    """A stream of ready batches (the last one smaller), for
    ``batch_size=None``."""

    def __iter__(self):
        return iter(torch.arange(10).split(4))


@pytest.mark.parametrize("mode, drop_last", [
    (DataLoaderMode.Async, False),
    (DataLoaderMode.AsyncRebatched, True),
    (DataLoaderMode.AsyncRebatched, False),
])
def test_async_without_batching_passes_ready_batches_through(
        poptorch_log, mode, drop_last):
    """With batch_size=None, as in Sync mode, each item the dataset yields
    is one model call's data: nothing is batched, so nothing is dropped."""
    arguments = dict(batch_size=None, drop_last=drop_last,
                     async_options={"sharing_strategy": SharingStrategy.Fork})
    sync = list(DataLoader(make_options(2), ReadyBatches(), **arguments))
    loader = DataLoader(make_options(2), ReadyBatches(), mode=mode,
                        **arguments)
    assert loader.combinedBatchSize is None
    assert_same_batches(cloned(loader), sync)
    assert [len(batch) for batch in sync] == [4, 4, 2]
    loader.terminate()
    rebatching_ignored = "AsyncRebatched builds no batches" in \
        poptorch_log.text
    assert rebatching_ignored == (mode == DataLoaderMode.AsyncRebatched)


def test_accessor_over_an_unbatched_sync_dataloader_needs_no_rebatching():
    sync = DataLoader(make_options(), ReadyBatches(), batch_size=None,
                      drop_last=False)
    accessor = fork_accessor(sync)
    assert_same_batches(cloned(accessor), list(sync))
    accessor.terminate()


def test_accessor_over_dataset_and_over_sync_dataloader():
    dataset = SampleDataset(9)
    with fork_accessor(dataset) as accessor:
        assert len(accessor) == 9
        assert [b.tolist() for b in accessor] == [dataset[i].tolist()
                                                   for i in range(9)]
    loader = DataLoader(make_options(2), dataset, batch_size=2)
    with fork_accessor(loader) as accessor:
        assert values(cloned(accessor)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_accessor_rejects_an_async_dataloader():
    loader = DataLoader(make_options(), SampleDataset(4),
                        mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy":
                                       SharingStrategy.Fork})
    with pytest.raises(Error, match="already loads asynchronously"):
        fork_accessor(loader)
    loader.terminate()


def test_accessor_rebatches_samples_of_a_plain_dataset():
    with fork_accessor(SampleDataset(11), rebatched_size=4) as accessor:
        assert len(accessor) == 2
        assert values(cloned(accessor)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("drop_last,expected_sizes", [(True, [4] * 4),
                                                      (False, [4] * 5)])
def test_accessor_rebatches_rows_of_a_torch_dataloader(drop_last,
                                                       expected_sizes):
    loader = torch.utils.data.DataLoader(SampleDataset(20, nested=True),
                                         batch_size=3, drop_last=drop_last)
    with fork_accessor(loader, rebatched_size=4) as accessor:
        batches = cloned(accessor)
        assert len(accessor) == len(expected_sizes)
    assert [len(batch["id"][0]) for batch in batches] == expected_sizes
    rows = len(expected_sizes) * 4
    expected = next(iter(torch.utils.data.DataLoader(
        SampleDataset(20, nested=True), batch_size=rows)))
    assert_same_batches([torch.utils.data.default_collate(batches)],
                        [torch.utils._pytree.tree_map(
                            lambda t: t.reshape(-1, 4, *t.shape[1:]),
                            expected)])


def test_rebatching_non_tensor_leaves_is_a_clear_error():
    loader = torch.utils.data.DataLoader(["a", "b", "c"], batch_size=1)
    with fork_accessor(loader, rebatched_size=2) as accessor:
        with pytest.raises(Error) as caught:
            list(accessor)
    assert str(caught.value).startswith(
        "Rebatching needs every leaf of a batch to be a tensor with a batch "
        "dimension, but a batch holds a str ('a'). ")


@pytest.mark.parametrize("load_indefinitely", [True, False])
def test_each_iteration_is_one_full_epoch(load_indefinitely):
    with fork_accessor(SampleDataset(5), buffer_size=2,
                       load_indefinitely=load_indefinitely) as accessor:
        for _ in range(3):
            assert [b[0].item() for b in accessor] == [0, 1, 2, 3, 4]


def test_load_indefinitely_preloads_the_next_epoch():
    for load_indefinitely, expected in ((True, 5 + 3), (False, 5)):
        dataset = CountingDataset(5)
        with fork_accessor(dataset, buffer_size=3,
                           load_indefinitely=load_indefinitely) as accessor:
            assert len(list(accessor)) == 5
            assert wait_until(lambda: dataset.loaded.value >= expected)
            time.sleep(0.2)
            assert dataset.loaded.value == expected


def test_early_preload_fills_the_buffer_before_iteration():
    for early_preload, expected in ((True, 3), (False, 0)):
        dataset = CountingDataset(10)
        with fork_accessor(dataset, buffer_size=3,
                           early_preload=early_preload):
            assert wait_until(lambda: dataset.loaded.value >= expected)
            time.sleep(0.2)
            assert dataset.loaded.value == expected


def test_new_iteration_before_the_end_restarts_the_epoch():
    with fork_accessor(SampleDataset(6), buffer_size=2) as accessor:
        first = next(iter(accessor))[0].item()
        assert [b[0].item() for b in accessor] == [0, 1, 2, 3, 4, 5]
        assert first == 0


def test_batches_are_shared_memory_reused_after_the_buffer_cycles():
    with fork_accessor(SampleDataset(8), buffer_size=2) as accessor:
        iterator = iter(accessor)
        kept = next(iterator)
        copy = kept.clone()
        assert kept.is_shared()
        for _ in range(2):
            next(iterator)
        assert torch.equal(copy, torch.zeros(3))
        assert not torch.equal(kept, copy), "slot reused: clone kept batches"


def test_smaller_final_batch_and_changing_shapes_come_through():

    def batches():
        yield torch.ones(4, 2)
        yield {"a": torch.zeros(3)}
        yield torch.ones(2, 2) * 2
        yield torch.ones(6, 2) * 3

    class Batches:

        def __iter__(self):
            return batches()

    with fork_accessor(Batches(), buffer_size=1) as accessor:
        assert_same_batches(cloned(accessor), list(batches()))


def test_dataset_exception_reaches_the_loop_with_type_message_traceback():
    with fork_accessor(FailingDataset(6)) as accessor:
        with pytest.raises(Error) as caught:
            list(accessor)
        text = str(caught.value)
        assert "ValueError: sample 3 is corrupt" in text
        assert "in __getitem__" in text and "raise ValueError" in text
        assert isinstance(caught.value.__cause__, ValueError)
        iterator = iter(accessor)
        assert [next(iterator)[0].item() for _ in range(3)] == [0, 1, 2]


def test_killed_worker_is_reported_within_five_seconds():
    before = worker_processes()
    with fork_accessor(SampleDataset(10**6), buffer_size=2) as accessor:
        (worker,) = worker_processes() - before
        iterator = iter(accessor)
        next(iterator)
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Error, match="killed by signal 9"):
            for _ in iterator:
                pass
        assert time.monotonic() - start < 5
        with pytest.raises(Error, match="killed by signal 9"):
            iter(accessor)


def test_crashing_worker_is_reported_not_hung():
    with fork_accessor(CrashingDataset(10)) as accessor:
        with pytest.raises(Error, match="killed by signal 11"):
            list(accessor)


def test_unpicklable_dataset_fails_at_construction_naming_the_strategy():

    class LocalDataset(SampleDataset):
        pass

    for strategy in (SharingStrategy.ForkServer, SharingStrategy.FileSystem,
                     SharingStrategy.SharedMemory):
        with pytest.raises(Error) as caught:
            AsynchronousDataAccessor(LocalDataset(3),
                                     sharing_strategy=strategy)
        assert f"sharing_strategy=SharingStrategy.{strategy.name}" in str(
            caught.value)
        assert "SharingStrategy.Fork" in str(caught.value)
    with fork_accessor(LocalDataset(3)) as accessor:
        assert len(list(accessor)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(SharingStrategy),
                         ids=lambda strategy: strategy.name)
def test_every_sharing_strategy_delivers_the_same_batches(strategy, tmp_path):
    dataset = TensorDataset(torch.arange(40.).reshape(20, 2),
                            torch.arange(20))
    loader = DataLoader(make_options(2), dataset, batch_size=3,
                        mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy": strategy})
    expected = list(DataLoader(make_options(2), dataset, batch_size=3))
    assert_same_batches(cloned(loader), expected)
    loader.terminate()


STRATEGIES = [
    pytest.param(SharingStrategy.Fork, id="Fork"),
    pytest.param(SharingStrategy.ForkServer, id="ForkServer"),
    pytest.param(SharingStrategy.SharedMemory, id="SharedMemory",
                 marks=pytest.mark.slow),
    pytest.param(SharingStrategy.FileSystem, id="FileSystem",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensors_created_while_pickling_reach_the_worker_intact(strategy):
    dataset = CopyOnPickleDataset()
    expected = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    with AsynchronousDataAccessor(
            DataLoader(Options(), dataset, batch_size=4),
            sharing_strategy=strategy) as accessor:
        assert_same_batches(cloned(accessor), expected)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seeded_generator_shuffles_as_in_torch(strategy):
    dataset = TensorDataset(torch.arange(24))
    torch_loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, shuffle=True,
        generator=torch.Generator().manual_seed(7))
    expected = [list(torch_loader) for _ in range(2)]
    loader = DataLoader(Options(), dataset, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(7),
                        mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy": strategy})
    for epoch in expected:
        assert_same_batches(cloned(loader), epoch)
    loader.terminate()


def read_epochs(loader, plan, wait_for_loaded=lambda samples: None):
    """Read one epoch per item of ``plan``: to its end (``None``), or only
    its first ``taken`` batches (``(taken, loaded)``), after which call
    ``wait_for_loaded(loaded)``."""
    epochs = []
    for item in plan:
        iterator = iter(loader)
        if item is None:
            epochs.append(cloned(iterator))
            continue
        taken, loaded = item
        epochs.append(cloned(next(iterator) for _ in range(taken)))
        wait_for_loaded(loaded)
    return epochs


@pytest.mark.parametrize("plan", [
    [(6, 32), (6, 64), None],
    [(5, 28), None, (1, 64), None],
    [None, (3, 44), None],
], ids=["all-batches-no-end", "break", "for-loop"])
@pytest.mark.parametrize("seeding", ["generator", "manual_seed"])
def test_epochs_left_early_shuffle_as_in_torch_after_loading_ahead(
        plan, seeding):
    """Epochs of 6 batches of 4 samples, a buffer of 3 batches. Torch draws
    no more random numbers for an epoch left after its last batch or
    before. Each time the test leaves an epoch it waits until the worker
    has loaded 2 batches beyond the last one read (``loaded`` samples in
    all): it has then reached the end of the epoch or begun the next."""
    if seeding == "generator":
        dataset = CountingDataset(24)
    else:
        dataset = RandomFeatureDataset(24)

    def loader_arguments():
        torch.manual_seed(3)
        generator = (torch.Generator().manual_seed(3)
                     if seeding == "generator" else None)
        return dict(batch_size=4, shuffle=True, generator=generator)

    expected = read_epochs(
        torch.utils.data.DataLoader(dataset, **loader_arguments()), plan)
    dataset.loaded.value = 0
    loader = DataLoader(Options(), dataset, mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy":
                                       SharingStrategy.Fork,
                                       "buffer_size": 3},
                        **loader_arguments())

    def wait_for_loaded(samples):
        assert wait_until(lambda: dataset.loaded.value >= samples)

    got = read_epochs(loader, plan, wait_for_loaded)
    loader.terminate()
    for got_epoch, expected_epoch in zip(got, expected):
        assert_same_batches(got_epoch, expected_epoch)


def test_distributed_epochs_left_after_loading_ahead_keep_shared_orders():
    """Each of 2 processes reads its 3 batches of 4 of a shuffled epoch
    and starts the next epoch without reaching the end (a fixed number of
    steps per epoch), after the worker began loading that epoch: the
    worker must go back to the epoch's permutation that every process
    uses, or the processes would read overlapping parts."""
    plan = [(3, 16), (3, 28), None]
    for process in range(2):
        dataset = CountingDataset(24)
        expected = read_epochs(
            DataLoader(make_options(process=(process, 2)), dataset,
                       batch_size=4, shuffle=True), plan)
        dataset.loaded.value = 0
        loader = DataLoader(make_options(process=(process, 2)), dataset,
                            batch_size=4, shuffle=True,
                            mode=DataLoaderMode.Async,
                            async_options={"sharing_strategy":
                                           SharingStrategy.Fork,
                                           "buffer_size": 3})
        got = read_epochs(loader, plan, lambda samples: wait_until(
            lambda: dataset.loaded.value >= samples))
        loader.terminate()
        for got_epoch, expected_epoch in zip(got, expected):
            assert_same_batches(got_epoch, expected_epoch)


def test_worker_starts_from_the_host_random_states():
    """A worker started by the fork server (the default) draws, without
    workers of its own, what the synchronous loader draws after the same
    torch.manual_seed, random.seed and numpy.random.seed."""
    epochs = {}
    for mode in (DataLoaderMode.Sync, DataLoaderMode.Async):
        torch.manual_seed(4)
        random.seed(4)
        numpy.random.seed(4)
        loader = DataLoader(Options(), HostRandomDataset(), batch_size=2,
                            shuffle=True, mode=mode)
        epochs[mode] = cloned(loader)
        loader.terminate()
    assert_same_batches(epochs[DataLoaderMode.Async],
                        epochs[DataLoaderMode.Sync])


def test_terminate_stops_the_worker_and_blocks_further_use():
    before = worker_processes()
    accessor = fork_accessor(SampleDataset(4))
    (worker,) = worker_processes() - before
    accessor.terminate()
    assert not worker.is_alive()
    with pytest.raises(Error, match="terminated"):
        iter(accessor)
    accessor.terminate()


def test_garbage_collected_accessor_stops_its_worker():
    before = worker_processes()
    accessor = fork_accessor(SampleDataset(4))
    (worker,) = worker_processes() - before
    del accessor
    assert wait_until(lambda: not worker.is_alive())


@pytest.mark.parametrize("arguments,message", [
    (dict(buffer_size=0), "buffer_size must be an integer >= 1"),
    (dict(rebatched_size=0), "rebatched_size must be an integer >= 1"),
    (dict(miss_sleep_time_in_ms=-1), "miss_sleep_time_in_ms must be"),
    (dict(load_indefinitely=1), "load_indefinitely must be a bool"),
    (dict(sharing_strategy=9), "sharing_strategy must be one of"),
])
def test_bad_accessor_arguments_raise_clear_errors(arguments, message):
    before = worker_processes()
    with pytest.raises(Error, match=message):
        AsynchronousDataAccessor(SampleDataset(3), **arguments)
    assert worker_processes() == before


def run_child(script, tmp_path, wait=True):
    """Run ``script`` in a fresh interpreter whose temporary files go to
    ``tmp_path``; it must print the worker's pid on its first line."""
    environment = dict(os.environ, TMPDIR=str(tmp_path),
                       PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                             stdout=subprocess.PIPE, text=True,
                             env=environment)
    worker_pid = int(child.stdout.readline())
    if wait:
        assert child.wait(timeout=30) == 0
    return child, worker_pid


def process_gone(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


CHILD_SCRIPT = """
    import multiprocessing, time, torch
    from poptorch._impl.data import AsynchronousDataAccessor
    from poptorch.enums import SharingStrategy

    data = [torch.full((1000,), float(i)) for i in range(50)]
    accessor = AsynchronousDataAccessor(
        data, sharing_strategy=SharingStrategy.{strategy})
    iterator = iter(accessor)
    next(iterator)
    (worker,) = multiprocessing.active_children()
    print(worker.pid, flush=True)
    {ending}
"""


def shm_entries():
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("strategy", [
    "Fork",
    pytest.param("ForkServer", marks=pytest.mark.slow),
    pytest.param("FileSystem", marks=pytest.mark.slow),
])
def test_interpreter_exit_stops_worker_and_leaves_no_shared_memory(
        strategy, tmp_path):
    shm_before = shm_entries()
    _, worker_pid = run_child(
        CHILD_SCRIPT.format(strategy=strategy, ending="time.sleep(0.1)"),
        tmp_path)
    assert wait_until(lambda: process_gone(worker_pid))
    assert shm_entries() <= shm_before
    assert list(tmp_path.iterdir()) == []


def test_worker_exits_when_its_parent_is_killed(tmp_path):
    child, worker_pid = run_child(
        CHILD_SCRIPT.format(strategy="Fork", ending="time.sleep(60)"),
        tmp_path, wait=False)
    child.kill()
    child.wait()
    assert wait_until(lambda: process_gone(worker_pid))


def test_knobs_without_effect_are_accepted_and_logged_once(poptorch_log):
    with fork_accessor(SampleDataset(4),
                       miss_sleep_time_in_ms=5) as accessor:
        assert len(list(accessor)) == 4
    loader = DataLoader(make_options(), SampleDataset(4),
                        async_options={"buffer_size": 2},
                        rebatched_worker_size=1)
    assert len(list(loader)) == 4
    messages = [record.getMessage() for record in poptorch_log.records]
    assert any("miss_sleep_time_in_ms has no effect" in m for m in messages)
    assert any("async_options have no effect" in m for m in messages)
    assert any("rebatched_worker_size only applies" in m for m in messages)


def test_set_epoch_on_the_consumers_sampler_is_reported(poptorch_log):
    """The worker loads with its own copy of a torch DistributedSampler:
    set_epoch on the consumer's copy leaves the order as it was, which a
    warning says."""
    dataset = SampleDataset(8)
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = DataLoader(make_options(), dataset, batch_size=2,
                        sampler=sampler, mode=DataLoaderMode.Async,
                        auto_distributed_partitioning=False,
                        async_options={"sharing_strategy":
                                       SharingStrategy.Fork})
    first = values(cloned(loader))
    sampler.set_epoch(1)
    assert values(cloned(loader)) == first
    loader.terminate()
    messages = [record.getMessage() for record in poptorch_log.records]
    assert any("set_epoch() was called on the DataLoader's sampler" in m
               for m in messages)


UNGUARDED_SCRIPT = """
    import torch
    from poptorch._impl.data import AsynchronousDataAccessor
    from poptorch.enums import SharingStrategy

    accessor = AsynchronousDataAccessor(
        [torch.zeros(2)] * 4, sharing_strategy=SharingStrategy.SharedMemory)
    list(accessor)
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """A spawned worker runs the main script again, which starts another
    worker while the first is still starting: multiprocessing stops it.
    The error says what to change."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(UNGUARDED_SCRIPT))
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, str(script)], text=True,
                            capture_output=True, env=environment,
                            timeout=120)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert "exited with code 1" in last_line
    assert "if __name__ == '__main__':" in last_line
    assert "SharingStrategy.Fork" in last_line
