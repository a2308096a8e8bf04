"""Replication throughput.

1. In one process: a training model with R = 4 replicas of micro-batch S
   against one batch of 4 x S (plain eager PyTorch, and a poptorch model
   with R = 1), same process, same weights and data. The vectorised replica
   path should cost nothing over the one big batch (target >= 0.95x); the
   sequential replica loop is shown for comparison.
2. Processes: the same training run as 1 process and as 2 processes
   started by ``poprun`` (one thread each, gloo gradient all-reduce once
   per optimizer step of G micro-batches), in samples/s over all processes
   (target >= 1.7x on 2 cores), for the MLP (1.6 MB of gradients per step)
   and the CNN (0.1 MB for more arithmetic). The machine must be otherwise
   idle: another busy process makes one instance wait for the other at
   every all-reduce.

Run by hand: ``.venv/bin/python benchmarks/replication.py``. Prints
markdown tables.
"""
import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import poptorch
from poptorch._impl.replication import replicas as replica_execution


class MLP(torch.nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.cross_entropy(out, y)


class CNN(torch.nn.Module):
    """With ``batch_norm``, BatchNorm statistics are per replica
    (broadcastBuffers(False)): they couple the samples of a replica, so R
    replicas of S are not one batch of R x S."""

    def __init__(self, batch_norm: bool = False):
        super().__init__()
        norm = (torch.nn.BatchNorm2d(16) if batch_norm
                else torch.nn.Identity())
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), norm,
            torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(32 * 8 * 8, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def data(kind: str, rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, 256) if kind == "mlp" else (rows, 3, 16, 16)
    return (torch.randn(shape, generator=generator),
            torch.randint(0, 10, (rows,), generator=generator))


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def eager_step(model, x, y):
    """Plain PyTorch: one step on the whole batch."""
    optimizer = _optimizer(model)

    def step():
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()

    return step


def poptorch_step(model, x, y, replicas: int, sequential: bool = False):
    """One call of a training model: one optimizer step over R
    micro-batches of len(x) / R rows."""
    opts = poptorch.Options().replicationFactor(replicas)
    opts.broadcastBuffers(False).showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, _optimizer(model))
    choose = replica_execution._path_for
    if sequential:
        replica_execution._path_for = lambda *args: (
            replica_execution.SEQUENTIAL, "benchmark")
    try:
        training.compile(x, y)
    finally:
        replica_execution._path_for = choose
    return lambda: training(x, y)


def timed(steps, repeats: int, calls: int):
    """Median seconds per call of each step function, interleaved."""
    for step in steps:
        step()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for step, record in zip(steps, times):
            start = time.perf_counter()
            for _ in range(calls):
                step()
            record.append((time.perf_counter() - start) / calls)
    return [statistics.median(record) for record in times]


def in_process_table(arguments) -> None:
    replicas, micro = 4, arguments.micro_batch
    rows = replicas * micro
    print(f"\n### R = {replicas} replicas of S = {micro} vs one batch of "
          f"{rows} ({torch.get_num_threads()} threads, median of "
          f"{arguments.repeats} x {arguments.calls} steps)\n")
    print("| model | eager 4S samples/s | poptorch R=1, 4S | poptorch R=4 "
          "vectorised | R=4 / eager | R=4 / poptorch R=1 | R=4 sequential "
          "loop |")
    print("|---|---|---|---|---|---|---|")
    models = (("MLP", "mlp", MLP), ("CNN", "cnn", CNN),
              ("CNN + BatchNorm", "cnn", lambda: CNN(batch_norm=True)))
    for name, kind, build in models:
        torch.manual_seed(0)
        model = build()
        x, y = data(kind, rows)
        eager, single, vectorised, sequential = timed(
            [eager_step(copy.deepcopy(model), x, y),
             poptorch_step(copy.deepcopy(model), x, y, 1),
             poptorch_step(copy.deepcopy(model), x, y, replicas),
             poptorch_step(copy.deepcopy(model), x, y, replicas,
                           sequential=True)],
            arguments.repeats, arguments.calls)
        print(f"| {name} | {rows / eager:,.0f} | {rows / single:,.0f} "
              f"| {rows / vectorised:,.0f} | {eager / vectorised:.2f} | "
              f"{single / vectorised:.2f} | {rows / sequential:,.0f} |")


# --- processes -----------------------------------------------------------

