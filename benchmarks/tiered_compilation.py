"""Tiered compilation: the total wall time of training runs of a given
length of work with the ``graph``, ``inductor`` and ``auto`` backends, each
run in a new process with an empty executable cache and an empty Inductor
cache (as a user's first run), for the MLP, the CNN with BatchNorm and the
small transformer encoder of ``compiled.py``.

A run of L seconds of work is the number of calls the ``graph`` backend
makes in L seconds (measured first, in a process of its own); each backend
then runs that many calls, and the time from the model's creation to the
last call's end is reported, with ``auto``'s ratio to the better of the
other two and its speed-up over ``graph``.

Run by hand: ``.venv/bin/python benchmarks/tiered_compilation.py``
(``--lengths 5 60 300 --workloads ...``; a full run takes about an hour on
2 CPU cores).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
from compiled import WORKLOADS, _optimizer, make_data

import poptorch

BACKENDS = ("graph", "inductor", "auto")


def _child(workload: str, backend: str, calls: int) -> float:
    """Seconds from the model's creation to the end of ``calls`` calls (or,
    with ``calls`` 0, seconds per call of the graph backend)."""
    model_class, _, micro_batch, iterations = WORKLOADS[workload]
    torch.manual_seed(0)
    model = model_class()
    options = poptorch.Options().deviceIterations(iterations)
    options.setBackend(backend).showCompilationProgressBar(False)
    x, y = make_data(model_class, micro_batch * iterations)
    start = time.perf_counter()
    training = poptorch.trainingModel(model, options, _optimizer(model))
    if calls == 0:
        training(x, y)
        begin = time.perf_counter()
        for _ in range(10):
            training(x, y)
        return (time.perf_counter() - begin) / 10
    for _ in range(calls):
        training(x, y)
    return time.perf_counter() - start


def _run(workload: str, backend: str, calls: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        environment = dict(os.environ, POPTORCH_CACHE_DIR=cache,
                           TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "ind"))
        environment.pop("POPTORCH_TIER_UP_AFTER", None)
        result = subprocess.run(
            [sys.executable, __file__, "--child", workload, backend,
             str(calls)], capture_output=True, text=True, env=environment,
            check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=float, nargs="+",
                        default=[5.0, 60.0, 300.0])
    parser.add_argument("--workloads", nargs="+",
                        default=["MLP training", "CNN training",
                                 "Transformer training"])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload, backend, calls = args.child
        print(json.dumps(_child(workload, backend, int(calls))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; each run a new "
          "process, empty caches")
    print("| workload | work | calls | graph s | inductor s | auto s "
          "| auto / best | auto speed-up over graph |")
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        per_call = _run(workload, "graph", 0)
        for length in args.lengths:
            calls = max(1, round(length / per_call))
            times = {backend: _run(workload, backend, calls)
                     for backend in BACKENDS}
            best = min(times["graph"], times["inductor"])
            print(f"| {workload} | {length:g} s | {calls} "
                  f"| {times['graph']:.1f} | {times['inductor']:.1f} "
                  f"| {times['auto']:.1f} | {times['auto'] / best:.2f} "
                  f"| {times['graph'] / times['auto']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
