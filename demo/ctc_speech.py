"""Train a small speech-style model with the CTC loss under poptorch.

The data is synthetic: each "utterance" is a sequence of 2 to 5 labels
(out of 8), each label heard for 2 to 4 frames of a noisy 16-feature
pattern of its own, with silent frames (noise) around and between, padded
to 32 frames. The model, a 1-D convolution over the frames, a GRU and a
linear layer, gives log probabilities over the labels and the blank, and
is trained with ``torch.nn.CTCLoss`` in ``poptorch.trainingModel`` (device
iterations and gradient accumulation): the captured model computes the
loss with PopTorch's static-shape CTC loss. The mean loss of each epoch
falls; at the end, ``poptorch.inferenceModel`` transcribes held-out
utterances (best label per frame, repeats merged, blanks dropped).
"""
import argparse
import time
from typing import List, Tuple

import torch

import poptorch

LABELS, FEATURES, FRAMES, MAX_LABELS = 8, 16, 32, 5


def utterance(patterns: torch.Tensor, generator: torch.Generator
              ) -> Tuple[torch.Tensor, List[int], int]:
    """(frames [FRAMES, FEATURES], labels, number of frames used)."""
    count = int(torch.randint(2, MAX_LABELS + 1, (), generator=generator))
    labels = (torch.randint(1, LABELS + 1, (count,), generator=generator)
              .tolist())
    rows = []
    for label in labels:
        silence = int(torch.randint(0, 3, (), generator=generator))
        spoken = int(torch.randint(2, 5, (), generator=generator))
        rows += [torch.zeros(FEATURES)] * silence
        rows += [patterns[label]] * spoken
    used = len(rows)
    rows += [torch.zeros(FEATURES)] * (FRAMES - used)
    noise = 0.3 * torch.randn(FRAMES, FEATURES, generator=generator)
    return torch.stack(rows) + noise, labels, used


def dataset(size: int, seed: int) -> torch.utils.data.TensorDataset:
    """Utterances as (frames, labels padded to MAX_LABELS, frames used,
    number of labels)."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(LABELS + 1, FEATURES,
                           generator=torch.Generator().manual_seed(1234))
    frames, targets, input_lengths, target_lengths = [], [], [], []
    for _ in range(size):
        x, labels, used = utterance(patterns, generator)
        frames.append(x)
        targets.append(labels + [0] * (MAX_LABELS - len(labels)))
        input_lengths.append(used)
        target_lengths.append(len(labels))
    return torch.utils.data.TensorDataset(
        torch.stack(frames), torch.tensor(targets),
        torch.tensor(input_lengths), torch.tensor(target_lengths))


class SpeechModel(torch.nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.conv = torch.nn.Conv1d(FEATURES, hidden, 5, padding=2)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.classifier = torch.nn.Linear(hidden, LABELS + 1)
        self.loss = torch.nn.CTCLoss(blank=0, zero_infinity=True)

    def forward(self, frames, targets=None, input_lengths=None,
                target_lengths=None):
        """Log probabilities [N, T, C] or, given targets, the CTC loss."""
        h = torch.relu(self.conv(frames.transpose(1, 2))).transpose(1, 2)
        h, _ = self.gru(h)
        log_probs = self.classifier(h).log_softmax(-1)
        if targets is None:
            return log_probs
        return self.loss(log_probs.transpose(0, 1), targets, input_lengths,
                         target_lengths)


def transcribe(best: List[int]) -> List[int]:
    """Repeated labels merged, blanks dropped."""
    labels = [c for i, c in enumerate(best) if i == 0 or c != best[i - 1]]
    return [c for c in labels if c != 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: the model's tensors are small, "
                        "more threads mostly add waiting")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_set, test_set = dataset(512, args.seed), dataset(128, args.seed + 1)
    model = SpeechModel()

    train_opts = poptorch.Options().deviceIterations(4).randomSeed(args.seed)
    train_opts.Training.gradientAccumulation(2)
    train_loader = poptorch.DataLoader(train_opts, train_set, batch_size=16,
                                       shuffle=True)
    training_model = poptorch.trainingModel(
        model, train_opts, torch.optim.Adam(model.parameters(), lr=3e-3))
    start = time.perf_counter()
    for epoch in range(args.epochs):
        losses = [float(training_model(*batch)) for batch in train_loader]
        print(f"epoch {epoch + 1}/{args.epochs}: mean CTC loss "
              f"{sum(losses) / len(losses):.3f}", flush=True)
    train_seconds = time.perf_counter() - start

    model.eval()
    inference_model = poptorch.inferenceModel(model)
    frames, targets, input_lengths, target_lengths = test_set.tensors
    best = inference_model(frames).argmax(-1)
    correct = sum(
        transcribe(best[n, :input_lengths[n]].tolist())
        == targets[n, :target_lengths[n]].tolist()
        for n in range(len(test_set)))
    print(f"trained {args.epochs} epochs on {len(train_set)} utterances in "
          f"{train_seconds:.1f} s; held-out utterances transcribed exactly: "
          f"{correct / len(test_set):.1%} ({correct}/{len(test_set)})")


if __name__ == "__main__":
    main()
