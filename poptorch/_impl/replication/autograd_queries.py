"""Questions about autograd that the vectorised replica path cannot answer
as a replica run alone would.

Inside ``torch.func.vmap`` a replica's activations are batched tensors.
They report ``requires_grad`` False, no ``grad_fn``, and refuse
``register_hook``, even where the replica run alone tracks them. A model
that asks would lose its gradient hooks without a word: for example
``if h.requires_grad: h.register_hook(scale)``, or a module's full backward
hooks, which attach only to tensors that require gradients.

``answered_per_replica`` makes such a question fail when the batched
tensor's value does require gradients. The failure sends the model to the
sequential path (``replicas.py``), where each replica runs as the model
alone and its hooks apply.
"""
import torch
from torch._C._functorch import get_unwrapped, is_batchedtensor
from torch.overrides import TorchFunctionMode

from ...errors import Error

_QUESTIONS = {
    torch.Tensor.requires_grad.__get__: "reads requires_grad",
    torch.Tensor.grad_fn.__get__: "reads grad_fn",
    torch.Tensor.is_leaf.__get__: "reads is_leaf",
    torch.Tensor.register_hook: "registers a gradient hook",
    torch.Tensor.retain_grad: "calls retain_grad",
}


def _tracked(tensor: torch.Tensor) -> bool:
    """Whether the value under vmap's batched ``tensor`` requires
    gradients."""
    while is_batchedtensor(tensor):
        tensor = get_unwrapped(tensor)
    return tensor.requires_grad


class _PerReplicaQuestions(TorchFunctionMode):

    def __torch_function__(self, func, types, args=(), kwargs=None):
        question = _QUESTIONS.get(func)
        if (question is not None and args and
                isinstance(args[0], torch.Tensor) and
                is_batchedtensor(args[0]) and _tracked(args[0])):
            raise Error(f"the model {question} of an activation, which "
                        "vmap's batched tensors do not answer as the "
                        "replica's own tensor would (gradient hooks)")
        return func(*args, **(kwargs or {}))


def answered_per_replica() -> TorchFunctionMode:
    """A context in which a question about autograd on a batched tensor
    whose value requires gradients raises ``poptorch.Error``."""
    return _PerReplicaQuestions()
