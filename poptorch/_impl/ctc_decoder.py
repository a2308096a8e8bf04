"""CTC prefix beam search (``poptorch.ctc_beam_search_decoder``).

The decoder keeps ``beam_width`` prefixes (label sequences without blanks
and repeats) per batch item, each with two log probabilities: of the paths
so far that map to the prefix and end in a blank (``blank``) or in its last
label (``label``). At each time step t < ``lengths[b]``, with log
probabilities p of the step:

* every prefix stays, from paths that add a blank
  (``blank' = total + p[blank]``) or repeat its last label
  (``label' = label + p[last]``);
* every prefix is extended by every label c other than the blank
  (``label' = total + p[c]``, or ``blank + p[c]`` when c repeats the last
  label, which CTC only allows after a blank);
* an extension that equals a prefix already kept adds its probability to
  that prefix's (prefixes are compared by a rolling hash of their labels);
* the ``beam_width`` most likely candidates are kept.

It runs as one ``poptorch::ctc_beam_search_decoder`` operation: a captured
graph holds one node for it, and the loop over time runs with tensor
operations vectorised over the batch, the beams and the labels, on the
model's device. It returns, for the ``top_paths`` most likely prefixes,
their log probabilities, their lengths and their labels, padded with the
blank index past each length.
"""
from typing import Tuple

import torch
from torch import Tensor

from .replica_stacking import replicas_first

_NEGATIVE_INFINITY = float("-inf")
#: Multiplier of the rolling hash of a prefix's labels (an odd 63-bit
#: constant; int64 products wrap around).
_HASH_MULTIPLIER = 0x5851F42D4C957F2D


@torch.library.custom_op("poptorch::ctc_beam_search_decoder",
                         mutates_args=())
