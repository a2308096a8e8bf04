"""Capturing a model once into static graphs of tensor operations.

Everything is traced with ``make_fx`` in fake mode (no real computation, no
side effects), so each graph is a function of explicit inputs:

* an analysis trace of the forward pass finds the output structure, the
  buffers and inputs the model writes to, and (for training) the final loss;
* the inference step maps (parameters, buffers, micro-batch) to (written
  buffers, outputs);
* the training step (``training_step.py``) is forward + loss + backward
  (``torch.autograd.grad``, traced like AOTAutograd's joint graphs, so user
  ``autograd.Function``s work) + gradient reduction + the optimizer's
  pure-tensor update.

Buffers the model writes are cloned inside the step and returned, so a step
never changes its state inputs: the device loop rebinds the returned tensors.
Writes that ``forward`` makes to its input tensors stay in the graphs as
in-place operations on those inputs, so they reach the caller. Nodes carry
``torch.fx.traceback`` metadata (annotations such as blocks).
"""
import contextlib
import dataclasses
from typing import (Callable, Dict, Iterator, List, Optional, Sequence,
                    Set)

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import Error
from . import (backward_start, blocks, graph_writes, losses, recomputation,
               tracing_context)
from .compile_errors import capture_refusal, locate
from .cumulative_batch_norm import CumulativeAverage, mark_cumulative_modules
from .precision.automatic_casting import AutomaticCasting, Policy
from .precision.half_casting import MixedPrecisionCasting
from .names import module_scopes
from .profiling.ranges import profile_range
from .parameter_hooks import register_hooks
from .recurrent_layers import RecurrentLayersAsOps
from .signature import flattenable, holds_tensors
from .state_writes import in_place_state_writes
from .sparse_gradients import DenseGradients
from .weight_sync import host_reads_suspended

_capturing = [0]


def isRunningOnIpu() -> bool:
    """True while the model's Python code runs to be captured for the device,
    False when it runs on the host."""
    return _capturing[0] > 0


@contextlib.contextmanager
def capture_scope(module: torch.nn.Module, training_flags: Dict[str, bool]
                  ) -> Iterator[List[blocks.BlockRecord]]:
    """Mark capture in progress and apply the train/eval flags the module had
    when it was wrapped (PopTorch wraps a shallow copy of the module); batch
    norm modules with ``momentum=None`` get a capturable momentum
    (``cumulative_batch_norm.py``). Yields the list that receives the
    blocks met, when the scope ends.

    Attributes that ``forward`` assigns while it is traced (the spec's
    ``model.i`` example) are frozen into the graph and restored on the host
    module afterwards, so no traced value leaks into it; so are the
    module's parameters and buffers, which the trace replaces with its own
    tensors (torch's reparametrization, left to itself, leaves a traced
    tensor in a submodule reachable under two names)."""
    with host_reads_suspended():
        modules = dict(module.named_modules())
    saved = {name: _ModuleState(m) for name, m in modules.items()}
    records: List[blocks.BlockRecord] = []
    _capturing[0] += 1
    blocks.begin_capture()
    try:
        with host_reads_suspended(), fx_traceback.preserve_node_meta(), \
                module_scopes(modules):
            for name, flag in training_flags.items():
                if name in modules:
                    modules[name].training = flag
            mark_cumulative_modules(modules.values())
            yield records
    finally:
        records.extend(blocks.end_capture())
        _capturing[0] -= 1
        for name, state in saved.items():
            state.restore(modules[name])


