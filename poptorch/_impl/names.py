"""Tensor names of the captured graph (``getTensorNames``) and anchored
tensors (``Options.anchorTensor`` / ``getAnchoredTensor``).

Naming scheme. Every operation of the captured step that produces a tensor
has a name made of, joined by ``/``:

1. the path of the module whose ``forward`` ran it, with ``/`` between
   levels (``layer1/conv``), unless ``Options.disableModuleNamescope()``;
2. the enclosing ``poptorch.NameScope`` names (``outer/inner``);
3. the ATen operation (``convolution``, ``addmm``, ``relu``), with ``_1``,
   ``_2``... for its second, third... use under the same prefix;
4. ``:k`` for the k-th tensor of an operation that returns several
   (``bn/native_batch_norm:0`` is BatchNorm's output).

For example ``layer1/conv/convolution`` or ``encoder/attention/softmax:0``.
Operations outside any module's ``forward`` (the loss computed in the
top-level ``forward``, the backward pass and the optimizer update of a
training step) have no module part: ``mm_3``, ``_foreach_add:2``. Names are
listed in the order the operations run; in a training model they come from
the step that applies the optimizer update.

Anchoring a name adds that tensor to the step's outputs. Each call collects
it like a model output, under the anchor's own ``OutputMode`` (the model's
when none is given), and ``getAnchoredTensor(short_name)`` returns the last
call's value.
"""
import contextlib
import difflib
import operator
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch

from ..enums import OutputMode
from ..errors import Error
from .blocks import NAME_SCOPE_KEY
from .outputs import OutputCollector, check_return_period, resolve_output_mode
from .serialization.graph_format import is_tensor_node

MODULE_KEY = "poptorch_module"


@contextlib.contextmanager
def module_scopes(modules: Dict[str, torch.nn.Module]) -> Iterator[None]:
    """While capturing, annotate the operations each sub-module's
    ``forward`` runs with the module's path (``node.meta["custom"]``)."""
    handles = []
    for path, module in modules.items():
        # TorchScript modules take no hooks: their operations keep the
        # scope of the module that calls them.
        if path and not isinstance(module, torch.jit.ScriptModule):
            handles.append(module.register_forward_pre_hook(
                _enter_module(path.replace(".", "/")), prepend=True))
            handles.append(module.register_forward_hook(
                _exit_module, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


_open_scopes: List[contextlib.AbstractContextManager] = []


def _enter_module(path: str):
    import torch.fx.traceback as fx_traceback

    def hook(module, args) -> None:
        annotation = fx_traceback.annotate({MODULE_KEY: path})
        annotation.__enter__()
        _open_scopes.append(annotation)

    return hook


def _exit_module(module, args, output) -> None:
    if _open_scopes:
        _open_scopes.pop().__exit__(None, None, None)


def _prefix(node: torch.fx.Node, module_namescope: bool) -> List[str]:
    custom = node.meta.get("custom") or {}
    parts = []
    if module_namescope and custom.get(MODULE_KEY):
        parts.append(custom[MODULE_KEY])
    if custom.get(NAME_SCOPE_KEY):
        parts.append(custom[NAME_SCOPE_KEY])
    return parts


def _operation_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def tensor_names(graph: torch.fx.GraphModule,
                 module_namescope: bool = True) -> Dict[str, torch.fx.Node]:
    """Name -> node of every tensor an operation of ``graph`` produces, in
    the order the operations run."""
    names: Dict[str, torch.fx.Node] = {}
    of_node: Dict[torch.fx.Node, str] = {}
    used: Set[str] = set()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and \
                node.args[0] in of_node:
            name = f"{of_node[node.args[0]]}:{node.args[1]}"
        else:
            name = _unique("/".join(_prefix(node, module_namescope) +
                                    [_operation_name(node)]), used)
        used.add(name)
        of_node[node] = name
        if is_tensor_node(node):
            names[name] = node
    return names


def _unique(name: str, used: set) -> str:
    if name not in used:
        return name
    count = 1
    while f"{name}_{count}" in used:
        count += 1
    return f"{name}_{count}"


class Anchors:
    """The anchored tensors of a model: which graph nodes become extra
    outputs, and how each call collects them."""

    def __init__(self, anchored: Dict[str, Tuple[str, Optional[OutputMode],
                                                 int]],
                 module_namescope: bool) -> None:
        self.anchored = dict(anchored)
        self.module_namescope = module_namescope
        self.values: Dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.anchored)

    def add_outputs(self, graph: torch.fx.GraphModule, step: str,
                    before: int = 0) -> torch.fx.GraphModule:
        """Add the anchored tensors to the outputs of ``graph``: after the
        others, or before the last ``before`` of them."""
        if not self.anchored:
            return graph
        names = tensor_names(graph, self.module_namescope)
        nodes = [self._node(names, long_name, short, step)
                 for short, (long_name, _, _) in self.anchored.items()]
        output = next(n for n in graph.graph.nodes if n.op == "output")
        values = list(output.args[0])
        cut = len(values) - before
        output.args = (values[:cut] + nodes + values[cut:],)
        graph.recompile()
        return graph

    @staticmethod
    def _node(names: Dict[str, torch.fx.Node], long_name: str, short: str,
              step: str) -> torch.fx.Node:
        if long_name in names:
            return names[long_name]
        close = difflib.get_close_matches(long_name, list(names), n=5)
        hint = (f"; similar names: {', '.join(close)}" if close else
                "; getTensorNames() lists them")
        raise Error(f"anchorTensor({short!r}, {long_name!r}): the {step} "
                    f"step has no tensor named {long_name!r}{hint}")

    def collector(self, base: OutputCollector, model_mode: OutputMode,
                  training: bool, iterations: int, replicas: int):
        """``base``, or with anchors an ``AnchoredCollector`` around it."""
        if not self.anchored:
            return base
        collectors = {}
        for short, (_, mode, period) in self.anchored.items():
            mode = model_mode if mode is None else \
                resolve_output_mode(mode, training)
            check_return_period(mode, period, iterations)
            collectors[short] = OutputCollector(mode, period, iterations,
                                                replicas)
        return AnchoredCollector(base, collectors, self)

    def get(self, short_name: str) -> torch.Tensor:
        if short_name not in self.anchored:
            known = ", ".join(repr(n) for n in self.anchored) or "none"
            raise Error(f"getAnchoredTensor: no tensor is anchored as "
                        f"{short_name!r} (anchored: {known}); use "
                        "options.anchorTensor(short_name, long_name)")
        if short_name not in self.values:
            raise Error(f"getAnchoredTensor({short_name!r}): the model has "
                        "not run yet; call it first")
        return self.values[short_name]


class AnchoredCollector:
    """Hands a step's model outputs to ``base`` and its anchored tensors
    (the last outputs) to one collector per anchor."""

    def __init__(self, base: OutputCollector,
                 anchors: Dict[str, OutputCollector], owner: Anchors) -> None:
        self._base = base
        self._anchors = anchors
        self._owner = owner

    def wants(self, iteration: int) -> bool:
        return self._base.wants(iteration) or any(
            c.wants(iteration) for c in self._anchors.values())

    def add(self, iteration: int, replica: int,
            outputs: List[torch.Tensor]) -> None:
        split = len(outputs) - len(self._anchors)
        self._base.add(iteration, replica, outputs[:split])
        for collector, tensor in zip(self._anchors.values(),
                                     outputs[split:]):
            collector.add(iteration, replica, [tensor])

    def result(self) -> List[torch.Tensor]:
        for short, collector in self._anchors.items():
            self._owner.values[short] = _host(collector.result()[0])
        return self._base.result()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
