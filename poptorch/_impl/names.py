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
training step) have no module part: ``mm_3``, ``_foreach_add:2``. These
names are listed in the order the operations run; in a training model they
come from the step that applies the optimizer update.

Parameters, gradients and optimizer state have PopART's names:

* the parameter's ``state_dict`` name (``fc1.weight``): its value as the step
  reads it (before the update of a training step);
* ``Gradient___<name>``: the gradient the optimizer applies in the step: of
  all the step's micro-batches, combined per
  ``accumulationAndReplicationReductionType`` (the mean by default), with
  the loss scale removed and after clipping (``maxGradNorm``): ``param.grad``
  when a plain PyTorch loop calls ``optimizer.step()``;
* ``UpdatedVar___<name>``: the parameter after the update;
* the optimizer state after the update: ``Accl1___<name>`` and
  ``Accl2___<name>`` the first and second moments of Adam, AdamW and LAMB
  (torch's ``exp_avg`` and ``exp_avg_sq``), ``Step___<name>`` their step
  count; ``Accl___<name>`` SGD's velocity (``momentum_buffer``; with
  ``use_combined_accum`` the stored velocity, scaled by
  ``velocity_scaling``); for RMSprop ``Accl1___<name>`` the mean square
  (``square_avg``), ``Accl2___<name>`` the mean gradient of the centred
  variant (``grad_avg``) and ``Accl3___<name>`` the momentum buffer. AMSGrad's
  maximum has no name.

The names beyond the parameter's own exist for the parameters the optimizer
updates (those that require gradients, are in a param group and reach the
loss). ``getTensorNames`` lists these names first, then the operations'.
Inference models have the parameter names only; in a model whose blocks
form several stages none of these names exist.

Anchoring a name adds that tensor to the step's outputs. Each call collects
it like a model output, under the anchor's own ``OutputMode`` (the model's
when none is given), and ``getAnchoredTensor(short_name)`` returns the last
call's value. A parameter, gradient or optimizer-state name is collected
once per optimizer step (with gradient accumulation, after the step's last
micro-batch): ``All`` returns one value per device iteration and
``EveryN``'s period counts device iterations.
"""
import contextlib
import difflib
import operator
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ..enums import OutputMode
from ..errors import Error
from .blocks import NAME_SCOPE_KEY
from .distributed.sharding import gathered_rows
from .optimizers.adam import AdamRule
from .optimizers.lamb import LAMBRule
from .optimizers.rmsprop import RMSpropRule
from .optimizers.rule import UpdateRule
from .optimizers.sgd import SGDRule
from .outputs import OutputCollector, check_return_period, resolve_output_mode
from .graph_format import is_tensor_node

MODULE_KEY = "poptorch_module"
#: ``graph.meta`` key of a step's parameter, gradient and optimizer-state
#: names (name -> node; None for those another step of the model computes).
NAMED_TENSORS_KEY = "poptorch_named_tensors"
#: ``graph.meta`` key of the named tensors that are rows of a sharded
#: tensor: name -> (the whole tensor's shape, the number of processes).
ROWS_KEY = "poptorch_named_rows"

_ADAM_STATE = {"exp_avg": "Accl1___", "exp_avg_sq": "Accl2___",
               "step": "Step___"}
#: PopART's prefixes of the optimizer state, by rule and torch state name.
_STATE_PREFIXES = {
    SGDRule: {"momentum_buffer": "Accl___", "scaled_velocity": "Accl___"},
    AdamRule: _ADAM_STATE,
    LAMBRule: _ADAM_STATE,
    RMSpropRule: {"square_avg": "Accl1___", "grad_avg": "Accl2___",
                  "momentum_buffer": "Accl3___"},
}


def gradient_name(param: str) -> str:
    """PopART's name of the gradient of the parameter ``param``."""
    return f"Gradient___{param}"