class _ModuleState:
    """A module's attributes, parameters and buffers (those a scripted
    module holds in TorchScript are left to it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.attributes = dict(module.__dict__)
        self.tensors = [(held, dict(held)) for held in
                        (module._parameters, module._buffers)
                        if isinstance(held, dict)]

    def restore(self, module: torch.nn.Module) -> None:
        module.__dict__.clear()
        module.__dict__.update(self.attributes)
        for held, saved in self.tensors:
            held.clear()
            held.update(saved)


def trace(fn: Callable, example_inputs: Sequence[torch.Tensor],
          keep_detaches: bool = False) -> torch.fx.GraphModule:
    """A graph of ``fn`` over flat tensor inputs (``keep_detaches`` for a
    graph that will run under autograd).

    The fake tensors have static shapes and no shape environment, so
    anything that needs their data (``.item()``, a data-dependent output
    shape) raises instead of entering the graph as a symbolic value. Real
    tensors the model reads besides its inputs (plain tensor attributes,
    not buffers, and closure tensors) become constants of the graph, frozen
    at capture like other plain attributes, also in a ``forward`` that
    reads nothing else."""
    fake_mode = FakeTensorMode(allow_fallback_kernels=True,
                               allow_non_fake_inputs=True,
                               static_shapes=True)
    fake_inputs = [fake_mode.from_tensor(t) for t in example_inputs]
    # Active around make_fx, the mode is the trace's even without inputs.
    with profile_range("capture"), tracing_context.fake_tracing(), \
            tracing_context.written_constants() as written, fake_mode:
        graph_module = make_fx(fn, tracing_mode="fake")(*fake_inputs)
    _start_from_captured_values(graph_module, written)
    if not keep_detaches:
        _remove_detaches(graph_module.graph)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    return graph_module


def _start_from_captured_values(graph_module: torch.fx.GraphModule,
                                written: Dict[int, torch.Tensor]) -> None:
    """Constants the graph writes (``written``: copies of the user's
    tensors, see ``tracing_context.GraphConstants``) hold the user's value
    again, and each call writes a clone of it made where the graph first
    reads the constant: every call starts from the value captured."""
    clones: Dict[str, torch.fx.Node] = {}
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if node.target in clones:
            node.replace_all_uses_with(clones[node.target])
            graph.erase_node(node)
            continue
        value = getattr(graph_module, node.target, None)
        if not isinstance(value, torch.Tensor) or id(value) not in written:
            continue
        setattr(graph_module, node.target,
                written[id(value)].detach().to(value.device, copy=True))
        with graph.inserting_after(node):
            clone = graph.call_function(torch.ops.aten.clone.default, (node,))
        node.replace_all_uses_with(clone,
                                   delete_user_cb=lambda user: user is not clone)
        clones[node.target] = clone


def _remove_detaches(graph: torch.fx.Graph) -> None:
    """Captured graphs run without autograd, so ``detach`` is a no-op in
    them: use its input instead."""
    for node in list(graph.nodes):
        if node.op == "call_function" and \
                node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


@dataclasses.dataclass
class ModelCall:
    """How flat tensors become a call of the user's module; operations
    mixing float16 and float32 tensors compute in ``mixed_dtype``
    (``precision/half_casting.py``), and where automatic casting is enabled
    operations are typed by ``autocast_policy`` (None when
    ``Precision.autocastEnabled(False)``; ``precision/automatic_casting.py``)."""
    module: torch.nn.Module
    param_names: List[str]
    buffer_names: List[str]
    input_spec: pytree.TreeSpec
    input_leaves: List[object]
    tensor_positions: List[int]
    mixed_dtype: torch.dtype
    autocast_policy: Optional[Policy]
    _in_modes: bool = dataclasses.field(default=False, init=False,
                                        repr=False)

    @contextlib.contextmanager
    def bound(self, params: Sequence[torch.Tensor],
              buffers: Sequence[torch.Tensor]) -> Iterator[None]:
        """The module's parameters and buffers read as ``params`` and
        ``buffers`` in the block, with the capture's modes active. A
        training step keeps both through its backward pass, where
        ``torch.utils.checkpoint`` runs parts of ``forward`` again: without
        them, the recomputation would read the module's own tensors as
        constants, stale after the first update, and compute without the
        forward pass's casts. The parameters' gradient hooks apply to
        ``params`` (``parameter_hooks.py``)."""
        register_hooks(self.module_parameters(), params)
        state = dict(zip(self.param_names, params))
        state.update(zip(self.buffer_names, buffers))
        with torch.nn.utils.stateless._reparametrize_module(
                self.module, state, tie_weights=True), self._modes(), \
                recomputation.with_modes(self._mode_stack):
            yield

    def module_parameters(self) -> List[torch.nn.Parameter]:
        """The module's own parameters, in ``param_names`` order."""
        return [self.module.get_parameter(name) for name in self.param_names]

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        """The capture's modes, entered once when nested."""
        if self._in_modes:
            yield
            return
        self._in_modes = True
        try:
            with self._mode_stack():
                yield
        finally:
            self._in_modes = False

    def _mode_stack(self) -> contextlib.ExitStack:
        """The TorchFunctionModes of a captured forward pass: constants on
        the device, parameters and buffers replaced by assignment written
        in place, half/float casting, cumulative BatchNorm averages,
        recurrent layers as one op per layer, dense gradients where sparse
        ones are asked for and automatic casting."""
        modes = contextlib.ExitStack()
        modes.enter_context(tracing_context.GraphConstants())
        modes.enter_context(in_place_state_writes())
        modes.enter_context(MixedPrecisionCasting(self.mixed_dtype))
        modes.enter_context(CumulativeAverage())
        modes.enter_context(RecurrentLayersAsOps())
        modes.enter_context(DenseGradients())
        if self.autocast_policy is not None:
            modes.enter_context(AutomaticCasting(self.autocast_policy))
        return modes

    def __call__(self, params: Sequence[torch.Tensor],
                 buffers: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor]):
        leaves = list(self.input_leaves)
        for position, tensor in zip(self.tensor_positions, inputs):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.input_spec)
        state = (dict(zip(self.param_names, params)),
                 dict(zip(self.buffer_names, buffers)))
        with self._modes():
            return torch.func.functional_call(self.module, state,
                                              tuple(args), dict(kwargs))


