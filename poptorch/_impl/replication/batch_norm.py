"""BatchNorm in training over vectorised replicas, without copies.

Under ``torch.func.vmap`` (the vectorised replica path, ``replicas.py``)
PyTorch's batching rule for batch norm moves the replica dimension next to
the channels, [R, S, C, ...] -> [S, R x C, ...], which copies the
activations, and applies the affine weight as separate multiplications, in
the forward and again in the backward pass: about nine extra passes over
each normalised activation.

While the vectorised forward pass is traced, ``per_replica_statistics``
routes ``torch.nn.functional.batch_norm`` in training mode to
``poptorch::batch_norm_training``, whose vmap rule calls
``poptorch::replica_batch_norm`` on the stacked replicas. That op runs
PyTorch's own batch-norm kernel on each replica's contiguous [S, C, ...]
slice, writing straight into the stacked output (``native_batch_norm.out``),
and its backward pass does the same with ``native_batch_norm_backward.out``.
Each replica's statistics, running averages and gradients are exactly those
of the kernel run on that replica alone.
"""
import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..cumulative_batch_norm import CumulativeMomentum, batch_norm_arguments
from ..replica_stacking import replicas_first

_Stats = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
_REDUCED_PRECISION = (torch.float16, torch.bfloat16)


@torch.library.custom_op("poptorch::replica_batch_norm", mutates_args=())
def replica_batch_norm(x: Tensor, weight: Optional[Tensor],
                       bias: Optional[Tensor],
                       running_mean: Optional[Tensor],
                       running_var: Optional[Tensor], momentum: float,
                       eps: float) -> _Stats:
    """Batch norm in training of each replica r on ``x[r]`` (running
    statistics ``running_mean[r]``; the affine ``weight`` and ``bias``
    shared, [C], or per replica, [R, C]): (output, saved means, saved
    inverse deviations, new running means, new running variances), all
    stacked over replicas."""
    out = torch.empty_like(x)
    save_mean = statistics_storage(x, weight, running_mean)
    save_invstd = torch.empty_like(save_mean)
    new_mean = _copy(running_mean, x)
    new_var = _copy(running_var, x)
    for r in range(x.shape[0]):
        torch.ops.aten.native_batch_norm.out(
            x[r], _of_replica(weight, r), _of_replica(bias, r),
            _row(new_mean, r), _row(new_var, r), True, momentum, eps,
            out=out[r], save_mean=save_mean[r], save_invstd=save_invstd[r])
    return out, save_mean, save_invstd, new_mean, new_var


@replica_batch_norm.register_fake
def _replica_batch_norm_fake(x, weight, bias, running_mean, running_var,
                             momentum, eps) -> _Stats:
    stats = statistics_storage(x, weight, running_mean)
    return (torch.empty_like(x), stats, torch.empty_like(stats),
            _copy(running_mean, x), _copy(running_var, x))


def statistics_storage(x: Tensor, weight: Optional[Tensor],
                       running_mean: Optional[Tensor]) -> Tensor:
    """An [R, C] tensor for per-replica statistics, in the kernel's dtype
    for them: on the CPU the parameters' (the input's without any), on
    other devices float32 for float16 and bfloat16 inputs."""
    like = weight if weight is not None else running_mean
    dtype = x.dtype if like is None else like.dtype
    if x.device.type != "cpu" and x.dtype in _REDUCED_PRECISION:
        dtype = torch.float32
    return x.new_empty((x.shape[0], x.shape[2]), dtype=dtype)


def _of_replica(affine: Optional[Tensor], replica: int) -> Optional[Tensor]:
    if affine is None or affine.dim() == 1:
        return affine
    return affine[replica]


def _copy(running: Optional[Tensor], x: Tensor) -> Tensor:
    """A copy of running statistics to update (empty when there are
    none)."""
    if running is None:
        return x.new_empty((0,))
    return running.clone()


def _row(running: Tensor, replica: int) -> Optional[Tensor]:
    return running[replica] if running.numel() else None


@torch.library.custom_op("poptorch::replica_batch_norm_backward",
                         mutates_args=())