def ctc_beam_search_decoder(probs: Tensor, lengths: Tensor, blank: int,
                            beam_width: int, top_paths: int
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    """(log probabilities [B, top_paths], lengths [B, top_paths], labels
    [B, top_paths, T]) of the most likely prefixes of ``probs`` [T, B, C]
    (log probabilities), item b reading its first ``lengths[b]`` steps."""
    beams = _Beams.start(probs, beam_width, blank)
    lengths = lengths.to(probs.device)
    for step in range(probs.shape[0]):
        beams = beams.advance(probs[step].float(), lengths > step)
    return beams.best(top_paths, probs.dtype)


@ctc_beam_search_decoder.register_fake
def _ctc_beam_search_decoder_fake(probs, lengths, blank, beam_width,
                                  top_paths):
    steps, batch = probs.shape[0], probs.shape[1]
    return (probs.new_empty((batch, top_paths)),
            probs.new_empty((batch, top_paths), dtype=torch.int32),
            probs.new_empty((batch, top_paths, steps), dtype=torch.int32))


def _vmap_rule(info, in_dims, probs, lengths, blank, beam_width,
               top_paths):
    """Under vmap (vectorised replicas) the R batches of B items are one
    batch of R x B: each item is decoded on its own."""
    replicas = info.batch_size
    stacked = replicas_first(probs, in_dims[0], replicas)
    steps, batch = stacked.shape[1], stacked.shape[2]
    merged = stacked.transpose(0, 1).reshape(steps, replicas * batch, -1)
    results = ctc_beam_search_decoder(
        merged, replicas_first(lengths, in_dims[1], replicas).flatten(),
        blank, beam_width, top_paths)
    return tuple(result.unflatten(0, (replicas, batch))
                 for result in results), (0, 0, 0)


ctc_beam_search_decoder.register_vmap(_vmap_rule)


class _Beams:
    """The kept prefixes of every batch item, [B, K, ...] tensors: labels
    (padded with the blank), length, last label (the blank when empty),
    hash, and the two log probabilities."""

    def __init__(self, labels: Tensor, length: Tensor, last: Tensor,
                 hashes: Tensor, blank_logp: Tensor, label_logp: Tensor,
                 blank: int) -> None:
        self.labels, self.length, self.last = labels, length, last
        self.hashes = hashes
        self.blank_logp, self.label_logp = blank_logp, label_logp
        self.blank = blank

    @classmethod
    def start(cls, probs: Tensor, beam_width: int, blank: int) -> "_Beams":
        """One empty prefix of probability 1 per item; the other beams are
        impossible."""
        steps, batch = probs.shape[0], probs.shape[1]
        device = probs.device
        shape = (batch, beam_width)
        blank_logp = torch.full(shape, _NEGATIVE_INFINITY, device=device)
        blank_logp[:, 0] = 0.0
        return cls(
            labels=torch.full(shape + (steps,), blank, dtype=torch.int64,
                              device=device),
            length=torch.zeros(shape, dtype=torch.int64, device=device),
            last=torch.full(shape, blank, dtype=torch.int64, device=device),
            hashes=torch.zeros(shape, dtype=torch.int64, device=device),
            blank_logp=blank_logp,
            label_logp=torch.full(shape, _NEGATIVE_INFINITY, device=device),
            blank=blank)

    def total(self) -> Tensor:
        return torch.logaddexp(self.blank_logp, self.label_logp)

    def advance(self, logp: Tensor, active: Tensor) -> "_Beams":
        """The beams after one time step of log probabilities ``logp``
        [B, C]; items that are not ``active`` keep theirs."""
        classes = logp.shape[1]
        total = self.total()
        # Staying: a blank, or the last label once more.
        stay_blank = total + logp[:, self.blank, None]
        repeat = logp.gather(1, self.last)
        stay_label = torch.where(self.length > 0, self.label_logp + repeat,
                                 _NEGATIVE_INFINITY)
        # Extending beam k by label c: [B, K, C].
        repeats_last = (torch.arange(classes, device=logp.device)
                        == self.last[..., None])
        extend = torch.where(repeats_last, self.blank_logp[..., None],
                             total[..., None]) + logp[:, None, :]
        extend[..., self.blank] = _NEGATIVE_INFINITY
        child_hash = self.hashes[..., None] * _HASH_MULTIPLIER + \
            torch.arange(1, classes + 1, device=logp.device)
        stay_label, extend = self._merge_children(stay_label, extend,
                                                  child_hash, total)
        return self._select(stay_blank, stay_label, extend, child_hash,
                            active)

    def _merge_children(self, stay_label: Tensor, extend: Tensor,
                        child_hash: Tensor, total: Tensor) -> Tensor:
        """Add to each kept prefix the extension of another beam that
        equals it, and remove that extension from the candidates. Only an
        extension by the prefix's last label can equal it. Beams of
        probability 0 (while fewer prefixes than beams exist) take part in
        nothing."""
        width = extend.shape[1]
        by_last = self.last[:, None, :].expand(-1, width, -1)
        # same[b, i, j]: beam j extended by beam i's last label is beam i.
        same = child_hash.gather(2, by_last).transpose(1, 2) == \
            self.hashes[:, :, None]
        possible = (self.length > 0) & (total > _NEGATIVE_INFINITY)
        same &= possible[:, :, None]
        extension_logp = extend.gather(2, by_last).transpose(1, 2)
        merged = torch.where(same, extension_logp, _NEGATIVE_INFINITY)
        stay_label = torch.logaddexp(stay_label,
                                     torch.logsumexp(merged, dim=2))
        # Several beams may end in the same label: count their merges.
        taken = torch.zeros_like(extend, dtype=torch.int32).scatter_add_(
            2, by_last, same.transpose(1, 2).to(torch.int32))
        return stay_label, extend.masked_fill(taken > 0, _NEGATIVE_INFINITY)

    def _select(self, stay_blank: Tensor, stay_label: Tensor, extend: Tensor,
                child_hash: Tensor, active: Tensor) -> "_Beams":
        """Keep the most likely of the candidates: the K staying prefixes,
        then the K x C extensions."""
        width, classes = extend.shape[1], extend.shape[2]
        candidates_blank = torch.cat(
            [stay_blank, torch.full_like(extend.flatten(1),
                                         _NEGATIVE_INFINITY)], dim=1)
        candidates_label = torch.cat([stay_label, extend.flatten(1)], dim=1)
        scores = torch.logaddexp(candidates_blank, candidates_label)
        chosen = scores.topk(width, dim=1).indices
        extended = chosen >= width
        extension = (chosen - width).clamp(min=0)
        parent = torch.where(extended, extension // classes, chosen)
        label = torch.where(extended, extension % classes,
                            self.last.gather(1, parent))
        length = self.length.gather(1, parent)
        labels = self.labels.gather(
            1, parent[..., None].expand_as(self.labels))
        # The new label goes after the prefix; a staying prefix writes the
        # padding already there.
        position = length.clamp(max=labels.shape[2] - 1)[..., None]
        labels = labels.scatter(
            2, position, torch.where(extended, label, self.blank)[..., None])
        hashes = torch.where(extended,
                             child_hash.flatten(1).gather(1, extension),
                             self.hashes.gather(1, parent))
        advanced = _Beams(
            labels=labels, length=length + extended.long(), last=label,
            hashes=hashes, blank_logp=candidates_blank.gather(1, chosen),
            label_logp=candidates_label.gather(1, chosen), blank=self.blank)
        return self._where(active, advanced)

    def _where(self, active: Tensor, advanced: "_Beams") -> "_Beams":
        """``advanced`` for the active items, ``self`` for the others."""
        def pick(new: Tensor, old: Tensor) -> Tensor:
            mask = active.view((-1,) + (1,) * (new.dim() - 1))
            return torch.where(mask, new, old)
        return _Beams(
            labels=pick(advanced.labels, self.labels),
            length=pick(advanced.length, self.length),
            last=pick(advanced.last, self.last),
            hashes=pick(advanced.hashes, self.hashes),
            blank_logp=pick(advanced.blank_logp, self.blank_logp),
            label_logp=pick(advanced.label_logp, self.label_logp),
            blank=self.blank)

    def best(self, top_paths: int, dtype: torch.dtype
             ) -> Tuple[Tensor, Tensor, Tensor]:
        """The ``top_paths`` most likely prefixes, most likely first."""
        total, order = self.total().topk(top_paths, dim=1)
        length = self.length.gather(1, order)
        labels = self.labels.gather(
            1, order[..., None].expand(-1, -1, self.labels.shape[2]))
        return (total.to(dtype), length.to(torch.int32),
                labels.to(torch.int32))
