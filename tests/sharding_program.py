"""A training program run as several processes by the sharding tests.

    sharding_program.py OUTPUT_DIR [CONFIG ...]
    poprun --num-instances 2 --num-replicas 2 --ipus-per-replica 2 \
        sharding_program.py OUTPUT_DIR --staged
    sharding_program.py OUTPUT_DIR --process-0-saves

For each configuration of ``CONFIGS`` (all by default) each process trains
``Net`` twice from the same weights on the same data (its own, per
process): with the optimizer state sharded over the processes (replicated
tensor sharding on the optimizer location, and on the accumulator location
where the configuration says) and without. It saves, per configuration,
both runs' final weights, optimizer state dicts, losses and the bytes of
optimizer state the process kept, to ``OUTPUT_DIR/process<i>.pt``.

``--staged`` trains ``TwoStageNet`` (two blocks, sharded execution; each
``poprun`` instance runs a whole replica) the same way, with Adam and
clipping, and saves ``staged`` only.

``--process-0-saves``: as PopTorch programs save checkpoints, only
process 0 reads the weights (``net.state_dict()``) and
``optimizer.state_dict()`` of an AdamW model whose weights and optimizer
state are sharded, after the first call and after the last, when the
other process has finished, and then validates the trained module with an
inference model; it saves them beside every process's checkpoints of the
same run unsharded.

``resume``: a sharded run saves a checkpoint half way; a new model loads
it and trains the second half (its weights and state must equal the
uninterrupted run's bit for bit); and a sharded and an unsharded model
load the unsharded ``adam_zero2`` run's checkpoint and train on.
"""
import argparse
import copy
import dataclasses
import os
import time
from typing import Callable

import torch

import poptorch
from poptorch._impl.distributed import gradients, weight_sharding

# Buckets of 128 bytes: this small model's gradients go in several buckets,
# and its larger weights are gathered one by one, as a large model's are;
# sharded weights are gathered alone or a few together.
gradients.FIRST_BUCKET_BYTES = gradients.BUCKET_BYTES = 128
weight_sharding.GATHER_BUCKET_BYTES = 128

CALLS = 3
BATCH = 4


class Net(torch.nn.Module):
    """Odd sizes (rows are padded) and a bias small enough to stay whole
    (``MIN_ELEMENTS``)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 9)
        self.norm = torch.nn.LayerNorm(9)
        self.fc2 = torch.nn.Linear(9, 3)

    def forward(self, x, y):
        out = self.fc2(self.norm(torch.tanh(self.fc1(x))))
        return out, torch.nn.functional.cross_entropy(out, y)


MIN_ELEMENTS = 4


class TwoStageNet(torch.nn.Module):
    """Two blocks on IPUs 0 and 1: a multi-stage model."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 9)
        self.fc2 = torch.nn.Linear(9, 3)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.fc1(x))
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(h)
            return out, torch.nn.functional.cross_entropy(out, y)


def _sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9,
                           nesterov=True, weight_decay=1e-3)


def _combined_sgd(net):
    return poptorch.optim.SGD(net.parameters(), lr=0.05, momentum=0.5,
                              use_combined_accum=True, velocity_scaling=4.0,
                              loss_scaling=8.0, max_grad_norm=0.3)


def _adam(net):
    return torch.optim.Adam(net.parameters(), lr=1e-2, amsgrad=True)


def _adamw(net):
    return poptorch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1,
                                max_grad_norm=0.5, loss_scaling=16.0)


def _lamb(net):
    return poptorch.optim.LAMB(net.parameters(), lr=1e-2, weight_decay=0.01,
                               max_weight_norm=5.0, bias_correction=True)


def _rmsprop(net):
    return poptorch.optim.RMSprop(net.parameters(), lr=1e-2, momentum=0.9,
                                  centered=True)


@dataclasses.dataclass(frozen=True)
class Config:
    """One training configuration of the program."""
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    accumulation: int = 1              # G
    replicas: int = 1                  # R per process
    accumulators: bool = False         # the gradient buffer sharded too
    automatic_loss_scaling: bool = False
    nan_on_process_0: bool = False     # a NaN in process 0's second call
    reduction: poptorch.ReductionType = poptorch.ReductionType.Mean
    running_mean: bool = False         # MeanReductionStrategy.Running
    weights: bool = False              # the weights sharded too (stage 3)
    seed: int = 0                      # of the data


