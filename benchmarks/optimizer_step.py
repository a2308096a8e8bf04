"""Optimizer-step cost on a ~10M-parameter model: PopTorch's captured update
against ``torch.optim`` with ``foreach=True``, in the same process, and the
memory of float16 against float32 optimizer state.

Two measurements:

* update only: the update rules of the optimizer plan, traced with
  ``make_fx`` exactly as the training step traces them and run as an FX
  graph (the "graph" backend), against ``optimizer.step()`` on the same
  gradients;
* training step: ``poptorch.trainingModel`` (D steps per call) against the
  eager loop (forward, backward, ``step()``, ``zero_grad()``) with a trivial
  forward pass (one row through the layers), so that the update dominates.

Ratios are torch / poptorch times (> 1: poptorch is faster). Run by hand:
``.venv/bin/python benchmarks/optimizer_step.py``.
"""
import argparse
import copy
import platform

import torch
from timing import interleaved_medians
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from poptorch._impl.optimizers.plan import plan_optimizer
from poptorch._impl.training_step import TrainingLayout, apply_rules

OPTIMIZERS = {
    "SGD momentum": (
        lambda p: poptorch.optim.SGD(p, lr=0.01, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True)),
    "Adam": (lambda p: poptorch.optim.Adam(p, lr=1e-3),
             lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True)),
    "AdamW": (lambda p: poptorch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
              lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01,
                                          foreach=True)),
    "RMSprop": (lambda p: poptorch.optim.RMSprop(p, lr=1e-3),
                lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True)),
}


class Layers(torch.nn.Module):
    """``depth`` square Linear layers (``width**2 + width`` parameters each)
    and a sum loss."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        out = self.layers(x)
        return out, poptorch.identity_loss(out.square().mean(), "none")



def captured_update(optimizer, params, grads):
    """The plan's update rules over ``params`` traced into one FX graph as the
    training step traces them (constant attributes as numbers, variable ones
    as 0-d float64 inputs), and a pass running it ``steps`` times feeding its
    outputs back."""
    plan = plan_optimizer(optimizer, params)
    layout = TrainingLayout.build(plan, range(len(params)), len(params))
    values = [p.detach().clone() for p in params]
    state = layout.initial_state(values, [{} for _ in values])
    hyper = layout.hyper_values(plan, values[0].device)

    def update(values, grads, state, hyper):
        return apply_rules(layout, values, grads, state, hyper)

    graph = make_fx(update, tracing_mode="fake")(values, grads, state, hyper)
    carried = {"values": values, "state": state}

    def one_pass(steps):
        for _ in range(steps):
            carried["values"], carried["state"] = graph(
                carried["values"], grads, carried["state"], hyper)

    return one_pass


def eager_update(optimizer, params, grads):
    for param, grad in zip(params, grads):
        param.grad = grad.clone()

    def one_pass(steps):
        for _ in range(steps):
            optimizer.step()

    return one_pass


def update_only_rows(width, depth, steps, repeats):
    torch.manual_seed(0)
    module = Layers(width, depth)
    params = list(module.parameters())
    grads = [torch.randn_like(p) for p in params]
    for name, (ours, theirs) in OPTIMIZERS.items():
        eager_params = [p.detach().clone().requires_grad_() for p in params]
        ours_pass = captured_update(ours(params), params, grads)
        eager_pass = eager_update(theirs(eager_params), eager_params, grads)
        eager, captured = interleaved_medians(
            [lambda: eager_pass(steps), lambda: ours_pass(steps)], repeats)
        yield (name, eager / steps * 1e3, captured / steps * 1e3,
               eager / captured)


def training_model(module, optimizer, iterations, backend):
    opts = poptorch.Options().deviceIterations(iterations)
    opts.showCompilationProgressBar(False)
    if backend is not None:
        opts.setBackend(backend)
    return poptorch.trainingModel(module, opts, optimizer)


def training_step_rows(width, depth, iterations, repeats, backend):
    for name, (ours, theirs) in OPTIMIZERS.items():
        torch.manual_seed(0)
        module = Layers(width, depth)
        twin = copy.deepcopy(module)
        model = training_model(module, ours(module.parameters()),
                               iterations, backend)
        reference = theirs(twin.parameters())
        x = torch.randn(iterations, width)

        def eager_pass():
            for row in x.split(1):
                reference.zero_grad()
                twin(row)[1].backward()
                reference.step()

        eager, captured = interleaved_medians(
            [eager_pass, lambda: model(x)], repeats)
        yield (name, eager / iterations * 1e3, captured / iterations * 1e3,
               eager / captured)


def state_bytes(width, depth, make):
    torch.manual_seed(0)
    module = Layers(width, depth)
    opts = poptorch.Options().showCompilationProgressBar(False)
    model = poptorch.trainingModel(module, opts, make(module.parameters()))
    model(torch.randn(1, width))
    return sum(t.numel() * t.element_size() for t in model._state.optimizer)


MEMORY = {
    "Adam, fp32 moments": lambda p: poptorch.optim.Adam(p),
    "Adam, fp16 moments": lambda p: poptorch.optim.Adam(
        p, first_order_momentum_accum_type=torch.float16,
        second_order_momentum_accum_type=torch.float16),
    "SGD momentum, fp32 velocity": lambda p: poptorch.optim.SGD(
        p, lr=0.01, momentum=0.9),
    "SGD momentum, fp16 velocity": lambda p: poptorch.optim.SGD(
        p, lr=0.01, momentum=0.9, velocity_accum_type=torch.float16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default=None,
                        help="the training model's backend (opts.setBackend)"
                        ", e.g. inductor; default: the default backend")
    args = parser.parse_args()
    count = args.depth * (args.width ** 2 + args.width)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; {args.depth} "
          f"Linear({args.width}, {args.width}) = {count / 1e6:.1f}M "
          f"parameters, fp32, median of {args.repeats}")
    print("\nUpdate only (same gradients every step):\n")
    print("| optimizer | torch.optim foreach ms/step | captured update "
          "ms/step | ratio |")
    print("|---|---|---|---|")
    for name, eager, captured, ratio in update_only_rows(
            args.width, args.depth, args.steps, args.repeats):
        print(f"| {name} | {eager:.1f} | {captured:.1f} | {ratio:.2f} |")
    print(f"\nTraining step with a one-row forward pass (backend: "
          f"{args.backend or 'default'}):\n")
    print("| optimizer | eager loop ms/step | trainingModel ms/step | "
          "ratio |")
    print("|---|---|---|---|")
    for name, eager, captured, ratio in training_step_rows(
            args.width, args.depth, args.steps, args.repeats, args.backend):
        print(f"| {name} | {eager:.1f} | {captured:.1f} | {ratio:.2f} |")
    print("\nOptimizer state on the device:\n")
    print("| optimizer | state MiB | bytes per parameter |")
    print("|---|---|---|")
    for name, make in MEMORY.items():
        size = state_bytes(args.width, args.depth, make)
        print(f"| {name} | {size / 2 ** 20:.1f} | {size / count:.2f} |")


if __name__ == "__main__":
    main()
