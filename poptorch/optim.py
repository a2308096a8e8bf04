"""PopTorch optimizers (API reference 11.6, user guide "Optimizers").

``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` subclass the matching
torch.optim class; ``LAMB`` subclasses ``torch.optim.Optimizer``. All five
also subclass ``poptorch.optim.Optimizer``, their common base class. Every
constructor argument left at None takes the documented default (torch's
default for torch's arguments). Besides torch's hyper-parameters they have
PopTorch's extra attributes (``loss_scaling``, ``velocity_scaling``,
``max_grad_norm``, the accumulation types, ...), readable and settable on the
optimizer (``opt.loss_scaling = 2.0``) and in each param group; all of them
except ``velocity_scaling`` and LAMB's ``max_weight_norm`` must be the same in
every param group.

``variable_attrs`` says which attributes are variable (can be changed after
compilation and applied with ``setOptimizer``) and which are constant: the
attributes passed to the constructor are variable, the others constant, and
``lr`` is always variable; ``markAsConstant``/``markAsVariable`` override this
before compiling.

``step()`` runs on the host with the same update as a training model, so a
user can compare the two. ``loss_scaling`` has no effect on the host: the loss
is scaled only inside a training model, whose gradients are unscaled before
the update.

Accumulation types (user guide, "Accumulation types"): ``accum_type`` is the
dtype of the gradient accumulation buffer, ``velocity_accum_type`` (SGD) and
``first_order_momentum_accum_type`` / ``second_order_momentum_accum_type``
(Adam, AdamW, RMSprop, LAMB) the dtypes of the optimizer state. As in
PopTorch, each defaults to torch.float32 (None means that default), whatever
the parameters' dtype: a float16 model keeps float32 optimizer state and
gradient sums, and each update is computed in float32 and rounded to the
parameter's dtype. Pass ``torch.float16`` to halve the state's memory. A
torch.optim optimizer given to a training model gets the same float32
defaults.
"""
import math
from typing import Iterable, Optional, Tuple

import torch

from ._impl.optimizers import adam, lamb, rmsprop, sgd
from ._impl.optimizers.poptorch_optimizer import PoptorchOptimizer, VariableAttributes
from .errors import Error

__all__ = ["VariableAttributes", "Optimizer", "SGD", "Adam", "AdamW",
           "RMSprop", "LAMB"]

_ADAM_EXTRAS = {
    "loss_scaling": 1.0,
    "accum_type": torch.float32,
    "first_order_momentum_accum_type": torch.float32,
    "second_order_momentum_accum_type": torch.float32,
    "max_grad_norm": math.inf,
}


class Optimizer(PoptorchOptimizer):
    """The base class of the PopTorch optimizers: ``isinstance(optimizer,
    poptorch.optim.Optimizer)`` tells them from torch.optim ones. Each
    PopTorch optimizer also subclasses a ``torch.optim`` class."""


class SGD(Optimizer, torch.optim.SGD):
    """Stochastic gradient descent with optional momentum, as
    torch.optim.SGD, with optional loss and velocity scaling.

    Two variants compute torch's maths (with momentum):

    * separate tensors (``use_combined_accum=False``, default): the velocity
      is a state tensor of dtype ``velocity_accum_type``; gradients are
      accumulated in ``accum_type`` (both float32 by default);
      ``velocity_scaling`` is ignored;
    * combined (``use_combined_accum=True``): the velocity is stored
      multiplied by ``velocity_scaling``, in the parameter's dtype, and
      divided by it when the parameters are updated; ``accum_type`` and
      ``velocity_accum_type`` are ignored. A new ``velocity_scaling``
      rescales the stored velocity exactly.

    With ``momentum == 0`` the simple update is used and the variant settings
    are ignored. ``max_grad_norm`` (default inf: no clipping) clips the global
    gradient norm.
    """

    extra_defaults = {
        "loss_scaling": 1.0,
        "velocity_scaling": 1.0,
        "use_combined_accum": False,
        "accum_type": torch.float32,
        "velocity_accum_type": torch.float32,
        "max_grad_norm": math.inf,
    }
    variable_candidates = ("lr", "momentum", "dampening", "weight_decay",
                           "nesterov", "maximize", "loss_scaling",
                           "velocity_scaling", "max_grad_norm")
    rule_for_group = staticmethod(sgd.rule_for_group)

    def __init__(self, params: Iterable, lr: float,
                 momentum: Optional[float] = None,
                 dampening: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 nesterov: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 velocity_scaling: Optional[float] = None,
                 use_combined_accum: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 velocity_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        arguments = dict(
            lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
            foreach=foreach, differentiable=differentiable,
            loss_scaling=loss_scaling, velocity_scaling=velocity_scaling,
            use_combined_accum=use_combined_accum, accum_type=accum_type,
            velocity_accum_type=velocity_accum_type,
            max_grad_norm=max_grad_norm)
        super().__init__(params, **self._prepare(arguments))
        self._finish()


class Adam(Optimizer, torch.optim.Adam):
    """Adam, as torch.optim.Adam, with optional loss scaling, accumulation
    types for the gradients and both moments (``accum_type``,
    ``first_order_momentum_accum_type``, ``second_order_momentum_accum_type``,
    each float32 by default), and gradient clipping (``max_grad_norm``,
    default inf). AMSGrad is not supported."""

    extra_defaults = dict(_ADAM_EXTRAS)
    variable_candidates = ("lr", "betas", "eps", "weight_decay", "maximize",
                           "loss_scaling", "max_grad_norm")
    rule_for_group = staticmethod(adam.rule_for_group)

    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        arguments = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            loss_scaling=loss_scaling, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type,
            max_grad_norm=max_grad_norm)
        super().__init__(params, **self._prepare(arguments))
        self._finish()


