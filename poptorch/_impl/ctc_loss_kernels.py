"""CTC loss through PyTorch's own kernels, as one static-shape op (the
path ``ctc_loss.py`` takes on the CPU).

PyTorch's kernels (``aten._ctc_loss``, ``aten._ctc_loss_backward``) size
their forward variables by the largest target length, a value of the data,
so they cannot be traced with fake tensors; inside an op's kernel the data
is real. ``poptorch::ctc_loss_kernels`` returns PyTorch's losses [N] and
its forward variables padded with -inf to the static width 2 W + 1 of the
padded targets (PyTorch's are as wide as the longest target needs); its
backward op runs PyTorch's backward kernel on them, so losses and
gradients are PyTorch's, bit for bit.

It keeps the conventions of the frame-by-frame recursion in
``ctc_loss.py``: input lengths are bounded by the number of frames T, and
a target longer than the padded targets' width W has no alignment
(infinite loss; NaN gradients, or zero loss and gradients with
``zero_infinity``). Replicas (vmap) are one batch of R x N samples.
"""
from typing import Tuple

import torch
from torch import Tensor

from .replica_stacking import replicas_first


def bounded_lengths(log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                    target_lengths: Tensor) -> Tuple[Tensor, Tensor]:
    """The frames each sample reads and its target length, bounded by T
    and by the targets' width W."""
    return (input_lengths.clamp(0, log_probs.shape[0]),
            target_lengths.clamp(0, targets.shape[1]))


@torch.library.custom_op("poptorch::ctc_loss_kernels", mutates_args=())
def ctc_loss_kernels(log_probs: Tensor, targets: Tensor,
                     input_lengths: Tensor, target_lengths: Tensor,
                     blank: int, zero_infinity: bool
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    """(losses [N], negative log likelihoods [N], forward variables
    [N, T, 2 W + 1]) of ``log_probs`` [T, N, C] for padded int64
    ``targets`` [N, W]: the losses are the likelihoods with
    ``zero_infinity`` applied, the last two are for the backward op (the
    forward variables are PyTorch's, padded with -inf to the static
    width)."""
    lengths = bounded_lengths(log_probs, targets, input_lengths,
                              target_lengths)
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(
        log_probs, targets, *lengths, blank, False)
    nll = nll.masked_fill(target_lengths > targets.shape[1], float("inf"))
    padded = log_alpha.new_full(_forward_variables_shape(log_probs, targets),
                                float("-inf"))
    padded[:, :, :log_alpha.shape[2]] = log_alpha
    losses = nll.masked_fill(torch.isinf(nll), 0.0) if zero_infinity \
        else nll.clone()
    return losses, nll, padded


def _forward_variables_shape(log_probs: Tensor,
                             targets: Tensor) -> Tuple[int, int, int]:
    return (log_probs.shape[1], log_probs.shape[0], 2 * targets.shape[1] + 1)


@ctc_loss_kernels.register_fake
def _ctc_loss_kernels_fake(log_probs, targets, input_lengths, target_lengths,
                           blank, zero_infinity):
    batch = log_probs.shape[1]
    return (log_probs.new_empty((batch,)), log_probs.new_empty((batch,)),
            log_probs.new_empty(_forward_variables_shape(log_probs, targets)))


@torch.library.custom_op("poptorch::ctc_loss_kernels_backward",
                         mutates_args=())
def ctc_loss_kernels_backward(grad: Tensor, log_probs: Tensor,
                              targets: Tensor, input_lengths: Tensor,
                              target_lengths: Tensor, nll: Tensor,
                              log_alpha: Tensor, blank: int,
                              zero_infinity: bool) -> Tensor:
    """PyTorch's gradient for ``log_probs`` of ``ctc_loss_kernels``
    (PyTorch's backward kernel reads the padded forward variables as its
    own: it reads none past a sample's target), ``grad`` being the
    losses' gradient [N]."""
    lengths = bounded_lengths(log_probs, targets, input_lengths,
                              target_lengths)
    result = torch.ops.aten._ctc_loss_backward.Tensor(
        grad, log_probs, targets, *lengths, nll, log_alpha, blank,
        zero_infinity)
    if not zero_infinity:
        unaligned = target_lengths > targets.shape[1]
        result.masked_fill_(unaligned.view(1, -1, 1), float("nan"))
    return result.contiguous()


@ctc_loss_kernels_backward.register_fake
def _ctc_loss_kernels_backward_fake(grad, log_probs, targets, input_lengths,
                                    target_lengths, nll, log_alpha, blank,
                                    zero_infinity):
    """A contiguous tensor of ``log_probs``' shape, as the op returns
    whatever ``log_probs``' layout (a transposed [N, T, C] tensor's too):
    Inductor checks the op's result against this."""
    return log_probs.new_empty(log_probs.shape)


def _setup_context(ctx, inputs, output) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, \
        zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths,
                          *output[1:])
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx, grad, *_):
    grad_log_probs = ctc_loss_kernels_backward(
        grad, *ctx.saved_tensors, ctx.blank, ctx.zero_infinity)
    return grad_log_probs, None, None, None, None, None


ctc_loss_kernels.register_autograd(_backward, setup_context=_setup_context)


def replicas_as_one_batch(info, in_dims, log_probs: Tensor, targets: Tensor,
                          input_lengths: Tensor, target_lengths: Tensor
                          ) -> Tuple[Tuple[Tensor, ...], int, int]:
    """For a vmap rule (vectorised replicas): the op's tensor arguments
    with the R batches of N samples as one batch of R x N, R and N."""
    replicas = info.batch_size
    log_probs_dim, targets_dim, inputs_dim, lengths_dim = in_dims[:4]
    stacked = replicas_first(log_probs, log_probs_dim, replicas)
    frames, batch = stacked.shape[1], stacked.shape[2]
    merged = (
        stacked.transpose(0, 1).reshape(frames, replicas * batch, -1),
        replicas_first(targets, targets_dim, replicas).flatten(0, 1),
        replicas_first(input_lengths, inputs_dim, replicas).flatten(),
        replicas_first(target_lengths, lengths_dim, replicas).flatten())
    return merged, replicas, batch


def _vmap_rule(info, in_dims, log_probs, targets, input_lengths,
               target_lengths, blank, zero_infinity):
    merged, replicas, batch = replicas_as_one_batch(
        info, in_dims, log_probs, targets, input_lengths, target_lengths)
    results = ctc_loss_kernels(*merged, blank, zero_infinity)
    return tuple(result.unflatten(0, (replicas, batch))
                 for result in results), (0, 0, 0)


ctc_loss_kernels.register_vmap(_vmap_rule)
