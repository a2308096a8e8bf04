"""poptorch.DataLoader in DataLoaderMode.Sync: combined batch size, equality
with a plain torch DataLoader, batch samplers, freezing of the options and
the split of the data between the processes of a distributed run."""
from collections import namedtuple

import pytest
import torch
from torch.utils.data import (BatchSampler, Dataset, IterableDataset,
                              SequentialSampler, get_worker_info)

from poptorch._impl.data import DataLoader
from poptorch.enums import CommGroupType, DataLoaderMode
from poptorch.errors import Error
from poptorch.options import Options
from conftest import assert_same_batches

Pair = namedtuple("Pair", ["left", "right"])


class SampleDataset(Dataset):
    """Sample ``i`` holds the value ``i`` in every leaf, as a tensor, a
    tuple, a dict or a nested structure with a named tuple."""

    def __init__(self, length, structure="tensor"):
        self.length = length
        self.structure = structure

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        x = torch.full((3,), float(index))
        y = torch.tensor(index)
        if self.structure == "tensor":
            return x
        if self.structure == "tuple":
            return x, y
        if self.structure == "dict":
            return {"x": x, "y": y}
        return {"pair": Pair(x, [y, y * 2]), "id": (y,)}


class RangeStream(IterableDataset):
    """Samples ``start .. end-1``, split between torch workers in
    contiguous runs like torch's documented example."""

    def __init__(self, start, end):
        super().__init__()
        self.start, self.end = start, end

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(torch.arange(self.start, self.end))
        per_worker = -(-(self.end - self.start) // info.num_workers)
        first = self.start + info.id * per_worker
        return iter(torch.arange(first, min(first + per_worker, self.end)))


def make_options(device_iterations=1, replicas=1, accumulation=1, seed=None,
                 process=None):
    opts = Options().deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    if seed is not None:
        opts.randomSeed(seed)
    if process is not None:
        opts.Distributed.configureProcessId(*process)
    return opts


def first_values(batches):
    """The sample indices in each batch of tensors whose first column (or
    only value) is the index."""
    return [(batch if batch.dim() == 1 else batch[:, 0]).long().tolist()
            for batch in batches]


def test_combined_batch_size_is_micro_batch_times_d_g_r():
    loader = DataLoader(make_options(2, replicas=3, accumulation=4),
                        SampleDataset(100), batch_size=2)
    assert loader.combinedBatchSize == 2 * 2 * 3 * 4
    assert [len(batch) for batch in loader] == [48, 48]


def test_input_replica_grouping_divides_the_replicas_in_the_combined_batch():
    opts = make_options(device_iterations=2, replicas=4)
    opts.inputReplicaGrouping(2, CommGroupType.Consecutive)
    loader = DataLoader(opts, SampleDataset(40), batch_size=3)
    assert loader.combinedBatchSize == 3 * 2 * (4 // 2)


@pytest.mark.parametrize("structure", ["tensor", "tuple", "dict", "nested"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sync_batches_equal_plain_torch_dataloader(structure, drop_last):
    dataset = SampleDataset(29, structure)
    loader = DataLoader(make_options(2, accumulation=2), dataset,
                        batch_size=2, drop_last=drop_last)
    reference = torch.utils.data.DataLoader(dataset, batch_size=8,
                                            drop_last=drop_last)
    assert_same_batches(list(loader), list(reference))
    assert len(loader) == len(reference) == (3 if drop_last else 4)


def test_incomplete_final_batch_is_dropped_by_default():
    loader = DataLoader(make_options(device_iterations=4), SampleDataset(10),
                        batch_size=1)
    assert first_values(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shuffle_follows_torch_manual_seed_like_plain_torch():
    dataset = SampleDataset(30)
    torch.manual_seed(7)
    loader = DataLoader(make_options(replicas=2), dataset, batch_size=3,
                        shuffle=True)
    shuffled = [list(loader), list(loader)]
    torch.manual_seed(7)
    reference = torch.utils.data.DataLoader(dataset, batch_size=6,
                                            shuffle=True, drop_last=True)
    expected = [list(reference), list(reference)]
    for got, want in zip(shuffled, expected):
        assert_same_batches(got, want)
    assert first_values(shuffled[0]) != first_values(shuffled[1])


def test_workers_give_the_same_batches_as_plain_torch():
    dataset = SampleDataset(37, "dict")
    loader = DataLoader(make_options(device_iterations=2), dataset,
                        batch_size=2, num_workers=2, persistent_workers=True)
    reference = torch.utils.data.DataLoader(dataset, batch_size=4,
                                            num_workers=2, drop_last=True)
    expected = list(reference)
    assert_same_batches(list(loader), expected)
    assert_same_batches(list(loader), expected)


def test_iterable_dataset_with_workers_matches_plain_torch():
    dataset = RangeStream(0, 50)
    loader = DataLoader(make_options(device_iterations=3), dataset,
                        batch_size=2, num_workers=2)
    reference = torch.utils.data.DataLoader(dataset, batch_size=6,
                                            num_workers=2, drop_last=True)
    assert_same_batches(list(loader), list(reference))


def test_kwargs_reach_torch_dataloader():
    dataset = SampleDataset(12)
    loader = DataLoader(make_options(), dataset, batch_size=4,
                        collate_fn=lambda samples: len(samples))
    assert list(loader) == [4, 4, 4]


def test_options_are_frozen_and_kept_by_reference():
    opts = make_options(device_iterations=2)
    loader = DataLoader(opts, SampleDataset(8))
    assert loader.options is opts
    with pytest.raises(Error, match="frozen"):
        opts.deviceIterations(4)


def test_rejected_arguments_leave_options_unfrozen():
    opts = make_options()
    with pytest.raises(Error, match="batch_size"):
        DataLoader(opts, SampleDataset(8), batch_size=0)
    opts.deviceIterations(2)
    assert opts.device_iterations == 2


def test_batch_size_none_passes_dataset_items_through_unchanged():
    dataset = SampleDataset(5, "tuple")
    loader = DataLoader(make_options(device_iterations=2), dataset,
                        batch_size=None)
    assert loader.combinedBatchSize is None
    reference = torch.utils.data.DataLoader(dataset, batch_size=None)
    assert_same_batches(list(loader), list(reference))
    assert_same_batches([tuple(item) for item in loader],
                        [dataset[i] for i in range(5)])


@pytest.mark.parametrize("drop_last,expected", [
    (True, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
    (False, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14]]),
])
def test_batch_sampler_batches_are_micro_batches_of_a_combined_batch(
        drop_last, expected):
    dataset = SampleDataset(15)
    micro_batches = BatchSampler(SequentialSampler(dataset), 3, False)
    loader = DataLoader(make_options(replicas=2), dataset,
                        batch_sampler=micro_batches, drop_last=drop_last)
    assert loader.combinedBatchSize == 6
    assert first_values(loader) == expected
    assert len(loader) == len(expected)


def test_batch_sampler_excludes_batch_size_and_shuffle():
    dataset = SampleDataset(15)
    micro_batches = BatchSampler(SequentialSampler(dataset), 3, False)
    with pytest.raises(Error, match="batch_sampler is mutually exclusive"):
        DataLoader(make_options(), dataset, batch_size=3,
                   batch_sampler=micro_batches)
    with pytest.raises(Error, match="batch_sampler is mutually exclusive"):
        DataLoader(make_options(), dataset, shuffle=True,
                   batch_sampler=micro_batches)


@pytest.mark.parametrize("arguments,message", [
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(mode=7), "mode must be one of DataLoaderMode.Sync"),
    (dict(shuffle="yes"), "shuffle must be a bool"),
    (dict(async_options={"buffer": 2}), "unknown async_options"),
    (dict(mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=99),
     "rebatched_worker_size must be an integer from 1"),
])
def test_bad_arguments_raise_clear_errors(arguments, message):
    with pytest.raises(Error, match=message):
        DataLoader(make_options(), SampleDataset(8), **arguments)


def test_options_must_be_poptorch_options():
    with pytest.raises(Error, match="options must be a poptorch.Options"):
        DataLoader(None, SampleDataset(8))


def test_terminate_has_no_effect_in_sync_mode():
    loader = DataLoader(make_options(), SampleDataset(4), batch_size=2)
    loader.terminate()
    assert first_values(loader) == [[0, 1], [2, 3]]


def distributed_batches(dataset, num_processes, epochs=1, seed=None,
                        **arguments):
    """Per process, per epoch: the sample indices of each batch."""
    result = []
    for process in range(num_processes):
        opts = make_options(seed=seed, process=(process, num_processes))
        loader = DataLoader(opts, dataset, **arguments)
        result.append([first_values(loader) for _ in range(epochs)])
    return result


def test_distributed_processes_get_disjoint_consecutive_parts():
    per_process = distributed_batches(SampleDataset(26), 3, batch_size=4)
    assert per_process == [[[[0, 1, 2, 3], [4, 5, 6, 7]]],
                           [[[8, 9, 10, 11], [12, 13, 14, 15]]],
                           [[[16, 17, 18, 19], [20, 21, 22, 23]]]]


def test_the_instances_of_one_poprun_replica_read_the_same_part(monkeypatch):
    """poprun with more instances than replicas runs a pipeline stage per
    instance: the instances of one replica read the same data."""
    monkeypatch.setenv("POPDIST_NUM_INSTANCES", "4")
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "2")
    per_process = distributed_batches(SampleDataset(16), 4, batch_size=4)
    assert per_process[0] == per_process[1] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert per_process[2] == per_process[3] == [[[8, 9, 10, 11],
                                                 [12, 13, 14, 15]]]


def test_distributed_shuffle_is_a_shared_permutation_that_changes_each_epoch():
    epochs = []
    for _ in range(2):
        per_process = [
            [[index for batch in epoch for index in batch]
             for epoch in process_epochs]
            for process_epochs in distributed_batches(
                SampleDataset(24), 2, epochs=2, batch_size=3, shuffle=True,
                seed=42)
        ]
        epochs.append(per_process)
    assert epochs[0] == epochs[1], "same seed, same orders"
    for epoch in range(2):
        together = epochs[0][0][epoch] + epochs[0][1][epoch]
        assert sorted(together) == list(range(24))
    assert epochs[0][0][0] != epochs[0][0][1]
    generator = torch.Generator().manual_seed(42)
    first = torch.randperm(24, generator=generator).tolist()
    assert epochs[0][0][0] + epochs[0][1][0] == first
    assert together == torch.randperm(24, generator=generator).tolist()


def test_distributed_shuffle_without_random_seed_asks_for_one():
    opts = make_options(process=(0, 2))
    with pytest.raises(Error, match=r"options.randomSeed\(N\)"):
        DataLoader(opts, SampleDataset(8), shuffle=True)


def test_distributed_run_rejects_custom_sampler():
    dataset = SampleDataset(8)
    with pytest.raises(Error, match="auto_distributed_partitioning=False"):
        DataLoader(make_options(process=(0, 2)), dataset,
                   sampler=SequentialSampler(dataset))


def test_without_auto_partitioning_each_process_sees_everything():
    per_process = distributed_batches(SampleDataset(8), 2, batch_size=4,
                                      auto_distributed_partitioning=False)
    assert per_process[0] == per_process[1] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]


class Stream(IterableDataset):

    def __init__(self, length):
        super().__init__()
        self.length = length

    def __iter__(self):
        return (torch.full((2,), float(i)) for i in range(self.length))


@pytest.mark.parametrize("drop_last,expected", [
    (True, [[[[0, 1], [4, 5]]], [[[2, 3], [6, 7]]]]),
    (False, [[[[0, 1], [4, 5], [8]]], [[[2, 3], [6, 7], [9]]]]),
])
def test_distributed_iterable_takes_alternate_blocks_of_combined_batches(
        drop_last, expected):
    assert distributed_batches(Stream(11), 2, batch_size=2,
                               drop_last=drop_last) == expected


class SizedStream(Stream):

    def __len__(self):
        return self.length


@pytest.mark.parametrize("drop_last", [True, False])
def test_distributed_iterable_length_counts_the_process_batches(drop_last):
    """A sized stream of 11 samples, batches of 2 over 2 processes: the
    length of each process's loader is the number of batches it reads."""
    for process in range(2):
        loader = DataLoader(make_options(process=(process, 2)),
                            SizedStream(11), batch_size=2,
                            drop_last=drop_last)
        assert len(loader) == len(list(loader)) == 2 + int(not drop_last)


def test_distributed_iterable_with_workers_splits_each_worker_stream():
    per_process = distributed_batches(RangeStream(0, 16), 2, batch_size=2,
                                      num_workers=2)
    flat = [sorted(i for batch in p[0] for i in batch) for p in per_process]
    assert flat == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
