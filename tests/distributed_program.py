"""A training program run as several processes by the distributed tests.

    distributed_program.py OUTPUT_DIR [--popdist] [--replicas R]
        [--device-iterations D] [--fail kill|raise|hang --fail-step N]
        [--bucket-bytes B]

Each process trains ``Net`` with a poptorch.DataLoader over ``dataset()``
and saves the batches it saw and its final weights to
``OUTPUT_DIR/process<i>.pt``. The processes start from different weights
(seed 1 + process id), so equal results show that they share process 0's.
With ``--fail``, process 1 kills itself, raises or hangs before step N.
``--bucket-bytes`` sets the gradient all-reduce's bucket size, so that this
small model's gradients go in several buckets.
"""
import argparse
import os
import time

import torch

import poptorch

SAMPLES = 48
BATCH = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, torch.nn.functional.cross_entropy(out, y)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 4, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator))


def optimizer(net: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)


def _options(arguments) -> poptorch.Options:
    if arguments.popdist:
        import popdist
        import popdist.poptorch
        popdist.init()
        options = popdist.poptorch.Options(ipus_per_replica=1)
    else:
        options = poptorch.Options().replicationFactor(arguments.replicas)
    return options.deviceIterations(arguments.device_iterations)


def _fail(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), 9)
    if how == "raise":
        raise ValueError("process 1 gives up")
    time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--popdist", action="store_true")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--device-iterations", type=int, default=1)
    parser.add_argument("--fail", choices=["kill", "raise", "hang"])
    parser.add_argument("--fail-step", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int)
    arguments = parser.parse_args()
    if arguments.bucket_bytes:
        from poptorch._impl.distributed import gradients
        gradients.FIRST_BUCKET_BYTES = arguments.bucket_bytes
        gradients.BUCKET_BYTES = arguments.bucket_bytes
    options = _options(arguments)
    process = options.Distributed.processId
    torch.manual_seed(1 + process)
    net = Net()
    loader = poptorch.DataLoader(options, dataset(), batch_size=BATCH)
    model = poptorch.trainingModel(net, options, optimizer(net))
    batches = []
    for step, (x, y) in enumerate(loader):
        if arguments.fail and process == 1 and step == arguments.fail_step:
            _fail(arguments.fail)
        model(x, y)
        batches.append((x, y))
    torch.save({"batches": batches, "state": net.state_dict()},
               os.path.join(arguments.output, f"process{process}.pt"))


if __name__ == "__main__":
    main()