CONFIGS = {
    "sgd": Config(_sgd, seed=5, accumulators=True),
    "combined_sgd": Config(_combined_sgd, seed=2, accumulation=2,
                           reduction=poptorch.ReductionType.Sum),
    "adam_zero2": Config(_adam, seed=0, accumulation=3, accumulators=True),
    "adamw_clip": Config(_adamw, seed=1, accumulation=2, accumulators=True,
                         running_mean=True),
    "lamb_auto_scale": Config(_lamb, seed=3, accumulation=2,
                              accumulators=True,
                              automatic_loss_scaling=True,
                              nan_on_process_0=True),
    "rmsprop_replicas": Config(_rmsprop, seed=4, accumulation=2, replicas=2,
                               accumulators=True),
    "adam_zero3": Config(_adam, seed=6, accumulation=3, accumulators=True,
                         weights=True),
    "adamw_zero3_clip": Config(_adamw, seed=7, accumulation=2,
                               running_mean=True, weights=True),
    "lamb_zero3_auto_scale": Config(_lamb, seed=8, accumulation=2,
                                    automatic_loss_scaling=True,
                                    nan_on_process_0=True, weights=True),
    "sgd_zero3_replicas": Config(_sgd, seed=9, replicas=2, weights=True,
                                 reduction=poptorch.ReductionType.Sum),
}


def anchors(config: str):
    """Anchored tensors (models without replicas): a sharded weight's
    gradient, first optimizer state, value before and after the update,
    and a whole (small) bias's gradient."""
    if CONFIGS[config].replicas > 1:
        return {}
    state = "Accl___" if "sgd" in config else "Accl1___"
    return {"grad": "Gradient___fc1.weight",
            "bias_grad": "Gradient___fc2.bias",
            "state": state + "fc1.weight",
            "weight": "fc1.weight",
            "updated": "UpdatedVar___fc1.weight"}


def options(config, sharded: bool) -> poptorch.Options:
    settings = CONFIGS[config]
    opts = poptorch.Options().deviceIterations(2).replicationFactor(
        settings.replicas)
    for short, long_name in anchors(config).items():
        opts.anchorTensor(short, long_name)
    opts.Training.gradientAccumulation(settings.accumulation)
    opts.Training.accumulationAndReplicationReductionType(settings.reduction)
    if settings.running_mean:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running)
    if settings.automatic_loss_scaling:
        opts.Training.setAutomaticLossScaling(True)
    if sharded:
        rts = poptorch.TensorLocationSettings().useReplicatedTensorSharding(
            True).minElementsForReplicatedTensorSharding(MIN_ELEMENTS)
        opts.TensorLocations.setOptimizerLocation(rts)
        if settings.weights:
            opts.TensorLocations.setWeightLocation(rts)
        if settings.accumulators:
            opts.TensorLocations.setAccumulatorLocation(
                poptorch.TensorLocationSettings()
                .useReplicatedTensorSharding(True))
    return opts


def data(config: str, process: int, opts: poptorch.Options):
    """CALLS batches of this process's data for ``config``."""
    generator = torch.Generator().manual_seed(
        100 * process + CONFIGS[config].seed)
    rows = BATCH * opts.device_iterations * \
        opts.Training.gradient_accumulation * opts.replication_factor
    batches = []
    for call in range(CALLS):
        x = torch.randn(rows, 5, generator=generator)
        if CONFIGS[config].nan_on_process_0 and call == 1 and process == 0:
            x[0, 0] = float("nan")
        batches.append((x, torch.randint(0, 3, (rows,),
                                         generator=generator)))
    return batches


def state_bytes(model) -> int:
    """Bytes of optimizer state this process keeps for ``model``."""
    return sum(t.numel() * t.element_size()
               for t in model._compiled.state.optimizer)


def weight_bytes(model) -> int:
    """Bytes of weights this process keeps for ``model`` between calls."""
    return sum(t.numel() * t.element_size()
               for t in model._compiled.state.params)


def train(config: str, sharded: bool, start: Net, batches, process: int):
    net = copy.deepcopy(start)
    optimizer = CONFIGS[config].optimizer(net)
    model = poptorch.trainingModel(net, options(config, sharded), optimizer)
    losses = [model(x, y)[1].as_subclass(torch.Tensor) for x, y in batches]
    anchored = {short: model.getAnchoredTensor(short)
                for short in anchors(config)}
    result = {"weights": net.state_dict(), "losses": losses,
              "anchored": anchored,
              "state_dict": optimizer.state_dict(),
              "state_bytes": state_bytes(model),
              "weight_bytes": weight_bytes(model)}
    model.destroy()
    return result


def _resumed(checkpoint, sharded: bool):
    """A new Net and Adam loading ``checkpoint`` (weights and optimizer
    state dict), in a training model of ``adam_zero2``'s options."""
    net = Net()
    net.load_state_dict(checkpoint["weights"])
    optimizer = _adam(net)
    optimizer.load_state_dict(checkpoint["state_dict"])
    model = poptorch.trainingModel(net, options("adam_zero2", sharded),
                                   optimizer)
    return net, optimizer, model


