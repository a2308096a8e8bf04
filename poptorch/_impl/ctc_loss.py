"""CTC loss (``torch.nn.functional.ctc_loss``, ``torch.nn.CTCLoss``) with
static shapes, for captured models.

PyTorch's kernel (``aten._ctc_loss``) sizes its workspace by the largest
target length, a value of the data, so it cannot be captured with fake
tensors. Here the shapes come from the tensors' shapes alone. On the CPU
(float32, float64) ``ctc_loss`` runs PyTorch's kernels inside one op,
whose output has a static shape (``ctc_loss_kernels.py``); elsewhere it
runs the recursion below, one vectorised step per frame:

* targets are padded to a static width W: the padded ``(N, S)`` targets'
  S, or for concatenated 1-D targets their total length; either bounded by
  the number of frames T, since a target longer than T has no alignment
  (its loss is infinite, as in PyTorch);
* the extended label sequence of sample n is the blank, then each label
  followed by a blank: L = 2 W + 1 positions, of which the first
  ``2 * target_lengths[n] + 1`` are used;
* the forward variables alpha (log probability of the alignments of the
  frames up to t ending at position s) follow the CTC recursion in log
  space: ``alpha_t(s) = logaddexp(alpha_{t-1}(s), alpha_{t-1}(s-1),
  alpha_{t-1}(s-2) when position s holds a label unlike position s-2) +
  log_probs[t, label(s)]``, one vectorised step per frame over the batch
  and the positions, for all T frames; each sample's likelihood is read
  from its alphas after frame ``input_lengths[n] - 1`` (a gather, not a
  Python condition on values).

``poptorch::ctc_loss`` returns the negative log likelihoods and the
alphas; ``poptorch::ctc_loss_backward`` runs the backward recursion
(beta, each sample's from its last frame: masks select the end of the
target for the frames past its input) and returns PyTorch's gradient for
``log_probs``:
``exp(log_probs) - sum over the positions s holding class c of
exp(alpha_t(s) + beta_t(s) + nll - log_probs[t, c])``, times the loss's
gradient, zero from frame ``input_lengths[n]`` on. Like PyTorch's, it is
meant for log probabilities from ``log_softmax``: through its backward
pass it gives the exact gradient for the logits (the mathematical gradient
for ``log_probs`` lacks the ``exp(log_probs)`` term, which sums to one per
frame and cancels there).
Each op is one node of a captured graph; its loop over frames runs when
the graph runs. Losses that are infinite (no alignment) give NaN
gradients, or zero losses and gradients with ``zero_infinity``, as in
PyTorch.

``ctc_loss`` takes ``F.ctc_loss``'s arguments (targets padded or
concatenated, int32 or int64; lengths as tensors, lists or tuples;
unbatched inputs) and applies its reductions: "mean" divides each loss by
its target length (at least 1) and averages over the batch. While a model
is traced, ``F.ctc_loss`` calls run it (``tracing_context.py``).
``graphcore_ctc`` is the ``Ctc`` op of ``poptorch.custom_op``'s
``ai.graphcore`` domain.
"""
import math
from typing import Dict, List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..enums import ReductionType
from ..errors import Error
from .ctc_loss_kernels import (bounded_lengths, ctc_loss_kernels,
                               replicas_as_one_batch)

_NEGATIVE_INFINITY = float("-inf")
REDUCTIONS = ("none", "mean", "sum")

Lengths = Union[Tensor, Sequence[int], int]


def _extended_labels(targets: Tensor, blank: int) -> Tensor:
    """[N, 2 W + 1]: the blank, then each label followed by the blank."""
    extended = targets.new_full((targets.shape[0], 2 * targets.shape[1] + 1),
                                blank)
    extended[:, 1::2] = targets
    return extended


