"""Recurrent layers (``LSTM``, ``GRU``, ``RNN``) in captured training steps.

On the CPU PyTorch runs these layers with oneDNN's ``mkldnn_rnn_layer``,
whose forward kernel fills the workspace that its backward kernel reads
only while autograd's grad mode is on. A captured training step runs its
backward pass as plain operations with grad mode off, so the backward
kernel would find no workspace. While the forward pass of a training step
is captured (grad mode on), ``RecurrentLayersWithoutOneDnn`` therefore
runs the recurrent functions with oneDNN turned off for that call only:
they are traced into PyTorch's own cell operations, which compute the
same recurrences (up to rounding). Inference captures keep oneDNN.
"""
import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_RECURRENT = frozenset({torch.lstm, torch.gru, torch.rnn_tanh,
                        torch.rnn_relu})


class RecurrentLayersWithoutOneDnn(TorchFunctionMode):
    """Recurrent functions traced for a backward pass skip oneDNN."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RECURRENT and torch.is_grad_enabled():
            with _one_dnn_off():
                return func(*args, **kwargs)
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
