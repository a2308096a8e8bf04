"""Compiled execution: samples/s of training (MLP, CNN with BatchNorm, a
small transformer encoder) and CNN inference through plain eager PyTorch,
``torch.compile`` of the same plain loop, and ``poptorch`` with each
backend (``graph``, ``aot_eager``, ``inductor``), in one process, with the
ratio to eager; then, each in a new process, the time to compile a model
with the inductor backend cold (empty executable cache), warm (from the
executable cache) and to ``poptorch.load`` a precompiled file (each process
starts with an empty Inductor cache, as on another machine).

Run by hand: ``.venv/bin/python benchmarks/compiled.py`` (about 10 minutes
on 2 CPU cores; ``--quick`` for fewer repetitions, ``--no-processes`` to
skip the compile-time table).
"""
import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Callable, Dict, List, Tuple

import torch

import poptorch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10))

    def forward(self, x, y=None):
        out = self.net(x)
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10))

    def forward(self, x, y=None):
        out = self.net(x)
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


class Encoder(torch.nn.Module):
    """A BERT-like encoder: embeddings, 2 pre-norm layers of d_model 128
    with 4 heads, a classifier on the mean token."""

    def __init__(self, vocab=1000, length=32, width=128, layers=2):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Parameter(torch.zeros(length, width))
        layer = torch.nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True,
            norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers,
                                                   enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 2)

    def forward(self, tokens, y=None):
        h = self.encoder(self.tokens(tokens) + self.positions)
        out = self.head(h.mean(dim=1))
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


#: name -> (model class, training?, micro-batch, device iterations)
WORKLOADS = {
    "MLP training": (MLP, True, 32, 32),
    "CNN training": (CNN, True, 16, 16),
    "Transformer training": (Encoder, True, 8, 8),
    "CNN inference": (CNN, False, 64, 16),
}