class TensorLeaf:
    """Stands for a tensor among the leaves of the model's output (other
    leaves, ``None`` included, are constants returned as captured)."""

    def __repr__(self) -> str:
        return "TENSOR_LEAF"


TENSOR_LEAF = TensorLeaf()


@dataclasses.dataclass
class ModelAnalysis:
    """What the analysis trace found out about the model."""
    output_spec: pytree.TreeSpec
    output_constants: List[object]      # TENSOR_LEAF where a leaf is a tensor
    written_buffers: List[int]
    written_inputs: List[int]
    final_loss: Optional[int]
    params_reaching_loss: List[int]
    blocks: List[blocks.BlockRecord]    # annotated blocks, in order met
    #: The returned tensors that are an input, weight, buffer or constant
    #: (or a view of one) rather than a value the step computes.
    stored_outputs: List[int]
    #: The returned tensor the backward pass starts from, when it is one
    #: computed from the final loss(es) (``backward_start.py``).
    loss_output: Optional[int] = None
    #: The parameters ``forward`` writes in place (a teacher's EMA update).
    written_params: List[int] = dataclasses.field(default_factory=list)
    #: Where ``forward`` registers gradient hooks on tensors.
    gradient_hook_places: List[str] = dataclasses.field(default_factory=list)

    def backward_start(self, recorded_losses: List[torch.Tensor],
                       output_tensors: List[torch.Tensor]) -> torch.Tensor:
        """The scalar the backward pass starts from: the returned total, or
        the final recorded loss (summed when it is not a scalar)."""
        if self.loss_output is not None:
            value = output_tensors[self.loss_output]
        else:
            value = recorded_losses[self.final_loss]
        return value if value.dim() == 0 else value.sum()


