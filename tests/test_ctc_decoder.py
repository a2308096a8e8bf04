"""``poptorch.ctc_beam_search_decoder``: a CTC prefix beam search compared
with a plain-Python prefix beam search (dictionaries of prefixes) on the
same log probabilities, eagerly and inside a compiled inference model."""
import math
from collections import defaultdict

import pytest
import torch

import poptorch
from conftest import options

NEG_INF = -math.inf


def _logaddexp(a, b):
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    top = max(a, b)
    return top + math.log(math.exp(a - top) + math.exp(b - top))


def _total(probabilities):
    return _logaddexp(*probabilities)


def _reference(log_probs, length, blank, beam_width, top_paths):
    """[(log probability, labels)] of the ``top_paths`` best prefixes of
    ``log_probs`` ([T][C] lists) after ``length`` steps."""
    beams = {(): (0.0, NEG_INF)}
    for step in log_probs[:length]:
        grown = defaultdict(lambda: [NEG_INF, NEG_INF])
        for prefix, (ends_blank, ends_label) in beams.items():
            total = _logaddexp(ends_blank, ends_label)
            grown[prefix][0] = _logaddexp(grown[prefix][0],
                                          total + step[blank])
            if prefix:
                grown[prefix][1] = _logaddexp(grown[prefix][1],
                                              ends_label + step[prefix[-1]])
            for label, logp in enumerate(step):
                if label == blank:
                    continue
                source = ends_blank if prefix and prefix[-1] == label \
                    else total
                child = prefix + (label,)
                grown[child][1] = _logaddexp(grown[child][1], source + logp)
        ranked = sorted(grown.items(), key=lambda item: -_total(item[1]))
        beams = dict(ranked[:beam_width])
    ranked = sorted(beams.items(), key=lambda item: -_total(item[1]))
    return [(_total(value), prefix) for prefix, value in ranked[:top_paths]]


def _log_probs(steps=12, batch=3, classes=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, classes,
                       generator=generator).log_softmax(-1)


def _check_against_reference(decoded, probs, lengths, blank, beam_width,
                             top_paths):
    path_logp, path_lengths, paths = decoded
    batch, steps = probs.shape[1], probs.shape[0]
    assert path_logp.shape == (batch, top_paths)
    assert path_lengths.shape == (batch, top_paths)
    assert paths.shape == (batch, top_paths, steps)
    for item in range(batch):
        expected = _reference(probs[:, item].tolist(), int(lengths[item]),
                              blank, beam_width, top_paths)
        for rank, (logp, labels) in enumerate(expected):
            length = int(path_lengths[item, rank])
            assert tuple(paths[item, rank, :length].tolist()) == labels
            assert (paths[item, rank, length:] == blank).all()
            assert math.isclose(float(path_logp[item, rank]), logp,
                                abs_tol=1e-4)


@pytest.mark.parametrize("beam_width, top_paths", [(1, 1), (4, 2), (10, 3),
                                                   (50, 5)])
@pytest.mark.parametrize("blank", [0, 3])
def test_decoder_finds_the_reference_paths(beam_width, top_paths, blank):
    probs = _log_probs()
    lengths = torch.tensor([12, 7, 1])
    decoded = poptorch.ctc_beam_search_decoder(probs, lengths, blank,
                                               beam_width, top_paths)
    _check_against_reference(decoded, probs, lengths, blank, beam_width,
                             top_paths)


def test_repeated_labels_need_a_blank_between_them():
    """Label 1 twice in a row is one label; 1, blank, 1 is two."""
    certain = torch.full((3, 1, 3), -30.0)
    for step, label in enumerate([1, 1, 0]):
        certain[step, 0, label] = 0.0
    _, length, paths = poptorch.ctc_beam_search_decoder(
        certain.log_softmax(-1), torch.tensor([3]), beam_width=5)
    assert paths[0, 0, :length[0, 0]].tolist() == [1]
    certain[1, 0] = -30.0
    certain[1, 0, 0] = 0.0
    certain[2, 0] = -30.0
    certain[2, 0, 1] = 0.0
    _, length, paths = poptorch.ctc_beam_search_decoder(
        certain.log_softmax(-1), torch.tensor([3]), beam_width=5)
    assert paths[0, 0, :length[0, 0]].tolist() == [1, 1]


class Recogniser(torch.nn.Module):
    """Frames [B, T, F] -> log probabilities [B, T, C] -> decoded
    paths."""

    def __init__(self):
        super().__init__()
        self.classify = torch.nn.Linear(6, 5)

    def forward(self, frames, lengths):
        log_probs = self.classify(frames).log_softmax(-1)
        return (log_probs,) + tuple(poptorch.ctc_beam_search_decoder(
            log_probs.transpose(0, 1), lengths, blank=0, beam_width=8,
            top_paths=2))


@pytest.mark.parametrize("replicas", [1, 2])
def test_decoder_runs_in_a_compiled_model(replicas, capfd):
    """With 2 replicas (vectorised) the replicas' items are decoded as
    one batch, without torch.vmap's warning of a missing batching rule."""
    torch.manual_seed(0)
    model = poptorch.inferenceModel(
        Recogniser(), options(2 // replicas, replicas=replicas))
    frames = torch.randn(4, 10, 6)
    lengths = torch.tensor([10, 4, 7, 9])
    log_probs, *decoded = model(frames, lengths)
    assert "batching rule" not in capfd.readouterr().err
    # Each device iteration (replica) decodes its two items: compare item
    # by item.
    for half in range(2):
        items = slice(2 * half, 2 * half + 2)
        _check_against_reference(
            [part[items] for part in decoded],
            log_probs[items].transpose(0, 1), lengths[items], 0, 8, 2)


@pytest.mark.parametrize("arguments, message", [
    ((torch.randn(4, 3), torch.tensor([4])),
     "probs must be a floating-point tensor of shape [input_length, "
     "batch_size, num_classes]"),
    ((torch.randn(4, 2, 3), torch.tensor([4])),
     "lengths must be an integer tensor of shape [batch_size] = [2]"),
    ((torch.randn(4, 1, 3), torch.tensor([4.0])),
     "lengths must be an integer tensor"),
    ((torch.randn(4, 1, 3), torch.tensor([4]), 3),
     "blank must be a class index below num_classes (3), not 3"),
    ((torch.randn(4, 1, 3), torch.tensor([4]), 0, 0),
     "beam_width must be an integer >= 1, not 0"),
    ((torch.randn(4, 1, 3), torch.tensor([4]), 0, 2, 3),
     "top_paths (3) must not exceed beam_width (2)"),
])
def test_bad_arguments_raise(arguments, message):
    with pytest.raises(poptorch.Error) as raised:
        poptorch.ctc_beam_search_decoder(*arguments)
    assert message in str(raised.value)