class AdamW(Optimizer, torch.optim.AdamW):
    """Adam with decoupled weight decay, as torch.optim.AdamW, with optional
    loss scaling, accumulation types (float32 by default) and gradient
    clipping. ``bias_correction=False`` drops Adam's bias corrections
    (default True). AMSGrad is not supported."""

    extra_defaults = dict(_ADAM_EXTRAS, bias_correction=True)
    variable_candidates = ("lr", "betas", "eps", "weight_decay", "maximize",
                           "loss_scaling", "bias_correction", "max_grad_norm")
    rule_for_group = staticmethod(adam.rule_for_group)

    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        arguments = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, loss_scaling=loss_scaling,
            bias_correction=bias_correction, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type,
            max_grad_norm=max_grad_norm)
        super().__init__(params, **self._prepare(arguments))
        self._finish()


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with optional L2 penalty, as torch.optim.RMSprop, with
    optional loss scaling and accumulation types (float32 by default:
    ``second_order_momentum_accum_type`` for the average of squared
    gradients, ``first_order_momentum_accum_type`` for the momentum buffer
    and the centred average of gradients).

    ``use_tf_variant=True`` gives TensorFlow's variant instead: the average of
    squared gradients starts at ones, epsilon is added inside the square root,
    and the learning rate is accumulated in the momentum buffer.
    """

    extra_defaults = {
        "loss_scaling": 1.0,
        "accum_type": torch.float32,
        "first_order_momentum_accum_type": torch.float32,
        "second_order_momentum_accum_type": torch.float32,
        "use_tf_variant": False,
    }
    variable_candidates = ("lr", "alpha", "eps", "weight_decay", "momentum",
                           "centered", "maximize", "loss_scaling",
                           "use_tf_variant")
    rule_for_group = staticmethod(rmsprop.rule_for_group)

    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 alpha: Optional[float] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 momentum: Optional[float] = None,
                 centered: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 use_tf_variant: Optional[bool] = None) -> None:
        arguments = dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
            momentum=momentum, centered=centered, foreach=foreach,
            maximize=maximize, differentiable=differentiable,
            loss_scaling=loss_scaling, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type,
            use_tf_variant=use_tf_variant)
        super().__init__(params, **self._prepare(arguments))
        self._finish()


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB).

    From "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes" (You et al. 2019). Per parameter tensor ``w``, with Adam's
    moments ``m`` and ``v`` (bias-corrected unless
    ``bias_correction=False``), the update ``u = m / (sqrt(v) + eps) +
    weight_decay * w`` is applied as ``w -= lr * phi(||w||) / ||u|| * u``,
    with ``phi(z) = min(z, max_weight_norm)`` (``max_weight_norm=None``: no
    clamping) and a ratio of 1 when ``phi(||w||)`` or ``||u||`` is 0: so
    ``max_weight_norm=0`` in a param group gives its parameters plain Adam
    steps without the layer-wise adaptation (Optimum Graphcore's BERT
    recipes put the biases in such a group).

    Defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-8``,
    ``weight_decay=1e-2``, ``bias_correction=True``, ``loss_scaling=1.0``,
    ``max_weight_norm=None``, accumulation types ``torch.float32``. The
    spec leaves ``bias_correction``'s default open; True is Graphcore's
    PopTorch default and the paper's algorithm, and the form Optimum
    Graphcore calls plain LAMB (``--lamb``, against
    ``--lamb_no_bias_correction``). Without the correction, parameters with
    the layer-wise adaptation off (``max_weight_norm=0``) take first steps
    up to several times larger, and weight decay weighs differently in the
    others' updates.
    """

    extra_defaults = {
        "bias_correction": True,
        "loss_scaling": 1.0,
        "max_weight_norm": None,
        "accum_type": torch.float32,
        "first_order_momentum_accum_type": torch.float32,
        "second_order_momentum_accum_type": torch.float32,
    }
    variable_candidates = ("lr", "betas", "eps", "weight_decay",
                           "bias_correction", "loss_scaling", "max_weight_norm")
    rule_for_group = staticmethod(lamb.rule_for_group)
    _DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                 "weight_decay": 1e-2}

    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 max_weight_norm: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None
                 ) -> None:
        arguments = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, loss_scaling=loss_scaling,
            max_weight_norm=max_weight_norm, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type)
        defaults = dict(self._DEFAULTS, **self._prepare(arguments))
        _check_lamb_hyper_parameters(defaults)
        super().__init__(params, defaults)
        self._finish()


def _check_lamb_hyper_parameters(values: dict) -> None:
    problems = []
    if not values["lr"] >= 0:
        problems.append(f"lr {values['lr']!r} (must be >= 0)")
    if not values["eps"] >= 0:
        problems.append(f"eps {values['eps']!r} (must be >= 0)")
    if not values["weight_decay"] >= 0:
        problems.append(f"weight_decay {values['weight_decay']!r} (must be >= 0)")
    betas = values["betas"]
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        problems.append(f"betas {betas!r} (must be two numbers in [0, 1))")
    if problems:
        raise Error("LAMB: invalid " + ", ".join(problems))