def updated_name(param: str) -> str:
    """PopART's name of the parameter ``param`` after the update."""
    return f"UpdatedVar___{param}"


def optimizer_state_name(rule: UpdateRule, state: str,
                         param: str) -> Optional[str]:
    """PopART's name of the optimizer state ``state`` (torch's name) of
    ``param`` under ``rule``; None when PopART has none."""
    prefix = _STATE_PREFIXES.get(type(rule), {}).get(state)
    return None if prefix is None else prefix + param


def mark_named_tensors(graph: torch.fx.GraphModule,
                       named: Dict[str, Optional[torch.fx.Node]],
                       rows: Optional[Dict[str, Tuple[List[int], int]]]
                       = None) -> None:
    """Record the parameter, gradient and optimizer-state names of a
    captured step (``None``: a name the model has that this step does not
    compute), and of those that are this process's rows of a sharded tensor
    (replicated tensor sharding), the whole tensor's shape and the number
    of processes. The graph's metadata keeps the nodes' names, not the
    nodes: compilers deep-copy graphs with their metadata."""
    graph.meta[NAMED_TENSORS_KEY] = {
        name: None if node is None else node.name
        for name, node in named.items()}
    graph.meta[ROWS_KEY] = dict(rows or {})


def named_tensors(graph: torch.fx.GraphModule
                  ) -> Optional[Dict[str, Optional[torch.fx.Node]]]:
    """The nodes ``mark_named_tensors`` named in ``graph``, None when it
    named none."""
    named = graph.meta.get(NAMED_TENSORS_KEY)
    if named is None:
        return None
    nodes = {node.name: node for node in graph.graph.nodes}
    return {name: None if node is None else nodes[node]
            for name, node in named.items()}


