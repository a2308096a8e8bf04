"""Loss discovery (docs/semantics.md, "Losses in training").

While a training model is captured, every call of a torch loss function (the
``torch.nn.functional`` losses, which the ``torch.nn`` loss modules call) and
every ``poptorch.identity_loss`` is recorded in call order. The final loss is
the recorded loss that no other recorded loss depends on; the capture finds it
by graph reachability, and starts the backward pass from it, or from the
single-element tensor ``forward`` returns that is the model's total loss
(``backward_start.py``). A loss computed under ``torch.no_grad()`` (a
metric) is not recorded: nothing can be trained on it; nor is one computed
inside a ``torch.func`` transform that ``forward`` applies (``vmap`` of a
loss function, per-sample gradients): it is part of the graph, and its
value does not exist outside the transform.
"""
import contextlib
import traceback
from typing import ContextManager, List, Optional

import torch
import torch.nn.functional as F
from torch._C._functorch import maybe_current_level
from torch.overrides import TorchFunctionMode

from ..errors import Error
from .compile_errors import describe_frame, user_frame

_EXTRA_LOSS_NAMES = ("cross_entropy", "binary_cross_entropy",
                     "binary_cross_entropy_with_logits", "kl_div")

LOSS_FUNCTIONS = frozenset(
    getattr(F, name) for name in dir(F)
    if name.endswith("_loss") or name in _EXTRA_LOSS_NAMES)

IDENTITY_LOSS_REDUCTIONS = ("sum", "mean", "none")

_active_recorders: List["LossRecorder"] = []


class LossRecorder(TorchFunctionMode):
    """Records the results of loss functions called while it is active, and
    the user's source line that called each."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: List[torch.Tensor] = []
        self.places: List[str] = []
        self._level = maybe_current_level()

    def record(self, loss: torch.Tensor) -> None:
        if not torch.is_grad_enabled() or \
                maybe_current_level() != self._level:
            return
        self.losses.append(loss)
        self.places.append(describe_frame(user_frame(
            traceback.extract_stack())))

    def __enter__(self):
        _active_recorders.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active_recorders.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in LOSS_FUNCTIONS and isinstance(result, torch.Tensor):
            self.record(result)
        return result


def recording_mode(training: bool) -> ContextManager[None]:
    """Grad mode on while a training model's forward pass is traced, as
    the training step traces it, so that the losses recorded are the same
    in every trace (those under the model's own ``torch.no_grad()`` are
    not); an inference trace keeps the caller's mode."""
    return torch.enable_grad() if training else contextlib.nullcontext()


def _active_recorder() -> Optional[LossRecorder]:
    return _active_recorders[-1] if _active_recorders else None


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the loss the backward pass starts from.

    ``reduction`` is "sum", "mean" or "none", applied as in PyTorch loss
    functions. Several identity losses may be used in one model provided they
    all feed a single final loss, itself marked by ``identity_loss``.
    """
    if reduction not in IDENTITY_LOSS_REDUCTIONS:
        raise Error(f"identity_loss: reduction must be one of "
                    f"{', '.join(repr(r) for r in IDENTITY_LOSS_REDUCTIONS)},"
                    f" got {reduction!r}")
    if not isinstance(x, torch.Tensor):
        raise Error(f"identity_loss: x must be a torch.Tensor, got "
                    f"{type(x).__name__}")
    if reduction == "sum":
        loss = x.sum()
    elif reduction == "mean":
        loss = x.mean()
    else:
        loss = x
    recorder = _active_recorder()
    if recorder is not None:
        recorder.record(loss)
    return loss


NO_LOSS_MESSAGE = (
    "The training model computed no loss. A training model must compute its "
    "loss inside forward(), with a torch loss function or module (for example "
    "torch.nn.functional.cross_entropy) or by wrapping a custom loss in "
    "poptorch.identity_loss(loss, reduction='mean'|'sum'|'none').")

SEVERAL_LOSSES_MESSAGE = (
    "The training model computed {count} unrelated final losses ({where}). The "
    "backward pass starts from one final loss: combine them into one tensor "
    "and wrap it in poptorch.identity_loss, for example "
    "poptorch.identity_loss(loss_a + loss_b, reduction='none'). A loss "
    "computed only to be returned (a metric, a detached per-sample loss) "
    "can be computed under torch.no_grad(), so that it is not taken for a "
    "training loss.")

NO_GRADIENT_MESSAGE = (
    "The training model's loss ({where}) does not require gradients: it is "
    "computed from detached tensors (.detach()), under torch.no_grad(), or "
    "from no parameter that requires gradients, so PyTorch's "
    "loss.backward() would fail on it too. Compute the loss from the "
    "model's outputs without detaching them; to run the model without "
    "training anything, set requires_grad=False on its parameters.")

SEVERAL_TOTALS_MESSAGE = (
    "The training model returns several single-element values computed "
    "from its loss with further terms (outputs {positions} of its flattened "
    "tensor outputs), none computed from the others, so it is not clear "
    "which one to train on: wrap that one in poptorch.identity_loss, for "
    "example poptorch.identity_loss(total, reduction='none').")