def resume(process: int, unsharded_checkpoint):
    """The ``resume`` configuration (see the module's docstring)."""
    config = "adam_zero2"
    torch.manual_seed(7)
    start = Net()
    batches = data(config, process, options(config, True))
    net = copy.deepcopy(start)
    optimizer = _adam(net)
    model = poptorch.trainingModel(net, options(config, True), optimizer)
    model(*batches[0])
    saved = {"weights": copy.deepcopy(net.state_dict()),
             "state_dict": copy.deepcopy(optimizer.state_dict())}
    for x, y in batches[1:]:
        model(x, y)
    resumed, resumed_optimizer, again = _resumed(saved, True)
    for x, y in batches[1:]:
        again(x, y)
    result = {"uninterrupted": net.state_dict(),
              "uninterrupted_state": optimizer.state_dict(),
              "resumed": resumed.state_dict(),
              "resumed_state": resumed_optimizer.state_dict()}
    for sharded in (True, False):
        loaded, loaded_optimizer, model = _resumed(unsharded_checkpoint,
                                                   sharded)
        for x, y in batches:
            model(x, y)
        result[f"loaded_{'sharded' if sharded else 'unsharded'}"] = {
            "weights": loaded.state_dict(),
            "state_dict": loaded_optimizer.state_dict()}
    return result


def staged() -> dict:
    """The ``--staged`` run (see the module's docstring), under poprun."""
    import popdist
    import popdist.poptorch
    popdist.init()
    process = popdist.getInstanceIndex()
    torch.manual_seed(1 + process)
    start = TwoStageNet()
    generator = torch.Generator().manual_seed(process)
    batches = [(torch.randn(8, 5, generator=generator),
                torch.randint(0, 3, (8,), generator=generator))
               for _ in range(CALLS)]
    results = {}
    for sharded in (True, False):
        opts = popdist.poptorch.Options(ipus_per_replica=2)
        opts.setExecutionStrategy(poptorch.ShardedExecution())
        opts.Training.gradientAccumulation(2)
        if sharded:
            opts.TensorLocations.setOptimizerLocation(
                poptorch.TensorLocationSettings()
                .useReplicatedTensorSharding(True))
        net = copy.deepcopy(start)
        optimizer = poptorch.optim.Adam(net.parameters(), lr=0.01,
                                        max_grad_norm=0.5)
        model = poptorch.trainingModel(net, opts, optimizer)
        for x, y in batches:
            model(x, y)
        results["sharded" if sharded else "unsharded"] = {
            "weights": net.state_dict(), "state_dict": optimizer.state_dict(),
            "state_bytes": state_bytes(model)}
        model.destroy()
    return {"staged": results}


def process_0_saves() -> dict:
    """The ``--process-0-saves`` run (see the module's docstring)."""
    process = int(os.environ["RANK"])
    config = "adamw_zero3_clip"
    torch.manual_seed(1 + process)
    start = Net()
    batches = data(config, process, options(config, True))
    saved = {}
    for sharded in (False, True):
        net = copy.deepcopy(start)
        optimizer = _adamw(net)
        model = poptorch.trainingModel(net, options(config, sharded),
                                       optimizer)
        for call, (x, y) in enumerate(batches):
            model(x, y)
            if call == 0 and (process == 0 or not sharded):
                saved[sharded, "first"] = _checkpoint(net, optimizer)
        if process == 0 and sharded:
            time.sleep(2)   # the other process has left its training loop
        if process == 0 or not sharded:
            saved[sharded, "last"] = _checkpoint(net, optimizer)
            validation = poptorch.inferenceModel(net.eval())
            saved[sharded, "validation"] = validation(*batches[0])[0]
    return saved if process == 0 else {}


def _checkpoint(net, optimizer) -> dict:
    return {"weights": copy.deepcopy(net.state_dict()),
            "state_dict": optimizer.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("configs", nargs="*")
    parser.add_argument("--staged", action="store_true")
    parser.add_argument("--process-0-saves", action="store_true")
    arguments = parser.parse_args()
    process = int(os.environ["RANK"])
    if arguments.staged or arguments.process_0_saves:
        results = staged() if arguments.staged else process_0_saves()
        if results:
            torch.save(results, os.path.join(arguments.output,
                                             f"process{process}.pt"))
        return
    results = {}
    for config in arguments.configs or sorted(CONFIGS):
        torch.manual_seed(1 + process)   # process 0's weights are used
        start = Net()
        batches = data(config, process, options(config, True))
        results[config] = {
            "sharded": train(config, True, start, batches, process),
            "unsharded": train(config, False, start, batches, process)}
    if not arguments.configs:
        results["resume"] = resume(process,
                                   results["adam_zero2"]["unsharded"])
    torch.save(results, os.path.join(arguments.output,
                                     f"process{process}.pt"))


if __name__ == "__main__":
    main()
