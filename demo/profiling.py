"""Profile a pipelined training run as a PopTorch user would.

    .venv/bin/python demo/profiling.py [PROFILE_DIR]

A small convolutional classifier is cut into two pipeline stages
(``poptorch.Block``, ``PipelinedExecution``) and trained for a few calls of
2 device iterations x 4 micro-batches with ``opts.enableProfiling``. The
program is an ordinary PopTorch program; the profile directory (default
``profile/``) then holds ``training.trace.json`` (open it in
https://ui.perfetto.dev or ``chrome://tracing``), the report
``training.report.json``, its one-page ``training.summary.md`` and the
picture ``training.timeline.svg``. The summary of the directory is printed
at the end, as ``python -m poptorch.profiling PROFILE_DIR`` prints it.
"""
import subprocess
import sys

import torch

import poptorch


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2))
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64),
            torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, images, labels):
        with poptorch.Block("features", ipu_id=0):
            features = self.features(images)
        with poptorch.Block("head", ipu_id=1):
            logits = self.head(features)
            return logits, torch.nn.functional.cross_entropy(logits, labels)


def main(directory: str) -> None:
    options = poptorch.Options().deviceIterations(2)
    options.Training.gradientAccumulation(4)
    options.setExecutionStrategy(
        poptorch.PipelinedExecution("features", "head"))
    options.enableProfiling(directory)
    torch.manual_seed(0)
    images = torch.randn(512, 1, 16, 16)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    dataset = torch.utils.data.TensorDataset(images, labels)
    loader = poptorch.DataLoader(options, dataset, batch_size=8,
                                 shuffle=True)
    net = Classifier()
    model = poptorch.trainingModel(
        net, options, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.05,
                                                   momentum=0.9))
    channel = poptorch.profiling.Channel("demo")
    for epoch in range(2):
        with channel.tracepoint(f"epoch {epoch}"):
            for batch_images, batch_labels in loader:
                _, loss = model(batch_images, batch_labels)
        print(f"epoch {epoch}: loss {float(loss.mean()):.3f}")
    model.destroy()
    subprocess.run([sys.executable, "-m", "poptorch.profiling", directory],
                   check=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "profile")