def _skip_masks(extended: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Additive masks (0 allowed, -inf not) of the skip transitions
    s-2 -> s, by destination s (for alphas) and by source s (for betas): a
    label position may be reached from the label before it unless both
    labels are equal."""
    allowed = torch.zeros_like(extended, dtype=torch.bool)
    allowed[:, 3::2] = extended[:, 3::2] != extended[:, 1:-2:2]
    into = torch.zeros(extended.shape, dtype=dtype, device=extended.device)
    into.masked_fill_(~allowed, _NEGATIVE_INFINITY)
    out_of = torch.full_like(into, _NEGATIVE_INFINITY)
    out_of[:, :-2] = into[:, 2:]
    return into, out_of


def _emissions(log_probs: Tensor, extended: Tensor) -> Tensor:
    """[T, N, L]: ``log_probs[t, n, extended[n, s]]``."""
    index = extended.unsqueeze(0).expand(log_probs.shape[0], -1, -1)
    return log_probs.gather(2, index)


def _active(frames_read: Tensor, frames: int) -> Tensor:
    """[T, N, 1] booleans: frame t is inside sample n's input."""
    steps = torch.arange(frames, device=frames_read.device)
    return (steps.unsqueeze(1) < frames_read.unsqueeze(0)).unsqueeze(-1)


def _transitions(same: Tensor, neighbour: Tensor, skipped: Tensor,
                 skip: Tensor, total: Tensor, jump: Tensor) -> Tensor:
    """``logaddexp(same, neighbour, skipped + skip)`` written into
    ``total`` (``jump`` is scratch): the variables of the previous (or
    following) frame at s, at the neighbouring position and two positions
    away."""
    torch.logaddexp(same, neighbour, out=total)
    torch.add(skipped, skip, out=jump)
    return torch.logaddexp(total, jump, out=total)


def _scratch(emissions: Tensor) -> Tuple[Tensor, Tensor]:
    shape = emissions.shape[1:]
    return emissions.new_empty(shape), emissions.new_empty(shape)


def _alphas(emissions: Tensor, skip_into: Tensor,
            feasible: Tensor) -> Tensor:
    """[T + 1, N, L + 2]: row t + 1 holds the alphas after frame t, for
    every frame (rows past a sample's input are not read), positions
    shifted right by two columns of -inf that stand for s - 1 and s - 2
    below 0. Row 0, before the first frame, holds probability 1 at
    position 0 (the first frame then starts at the blank or the first
    label), none for the samples that are not ``feasible``."""
    frames, batch, positions = emissions.shape
    alphas = emissions.new_empty((frames + 1, batch, positions + 2))
    alphas[:, :, :2].fill_(_NEGATIVE_INFINITY)
    alphas[0, :, 2:].fill_(_NEGATIVE_INFINITY)
    alphas[0, :, 2].masked_fill_(feasible, 0.0)
    same = alphas[:, :, 2:].unbind(0)
    neighbour = alphas[:, :, 1:-1].unbind(0)
    skipped = alphas[:, :, :-2].unbind(0)
    scratch = _scratch(emissions)
    for t, emission in enumerate(emissions.unbind(0)):
        total = _transitions(same[t], neighbour[t], skipped[t], skip_into,
                             *scratch)
        torch.add(total, emission, out=same[t + 1])
    return alphas


def _log_likelihood(alphas: Tensor, frames_read: Tensor,
                    target_lengths: Tensor) -> Tensor:
    """[N]: log probability of the target, from the alphas after the
    sample's last frame (the alignments ending at its last label or at the
    blank after it)."""
    batch, columns = alphas.shape[1], alphas.shape[2]
    rows = frames_read.view(1, batch, 1).expand(1, batch, columns)
    last = alphas.gather(0, rows)[0]
    end = (2 * target_lengths + 2).unsqueeze(1)
    return torch.logaddexp(last.gather(1, end), last.gather(1, end - 1))[:, 0]


def _prepared(log_probs: Tensor, targets: Tensor, blank: int
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(extended labels, their emissions, the skip masks into and out of
    each position)."""
    extended = _extended_labels(targets, blank)
    skip_into, skip_out_of = _skip_masks(extended, log_probs.dtype)
    return extended, _emissions(log_probs, extended), skip_into, skip_out_of


@torch.library.custom_op("poptorch::ctc_loss", mutates_args=())
def _ctc_loss_op(log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                 target_lengths: Tensor, blank: int, zero_infinity: bool
                 ) -> Tuple[Tensor, Tensor]:
    """(negative log likelihoods [N], alphas [T + 1, N, 2 W + 3]) of
    ``log_probs`` [T, N, C] for padded int64 ``targets`` [N, W]; a target
    longer than W has no alignment."""
    _, emissions, skip_into, _ = _prepared(log_probs, targets, blank)
    alphas = _alphas(emissions, skip_into, target_lengths <= targets.shape[1])
    nll = -_log_likelihood(alphas, *bounded_lengths(
        log_probs, targets, input_lengths, target_lengths))
    if zero_infinity:
        nll = nll.masked_fill(torch.isinf(nll), 0.0)
    return nll, alphas


@_ctc_loss_op.register_fake
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank,
                   zero_infinity):
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    return (log_probs.new_empty((batch,)),
            log_probs.new_empty((frames + 1, batch, 2 * targets.shape[1] + 3)))


def _betas(emissions: Tensor, skip_out_of: Tensor, active: Tensor,
           target_lengths: Tensor) -> Tensor:
    """[T + 1, N, L + 2]: the betas of each frame (log probability of the
    rest of the target from position s at frame t, frame t included),
    positions followed by two columns of -inf that stand for s + 1 and
    s + 2 past the end. Row T, and the frames past a sample's input, hold
    its end: probability 1 at the blank after the last label (the last
    frame then ends at that blank or at the last label)."""
    frames, batch, positions = emissions.shape
    betas = emissions.new_empty((frames + 1, batch, positions + 2))
    betas[:, :, -2:].fill_(_NEGATIVE_INFINITY)
    betas[frames].fill_(_NEGATIVE_INFINITY)
    betas[frames].scatter_(1, (2 * target_lengths).unsqueeze(1), 0.0)
    same = betas[:, :, :-2].unbind(0)
    neighbour = betas[:, :, 1:-1].unbind(0)
    skipped = betas[:, :, 2:].unbind(0)
    scratch = _scratch(emissions)
    active, emissions = active.unbind(0), emissions.unbind(0)
    for t in reversed(range(frames)):
        total = _transitions(same[t + 1], neighbour[t + 1], skipped[t + 1],
                             skip_out_of, *scratch)
        torch.where(active[t], total.add_(emissions[t]), same[frames],
                    out=same[t])
    return betas


@torch.library.custom_op("poptorch::ctc_loss_backward", mutates_args=())
def _ctc_loss_backward_op(grad: Tensor, log_probs: Tensor, targets: Tensor,
                          input_lengths: Tensor, target_lengths: Tensor,
                          alphas: Tensor, blank: int, zero_infinity: bool
                          ) -> Tensor:
    """The gradient for ``log_probs`` of ``poptorch::ctc_loss`` (see the
    module docstring), ``grad`` being the losses' gradient [N]."""
    frames = log_probs.shape[0]
    extended, emissions, _, skip_out_of = _prepared(log_probs, targets, blank)
    frames_read, lengths = bounded_lengths(log_probs, targets, input_lengths,
                                         target_lengths)
    active = _active(frames_read, frames)
    betas = _betas(emissions, skip_out_of, active, lengths)
    nll = -_log_likelihood(alphas, frames_read, lengths)
    impossible = torch.isinf(nll)
    occupation = alphas[1:, :, 2:] + betas[:-1, :, :-2]
    occupation.add_(nll.masked_fill(impossible, 0.0).unsqueeze(1))
    occupation.sub_(emissions).exp_().neg_()
    index = extended.unsqueeze(0).expand(frames, -1, -1)
    result = log_probs.exp().scatter_add_(2, index, occupation)
    scale = grad.masked_fill(impossible, 0.0 if zero_infinity else math.nan)
    result.mul_(scale.unsqueeze(1))
    return result.masked_fill_(~active, 0.0)


@_ctc_loss_backward_op.register_fake
def _ctc_loss_backward_fake(grad, log_probs, targets, input_lengths,
                            target_lengths, alphas, blank, zero_infinity):
    return torch.empty_like(log_probs)


def _setup_context(ctx, inputs, output) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, \
        zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths,
                          output[1])
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx, grad, _):
    log_probs, targets, input_lengths, target_lengths, alphas = \
        ctx.saved_tensors
    grad_log_probs = _ctc_loss_backward_op(
        grad, log_probs, targets, input_lengths, target_lengths, alphas,
        ctx.blank, ctx.zero_infinity)
    return grad_log_probs, None, None, None, None, None


