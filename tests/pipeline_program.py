"""A model of two pipeline stages trained by several processes (one stage
per process, or under poprun with whole replicas per instance, all the
stages in each process) for the multi-process pipeline tests.

    pipeline_program.py OUTPUT_DIR [--stages K] [--calls N]
        [--different-inputs] [--dataloader] [--tied] [--clip NORM]
        [--loss-scale SCALE] [--running-mean] [--momentum M]
        [--shared-norm] [--fail kill|raise]

Every process trains ``Chain`` (K blocks, one per IPU) with
``PipelinedExecution`` for N calls of D = 2 iterations of G = 2K - 1
micro-batches, and saves its returned outputs and losses, its final weights
and its optimizer state to ``OUTPUT_DIR/process<i>.pt``. The processes of
pipeline p (process id // K) get the data ``data(K, N, p)``; with
``--different-inputs``, process 1 gets pipeline 1's instead; with
``--dataloader``, a poptorch.DataLoader over every pipeline's data hands
each replica its part (under poprun). The processes start from different
weights (seed 1 + process id), so equal results show that they share
process 0's. The first block's linear layer is anchored (``ANCHOR``), and
its values in the last call are saved too. ``--tied`` makes the last block
also apply the first block's weight (a weight two stages read), ``--clip``
clips the gradient norm (``max_grad_norm``), ``--loss-scale`` turns
automatic loss scaling on, starting from SCALE, and gives the last block a
weight whose gradient is ``LOUDNESS`` times its output's (so that one
stage's gradients overflow first), ``--running-mean`` selects
``MeanReductionStrategy.Running``, ``--momentum`` sets SGD's momentum (0.9
by default; 0 keeps no optimizer state), ``--shared-norm`` makes the last
block also apply the first block's BatchNorm (buffers two stages update).
With ``--fail``, process 1 kills
itself or raises before its second call.
"""
import argparse
import os

import torch

import poptorch

BATCH = 2
ITERATIONS = 2
LOUDNESS = 1000.0
ANCHOR = "layers/0/0/addmm"


class Chain(torch.nn.Module):
    """K blocks of Linear + BatchNorm + tanh; the last block also computes
    the loss, after applying the first block's weight when ``tied`` and
    its BatchNorm when ``shared_norm``, and
    adds ``LOUDNESS * (loud - loud.detach())`` (zero, with a large
    gradient) when ``loud``."""

    def __init__(self, stages: int, annotate: bool = True,
                 tied: bool = False, loud: bool = False,
                 shared_norm: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(4, 4),
                                 torch.nn.BatchNorm1d(4))
             for _ in range(stages)])
        self.annotate = annotate
        self.tied = tied
        self.shared_norm = shared_norm
        self.loud = torch.nn.Parameter(torch.zeros(4)) if loud else None

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            if self.annotate:
                with poptorch.Block(f"block{index}", ipu_id=index):
                    x = self._block(index, layer, x)
            else:
                x = self._block(index, layer, x)
        return x, torch.nn.functional.cross_entropy(x, y)

    def _block(self, index: int, layer: torch.nn.Module,
               x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(layer(x))
        if index < len(self.layers) - 1:
            return x
        if self.tied:
            x = torch.nn.functional.linear(x, self.layers[0][0].weight)
        if self.shared_norm:
            x = self.layers[0][1](x)
        if self.loud is not None:
            x = x + LOUDNESS * (self.loud - self.loud.detach())
        return x


def accumulation(stages: int) -> int:
    return 2 * stages - 1


def data(stages: int, calls: int, pipeline: int = 0):
    """The inputs and labels of each call of pipeline ``pipeline``."""
    generator = torch.Generator().manual_seed(pipeline)
    rows = ITERATIONS * accumulation(stages) * BATCH
    return [(torch.randn(rows, 4, generator=generator),
             torch.randint(0, 4, (rows,), generator=generator))
            for _ in range(calls)]


def every_pipelines_data(stages: int, calls: int, pipelines: int
                         ) -> torch.utils.data.TensorDataset:
    """The data of every pipeline, one after the other: the part of the
    dataset that poptorch.DataLoader gives pipeline p is ``data(..., p)``."""
    parts = [data(stages, calls, p) for p in range(pipelines)]
    return torch.utils.data.TensorDataset(
        torch.cat([x for part in parts for x, _ in part]),
        torch.cat([y for part in parts for _, y in part]))


def optimizer(net: torch.nn.Module, poptorch_optimizer: bool = True,
              momentum: float = 0.9, **extra) -> torch.optim.Optimizer:
    """SGD with ``momentum`` (poptorch's reads the device state, and takes
    ``extra`` attributes)."""
    if not poptorch_optimizer:
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
    return poptorch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum,
                              **extra)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A returned training output as a plain tensor (to save it)."""
    return tensor.as_subclass(torch.Tensor)


def fail(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), 9)
    raise ValueError("process 1 gives up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--different-inputs", action="store_true")
    parser.add_argument("--dataloader", action="store_true")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--clip", type=float)
    parser.add_argument("--loss-scale", type=float)
    parser.add_argument("--running-mean", action="store_true")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--shared-norm", action="store_true")
    parser.add_argument("--fail", choices=["kill", "raise"])
    arguments = parser.parse_args()
    process = int(os.environ["RANK"])
    replicas = int(os.environ.get(
        "POPDIST_NUM_TOTAL_REPLICAS",
        int(os.environ["WORLD_SIZE"]) // arguments.stages))
    pipeline = process // arguments.stages
    if arguments.different_inputs and process == 1:
        pipeline = 1
    torch.manual_seed(1 + process)
    net = Chain(arguments.stages, tied=arguments.tied,
                loud=arguments.loss_scale is not None,
                shared_norm=arguments.shared_norm)
    options = poptorch.Options().deviceIterations(ITERATIONS)
    options.autoRoundNumIPUs(True)
    if replicas > 1:
        options.broadcastBuffers(False)   # each replica its own statistics
    options.Training.gradientAccumulation(accumulation(arguments.stages))
    options.outputMode(poptorch.OutputMode.All)
    options.anchorTensor("first", ANCHOR)
    extra = {}
    if arguments.clip is not None:
        extra["max_grad_norm"] = arguments.clip
    if arguments.running_mean:
        options.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running)
    if arguments.loss_scale is not None:
        options.Training.setAutomaticLossScaling(True)
        extra["loss_scaling"] = arguments.loss_scale
    sgd = optimizer(net, momentum=arguments.momentum, **extra)
    model = poptorch.trainingModel(net, options, sgd)
    if arguments.dataloader:
        calls = poptorch.DataLoader(options, every_pipelines_data(
            arguments.stages, arguments.calls, replicas), batch_size=BATCH)
    else:
        calls = data(arguments.stages, arguments.calls, pipeline)
    results = []
    for call, (x, y) in enumerate(calls):
        if call == 1 and process == 1 and arguments.fail:
            fail(arguments.fail)
        results.append(model(x, y))
    model.copyWeightsToHost()
    torch.save({"outputs": [plain(r[0]) for r in results],
                "losses": [plain(r[1]) for r in results],
                "anchored": model.getAnchoredTensor("first"),
                "weights": net.state_dict(),
                "momentum": [state["momentum_buffer"] for _, state in
                             sorted(sgd.state_dict()["state"].items())]},
               os.path.join(arguments.output, f"process{process}.pt"))


if __name__ == "__main__":
    main()
