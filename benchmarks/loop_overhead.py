"""Training-loop overhead: ``poptorch.trainingModel`` with D device
iterations per call against the plain eager PyTorch loop doing the same
steps, in the same process. Prints a markdown table of samples/s and the
ratio (poptorch / eager; > 1 means poptorch is faster).

Run by hand: ``.venv/bin/python benchmarks/loop_overhead.py``.
"""
import argparse
import copy
import platform
from typing import Optional

import torch
from timing import interleaved_medians

import poptorch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.cross_entropy(out, y)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(16 * 8 * 8, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def data(kind: str, rows: int):
    shape = (rows, 64) if kind == "mlp" else (rows, 1, 16, 16)
    return torch.randn(shape), torch.randint(0, 10, (rows,))


def eager_pass(model, x, y, micro_batch: int):
    """One pass over the data with the plain eager training loop."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = list(zip(x.split(micro_batch), y.split(micro_batch)))

    def one_pass():
        for xb, yb in batches:
            optimizer.zero_grad()
            _, loss = model(xb, yb)
            loss.backward()
            optimizer.step()

    return one_pass


def poptorch_pass(model, x, y, iterations: int, micro_batch: int,
                  floating_point_exceptions: bool = False,
                  profile_dir: Optional[str] = None):
    """One pass over the same data through a training model with
    ``iterations`` device iterations per call (checking every step's values
    with ``floating_point_exceptions``; profiled into ``profile_dir`` when
    given)."""
    opts = poptorch.Options().deviceIterations(iterations)
    opts.showCompilationProgressBar(False)
    opts.Precision.enableFloatingPointExceptions(floating_point_exceptions)
    if profile_dir is not None:
        opts.enableProfiling(profile_dir)
    training = poptorch.trainingModel(
        model, opts,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    rows_per_call = iterations * micro_batch
    calls = list(zip(x.split(rows_per_call), y.split(rows_per_call)))

    def one_pass():
        for xb, yb in calls:
            training(xb, yb)

    return one_pass



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = args.calls * args.iterations * args.micro_batch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; D = "
          f"{args.iterations}, micro-batch {args.micro_batch}, "
          f"{rows} samples per pass, median of {args.repeats}")
    print("| model | eager samples/s | poptorch (graph) samples/s | ratio "
          "| with floating-point exceptions: samples/s | ratio | cost |")
    print("|---|---|---|---|---|---|---|")
    for kind, cls in (("mlp", MLP), ("cnn", CNN)):
        torch.manual_seed(0)
        model = cls()
        x, y = data(kind, rows)
        eager, ours, checked = interleaved_medians(
            [eager_pass(copy.deepcopy(model), x, y, args.micro_batch),
             poptorch_pass(copy.deepcopy(model), x, y, args.iterations,
                           args.micro_batch),
             poptorch_pass(model, x, y, args.iterations, args.micro_batch,
                           floating_point_exceptions=True)],
            args.repeats)
        print(f"| {kind.upper()} | {rows / eager:,.0f} | {rows / ours:,.0f} "
              f"| {eager / ours:.2f} | {rows / checked:,.0f} "
              f"| {eager / checked:.2f} | {checked / ours - 1:+.0%} |")


if __name__ == "__main__":
    main()
