"""The model's state on its device: parameters, buffers (one set per replica
when replicas keep their own buffers) and optimizer state. Copies to and from
the user's module go through here."""
from typing import Dict, List

import torch

from ..errors import Error
from .logger import warn_once


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
        #: Where each host parameter and buffer was stored and how often it
        #: had been written when the last copy between them and the device
        #: was made (``host_changed``).
        self._host_marks: List[tuple] = []
        #: The host tensors those marks are of.
        self._host_copied: List[torch.Tensor] = []
        #: With sharded weights (``distributed/weight_sharding.py``), the
        #: ``WeightRows`` of the parameters kept as this process's rows.
        self.rows = None
        self.load_from_host(module)

    def _host_tensors(self, module: torch.nn.Module):
        """The module's parameters and buffers of the compiled names;
        ``poptorch.Error`` when some are gone."""
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        gone = ([n for n in self.param_names if n not in params] +
                [n for n in self.buffer_names if n not in buffers])
        if gone:
            raise Error(
                f"The module's parameters or buffers {gone} are gone since "
                "the model was compiled (torch.nn.utils.prune and "
                "parametrizations move a weight to a new name): call "
                "destroy() to compile the model again for the module as it "
                "is now.")
        return ([params[n] for n in self.param_names],
                [buffers[n] for n in self.buffer_names])

    def load_from_host(self, module: torch.nn.Module) -> None:
        """Copy the module's parameters and buffers to the device; after the
        first copy, ``poptorch.Error`` (before anything changes) when one of
        them no longer has the shape and dtype compiled for."""
        params, buffers = self._host_tensors(module)
        if self.params:
            self._check_compiled_like(
                zip(self.param_names, params, self.whole_shaped_params()),
                "parameter")
            self._check_compiled_like(
                zip(self.buffer_names, buffers, self.buffers[0]), "buffer")
        self.params = _copy(params, self.device)
        if self.rows is not None:
            self._cut_into_rows()
        self.buffers = [_copy(buffers, self.device)
                        for _ in range(self.buffer_sets)]
        self._remember_host(params + buffers)

    @staticmethod
    def _check_compiled_like(named, kind: str) -> None:
        for name, host, device in named:
            if host.shape != device.shape or host.dtype != device.dtype:
                raise Error(
                    f"The host's {kind} '{name}' is {_describe(host)} but "
                    f"the model was compiled for {_describe(device)}, so it "
                    "cannot be copied to the device. Call destroy() to "
                    "compile the model again for the new weights.")

    def keep_rows(self, rows) -> None:
        """From now on keep the weights that ``rows`` (a ``WeightRows``)
        shards as this process's rows of them."""
        self.rows = rows
        self._cut_into_rows()

    def _cut_into_rows(self) -> None:
        """Keep only this process's rows of the sharded weights in
        ``params``, and serve them to the other processes."""
        self.params = self.rows.cut(self.params)
        self.rows.publish(self.params)

    def whole_params(self) -> List[torch.Tensor]:
        """The parameters whole: the sharded ones gathered from every
        process."""
        if self.rows is None:
            return self.params
        return self.rows.whole(self.params)

    def whole_shaped_params(self) -> List[torch.Tensor]:
        """The parameters, or for sharded ones a tensor of no memory with
        the whole parameter's shape, dtype and device."""
        if self.rows is None:
            return self.params
        return self.rows.whole_shaped(self.params)

    def after_call(self, completed: bool) -> None:
        """A training call ended (``completed``, or failed and rolled
        back): sharded weights serve their rows after it."""
        if self.rows is not None:
            self.rows.after_call(completed, self.params)

    @torch.no_grad()
    def load_buffers_from_host(self, buffers: Dict[str, torch.Tensor]
                               ) -> None:
        """Copy host ``buffers`` (name -> tensor) into the device buffers of
        those names, in every buffer set, in place: nothing else changes
        on the device."""
        for name, host in buffers.items():
            index = self.buffer_names.index(name)
            for buffer_set in self.buffers:
                device = buffer_set[index]
                if host.shape != device.shape or host.dtype != device.dtype:
                    raise Error(
                        f"copyNamedBuffersToDevice: buffer '{name}' is "
                        f"{_describe(host)} on the host but the model was "
                        f"compiled for {_describe(device)}; call destroy() "
                        "to compile the model again for the new buffer")
                device.copy_(host)
            self._host_marks[len(self.param_names) + index] = \
                _marks([host])[0]

    @torch.no_grad()
    def store_to_host(self, module: torch.nn.Module) -> None:
        """Copy parameters and the first replica's buffers to the module
        (a change the program made to them in place since the last copy,
        which the copy replaces, is logged once)."""
        params, buffers = self._host_tensors(module)
        changed = self._changed(params + buffers)
        if changed:
            warn_once(
                f"{changed} changed on the host since the model last copied "
                "its weights to or from the device, and copying the "
                "device's weights to the host now replaces the change: call "
                "copyWeightsToDevice() after changing weights or buffers in "
                "place (as PopTorch, the device does not see such changes "
                "otherwise).")
        if params:
            torch._foreach_copy_(params, self.whole_params())
        if buffers:
            torch._foreach_copy_(buffers, self.buffers[0])
        self._remember_host(params + buffers)

    def _remember_host(self, host: List[torch.Tensor]) -> None:
        self._host_copied = host
        self._host_marks = _marks(host)

    def host_edited(self) -> List[str]:
        """``host_changed`` of the tensors of the last copy, without looking
        the module's tensors up again (cheap enough for every call)."""
        return self._changed(self._host_copied)

    def host_changed(self, module: torch.nn.Module) -> List[str]:
        """The names of the module's parameters and buffers written in
        place (or given other storage) since the last copy between them
        and the device. Writes through ``.data`` are not seen."""
        params, buffers = self._host_tensors(module)
        return self._changed(params + buffers)

    def _changed(self, host: List[torch.Tensor]) -> List[str]:
        """The names of the ``host`` tensors (parameters, then buffers)
        whose marks differ from those of the last copy."""
        names = self.param_names + self.buffer_names
        return [name for name, mark, now in zip(
            names, self._host_marks, _marks(host)) if mark != now]

    def move(self, device: torch.device) -> None:
        """Move every state tensor to ``device`` (attach / detach)."""
        self.device = device
        self.params = _copy(self.params, device)
        self.buffers = [_copy(b, device) for b in self.buffers]
        self.optimizer = _copy(self.optimizer, device)


def _marks(tensors: List[torch.Tensor]) -> List[tuple]:
    return [(t.data_ptr(), t._version) for t in tensors]


def _describe(tensor: torch.Tensor) -> str:
    return f"a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"


def updatable_buffers(module: torch.nn.Module,
                      names: List[str]) -> Dict[str, torch.Tensor]:
    """The module's buffers listed in ``options.updatableNamedBuffers``
    (``names``), by name; ``poptorch.Error`` when the list is empty or
    names something that is not a buffer of the module."""
    if not names:
        raise Error("copyNamedBuffersToDevice: no buffer is updatable; list "
                    "the buffers to copy with options.updatableNamedBuffers"
                    "([...]) before wrapping the model")
    buffers = dict(module.named_buffers())
    unknown = [name for name in names if name not in buffers]
    if unknown:
        raise Error(f"options.updatableNamedBuffers: {unknown} are not "
                    "buffers of the model; its buffers are "
                    f"{sorted(buffers)}")
    return {name: buffers[name] for name in names}
