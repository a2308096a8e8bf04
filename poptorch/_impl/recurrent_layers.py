"""Recurrent layers (``LSTM``, ``GRU``, ``RNN``) in captured training steps.

Traced operation by operation, a recurrent layer unrolls into a few
operations per time step and direction: capturing it takes time in
proportion to the sequence length (seconds at 20 steps, minutes at the
lengths of speech frames), and the captured step runs each of those small
operations on its own. While the forward pass of a training step is
captured (grad mode on), ``RecurrentLayersAsOps`` therefore turns each
``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu``
call on padded sequences into one ``poptorch::recurrent_layer`` node per
layer, with the dropout between layers (``dropout``, in training) traced as
an ordinary operation in between, as PyTorch applies it:

* its forward kernel is PyTorch's own function for one layer (oneDNN's or
  cuDNN's kernels included), run with grad mode off;
* its backward, ``poptorch::recurrent_layer_backward``, runs that function
  again with grad mode on and takes PyTorch's own gradients of it. The
  layer's forward computation runs twice per step (once in each pass) in
  exchange for a capture that does not depend on the sequence length and
  for gradients that are PyTorch's.

Replicas (vmap) run the layer once per replica. Inference captures, packed
sequences (refused later with an explanation), calls with keyword arguments
and calls under ``torch.autocast`` (whose casts depend on the function)
keep PyTorch's functions as they are; for a training capture these run
with oneDNN off, since oneDNN's LSTM fills the workspace its backward
kernel reads only under grad mode, which a captured backward pass does not
have.
"""
import contextlib
from typing import Callable, Dict, Iterator, List, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .replica_stacking import per_replica_rule

_RECURRENT: Dict[Callable, str] = {
    torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh",
    torch.rnn_relu: "rnn_relu"}


def _one_layer(kind: str, input: Tensor, hx: Sequence[Tensor],
               params: Sequence[Tensor], has_biases: bool, train: bool,
               bidirectional: bool, batch_first: bool) -> List[Tensor]:
    """[output, h_n] (and c_n for an LSTM) of PyTorch's function for one
    layer without dropout."""
    function = getattr(torch, kind)
    state = tuple(hx) if kind == "lstm" else hx[0]
    return list(function(input, state, list(params), has_biases, 1, 0.0,
                         train, bidirectional, batch_first))


@torch.library.custom_op("poptorch::recurrent_layer", mutates_args=())
def recurrent_layer(kind: str, input: Tensor, hx: List[Tensor],
                    params: List[Tensor], has_biases: bool, train: bool,
                    bidirectional: bool, batch_first: bool) -> List[Tensor]:
    """One layer of ``torch.<kind>``: [output, h_n] (and c_n for an LSTM),
    contiguous."""
    with torch.no_grad():
        results = _one_layer(kind, input, hx, params, has_biases, train,
                             bidirectional, batch_first)
    return _unshared(results)


@recurrent_layer.register_fake
def _recurrent_layer_fake(kind, input, hx, params, has_biases, train,
                          bidirectional, batch_first):
    state_size = hx[0].shape[-1]
    directions = 2 if bidirectional else 1
    output = input.new_empty((*input.shape[:-1], directions * state_size))
    return [output, *(state.new_empty(state.shape) for state in hx)]


@torch.library.custom_op("poptorch::recurrent_layer_backward",
                         mutates_args=())
def recurrent_layer_backward(kind: str, input: Tensor, hx: List[Tensor],
                             params: List[Tensor], grads: List[Tensor],
                             has_biases: bool, train: bool,
                             bidirectional: bool,
                             batch_first: bool) -> List[Tensor]:
    """The gradients for [input, *hx, *params] of ``recurrent_layer``
    given ``grads`` for its outputs: PyTorch's, from the layer run again
    with autograd and grad mode on (oneDNN's LSTM fills the workspace of
    its backward kernel only then)."""
    with _autograd_in_kernel(), torch.enable_grad():
        leaves = [tensor.detach().requires_grad_()
                  for tensor in (input, *hx, *params)]
        outputs = _one_layer(kind, leaves[0], leaves[1:1 + len(hx)],
                             leaves[1 + len(hx):], has_biases, train,
                             bidirectional, batch_first)
        gradients = torch.autograd.grad(outputs, leaves, grads,
                                        allow_unused=True)
    return _unshared([torch.zeros_like(leaf) if gradient is None
                      else gradient
                      for leaf, gradient in zip(leaves, gradients)])


