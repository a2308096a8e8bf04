"""Data loading overlap: how much of the loading time each loader hides
behind the model's compute.

A map-style dataset spends ``--sample-ms`` on every sample: CPU time in a
busy loop standing in for decoding and augmentation (``--load-kind cpu``,
the default; each loading process then needs a core of its own), or
waiting as for a read from disk (``--load-kind wait``). Each batch feeds a
"model step" calibrated to cost as long as loading that batch was measured
to take: a small MLP's forward, backward and SGD update, repeated (the MLP
starts from the same weights for every loader). The main process
computes with one thread, so on a machine with few cores the loading
processes are not starved.

Loaders, each with the same number of torch workers (``--workers``, a list,
default 0 and 1; persistent workers when > 0):
  * ``torch.utils.data.DataLoader`` (the baseline),
  * ``poptorch.DataLoader`` in ``DataLoaderMode.Sync`` (the same loader),
  * ``poptorch.DataLoader`` in ``DataLoaderMode.Async`` (loading runs in the
    ``AsynchronousDataAccessor``'s worker process, ahead of use).

For each it prints samples/s (median epoch of ``--epochs`` timed epochs,
after one warm-up epoch) and the fraction of the loading time hidden behind
compute: ``(load_only + compute_only - measured) / load_only`` per epoch,
where ``load_only`` is a synchronous pass over the data without compute and
``compute_only`` the same steps on ready batches (100 % = loading is free,
0 % = none hidden; noise moves it a few percent either way).

Run by hand: ``.venv/bin/python benchmarks/data_loading.py``.
"""
import argparse
import datetime
import os
import platform
import statistics
import time
from typing import Callable, Iterable, List, Tuple

import torch
from torch.utils.data import Dataset

from poptorch._impl.data import DataLoader
from poptorch.enums import DataLoaderMode
from poptorch.options import Options

FEATURES = 64
CLASSES = 10


class SlowDataset(Dataset):
    """Sample ``i`` costs ``sample_seconds`` to produce: busy CPU time, or
    waiting when ``busy`` is false."""

    def __init__(self, length: int, sample_seconds: float,
                 busy: bool) -> None:
        self.length = length
        self.sample_seconds = sample_seconds
        self.busy = busy

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.busy:
            deadline = time.perf_counter() + self.sample_seconds
            while time.perf_counter() < deadline:
                pass
        else:
            time.sleep(self.sample_seconds)
        generator = torch.Generator().manual_seed(index)
        return (torch.randn(FEATURES, generator=generator),
                torch.tensor(index % CLASSES))


class ModelStep:
    """``repeats`` forward/backward/update steps of a small MLP."""

    def __init__(self, repeats: int = 1) -> None:
        self.repeats = repeats
        self.reset()

    def reset(self) -> None:
        """Fresh weights, so that every loader trains the same model."""
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, CLASSES))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def __call__(self, batch: Tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        for _ in range(self.repeats):
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()

    def calibrate(self, batch, target_seconds: float) -> None:
        """Choose ``repeats`` so that one call takes ``target_seconds``
        (median of five timed calls, after a warm-up call)."""
        self.repeats = 10
        self(batch)
        per_repeat = statistics.median(
            timed(lambda: self(batch)) for _ in range(5)) / self.repeats
        self.repeats = max(1, round(target_seconds / per_repeat))


def timed(function: Callable[[], None]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def median_epoch_seconds(one_epoch: Callable[[], None], epochs: int) -> float:
    """Median wall time of ``one_epoch`` over ``epochs`` timed runs, after
    one warm-up run."""
    one_epoch()
    return statistics.median(timed(one_epoch) for _ in range(epochs))


def training_epoch(loader: Iterable, step: ModelStep) -> Callable[[], None]:
    def one_epoch():
        for batch in loader:
            step(batch)
    return one_epoch


def loaders(dataset: Dataset, batch_size: int, device_iterations: int,
            workers: int) -> List[Tuple[str, Iterable]]:
    common = dict(num_workers=workers, persistent_workers=workers > 0)
    opts = Options().deviceIterations(device_iterations)
    return [
        ("torch.utils.data.DataLoader",
         torch.utils.data.DataLoader(
             dataset, batch_size=batch_size * device_iterations,
             drop_last=True, **common)),
        ("poptorch.DataLoader Sync",
         DataLoader(opts.clone(), dataset, batch_size=batch_size, **common)),
        ("poptorch.DataLoader Async",
         DataLoader(opts.clone(), dataset, batch_size=batch_size,
                    mode=DataLoaderMode.Async, **common)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--load-kind", choices=["cpu", "wait"],
                        default="cpu")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=3)
    arguments = parser.parse_args()
    load_average = os.getloadavg()[0]
    torch.set_num_threads(1)

    dataset = SlowDataset(arguments.samples, arguments.sample_ms / 1000,
                          busy=arguments.load_kind == "cpu")
    combined = arguments.batch_size * arguments.device_iterations
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=combined,
                                               drop_last=True))
    load_only = median_epoch_seconds(
        lambda: list(torch.utils.data.DataLoader(
            dataset, batch_size=combined, drop_last=True)), arguments.epochs)
    step = ModelStep()
    step.calibrate(batches[0], load_only / len(batches))
    step.reset()
    compute_only = median_epoch_seconds(
        lambda: [step(batch) for batch in batches], arguments.epochs)

    samples = len(batches) * combined
    machine = platform.processor() or platform.machine()
    print(f"{datetime.date.today()}, {machine}, {os.cpu_count()} CPUs "
          f"(load average {load_average:.1f} before the run: overlap needs "
          f"idle cores), torch {torch.__version__}; "
          f"{arguments.samples} samples, {arguments.sample_ms} ms/sample "
          f"({arguments.load_kind}), combined batch {combined}, "
          f"median of {arguments.epochs} epochs")
    print(f"per epoch: load only {load_only:.2f} s, compute only "
          f"{compute_only:.2f} s; bounds: no overlap "
          f"{samples / (load_only + compute_only):.0f} samples/s, full "
          f"overlap {samples / max(load_only, compute_only):.0f} samples/s; "
          f"at most {100 * min(1, compute_only / load_only):.0f} % of the "
          "loading can hide behind compute\n")
    print("| loader | torch workers | samples/s | loading hidden |")
    print("| --- | --- | --- | --- |")
    for workers in arguments.workers:
        for name, loader in loaders(dataset, arguments.batch_size,
                                    arguments.device_iterations, workers):
            step.reset()
            seconds = median_epoch_seconds(training_epoch(loader, step),
                                           arguments.epochs)
            hidden = (load_only + compute_only - seconds) / load_only
            print(f"| {name} | {workers} | {samples / seconds:.0f} | "
                  f"{100 * hidden:.0f} % |")
            if hasattr(loader, "terminate"):
                loader.terminate()


if __name__ == "__main__":
    main()
