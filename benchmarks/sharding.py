"""Replicated tensor sharding of the optimizer state and weights: memory
and speed.

A BERT-style encoder (5.3 M parameters: token embedding, 4 transformer
layers of width 256, a classifier) trained with Adam by ``poprun
--num-instances n --num-replicas n`` (one replica and one thread per
instance, gloo), for n = 2 and 4, in four ways in the same run:

* poptorch, optimizer state whole on every process (the gradients
  all-reduced);
* poptorch with ``opts.TensorLocations.setOptimizerLocation(
  TensorLocationSettings().useReplicatedTensorSharding(True))`` (ZeRO
  stage 1), and with the same on the accumulator location too (stage 2:
  the buffer of gradient accumulation, G = 2, sharded), and with the same
  on the weight location as well (stage 3: the weights kept as rows
  between calls, each gathered in the step just before its use);
* plain PyTorch: ``DistributedDataParallel`` with ``torch.optim.Adam``;
* plain PyTorch: ``DistributedDataParallel`` with
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (PyTorch's own
  optimizer-state sharding).

Each instance builds every configuration's model (one warm-up step
each), then times ``--steps`` optimizer steps of each in turn,
``--repeats`` times, the processes starting each timing together. Per
configuration it reports the optimizer state and the weights each process
keeps between steps (mean over the processes) and the samples per second
of the whole run (the median over the repeats of the slowest process's
time). The sharded state (and sharded weights) should be 1/n of the whole,
plus the few small tensors left whole.

Run by hand: ``.venv/bin/python benchmarks/sharding.py [--instances 2 4]
[--steps 8] [--repeats 5]``. Prints a markdown table. The machine should
be otherwise idle.
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
import time

import torch

MODES = ("poptorch", "poptorch, optimizer state sharded",
         "poptorch, optimizer state and accumulator sharded",
         "poptorch, weights, optimizer state and accumulator sharded",
         "torch DDP", "torch DDP + ZeroRedundancyOptimizer")
VOCABULARY, WIDTH, LAYERS, SEQUENCE, BATCH = 8192, 256, 4, 64, 8
ACCUMULATION = 2


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCABULARY, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(
            layer, LAYERS, enable_nested_tensor=False)
        self.classifier = torch.nn.Linear(WIDTH, 2)

    def forward(self, tokens, labels):
        hidden = self.encoder(self.embedding(tokens))
        out = self.classifier(hidden.mean(1))
        return out, torch.nn.functional.cross_entropy(out, labels)


def _batches(rows: int, count: int, rank: int):
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randint(0, VOCABULARY, (rows, SEQUENCE),
                           generator=generator),
             torch.randint(0, 2, (rows,), generator=generator))
            for _ in range(count)]


def _state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor))


def _poptorch_step(mode: str, rank: int):
    """A poptorch training model of ``mode`` and a call of it."""
    import popdist.poptorch
    import poptorch
    opts = popdist.poptorch.Options()
    opts.Training.gradientAccumulation(ACCUMULATION)
    rts = poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
    if "sharded" in mode:
        opts.TensorLocations.setOptimizerLocation(rts)
    if "accumulator" in mode:
        opts.TensorLocations.setAccumulatorLocation(copy.deepcopy(rts))
    if "weights" in mode:
        opts.TensorLocations.setWeightLocation(copy.deepcopy(rts))
    torch.manual_seed(0)
    net = Encoder()
    model = poptorch.trainingModel(
        net, opts, torch.optim.Adam(net.parameters(), lr=1e-4))
    tokens, labels = _batches(BATCH * ACCUMULATION, 1, rank)[0]
    model(tokens, labels)
    state = model._compiled.state
    return ((_state_bytes(state.optimizer), _state_bytes(state.params)),
            lambda: model(tokens, labels))


def _torch_step(zero: bool, rank: int):
    """A DistributedDataParallel model (with ZeroRedundancyOptimizer when
    ``zero``) and an optimizer step of it over G micro-batches."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(Encoder())
    if zero:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    micro = _batches(BATCH, ACCUMULATION, rank)

    def step():
        for index, (tokens, labels) in enumerate(micro):
            if index < len(micro) - 1:
                with model.no_sync():
                    (model(tokens, labels)[1] / len(micro)).backward()
            else:
                (model(tokens, labels)[1] / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    local = optimizer.optim if zero else optimizer
    state = _state_bytes([value for entry in local.state.values()
                          for value in entry.values()])
    return (state, _state_bytes(list(model.parameters()))), step


def worker(steps: int, repeats: int, output: str) -> None:
    """One instance of ``poprun``: build every mode's model, then time
    ``steps`` optimizer steps of each, the modes interleaved, ``repeats``
    times; write the figures."""
    import popdist
    import torch.distributed as dist
    torch.set_num_threads(1)
    popdist.init()
    rank = popdist.getInstanceIndex()
    built = {mode: (_poptorch_step(mode, rank) if mode.startswith("poptorch")
                    else _torch_step("Zero" in mode, rank))
             for mode in MODES}
    seconds = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, (_, step) in built.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            seconds[mode].append(time.perf_counter() - start)
    with open(os.path.join(output, f"{rank}.json"), "w") as file:
        json.dump({mode: {"state": built[mode][0][0],
                          "weights": built[mode][0][1],
                          "seconds": seconds[mode]}
                   for mode in MODES}, file)


def _launch(instances: int, steps: int, repeats: int) -> dict:
    """Every mode's figures with ``instances`` instances."""
    with tempfile.TemporaryDirectory() as output:
        run = subprocess.run(
            [sys.executable, "-m", "poptorch.run", "--num-instances",
             str(instances), "--num-replicas", str(instances), __file__,
             "--worker", "--steps", str(steps), "--repeats", str(repeats),
             "--output", output],
            capture_output=True, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1",
                     POPTORCH_BACKEND="graph"))
        if run.returncode != 0:
            sys.exit(f"{instances} instances failed:\n{run.stderr}")
        runs = [json.load(open(os.path.join(output, f"{rank}.json")))
                for rank in range(instances)]
    samples = instances * BATCH * ACCUMULATION * steps
    figures = {}
    for mode in MODES:
        slowest = [max(r[mode]["seconds"][k] for r in runs)
                   for k in range(repeats)]
        figures[mode] = {
            "state": sum(r[mode]["state"] for r in runs) / instances,
            "weights": sum(r[mode]["weights"] for r in runs) / instances,
            "throughput": samples / statistics.median(slowest)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--output")
    arguments = parser.parse_args()
    if arguments.worker:
        worker(arguments.steps, arguments.repeats, arguments.output)
        return
    parameters = sum(p.numel() for p in Encoder().parameters())
    print(f"Encoder: {parameters / 1e6:.2f} M parameters, Adam "
          f"({8 * parameters / 2**20:.1f} MiB of state whole), "
          f"G = {ACCUMULATION}, micro-batch {BATCH} x {SEQUENCE} tokens; "
          f"torch {torch.__version__}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores\n")
    print("| instances | run | optimizer state per process (MiB) | "
          "weights per process (MiB) | samples/s | vs poptorch whole | "
          "vs torch DDP |")
    print("|---|---|---|---|---|---|---|")
    for instances in arguments.instances:
        figures = _launch(instances, arguments.steps, arguments.repeats)
        base = figures["poptorch"]["throughput"]
        ddp = figures["torch DDP"]["throughput"]
        for mode, result in figures.items():
            print(f"| {instances} | {mode} | {result['state'] / 2**20:.1f} "
                  f"| {result['weights'] / 2**20:.1f} "
                  f"| {result['throughput']:.1f} | "
                  f"{result['throughput'] / base:.2f} | "
                  f"{result['throughput'] / ddp:.2f} |")


if __name__ == "__main__":
    main()
