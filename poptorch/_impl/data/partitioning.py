"""Split a dataset between the processes of a distributed run.

``poptorch.DataLoader`` gives every process of a distributed run
(``options.Distributed.numProcesses > 1``) a disjoint part of the dataset, and
every process takes part in the same number of model calls. Under ``poprun``
with more instances than replicas, the consecutive instances of one replica
(the stages of one pipeline) count as one process here and read the same
part (``_Distribution`` in ``dataloader.py``).

Map-style datasets (``DistributedPartitionSampler``): each epoch orders the
whole dataset (the identity order, or with shuffling the next permutation
drawn from the sampler's generator, seeded with ``random_seed``, so it is
the same on every process and different each epoch), cuts it into
``numProcesses`` contiguous parts of ``len(dataset) // numProcesses``
samples and hands part ``processId`` to its process. The
``len(dataset) % numProcesses`` samples left over are not used that epoch.
Contiguous parts (rather than torch's interleaved ``DistributedSampler``)
keep the samples of a combined batch consecutive.

Iterable datasets (``ProcessShareIterable``): the stream of samples (each
torch worker's stream when there are workers) is cut into groups of
``numProcesses x block`` consecutive samples, where ``block`` is the batch
size the torch workers use; process ``i`` takes the ``i``-th block of
``block`` samples of every group. A final incomplete group is dropped with
``drop_last=True``; otherwise it is split evenly, each process taking
``len(group) // numProcesses`` consecutive samples of it.
"""
from typing import Iterator, List

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler


class DistributedPartitionSampler(Sampler[int]):
    """Indices of this process's contiguous part of a map-style dataset."""

    def __init__(self, dataset_length: int, process_id: int,
                 num_processes: int, shuffle: bool, seed: int) -> None:
        super().__init__()
        self._dataset_length = dataset_length
        self._process_id = process_id
        self._num_processes = num_processes
        self._shuffle = shuffle
        #: Where the epochs' permutations come from: like the generator of
        #: torch's ``RandomSampler``, the state that says which epoch comes
        #: next, which an asynchronous loader's worker puts back when the
        #: consumer leaves an epoch it had loaded ahead of (``worker.py``).
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return self._dataset_length // self._num_processes

    def __iter__(self) -> Iterator[int]:
        order = self._epoch_order()
        start = self._process_id * len(self)
        return iter(order[start:start + len(self)])

    def _epoch_order(self) -> List[int]:
        if not self._shuffle:
            return list(range(self._dataset_length))
        return torch.randperm(self._dataset_length,
                              generator=self.generator).tolist()


class ProcessShareIterable(IterableDataset):
    """This process's share of the samples of an iterable dataset."""

    def __init__(self, dataset: Dataset, process_id: int, num_processes: int,
                 block: int, drop_last: bool) -> None:
        super().__init__()
        self.dataset = dataset
        self._process_id = process_id
        self._num_processes = num_processes
        self._block = block
        self._drop_last = drop_last

    def __len__(self) -> int:
        """This process's share of the ``len(dataset)`` samples of one
        stream (``TypeError`` when the dataset has no length, as in torch).
        Like torch's length of an iterable dataset it is what the dataset
        promises: with torch workers each cuts its own stream, which may
        leave fewer."""
        group_size = self._num_processes * self._block
        groups, left = divmod(len(self.dataset), group_size)
        share = groups * self._block
        if left and not self._drop_last:
            share += left // self._num_processes
        return share

    def __iter__(self) -> Iterator:
        group_size = self._num_processes * self._block
        own_start = self._process_id * self._block
        group = []
        for sample in self.dataset:
            group.append(sample)
            if len(group) == group_size:
                yield from group[own_start:own_start + self._block]
                group = []
        if group and not self._drop_last:
            share = len(group) // self._num_processes
            start = self._process_id * share
            yield from group[start:start + share]