def replica_batch_norm_backward(grad: Tensor, x: Tensor,
                                weight: Optional[Tensor], save_mean: Tensor,
                                save_invstd: Tensor, eps: float
                                ) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``replica_batch_norm`` for the input and the weight and
    bias (per replica; summed over replicas when they are shared)."""
    grad = grad.contiguous()
    grad_x = torch.empty_like(x)
    grad_weight = torch.empty_like(save_mean)
    grad_bias = torch.empty_like(save_mean)
    for r in range(x.shape[0]):
        torch.ops.aten.native_batch_norm_backward.out(
            grad[r], x[r], _of_replica(weight, r), None, None, save_mean[r],
            save_invstd[r], True, eps, [True, True, True], out0=grad_x[r],
            out1=grad_weight[r], out2=grad_bias[r])
    if weight is None or weight.dim() == 2:
        return grad_x, grad_weight, grad_bias
    return grad_x, grad_weight.sum(0), grad_bias.sum(0)


@replica_batch_norm_backward.register_fake
def _replica_batch_norm_backward_fake(grad, x, weight, save_mean,
                                      save_invstd, eps):
    affine = torch.empty_like(save_mean)
    if weight is not None and weight.dim() == 1:
        affine = affine[0]
    return torch.empty_like(x), affine, torch.empty_like(affine)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _, _, _, eps = inputs
    _, save_mean, save_invstd, _, _ = output
    ctx.save_for_backward(x, weight, save_mean, save_invstd)
    ctx.eps = eps
    ctx.has_bias = bias is not None


def _backward(ctx, grad, *_):
    x, weight, save_mean, save_invstd = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = replica_batch_norm_backward(
        grad, x, weight, save_mean, save_invstd, ctx.eps)
    return (grad_x, grad_weight if weight is not None else None,
            grad_bias if ctx.has_bias else None, None, None, None, None)


replica_batch_norm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("poptorch::batch_norm_training", mutates_args=())
def batch_norm_training(x: Tensor, weight: Optional[Tensor],
                        bias: Optional[Tensor],
                        running_mean: Optional[Tensor],
                        running_var: Optional[Tensor], momentum: float,
                        eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """One replica's batch norm in training: (output, new running means,
    new running variances; empty without running statistics). Under vmap
    its rule runs all the replicas at once (see the module docstring)."""
    out, _, _, mean, var = replica_batch_norm(
        x.unsqueeze(0), weight, bias, _unsqueezed(running_mean),
        _unsqueezed(running_var), momentum, eps)
    return out[0], mean[0] if mean.numel() else mean, \
        var[0] if var.numel() else var


@batch_norm_training.register_fake
def _batch_norm_training_fake(x, weight, bias, running_mean, running_var,
                              momentum, eps):
    return (torch.empty_like(x), _copy(running_mean, x),
            _copy(running_var, x))


def _unsqueezed(running: Optional[Tensor]) -> Optional[Tensor]:
    return None if running is None else running.unsqueeze(0)


def _vmap_rule(info, in_dims, x, weight, bias, running_mean, running_var,
               momentum, eps):
    """The replicas stacked along dimension 0: the input and the running
    statistics per replica; the affine weight and bias shared, or per
    replica when either is (grouped weights)."""
    x_dim, weight_dim, bias_dim, mean_dim, var_dim = in_dims[:5]
    replicas = info.batch_size
    if weight_dim is not None or bias_dim is not None:
        weight = replicas_first(weight, weight_dim, replicas)
        bias = replicas_first(bias, bias_dim, replicas)
    out, _, _, mean, var = replica_batch_norm(
        replicas_first(x, x_dim, replicas).contiguous(), weight, bias,
        replicas_first(running_mean, mean_dim, replicas),
        replicas_first(running_var, var_dim, replicas), momentum, eps)
    running_dims = 0 if running_mean is not None else None
    return (out, mean, var), (0, running_dims, running_dims)


batch_norm_training.register_vmap(_vmap_rule)


class _RouteBatchNorm(TorchFunctionMode):
    """``F.batch_norm`` in training mode -> ``poptorch::batch_norm_training``
    (the running statistics written back in place, as batch norm does).
    A float16 or bfloat16 input with float32 statistics (the half/float
    rule leaves normalisations as PyTorch runs them), which vmap's rules
    for batch and instance norm mishandle: in evaluation mode it is
    normalised in the statistics' dtype (``_evaluated_in``), and instance
    norm's output gets the input's dtype, as PyTorch's kernels give."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.instance_norm:
            return func(*args, **kwargs).to(_input_of(args, kwargs).dtype)
        if func is not torch.nn.functional.batch_norm:
            return func(*args, **kwargs)
        bound = batch_norm_arguments(*args, **kwargs)
        if not bound["training"] and bound["running_mean"] is not None and \
                bound["running_mean"].dtype != bound["input"].dtype:
            return _evaluated_in(bound["running_mean"].dtype, bound)
        if not bound["training"] or isinstance(bound["momentum"],
                                               CumulativeMomentum):
            # Momentum None: ``CumulativeAverage`` (below) updates the
            # statistics and normalises without running ones, which comes
            # back here.
            return func(*args, **kwargs)
        running: List[Optional[Tensor]] = [bound["running_mean"],
                                           bound["running_var"]]
        out, mean, var = batch_norm_training(
            bound["input"], bound["weight"], bound["bias"], *running,
            float(bound["momentum"]), float(bound["eps"]))
        for tensor, value in zip(running, (mean, var)):
            if tensor is not None:
                tensor.copy_(value)
        return out


def _input_of(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["input"]


def _evaluated_in(dtype: torch.dtype, bound: dict) -> Tensor:
    """Batch norm with running statistics, computed in ``dtype`` and
    returned in the input's dtype."""
    x = bound["input"]
    invstd = torch.rsqrt(bound["running_var"] + bound["eps"])
    scale = invstd if bound["weight"] is None else bound["weight"] * invstd
    shift = -bound["running_mean"] * scale
    if bound["bias"] is not None:
        shift = shift + bound["bias"]
    channels = (-1,) + (1,) * (x.dim() - 2)
    return (x.to(dtype) * scale.view(channels)
            + shift.view(channels)).to(x.dtype)


@contextlib.contextmanager
def per_replica_statistics() -> Iterator[None]:
    """While tracing the vectorised forward pass: batch norm in training
    runs per replica without vmap's copies."""
    with _RouteBatchNorm():
        yield