def make_data(model_class, rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    if model_class is MLP:
        x = torch.randn(rows, 64, generator=generator)
    elif model_class is CNN:
        x = torch.randn(rows, 1, 16, 16, generator=generator)
    else:
        x = torch.randint(0, 1000, (rows, 32), generator=generator)
    classes = 2 if model_class is Encoder else 10
    return x, torch.randint(0, classes, (rows,), generator=generator)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def eager_runner(model, training, x, y, micro_batch, compiled=False):
    """A pass of the plain loop; ``compiled`` wraps its step in
    torch.compile."""
    batches = list(zip(x.split(micro_batch), y.split(micro_batch)))
    if training:
        optimizer = _optimizer(model)

        def step(xb, yb):
            optimizer.zero_grad()
            _, loss = model(xb, yb)
            loss.backward()
            optimizer.step()
    else:
        model.eval()

        def step(xb, yb):
            with torch.no_grad():
                return model(xb)

    step = torch.compile(step) if compiled else step

    def one_pass():
        for xb, yb in batches:
            step(xb, yb)

    return one_pass


def poptorch_runner(model, training, x, y, micro_batch, iterations,
                    backend):
    opts = poptorch.Options().deviceIterations(iterations)
    opts.setBackend(backend).showCompilationProgressBar(False)
    rows = iterations * micro_batch
    calls = list(zip(x.split(rows), y.split(rows)))
    if training:
        wrapped = poptorch.trainingModel(model, opts, _optimizer(model))

        def one_pass():
            for xb, yb in calls:
                wrapped(xb, yb)
    else:
        model.eval()
        wrapped = poptorch.inferenceModel(model, opts)

        def one_pass():
            for xb, _ in calls:
                wrapped(xb)

    return one_pass


def measure(passes: Dict[str, Callable[[], None]], repeats: int
            ) -> Dict[str, Tuple[float, float]]:
    """(first pass seconds, median pass seconds) of each runner, passes run
    alternately so that machine noise affects them alike."""
    first = {}
    for name, one_pass in passes.items():
        start = time.perf_counter()
        one_pass()
        first[name] = time.perf_counter() - start
    times = {name: [] for name in passes}
    for _ in range(repeats):
        for name, one_pass in passes.items():
            start = time.perf_counter()
            one_pass()
            times[name].append(time.perf_counter() - start)
    return {name: (first[name], statistics.median(times[name]))
            for name in passes}


RUNNERS = ["eager", "torch.compile", "poptorch graph", "poptorch aot_eager",
           "poptorch inductor"]


def throughput_table(repeats: int, calls: int) -> None:
    print("| workload | runner | samples/s | vs eager | first pass (s) |")
    print("|---|---|---|---|---|")
    for workload, (cls, training, micro, iterations) in WORKLOADS.items():
        torch.manual_seed(0)
        model = cls()
        rows = calls * iterations * micro
        x, y = make_data(cls, rows)
        passes = {
            "eager": eager_runner(copy.deepcopy(model), training, x, y, micro),
            "torch.compile": eager_runner(copy.deepcopy(model), training, x,
                                          y, micro, compiled=True),
        }
        for backend in ("graph", "aot_eager", "inductor"):
            passes[f"poptorch {backend}"] = poptorch_runner(
                copy.deepcopy(model), training, x, y, micro, iterations,
                backend)
        results = measure(passes, repeats)
        eager = results["eager"][1]
        for runner in RUNNERS:
            first, median = results[runner]
            print(f"| {workload} | {runner} | {rows / median:,.0f} | "
                  f"{eager / median:.2f} | {first:.1f} |", flush=True)


_CHILD = '''
import json, sys, time
start = time.perf_counter()
import torch
sys.path.insert(0, {here!r})
import poptorch
from compiled import WORKLOADS, make_data, _optimizer
imported = time.perf_counter() - start
cls, training, micro, iterations = WORKLOADS[{workload!r}]
torch.manual_seed(0)
model = cls()
optimizer = _optimizer(model)   # the program's own one-time costs first
x, y = make_data(cls, micro * iterations)
begin = time.perf_counter()
if {mode!r} == "load":
    wrapped = poptorch.load({path!r})
else:
    opts = poptorch.Options().deviceIterations(iterations)
    opts.setBackend("inductor").showCompilationProgressBar(False)
    opts.enableExecutableCaching({cache!r})
    wrapped = (poptorch.trainingModel(model, opts, optimizer)
               if training else poptorch.inferenceModel(model.eval(), opts))
    wrapped.compile(x, y)
ready = time.perf_counter() - begin
if {mode!r} == "cold":
    wrapped.save({path!r})
print(json.dumps({{"seconds": ready, "import": imported}}))
'''


def _child(workload: str, mode: str, cache: str, path: str) -> float:
    """Seconds to get a compiled model in a new process whose Inductor
    cache directory is empty (as on another machine)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _CHILD.format(here=here, workload=workload, mode=mode,
                         cache=cache, path=path)
    with tempfile.TemporaryDirectory() as inductor_dir:
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir}
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], check=True,
            capture_output=True, text=True, env=environment)
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def compile_time_table(workloads: List[str]) -> None:
    print("| workload | cold compile (s) | warm cache (s) | precompiled load "
          "(s) | warm / cold | load / cold |")
    print("|---|---|---|---|---|---|")
    for workload in workloads:
        with tempfile.TemporaryDirectory() as directory:
            cache = os.path.join(directory, "cache")
            path = os.path.join(directory, "model.poptorch")
            cold = _child(workload, "cold", cache, path)
            warm = _child(workload, "warm", cache, path)
            load = _child(workload, "load", cache, path)
        print(f"| {workload} | {cold:.1f} | {warm:.2f} | {load:.2f} | "
              f"{warm / cold:.0%} | {load / cold:.0%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=4,
                        help="poptorch calls per pass")
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats of 2 calls")
    parser.add_argument("--no-processes", action="store_true",
                        help="skip the compile-time table")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.calls = 2, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats} interleaved "
          f"passes of {args.calls} poptorch calls\n")
    # Inductor's own cache starts empty, so first passes are cold compiles.
    with tempfile.TemporaryDirectory(prefix="inductor-") as inductor_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
        throughput_table(args.repeats, args.calls)
    if not args.no_processes:
        print()
        compile_time_table(["CNN training", "Transformer training"])
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