_ctc_loss_op.register_autograd(_backward, setup_context=_setup_context)


def _vmap_rule(info, in_dims, log_probs, targets, input_lengths,
               target_lengths, blank, zero_infinity):
    """Under vmap (vectorised replicas) the R batches are one batch of
    R x N samples."""
    merged, replicas, batch = replicas_as_one_batch(
        info, in_dims, log_probs, targets, input_lengths, target_lengths)
    nll, alphas = _ctc_loss_op(*merged, blank, zero_infinity)
    return ((nll.unflatten(0, (replicas, batch)),
             alphas.unflatten(1, (replicas, batch))), (0, 1))


_ctc_loss_op.register_vmap(_vmap_rule)


def _check_arguments(log_probs: Tensor, blank: int, reduction: str) -> None:
    if not isinstance(log_probs, Tensor) or log_probs.dim() not in (2, 3) \
            or not log_probs.is_floating_point():
        raise Error("ctc_loss: log_probs must be a floating-point tensor of "
                    "shape (T, N, C) or (T, C), got "
                    f"{getattr(log_probs, 'dtype', type(log_probs).__name__)}"
                    f" of shape {tuple(getattr(log_probs, 'shape', ()))}")
    if reduction not in REDUCTIONS:
        raise Error(f"ctc_loss: reduction must be one of "
                    f"{', '.join(map(repr, REDUCTIONS))}, not {reduction!r}")
    classes = log_probs.shape[-1]
    if isinstance(blank, bool) or not isinstance(blank, int) \
            or not 0 <= blank < classes:
        raise Error(f"ctc_loss: blank must be a class index in "
                    f"[0, {classes - 1}] (C = {classes}), not {blank!r}")