@contextlib.contextmanager
def _autograd_in_kernel() -> Iterator[None]:
    """Autograd back on inside an operator's kernel, which runs below it.
    (``torch.func.vjp`` would bring it back too, but computes the
    backward differentiably, which for oneDNN's LSTM means its step by
    step formula instead of its backward kernel: 7 times slower.)"""
    key = torch._C.DispatchKey.AutogradFunctionality
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


def _unshared(tensors: Sequence[Tensor]) -> List[Tensor]:
    """``tensors`` contiguous, each with its own storage (a custom op's
    outputs may not alias each other: oneDNN's LSTM gives both of a
    layer's biases one gradient tensor)."""
    seen = set()
    result = []
    for tensor in tensors:
        tensor = tensor.contiguous()
        storage = tensor.untyped_storage().data_ptr()
        result.append(tensor.clone() if storage in seen else tensor)
        seen.add(storage)
    return result


@recurrent_layer_backward.register_fake
def _recurrent_layer_backward_fake(kind, input, hx, params, grads,
                                   has_biases, train, bidirectional,
                                   batch_first):
    return [tensor.new_empty(tensor.shape) for tensor in (input, *hx, *params)]


def _setup_context(ctx, inputs, output) -> None:
    kind, input, hx, params, *flags = inputs
    ctx.save_for_backward(input, *hx, *params)
    ctx.kind, ctx.states, ctx.flags = kind, len(hx), flags


def _backward(ctx, grads):
    input, *rest = ctx.saved_tensors
    hx, params = rest[:ctx.states], rest[ctx.states:]
    gradients = recurrent_layer_backward(ctx.kind, input, hx, params,
                                         list(grads), *ctx.flags)
    return (None, gradients[0], gradients[1:1 + ctx.states],
            gradients[1 + ctx.states:], None, None, None, None)


recurrent_layer.register_autograd(_backward, setup_context=_setup_context)
recurrent_layer.register_vmap(per_replica_rule(recurrent_layer))


def _layer_slices(items: Sequence[Tensor], layers: int) -> List[List[Tensor]]:
    """``items`` (the flat weights, or the states' first dimension) split
    into ``layers`` equal consecutive parts."""
    size = len(items) // layers
    return [list(items[layer * size:(layer + 1) * size])
            for layer in range(layers)]


def _layers_as_ops(kind: str, input: Tensor, hx, params: Sequence[Tensor],
                   has_biases: bool, num_layers: int, dropout: float,
                   train: bool, bidirectional: bool, batch_first: bool):
    """``torch.<kind>``'s result, one ``recurrent_layer`` per layer."""
    states = list(hx) if kind == "lstm" else [hx]
    directions = 2 if bidirectional else 1
    weights = _layer_slices(params, num_layers)
    finals: List[List[Tensor]] = []
    for layer in range(num_layers):
        layer_states = [state[layer * directions:(layer + 1) * directions]
                        for state in states]
        input, *layer_finals = recurrent_layer(
            kind, input, layer_states, weights[layer], has_biases, train,
            bidirectional, batch_first)
        finals.append(layer_finals)
        if dropout and train and layer < num_layers - 1:
            input = torch.dropout(input, dropout, True)
    stacked = [torch.cat(per_layer) for per_layer in zip(*finals)]
    return (input, *stacked)


def _on_padded_sequences(args, kwargs) -> bool:
    """Whether a call has the positional arguments of the padded-sequence
    form ``(input, hx, params, has_biases, num_layers, dropout, train,
    bidirectional, batch_first)`` (the packed form has ``batch_sizes``
    second and no ``batch_first``)."""
    return not kwargs and len(args) == 9 and isinstance(args[3], bool)


def _under_autocast(tensor: Tensor) -> bool:
    return torch.is_autocast_enabled(tensor.device.type)


class RecurrentLayersAsOps(TorchFunctionMode):
    """Recurrent functions traced for a backward pass become one
    ``recurrent_layer`` per layer (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _RECURRENT.get(func)
        if kind is None or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if _on_padded_sequences(args, kwargs) \
                and not _under_autocast(args[0]):
            return _layers_as_ops(kind, *args)
        with _one_dnn_off():
            return func(*args, **kwargs)


@contextlib.contextmanager
def _one_dnn_off() -> Iterator[None]:
    """oneDNN off (only its on/off switch: ``torch.backends.mkldnn.flags``
    also sets TF32, which warns on builds without Intel GPUs)."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled
