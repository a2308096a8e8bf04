"""CTC loss: PopTorch's static-shape implementations (``_impl/ctc_loss.py``,
what a captured model runs) against PyTorch's eager CPU kernel, forward
and backward, in the same process on the same data: a batch of N = 16
inputs of T = 200 frames over 30 labels and the blank, targets of 40 to 50
labels padded to S = 50, mean reduction. The two implementations are
PyTorch's kernels in one op (``ctc_loss_kernels.py``, what the CPU runs)
and the frame-by-frame recursion (what other devices run).

Each pass runs ``loss.backward()`` from fresh log probabilities; ratio =
PyTorch time / PopTorch time (> 1: PopTorch is faster). Measured with one
torch thread and with the default thread count. Run by hand:
``.venv/bin/python benchmarks/ctc_loss.py``. Prints a markdown table.
"""
import argparse
import platform
from typing import Callable

import torch
import torch.nn.functional as F
from timing import interleaved_medians

from poptorch._impl import ctc_loss as ctc_loss_module
from poptorch._impl.ctc_loss import ctc_loss

BATCH, FRAMES, LABELS, WIDTH = 16, 200, 30, 50


def batch(seed: int = 0):
    """(log probabilities [T, N, C], targets [N, S], input lengths, target
    lengths)."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(FRAMES, BATCH, LABELS + 1,
                            generator=generator).log_softmax(-1)
    targets = torch.randint(1, LABELS + 1, (BATCH, WIDTH), generator=generator)
    input_lengths = torch.randint(FRAMES - 20, FRAMES + 1, (BATCH,),
                                  generator=generator)
    target_lengths = torch.randint(WIDTH - 10, WIDTH + 1, (BATCH,),
                                   generator=generator)
    return log_probs, targets, input_lengths, target_lengths


def training_pass(function: Callable, data) -> Callable[[], None]:
    log_probs, *rest = data

    def one_pass() -> None:
        leaf = log_probs.clone().requires_grad_()
        function(leaf, *rest).backward()

    return one_pass


def recursion(*args, **kwargs):
    """``ctc_loss`` on the path of devices other than the CPU."""
    on_cpu = ctc_loss_module.uses_pytorch_kernels
    ctc_loss_module.uses_pytorch_kernels = lambda log_probs: False
    try:
        return ctc_loss(*args, **kwargs)
    finally:
        ctc_loss_module.uses_pytorch_kernels = on_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    data = batch()
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {platform.processor() or 'cpu'}, "
          f"N = {BATCH}, T = {FRAMES}, C = {LABELS + 1}, S = {WIDTH}\n")
    print("| threads | PyTorch eager F.ctc_loss (ms) | PopTorch, kernels op "
          "(CPU) (ms) | ratio | PopTorch, recursion (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        eager, kernels, recursive = interleaved_medians(
            [training_pass(function, data)
             for function in (F.ctc_loss, ctc_loss, recursion)],
            args.repeats)
        print(f"| {threads} | {eager * 1e3:.1f} | {kernels * 1e3:.1f} | "
              f"{eager / kernels:.2f} | {recursive * 1e3:.1f} | "
              f"{eager / recursive:.2f} |")


if __name__ == "__main__":
    main()