def _placeholders(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _choose_backward_start(analysis: ModelAnalysis,
                           returned: List[torch.fx.Node],
                           loss_nodes: List[torch.fx.Node],
                           places: List[str],
                           flow: graph_writes.DataFlow,
                           returned_without: Set[torch.fx.Node],
                           losses_without: Set[torch.fx.Node]
                           ) -> torch.fx.Node:
    """Set where the backward pass starts (a returned total, else the one
    final loss) and return its node. ``places``: the user's line of each
    recorded loss; ``returned_without`` and ``losses_without``: the
    returned tensors and the losses that do not require gradients in a
    model that trains parameters (such a loss is an error for the
    start)."""
    finals = backward_start.used_losses(
        backward_start.final_losses(loss_nodes, flow), returned, flow,
        returned_without)
    analysis.loss_output = backward_start.returned_total(
        returned, finals, flow, returned_without)
    if analysis.loss_output is not None:
        return returned[analysis.loss_output]
    if len(finals) > 1:
        where = "; ".join(places[loss_nodes.index(n)] for n in finals)
        raise Error(losses.SEVERAL_LOSSES_MESSAGE.format(count=len(finals),
                                                         where=where))
    analysis.final_loss = loss_nodes.index(finals[0])
    if finals[0] in losses_without:
        raise Error(losses.NO_GRADIENT_MESSAGE.format(
            where=places[analysis.final_loss]))
    return finals[0]


def analyse(call: ModelCall, params: List[torch.Tensor],
            buffers: List[torch.Tensor], inputs: List[torch.Tensor],
            training: bool, training_flags: Dict[str, bool]) -> ModelAnalysis:
    """Trace the forward pass once to learn the model's shape of work. A
    training model's parameters that require gradients do so in the trace,
    as in the training step, so that ``forward`` may differentiate with
    respect to them (MAML's inner step)."""
    _refuse_quantized_modules(call.module)
    found = {}
    tracked = [training and parameter.requires_grad
               for parameter in call.module_parameters()]

    def forward(*flat):
        p, b, x = split_flat(flat, [len(params), len(buffers)])
        p = [t.detach().requires_grad_() if track else t
             for t, track in zip(p, tracked)]
        with losses.LossRecorder() as recorder:
            output = call(p, b, x)
        leaves, found["spec"] = pytree.tree_flatten(
            flattenable(output, keep_dict_types=True))
        _refuse_objects_holding_tensors(leaves)
        found["constants"] = [
            TENSOR_LEAF if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves]
        found["num_losses"] = len(recorder.losses)
        found["places"] = recorder.places
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        found["requires_grad"] = [
            t.requires_grad for t in tensors + recorder.losses]
        return tensors + recorder.losses

    with capture_scope(call.module, training_flags) as block_records, \
            losses.recording_mode(training), \
            tracing_context.gradient_hooks_recorded() as hook_places:
        graph = trace_user_code(forward, params + buffers + inputs).graph
    flow = graph_writes.DataFlow(graph)
    written = flow.written_placeholders()
    num_state = len(params) + len(buffers)
    outputs = list(next(n for n in graph.nodes if n.op == "output").args[0])
    split_at = len(outputs) - found["num_losses"]
    analysis = ModelAnalysis(
        output_spec=found["spec"], output_constants=found["constants"],
        written_buffers=[i - len(params) for i in written
                         if len(params) <= i < num_state],
        written_inputs=[i - num_state for i in written if i >= num_state],
        written_params=[i for i in written if i < len(params)],
        final_loss=None, params_reaching_loss=[],
        blocks=blocks.with_layers_before(block_records, graph.nodes),
        stored_outputs=flow.stored_outputs(outputs[:split_at]),
        gradient_hook_places=hook_places)
    if training:
        grads = found["requires_grad"] if any(tracked) else \
            [True] * len(outputs)
        start = _choose_backward_start(
            analysis, outputs[:split_at], outputs[split_at:],
            found["places"], flow,
            _without_gradients(outputs[:split_at], grads[:split_at]),
            _without_gradients(outputs[split_at:], grads[split_at:]))
        reaching = flow.ancestors(start)
        analysis.params_reaching_loss = [
            i for i, node in enumerate(_placeholders(graph)[:len(params)])
            if node in reaching]
    return analysis


def _without_gradients(outputs: List[torch.fx.Node],
                        requires_grad: List[bool]) -> Set[torch.fx.Node]:
    """The nodes of ``outputs`` none of whose tensors there requires
    gradients (the graph has no detaches: a returned ``loss`` and a logged
    ``loss.detach()`` are one node)."""
    with_gradients = {node for node, grad in zip(outputs, requires_grad)
                      if grad}
    return {node for node in outputs if node not in with_gradients}


#: torch.ao.nn.quantized's modules that compute in floating point (a
#: quantizable model's additions before convert()).
_FLOAT_QUANTIZED_MODULES = ("FloatFunctional", "FXFloatFunctional")


def _refuse_quantized_modules(module: torch.nn.Module) -> None:
    """Integer-quantized layers (a model after torch.ao's ``convert``) run
    PyTorch's quantized CPU kernels on quantized tensors, which a captured
    graph cannot hold."""
    with host_reads_suspended():
        quantized = [f"'{name}' ({type(sub).__name__})"
                     for name, sub in module.named_modules()
                     if type(sub).__module__.startswith(
                         "torch.ao.nn.quantized")
                     and type(sub).__name__ not in _FLOAT_QUANTIZED_MODULES]
    if quantized:
        raise Error(
            f"The model holds integer-quantized layers ({quantized[0]}, "
            "from torch.ao.quantization.convert), whose quantized tensors a "
            "compiled model cannot hold. Wrap the model before convert() "
            "(quantization-aware training runs in floating point), and run "
            "the converted model in PyTorch.")


def _refuse_objects_holding_tensors(leaves: List[object]) -> None:
    for leaf in leaves:
        if holds_tensors(leaf):
            raise Error(
                f"forward returned a {type(leaf).__name__} object holding "
                "tensors: a compiled model returns tensors in tuples, "
                "lists, dicts, named tuples or dataclasses (or in a type "
                "registered with poptorch.registerCustomArgParser), which it "
                "fills with the values of every micro-batch.")


def trace_user_code(fn: Callable, example_inputs,
                    keep_detaches: bool = False) -> torch.fx.GraphModule:
    """``trace`` with failures located in the user's code: what a static
    graph cannot hold as a ``poptorch.Error``, any other exception as
    itself with a note (``compile_errors.py``)."""
    try:
        return trace(fn, example_inputs, keep_detaches)
    except Error:
        raise
    except Exception as error:
        refusal = capture_refusal(error)
        if refusal is not None:
            raise refusal from error
        locate(error)
        raise


def split_flat(flat: Sequence, sizes: Sequence[int]) -> List[list]:
    """Cut ``flat`` into consecutive parts of ``sizes``; the rest is last."""
    parts, start = [], 0
    for size in sizes:
        parts.append(list(flat[start:start + size]))
        start += size
    parts.append(list(flat[start:]))
    return parts


def tensor_outputs(output) -> List[torch.Tensor]:
    """The tensors among ``output``'s leaves, in flattening order."""
    return [leaf for leaf in pytree.tree_leaves(flattenable(output))
            if isinstance(leaf, torch.Tensor)]


def clone_written(buffers: List[torch.Tensor],
                   written: List[int]) -> List[torch.Tensor]:
    """Fresh copies of the buffers the model writes, so the graph returns new
    values instead of writing into its inputs."""
    buffers = list(buffers)
    for index in written:
        buffers[index] = buffers[index].clone()
    return buffers


def written_values(call: ModelCall, analysis: ModelAnalysis,
                   before: Sequence[torch.Tensor],
                   after: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The values a step leaves in the buffers ``forward`` writes (``after``;
    ``before`` holds the buffers the step started from); ``poptorch.Error``
    naming a buffer that ``forward`` gave another shape: a compiled step
    keeps the shape of every tensor it holds."""
    for index in analysis.written_buffers:
        if before[index].shape != after[index].shape:
            raise resized_buffer(call.buffer_names[index],
                                 before[index].shape, after[index].shape)
    return [after[index] for index in analysis.written_buffers]


def resized_buffer(name: str, old: torch.Size, new: torch.Size) -> Error:
    """The error for a buffer that ``forward`` resized."""
    return Error(
        f"Buffer '{name}' changes shape in forward, from {tuple(old)} to "
        f"{tuple(new)} (torch.ao quantization observers resize theirs on "
        "their first call): a compiled model keeps the shape of each "
        "buffer. Run the module once in PyTorch before wrapping it (for "
        "example `with torch.no_grad(): module(*example_inputs)`) so that "
        "its buffers take their final shapes.")


def trace_inference_step(call: ModelCall, analysis: ModelAnalysis,
                         params, buffers, inputs,
                         training_flags: Dict[str, bool]
                         ) -> torch.fx.GraphModule:
    """(params, buffers, inputs) -> (written buffers, outputs)."""

    def step(*flat):
        p, b, x = split_flat(flat, [len(params), len(buffers)])
        written = clone_written(b, analysis.written_buffers)
        output = call(p, written, x)
        return (written_values(call, analysis, b, written) +
                tensor_outputs(output))

    with capture_scope(call.module, training_flags):
        return trace_user_code(step, list(params) + list(buffers) +
                                list(inputs))