def _is_integer(value) -> bool:
    return isinstance(value, Tensor) and not value.is_floating_point() \
        and not value.is_complex() and value.dtype != torch.bool


def _lengths(name: str, value: Lengths, batch: int, batched: bool,
             device: torch.device) -> Tensor:
    """``value`` as an int64 tensor [N] on ``device``."""
    if not isinstance(value, Tensor):
        value = torch.tensor(value)
    shapes = [(batch,)] if batched else [(), (1,)]
    if not _is_integer(value) or tuple(value.shape) not in shapes:
        shape = " or ".join(map(str, shapes))
        raise Error(f"ctc_loss: {name} must hold integers, as a tensor of "
                    f"shape {shape} or a list or tuple of ints, got "
                    f"{value.dtype} of shape {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.long).reshape(batch)


def _concatenated_to_padded(targets: Tensor, target_lengths: Tensor,
                            width: int) -> Tensor:
    """[N, width]: sample n's labels are ``targets[start_n:start_n +
    target_lengths[n]]``, start_n the sum of the lengths before it."""
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    index = starts.unsqueeze(1) + torch.arange(width, device=targets.device)
    return targets[index.clamp(max=max(targets.shape[0] - 1, 0))]


def _padded_targets(targets: Tensor, target_lengths: Tensor, batch: int,
                    batched: bool, frames: int) -> Tensor:
    """int64 targets [N, W], W bounded by the number of frames."""
    dims_allowed = (1, 2) if batched else (1,)
    if not _is_integer(targets) or targets.dim() not in dims_allowed or \
            (targets.dim() == 2 and targets.shape[0] != batch):
        shape = f"({batch}, S) or (sum(target_lengths),)" if batched \
            else "(S,)"
        raise Error(f"ctc_loss: targets must be an integer tensor of shape "
                    f"{shape}, got {getattr(targets, 'dtype', targets)} of "
                    f"shape {tuple(getattr(targets, 'shape', ()))}")
    targets = targets.to(device=target_lengths.device, dtype=torch.long)
    if targets.dim() == 1 and not batched:
        targets = targets.unsqueeze(0)
    width = min(targets.shape[-1], frames)
    if targets.dim() == 2:
        return targets[:, :width]
    return _concatenated_to_padded(targets, target_lengths, width)


#: The dtypes of PyTorch's CTC kernels on the CPU.
_KERNEL_DTYPES = (torch.float32, torch.float64)


def uses_pytorch_kernels(log_probs: Tensor) -> bool:
    """Whether ``ctc_loss`` runs PyTorch's kernels (``ctc_loss_kernels``):
    on the CPU, where they are exact and about 25 times faster than the
    recursion. Elsewhere it runs the recursion: CUDA's kernel reads the
    lengths back to the host, which a CUDA graph cannot hold."""
    return log_probs.device.type == "cpu" and log_probs.dtype in _KERNEL_DTYPES


def _static_losses(log_probs: Tensor):
    """The op computing the negative log likelihoods [N] for ``log_probs``'s
    device and dtype."""
    op = ctc_loss_kernels if uses_pytorch_kernels(log_probs) else _ctc_loss_op
    return lambda *args: op(*args)[0]


def ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Lengths,
             target_lengths: Lengths, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> Tensor:
    """``torch.nn.functional.ctc_loss`` with static shapes (see the module
    docstring): the Connectionist Temporal Classification loss of
    ``log_probs`` (T, N, C) or (T, C) for ``targets`` (N, S), or the
    concatenated (sum(target_lengths),), with ``reduction`` "none", "mean"
    (each loss divided by its target length, then averaged over the batch)
    or "sum"; ``zero_infinity`` zeroes infinite losses and their
    gradients. Float16 and bfloat16 log probabilities are computed in
    float32, as PopLibs' CTC computes half inputs with float partials (the
    recursion's log likelihoods of long utterances, hundreds, keep no
    fraction bits in float16); the loss has their dtype."""
    _check_arguments(log_probs, blank, reduction)
    batched = log_probs.dim() == 3
    if not batched:
        log_probs = log_probs.unsqueeze(1)
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    device = log_probs.device
    input_lengths = _lengths("input_lengths", input_lengths, batch, batched,
                             device)
    target_lengths = _lengths("target_lengths", target_lengths, batch,
                              batched, device)
    padded = _padded_targets(targets, target_lengths, batch, batched, frames)
    computed = log_probs.to(torch.promote_types(log_probs.dtype,
                                                torch.float32))
    nll = _static_losses(computed)(computed, padded, input_lengths,
                                   target_lengths, blank,
                                   bool(zero_infinity))
    if reduction == "mean":
        loss = (nll / target_lengths.clamp(min=1).to(nll.dtype)).mean()
    elif reduction == "sum":
        loss = nll.sum()
    else:
        loss = nll if batched else nll[0]
    return loss.to(log_probs.dtype)


#: ``reduction`` of the ai.graphcore ``Ctc`` op: a ``poptorch.ReductionType``
#: (PopART's ``ReductionType``) value, or the name of a PyTorch reduction.
_GRAPHCORE_REDUCTIONS = {ReductionType.Sum: "sum",
                         ReductionType.Mean: "mean",
                         ReductionType.NoReduction: "none",
                         "sum": "sum", "mean": "mean", "none": "none"}
_GRAPHCORE_DEFAULTS = {"blank": 0, "reduction": ReductionType.Mean,
                       "zeroInfinity": 0, "outDataType": "UNDEFINED"}
# PopART's names of the loss's dtype (UNDEFINED: the log-probabilities').
_GRAPHCORE_OUT_TYPES = {"UNDEFINED": None, "FLOAT": torch.float32,
                        "FLOAT16": torch.float16}


def _graphcore_attributes(attributes: Dict[str, object]) -> Dict[str, object]:
    unknown = sorted(set(attributes) - set(_GRAPHCORE_DEFAULTS))
    if unknown:
        raise Error(f"custom_op Ctc (domain ai.graphcore): unknown attributes "
                    f"{unknown}; the op takes {list(_GRAPHCORE_DEFAULTS)}")
    values = dict(_GRAPHCORE_DEFAULTS, **attributes)
    reduction = values["reduction"]
    if not isinstance(reduction, (int, str)) or isinstance(reduction, bool) \
            or reduction not in _GRAPHCORE_REDUCTIONS:
        raise Error("custom_op Ctc (domain ai.graphcore): attribute "
                    f"reduction must be 0 (Sum), 1 (Mean), 2 (NoReduction) "
                    f"or 'sum', 'mean', 'none', not {reduction!r}")
    if values["zeroInfinity"] not in (0, 1):
        raise Error("custom_op Ctc (domain ai.graphcore): attribute "
                    "zeroInfinity must be 0 or 1, not "
                    f"{values['zeroInfinity']!r}")
    if values["outDataType"] not in _GRAPHCORE_OUT_TYPES:
        raise Error("custom_op Ctc (domain ai.graphcore): attribute "
                    f"outDataType must be one of {list(_GRAPHCORE_OUT_TYPES)}"
                    f", not {values['outDataType']!r}")
    return {"blank": values["blank"],
            "reduction": _GRAPHCORE_REDUCTIONS[reduction],
            "zero_infinity": bool(values["zeroInfinity"])}


def graphcore_ctc(inputs: Sequence[Tensor],
                  attributes: Dict[str, object]) -> List[Tensor]:
    """PopART's ``Ctc`` op (domain ai.graphcore), as ``F.ctc_loss`` (so a
    captured model records it as a loss and runs ``ctc_loss``): inputs
    (log_probs [T, N, C], targets [N, S], input_lengths [N],
    target_lengths [N]); attributes ``blank`` (default 0), ``reduction``
    (0 Sum, 1 Mean (default) or 2 NoReduction, as ``poptorch.ReductionType``
    numbers them), ``zeroInfinity`` (0 or 1, default 0) and
    ``outDataType`` (the loss's dtype: ``"UNDEFINED"``, the default, keeps
    the log-probabilities'; ``"FLOAT"``, ``"FLOAT16"``). Returns [loss]."""
    if len(inputs) != 4:
        raise Error("custom_op Ctc (domain ai.graphcore): inputs must be "
                    "(log_probs, targets, input_lengths, target_lengths), "
                    f"got {len(inputs)} input(s)")
    loss = F.ctc_loss(*inputs, **_graphcore_attributes(attributes))
    dtype = _GRAPHCORE_OUT_TYPES[attributes.get("outDataType", "UNDEFINED")]
    return [loss if dtype is None else loss.to(dtype)]