def _time_all_reduce_waits():
    """Seconds spent waiting for gradient all-reduces to finish (the part
    of their time that the backward pass did not hide, waiting for the
    other process included), measured by wrapping the process group's
    wait."""
    from poptorch._impl.distributed import process_group
    spent = [0.0]
    original = process_group.ProcessGroup.finish_all_reduce_

    def timed(self, *args):
        start = time.perf_counter()
        original(self, *args)
        spent[0] += time.perf_counter() - start

    process_group.ProcessGroup.finish_all_reduce_ = timed
    return spent


# name: (data kind, model builder, micro-batch S)
PROCESS_MODELS = {
    "MLP": ("mlp", lambda width: MLP(width), 256),
    "CNN": ("cnn", lambda width: CNN(), 64),
}


def worker(arguments) -> None:
    """One process of the process benchmark: prints a JSON line with its
    samples/s (process 0 only)."""
    torch.set_num_threads(1)
    import popdist
    import popdist.poptorch
    popdist.init()
    all_reduce = _time_all_reduce_waits()
    opts = popdist.poptorch.Options()
    opts.deviceIterations(arguments.iterations)
    opts.showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(arguments.accumulation)
    kind, build, micro_batch = PROCESS_MODELS[arguments.model]
    torch.manual_seed(0)
    model = build(arguments.width)
    training = poptorch.trainingModel(model, opts, _optimizer(model))
    rows = arguments.iterations * arguments.accumulation * micro_batch
    x, y = data(kind, rows, seed=popdist.getInstanceIndex())
    training(x, y)
    all_reduce[0] = 0.0
    start = time.perf_counter()
    for _ in range(arguments.calls):
        training(x, y)
    elapsed = time.perf_counter() - start
    samples = arguments.calls * rows * popdist.getNumInstances()
    if popdist.getInstanceIndex() == 0:
        print(json.dumps({"samples_per_second": samples / elapsed,
                          "all_reduce_share": all_reduce[0] / elapsed}),
              flush=True)


def _run_workers(instances: int, model: str, arguments) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", model,
               "--width", str(arguments.width),
               "--iterations", str(arguments.iterations),
               "--accumulation", str(arguments.accumulation),
               "--calls", str(arguments.process_calls)]
    if instances > 1:
        command = [sys.executable, "-m", "poptorch.run", "--num-instances",
                   str(instances), "--num-replicas", str(instances),
                   *command[1:]]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True,
                            env=environment)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n"
                           f"{result.stderr[-3000:]}")
    line = next(l for l in result.stdout.splitlines()
                if l.startswith("{"))
    return json.loads(line)


def process_table(arguments) -> None:
    """Each model as 1 then 2 processes, ``process_repeats`` times in
    turn; the speed-up is the median of the pairs' ratios."""
    print(f"\n### 1 process vs 2 processes (poprun, 1 thread each, G = "
          f"{arguments.accumulation}, D = {arguments.iterations}, "
          f"{arguments.process_calls} calls, {arguments.process_repeats} "
          "pairs of runs)\n")
    print("| model | 1 process samples/s | 2 processes samples/s | speed-up "
          "(median, range) | time waiting for gradient all-reduces "
          "(process 0) |")
    print("|---|---|---|---|---|")
    for model, (_, _, micro_batch) in PROCESS_MODELS.items():
        pairs = [(_run_workers(1, model, arguments),
                  _run_workers(2, model, arguments))
                 for _ in range(arguments.process_repeats)]
        ratios = sorted(two["samples_per_second"] / one["samples_per_second"]
                        for one, two in pairs)
        one = statistics.median(p[0]["samples_per_second"] for p in pairs)
        two = statistics.median(p[1]["samples_per_second"] for p in pairs)
        wait = statistics.median(p[1]["all_reduce_share"] for p in pairs)
        name = (f"{model} (width {arguments.width}, S = {micro_batch})"
                if model == "MLP" else f"{model} (S = {micro_batch})")
        print(f"| {name} | {one:,.0f} | {two:,.0f} | "
              f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-"
              f"{ratios[-1]:.2f}) | {100 * wait:.0f}% |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--model", choices=sorted(PROCESS_MODELS),
                        default="MLP", help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=4,
                        help="gradient accumulation of the process runs: "
                        "one all-reduce per G micro-batches")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--process-calls", type=int, default=10)
    parser.add_argument("--process-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the in-process table")
    parser.add_argument("--skip-processes", action="store_true")
    arguments = parser.parse_args()
    if arguments.worker:
        worker(arguments)
        return
    torch.set_num_threads(arguments.threads)
    print(f"torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPU cores")
    in_process_table(arguments)
    if not arguments.skip_processes:
        process_table(arguments)


if __name__ == "__main__":
    main()
