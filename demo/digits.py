"""Train a small CNN on scikit-learn's handwritten digits with poptorch.

The data ships inside scikit-learn (no download). Training uses
``poptorch.trainingModel`` with device iterations and gradient accumulation,
fed by a ``poptorch.DataLoader``; evaluation uses ``poptorch.inferenceModel``
on the same module, which picks up the trained weights by itself.
"""
import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import poptorch


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Linear(32 * 4 * 4, 10)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, images, labels=None):
        logits = self.classifier(self.features(images).flatten(1))
        if labels is None:
            return logits
        return logits, self.loss(logits, labels)


def datasets(seed: int):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    images = images / 16.0
    labels = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=360, random_state=seed, stratify=labels)
    return (torch.utils.data.TensorDataset(train_x, train_y),
            torch.utils.data.TensorDataset(test_x, test_y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.seed)
    model = DigitsCNN()

    train_opts = poptorch.Options().deviceIterations(4).randomSeed(args.seed)
    train_opts.Training.gradientAccumulation(2)
    train_loader = poptorch.DataLoader(train_opts, train_set, batch_size=16,
                                       shuffle=True)
    training_model = poptorch.trainingModel(
        model, train_opts, torch.optim.Adam(model.parameters(), lr=3e-3))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}",
                   leave=False)
        for images, labels in bar:
            _, loss = training_model(images, labels)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_seconds = time.perf_counter() - start

    model.eval()
    test_opts = poptorch.Options().deviceIterations(4)
    test_loader = poptorch.DataLoader(test_opts, test_set, batch_size=10)
    inference_model = poptorch.inferenceModel(model, test_opts)
    correct = 0
    for images, labels in tqdm(test_loader, desc="evaluating", leave=False):
        correct += (inference_model(images).argmax(1) == labels).sum().item()
    accuracy = correct / len(test_set)
    print(f"trained {args.epochs} epochs on {len(train_set)} digits in "
          f"{train_seconds:.1f} s; held-out accuracy {accuracy:.1%} "
          f"({correct}/{len(test_set)})")


if __name__ == "__main__":
    main()
