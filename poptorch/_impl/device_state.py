"""The model's state on its device: parameters, buffers (one set per replica
when replicas keep their own buffers) and optimizer state. Copies to and from
the user's module go through here."""
from typing import List

import torch


def _copy(tensors: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    return [t.detach().to(device, copy=True) for t in tensors]


class DeviceState:
    """Device copies of a module's parameters and buffers, by name."""

    def __init__(self, module: torch.nn.Module, device: torch.device,
                 buffer_sets: int = 1) -> None:
        self.device = device
        self.buffer_sets = buffer_sets
        self.param_names = [n for n, _ in module.named_parameters()]
        self.buffer_names = [n for n, _ in module.named_buffers()]
        self.params: List[torch.Tensor] = []
        self.buffers: List[List[torch.Tensor]] = []
        self.optimizer: List[torch.Tensor] = []
        self.load_from_host(module)

    def _host_tensors(self, module: torch.nn.Module):
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        return ([params[n] for n in self.param_names],
                [buffers[n] for n in self.buffer_names])

    def load_from_host(self, module: torch.nn.Module) -> None:
        """Copy the module's parameters and buffers to the device."""
        params, buffers = self._host_tensors(module)
        self.params = _copy(params, self.device)
        self.buffers = [_copy(buffers, self.device)
                        for _ in range(self.buffer_sets)]

    @torch.no_grad()
    def store_to_host(self, module: torch.nn.Module) -> None:
        """Copy parameters and the first replica's buffers to the module."""
        params, buffers = self._host_tensors(module)
        if params:
            torch._foreach_copy_(params, self.params)
        if buffers:
            torch._foreach_copy_(buffers, self.buffers[0])

    def move(self, device: torch.device) -> None:
        """Move every state tensor to ``device`` (attach / detach)."""
        self.device = device
        self.params = _copy(self.params, device)
        self.buffers = [_copy(b, device) for b in self.buffers]
        self.optimizer = _copy(self.optimizer, device)
