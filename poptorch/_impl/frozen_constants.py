"""Values a compiled model holds as constants, frozen at compilation as
PopTorch freezes them: tensors that are not parameters, buffers or
arguments (plain tensor attributes, closure tensors;
``tracing_context.GraphConstants``), and the plain Python attributes of the
module and its sub-modules (a temperature, a curriculum's length,
``dropout.p``), the train/eval modes of the sub-modules and the hooks of
the sub-modules, of their parameters and torch's global module hooks
(traced into the graph as they were). A program that changes one on the
host between calls (a per-epoch class weighting, an annealed temperature,
``bn.eval()`` on a frozen backbone's BatchNorm layers, a forward hook
added for one epoch) would otherwise see no effect without a word: the
first change is reported once, naming the attribute and what to do
instead. Modes changed for the whole module at once (``module.eval()``
before running an inference model of it) are the usual way of
alternating training and validation, and are not reported."""
from typing import Dict, List, Tuple

import torch
import torch.nn.modules.module as module_hooks

from .logger import warn_once
from .weight_sync import host_reads_suspended

_PLAIN_TYPES = (bool, int, float, str)


class FrozenConstants:
    """The user's tensors a compilation read as constants, how often each
    had been written when it was compiled, and the module's plain Python
    attributes then."""

    def __init__(self, module: torch.nn.Module,
                 tensors: List[torch.Tensor]) -> None:
        self._module = module
        self._constants = tensors
        self._reported = False
        self.remember_values()

    def remember_values(self) -> None:
        """Take the values now as those compiled in: at compilation, and
        after each call, whose host code (``poptorch.CPU`` functions) may
        change the module's attributes as it runs."""
        if self._reported:
            return
        self._tensors = [(tensor, tensor._version)
                         for tensor in self._constants]
        self._attributes, self._modes, self._hooks = _watched(self._module)

    def report_changes(self) -> None:
        """Warn once when a constant has changed since the last call."""
        if self._reported:
            return
        changed = [tensor for tensor, version in self._tensors
                   if tensor._version != version]
        if changed:
            self._warn(f"Tensors that forward reads as constants "
                       f"({self._tensor_names(changed)})",
                       "register it as a buffer (module.register_buffer) "
                       "and call copyWeightsToDevice(), or pass it as an "
                       "argument")
            return
        attributes, modes, hooks = _watched(self._module)
        if attributes != self._attributes:
            name = next(name for name in sorted(attributes.keys() |
                                                self._attributes.keys())
                        if attributes.get(name) != self._attributes.get(name))
            self._warn(f"The attribute '{name}' of the wrapped module "
                       f"({self._attributes.get(name)!r} when compiled, now "
                       f"{attributes.get(name)!r})",
                       "keep the value in a buffer (module.register_buffer) "
                       "and call copyWeightsToDevice(), or pass it as an "
                       "argument")
        elif modes != self._modes and len(set(modes.values())) > 1:
            self._warn_mode_change(modes)
        elif hooks != self._hooks:
            path, kind = next(key for key in sorted(hooks.keys() |
                                                    self._hooks.keys())
                              if hooks.get(key) != self._hooks.get(key))
            self._reported = True
            subject = (f"torch's {kind}" if kind.startswith("global")
                       else f"The {kind} of "
                       f"'{path or type(self._module).__name__}' in the "
                       "wrapped module")
            warn_once(
                f"{subject} changed (added or removed) after the "
                "model was compiled. The compiled model runs the hooks it was "
                "compiled with, as PopTorch traced them: register them "
                "before the first call, or call destroy() to compile the "
                "model again with the hooks it has now.")

    def _warn_mode_change(self, modes: Dict[str, bool]) -> None:
        name = next(name for name in sorted(modes)
                    if modes[name] != self._modes.get(name, modes[name]))
        self._reported = True
        warn_once(
            f"The train/eval mode of "
            f"'{name or type(self._module).__name__}' in the wrapped module "
            "changed after the model was compiled "
            f"({mode_name(self._modes[name])} when compiled, now "
            f"{mode_name(modes[name])}). The compiled model keeps the modes "
            "it was compiled with, as PopTorch does: set them before the "
            "first call, or call destroy() to compile the model again in "
            "the new modes.")

    def _warn(self, what: str, remedy: str) -> None:
        self._reported = True
        warn_once(
            f"{what} changed after the model was compiled. The compiled "
            "model keeps the values it was compiled with, as PopTorch "
            "does for values that are not parameters, buffers or "
            f"arguments. To change such a value between calls, {remedy}; "
            "destroy() compiles the model again with the new values.")

    def _tensor_names(self, tensors: List[torch.Tensor]) -> str:
        named = {id(value): f"'{dotted}'"
                 for dotted, _, value in _attributes(self._module)
                 if isinstance(value, torch.Tensor)}
        return ", ".join(
            named.get(id(tensor), f"one of shape {tuple(tensor.shape)} "
                      "(a closure or global)") for tensor in tensors)


#: The module attributes holding its forward and backward hooks.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
          "_backward_hooks")
#: torch's hooks of every module (``register_module_forward_hook``...).
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")


def _watched(module: torch.nn.Module
             ) -> Tuple[Dict[str, object], Dict[str, bool],
                        Dict[Tuple[str, str], Tuple[int, ...]]]:
    """The public attributes of plain Python types of the module and its
    sub-modules (their ``training`` flags aside), by dotted name, the
    sub-modules' ``training`` flags, by path, and the handles of their
    hooks, by path and kind."""
    attributes, modes, hooks = {}, {}, _global_hooks()
    for dotted, name, value in _attributes(module):
        path = dotted[:-len(name)].rstrip(".")
        if name == "training":
            modes[path] = value
        elif name in _HOOKS:
            if value:
                hooks[(path, name.strip("_").replace("_", " "))] = \
                    tuple(value)
        elif name == "_parameters":
            hooks.update(_parameter_hooks(path, value))
        elif type(value) in _PLAIN_TYPES and not name.startswith("_"):
            attributes[dotted] = value
    return attributes, modes, hooks


def _parameter_hooks(path: str, parameters: Dict[str, torch.Tensor]
                     ) -> Dict[Tuple[str, str], Tuple[int, ...]]:
    """The handles of the gradient hooks of a module's ``parameters``."""
    return {(f"{path}{'.' if path else ''}{name}", kind): tuple(hooks)
            for name, parameter in parameters.items()
            for kind, hooks in (
                ("gradient hooks",
                 getattr(parameter, "_backward_hooks", None)),
                ("post-accumulate-grad hooks",
                 getattr(parameter, "_post_accumulate_grad_hooks", None)))
            if hooks}


def _global_hooks() -> Dict[Tuple[str, str], Tuple[int, ...]]:
    """The handles of torch's global module hooks, by kind."""
    return {("", name.strip("_").replace("_", " ")):
            tuple(getattr(module_hooks, name))
            for name in _GLOBAL_HOOKS if getattr(module_hooks, name)}


def mode_name(training: bool) -> str:
    """How messages name a ``training`` flag."""
    return "training" if training else "evaluation"


def _attributes(module: torch.nn.Module) -> List[Tuple[str, str, object]]:
    """(dotted name, own name, value) of each instance attribute of the
    module and its sub-modules."""
    with host_reads_suspended():
        return [(f"{prefix}{'.' if prefix else ''}{name}", name, value)
                for prefix, sub in module.named_modules()
                for name, value in vars(sub).items()]