def mark_parameters(graph: torch.fx.GraphModule,
                    param_names: Sequence[str]) -> torch.fx.GraphModule:
    """Name the first inputs of ``graph`` (the model's parameters, in
    order) ``param_names``; returns ``graph``."""
    inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
    mark_named_tensors(graph, dict(zip(param_names, inputs)))
    return graph


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
    """Name -> node of the parameters, gradients and optimizer state
    ``graph`` has, then of every tensor an operation of ``graph``
    produces, in the order the operations run."""
    names = {name: node for name, node in
             (named_tensors(graph) or {}).items() if node is not None}
    of_node: Dict[torch.fx.Node, str] = {}
    used: Set[str] = set(names)
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
    outputs, and how each call collects them. Anchors of parameter,
    gradient and optimizer-state names (``per_update``) are outputs of the
    step that applies the update only, after the others, once per
    ``accumulation`` micro-batches (1 for inference)."""

    def __init__(self, anchored: Dict[str, Tuple[str, Optional[OutputMode],
                                                 int]],
                 module_namescope: bool, accumulation: int) -> None:
        self.anchored = dict(anchored)
        self.module_namescope = module_namescope
        self.accumulation = accumulation
        self.per_update: Set[str] = set()
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
        named = named_tensors(graph)
        nodes, per_update = [], []
        rows = graph.meta.get(ROWS_KEY, {})
        for short, (long_name, _, _) in self.anchored.items():
            if named is not None and long_name in named:
                self.per_update.add(short)
                if long_name in rows:
                    per_update.append(gathered_rows(graph, named[long_name],
                                                    *rows[long_name]))
                elif named[long_name] is not None:
                    per_update.append(named[long_name])
            else:
                nodes.append(self._node(names, long_name, short, step,
                                        named is not None))
        output = next(n for n in graph.graph.nodes if n.op == "output")
        values = list(output.args[0])
        cut = len(values) - before
        output.args = (values[:cut] + nodes + per_update + values[cut:],)
        graph.recompile()
        return graph

    @staticmethod
    def _node(names: Dict[str, torch.fx.Node], long_name: str, short: str,
              step: str, has_parameter_names: bool) -> torch.fx.Node:
        if long_name in names:
            return names[long_name]
        close = difflib.get_close_matches(long_name, list(names), n=5)
        hint = (f"; similar names: {', '.join(close)}" if close else
                "; getTensorNames() lists them")
        if not has_parameter_names:
            hint += ("; a model whose blocks form several stages has no "
                     "names of parameters, gradients or optimizer state")
        raise Error(f"anchorTensor({short!r}, {long_name!r}): the {step} "
                    f"step has no tensor named {long_name!r}{hint}")

    def collector(self, base: OutputCollector, model_mode: OutputMode,
                  training: bool, iterations: int, replicas: int):
        """``base``, or with anchors an ``AnchoredCollector`` around it;
        ``iterations``: the call's micro-batch steps per replica."""
        if not self.anchored:
            return base
        every_step, per_update = {}, {}
        for short, (long_name, mode, period) in self.anchored.items():
            mode = model_mode if mode is None else \
                resolve_output_mode(mode, training)
            if short in self.per_update:
                _check_update_period(short, long_name, mode, period,
                                     iterations // self.accumulation)
                per_update[short] = OutputCollector(
                    mode, period, iterations // self.accumulation, replicas)
            else:
                check_return_period(mode, period,
                                    iterations // self.accumulation)
                every_step[short] = OutputCollector(
                    mode, period, iterations, replicas, self.accumulation)
        return AnchoredCollector(base, every_step, per_update,
                                 self.accumulation, self)

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


def _check_update_period(short: str, long_name: str, mode: OutputMode,
                         period: int, updates: int) -> None:
    """EveryN of a tensor of the update step counts optimizer steps."""
    if mode == OutputMode.EveryN and updates % period:
        raise Error(
            f"anchorTensor({short!r}, {long_name!r}, OutputMode.EveryN, "
            f"{period}): {long_name!r} is computed once per optimizer step "
            f"and a call runs deviceIterations = {updates} optimizer "
            f"steps, which is not a multiple of {period}")


class AnchoredCollector:
    """Hands a step's model outputs to ``base`` and its anchored tensors
    (the last outputs) to one collector per anchor: those of every step,
    then, on the last micro-batch of each optimizer step, those of the
    update step, counted in optimizer steps."""

    def __init__(self, base: OutputCollector,
                 every_step: Dict[str, OutputCollector],
                 per_update: Dict[str, OutputCollector], accumulation: int,
                 owner: Anchors) -> None:
        self._base = base
        self._every_step = every_step
        self._per_update = per_update
        self._accumulation = accumulation
        self._owner = owner

    def _targets(self, iteration: int) -> List[Tuple[OutputCollector, int]]:
        """The anchors' collectors of a step, each with the iteration it
        counts the step as."""
        targets = [(c, iteration) for c in self._every_step.values()]
        if (iteration + 1) % self._accumulation == 0:
            update = iteration // self._accumulation
            targets += [(c, update) for c in self._per_update.values()]
        return targets

    def wants(self, iteration: int) -> bool:
        return self._base.wants(iteration) or any(
            c.wants(index) for c, index in self._targets(iteration))

    def add(self, iteration: int, replica: int,
            outputs: List[torch.Tensor]) -> None:
        targets = self._targets(iteration)
        split = len(outputs) - len(targets)
        self._base.add(iteration, replica, outputs[:split])
        for position, ((collector, index), tensor) in enumerate(
                zip(targets, outputs[split:])):
            if not collector.wants(index):
                continue
            # Parameters and optimizer state are written in place by later
            # steps, and a gradient may be the reused gradient buffer.
            if position >= len(self._every_step):
                tensor = tensor.clone()
            collector.add(index, replica, [tensor])

    def result(self) -> List[torch.Tensor]:
        for short, collector in {**self._every_step,
                                 **self._per_update}.items():
            self._owner.values[short] = _host(collector.result()[0])
        return self._base.result()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
