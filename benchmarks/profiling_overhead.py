"""What profiling costs a training loop (docs/profiling.md): the MLP of
``loop_overhead.py`` trained with D device iterations per call, profiling
off and on (``opts.enableProfiling``), interleaved in one process, against
the plain eager PyTorch loop doing the same steps.

With profiling off, a call passes the same range sites as with it on, each
a flag check instead of a range; their cost is measured directly (the time
of ``profile_range`` with nothing recording, times the ranges a call
passes) and given as a share of a call, since it is far below the run-to-run
noise of whole-loop timings.

Run by hand: ``.venv/bin/python benchmarks/profiling_overhead.py``.
"""
import argparse
import copy
import platform
import tempfile
import time

import torch
from loop_overhead import MLP, data, eager_pass, poptorch_pass
from timing import interleaved_medians

from poptorch._impl.profiling.ranges import profile_range


def range_site_seconds(samples: int = 200_000) -> float:
    """Seconds per range site passed with no profiler recording."""
    start = time.perf_counter()
    for _ in range(samples):
        with profile_range("step"):
            pass
    return (time.perf_counter() - start) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = args.calls * args.iterations * args.micro_batch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; MLP, D = "
          f"{args.iterations}, micro-batch {args.micro_batch}, {rows} "
          f"samples per pass, median of {args.repeats}")
    site = range_site_seconds()   # before a profiled model starts recording
    torch.manual_seed(0)
    model = MLP()
    x, y = data("mlp", rows)
    with tempfile.TemporaryDirectory() as directory:
        eager, off, on = interleaved_medians(
            [eager_pass(copy.deepcopy(model), x, y, args.micro_batch),
             poptorch_pass(copy.deepcopy(model), x, y, args.iterations,
                           args.micro_batch),
             poptorch_pass(model, x, y, args.iterations, args.micro_batch,
                           profile_dir=directory)],
            args.repeats)
    # A call passes: call, host to device, device to host, and per device
    # iteration one iteration range and one step range.
    sites_per_call = 3 + 2 * args.iterations
    off_share = site * sites_per_call * args.calls / off
    print("| eager samples/s | profiling off samples/s | ratio "
          "| profiling on samples/s | ratio | cost of on | range sites "
          "when off |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {rows / eager:,.0f} | {rows / off:,.0f} | {eager / off:.2f} "
          f"| {rows / on:,.0f} | {eager / on:.2f} | {on / off - 1:+.0%} "
          f"| {site * 1e9:.0f} ns each, {off_share:.3%} of a call |")


if __name__ == "__main__":
    main()
