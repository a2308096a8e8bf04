"""The pure training step: forward, loss, backward (``torch.autograd.grad``
traced into the graph), gradient reduction and the optimizer's update,
built for capture by ``capture.trace``.

Flat inputs, in order: trainable parameters (those the optimizer updates and
the final loss depends on), the other parameters, buffers, optimizer state
(the param groups', then automatic loss scaling's), hyper-parameters (0-d
float64 tensors, so new values need no new capture and the scalar maths
matches torch.optim's Python doubles; the param groups', then the variable
optimizer-wide ``loss_scaling`` / ``max_grad_norm``), the running gradient
buffer (accumulating variants only), the micro-batch.
Outputs: new trainable parameters, written buffers, new optimizer state and the
model's output tensors — or, for the accumulate variant, written buffers, the
new gradient buffer and the outputs. Both graphs carry PopART's names of the
parameters, the applied gradients, the updated parameters and the optimizer
state (``names.py``), which the update step computes.

The gradients of the G x R micro-batches of one optimizer step are combined
in a buffer of the optimizer's ``accum_type`` and reduced per
``ReductionType`` and ``MeanReductionStrategy`` (docs/semantics.md;
``optimizers/gradient_reduction.py``); loss scaling, automatic loss scaling
and clipping are in ``optimizers/global_attributes.py``.
"""
import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx.traceback as fx_traceback

from ..enums import ReductionType
from . import losses
from .backends.in_place import Donation
from .capture import (ModelAnalysis, ModelCall, capture_scope,
                      clone_written, split_flat, tensor_outputs,
                      trace, trace_user_code, written_values)
from .distributed.gradients import GradientExchange, start_all_reduces_early
from .distributed.weight_sharding import gather_weights_before_use
from .floating_point_checks import step_flags
from .names import (gradient_name, mark_named_tensors, optimizer_state_name,
                    updated_name)
from .optimizers.global_attributes import (GlobalAttributes,
                                          PartialGradients, StepScaling)
from .optimizers.gradient_reduction import GradientReduction
from .optimizers.plan import OptimizerPlan
from .optimizers.rule import UpdateRule
from .profiling.facts import BACKWARD, PASS_KEY


# Hyper-parameter names whose optimizer attribute has another name.
_ATTRIBUTE_OF_HYPER = {"beta1": "betas", "beta2": "betas"}


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One optimizer param group inside the flat training inputs.

    Hyper-parameters of constant attributes are embedded in the graph as
    Python numbers (the spec's constant attributes); the variable ones are
    0-d tensor inputs, so new values need no new capture."""
    rule: UpdateRule
    positions: List[int]        # positions in the trainable list
    plan_index: int             # index of the group in the optimizer plan
    variable_hyper: List[str]
    constant_hyper: Dict[str, float]

    @staticmethod
    def build(plan: OptimizerPlan, plan_index: int,
              positions: List[int]) -> "GroupLayout":
        group = plan.groups[plan_index]
        constant = [name for name in group.rule.hyper_names
                    if _ATTRIBUTE_OF_HYPER.get(name, name)
                    in plan.constant_attrs]
        return GroupLayout(
            group.rule, positions, plan_index,
            [n for n in group.rule.hyper_names if n not in constant],
            {name: float(group.hyper[name]) for name in constant})


@dataclasses.dataclass(frozen=True)
class TrainingLayout:
    """Which parameters train and where optimizer state sits."""
    trainable: List[int]        # indices into the model's parameters
    frozen: List[int]
    groups: List[GroupLayout]

    @staticmethod
    def build(plan: OptimizerPlan, params_reaching_loss: Sequence[int],
              num_params: int) -> "TrainingLayout":
        reaching = set(params_reaching_loss)
        trainable = [i for group in plan.groups for i in group.indices
                     if i in reaching]
        position = {index: p for p, index in enumerate(trainable)}
        groups = [GroupLayout.build(plan, plan_index,
                                    [position[i] for i in group.indices
                                     if i in position])
                  for plan_index, group in enumerate(plan.groups)]
        return TrainingLayout(
            trainable=trainable,
            frozen=[i for i in range(num_params) if i not in position],
            groups=[g for g in groups if g.positions])

    def state_size(self) -> int:
        return sum(len(g.rule.state_names) * len(g.positions)
                   for g in self.groups)

    def hyper_size(self) -> int:
        """Hyper-parameter inputs of the param groups (the optimizer-wide
        ones follow them)."""
        return sum(len(g.variable_hyper) for g in self.groups)

    def flatten_state(self, states: Sequence[Dict[str, List[torch.Tensor]]]
                      ) -> List[torch.Tensor]:
        """The flat optimizer state of per-group states (inverse of
        ``unflatten_state``)."""
        return [tensor for group, state in zip(self.groups, states)
                for name in group.rule.state_names for tensor in state[name]]

    def hyper_values(self, plan: OptimizerPlan,
                     device: torch.device) -> List[torch.Tensor]:
        return [torch.tensor(float(plan.groups[g.plan_index].hyper[name]),
                             dtype=torch.float64, device=device)
                for g in self.groups for name in g.variable_hyper]

    def merge(self, trainable: Sequence[torch.Tensor],
              frozen: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """All the model's parameters, in order, from the trainable and the
        frozen lists."""
        params = [None] * (len(trainable) + len(frozen))
        for index, tensor in zip(self.trainable, trainable):
            params[index] = tensor
        for index, tensor in zip(self.frozen, frozen):
            params[index] = tensor
        return params

    def state_indices(self) -> Dict[int, List[int]]:
        """The flat optimizer state indices of each trainable position."""
        indices: Dict[int, List[int]] = {}
        index = 0
        for group in self.groups:
            for _ in group.rule.state_names:
                for position in group.positions:
                    indices.setdefault(position, []).append(index)
                    index += 1
        return indices

    def restricted(self, positions: Sequence[int]
                   ) -> Tuple["TrainingLayout", List[int], List[int]]:
        """The layout of the trainable ``positions`` alone, with the indices
        of their entries in this layout's flat optimizer state and of their
        groups' entries in its param-group hyper-parameters."""
        kept = set(positions)
        order = {p: i for i, p in enumerate(sorted(kept))}
        groups, state, hyper = [], [], []
        state_start, hyper_start = 0, 0
        for group in self.groups:
            mine = [j for j, p in enumerate(group.positions) if p in kept]
            for name_index in range(len(group.rule.state_names)):
                state.extend(state_start + name_index * len(group.positions)
                             + j for j in mine)
            state_start += len(group.rule.state_names) * len(group.positions)
            if mine:
                hyper.extend(range(hyper_start,
                                   hyper_start + len(group.variable_hyper)))
                groups.append(dataclasses.replace(
                    group, positions=[order[group.positions[j]]
                                      for j in mine]))
            hyper_start += len(group.variable_hyper)
        trainable = [self.trainable[p] for p in sorted(kept)]
        frozen = sorted(set(self.frozen) | set(self.trainable) - set(trainable))
        return TrainingLayout(trainable, frozen, groups), state, hyper

    def unflatten_state(self, flat: Sequence[torch.Tensor]
                        ) -> List[Dict[str, List[torch.Tensor]]]:
        states, start = [], 0
        for group in self.groups:
            state = {}
            for name in group.rule.state_names:
                state[name] = list(flat[start:start + len(group.positions)])
                start += len(group.positions)
            states.append(state)
        return states


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Compile-time constants of the training step."""
    gradients: GradientReduction     # the running buffer and its reduction
    attributes: GlobalAttributes     # loss scaling and clipping
    finite_checks: bool = False      # floating-point exception flags

    @property
    def reduction(self) -> ReductionType:
        return self.gradients.reduction

    @staticmethod
    def build(options, plan: OptimizerPlan, layout, step_replicas: int
              ) -> "StepSettings":
        """The settings of ``options`` (a ``poptorch.Options``) for the
        optimizer ``plan``: the reduction of micro-batches (a step covering
        ``step_replicas`` replicas; a vectorised step is one micro-batch of
        all replicas) and the global optimizer attributes."""
        return StepSettings(
            gradients=GradientReduction.build(
                options.Training, layout.gradient_accumulation,
                step_replicas, plan.accum_dtype),
            attributes=GlobalAttributes.build(
                plan, options.Training.auto_loss_scaling),
            finite_checks=options.Precision.floating_point_exceptions)


def apply_rules(layout: TrainingLayout, params: List[torch.Tensor],
                grads: List[torch.Tensor], state: Sequence[torch.Tensor],
                hyper: Sequence[torch.Tensor],
                exchange: Optional[GradientExchange] = None):
    """Each param group's optimizer rule applied to the trainable
    ``params`` (this process's rows of them with replicated tensor
    sharding, whose per-tensor norms ``exchange`` totals): new params and
    the new flat optimizer state."""
    new_params, new_state, hyper_start = list(params), [], 0
    for group, group_state in zip(layout.groups,
                                  layout.unflatten_state(state)):
        names = group.variable_hyper
        group_hyper = dict(group.constant_hyper)
        group_hyper.update(zip(names, hyper[hyper_start:hyper_start +
                                            len(names)]))
        hyper_start += len(names)
        updated, updated_state = group.rule.update(
            [params[p] for p in group.positions],
            [grads[p] for p in group.positions], group_state, group_hyper,
            exchange.norms(group.positions) if exchange else None)
        for p, tensor in zip(group.positions, updated):
            new_params[p] = tensor
        for name in group.rule.state_names:
            new_state.extend(updated_state[name])
    return new_params, new_state


def _apply_update(layout: TrainingLayout, settings: StepSettings,
                  scaling: StepScaling, trainable, grads, state, hyper,
                  exchange: Optional[GradientExchange]):
    """New params, new optimizer state and the gradients the rules applied
    (reduced, unscaled and clipped). With nothing to train, the state
    stays as it is. With an ``exchange`` that shards, the rules update this
    process's rows of the parameters, gathered whole afterwards."""
    if not trainable:
        return [], list(state), []
    grads = scaling.unscale(grads, settings.gradients.divisor())
    finite = scaling.finite(grads)
    grads = scaling.clip(grads)
    local = exchange.local(trainable) if exchange else trainable
    new_local, new_state = apply_rules(layout, local, grads, state, hyper,
                                       exchange)
    new_local, new_state = scaling.finish(
        finite, local, new_local, state[:layout.state_size()], new_state)
    new_params = (exchange.gather(new_local, trainable) if exchange
                  else new_local)
    return new_params, new_state, grads


def micro_batch_forward(call: ModelCall, analysis: ModelAnalysis,
                        params: List[torch.Tensor],
                        buffers: List[torch.Tensor],
                        inputs: List[torch.Tensor]):
    """One micro-batch's forward pass: (the scalar the backward pass starts
    from, the model's output tensors, the new values of written buffers)."""
    written = clone_written(buffers, analysis.written_buffers)
    with losses.LossRecorder() as recorder:
        output = call(params, written, inputs)
    returned = tensor_outputs(output)
    return (analysis.backward_start(recorder.losses, returned), returned,
            written_values(call, analysis, buffers, written))


def _gradients(loss: torch.Tensor, trainable: List[torch.Tensor]
               ) -> List[torch.Tensor]:
    """The gradients of ``loss`` for the ``trainable`` parameters (zeros for
    those it does not use). With nothing to train (every parameter frozen,
    none in the optimizer or none reaching the loss) there are none: the
    step runs the forward pass, writes the buffers and returns the outputs,
    as PyTorch's ``backward()`` would leave no gradient to apply."""
    if not trainable:
        return []
    with fx_traceback.annotate({PASS_KEY: BACKWARD}):
        grads = torch.autograd.grad(loss, trainable, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g
            for p, g in zip(trainable, grads)]


def trace_training_step(call: ModelCall, analysis: ModelAnalysis,
                        layout: TrainingLayout, settings: StepSettings,
                        example: Dict[str, List[torch.Tensor]],
                        training_flags: Dict[str, bool], update: bool,
                        accumulated: bool,
                        forward: Optional[Callable] = None,
                        combine_losses: Optional[Callable] = None,
                        gradient_divisor: float = 1.0,
                        exchange: Optional[GradientExchange] = None
                        ) -> torch.fx.GraphModule:
    """Trace one micro-batch step; ``update`` selects the optimizer-step
    variant, ``accumulated`` whether a running gradient sum is an input.
    ``forward(params, buffers, inputs)`` replaces ``micro_batch_forward``
    (replicas run it vectorised, see ``replication/replicas.py``), and
    ``combine_losses`` turns the losses it returns (one per replica) into
    the value the backward pass starts from, whose gradients are divided
    by ``gradient_divisor``;
    ``exchange`` combines the step's gradients with other processes' (in
    an n-process run): before the update, or, when it shards the running
    buffer, as each micro-batch's are added to it; its collectives start
    as soon as their gradients exist (``distributed/gradients.py``,
    ``distributed/sharding.py``). With
    ``settings.finite_checks`` the step also returns its floating-point
    flags (``floating_point_checks.py``) before the model's outputs."""
    if forward is None:
        forward = functools.partial(micro_batch_forward, call, analysis)
    check_gradients = settings.attributes.automatic is None
    running = []
    if accumulated:
        running = settings.gradients.start(
            accumulated_like(example["trainable"], exchange))
    rows_done = (accumulated and exchange is not None
                 and exchange.reduces_each_micro_batch)
    sizes = [len(example["trainable"]), len(example["frozen"]),
             len(example["buffers"]), len(example["state"]),
             len(example["hyper"]), len(running)]

    def step(*flat):
        trainable, frozen, buffers, state, hyper, running, inputs = split_flat(
            flat, sizes)
        if exchange is not None and flat:
            exchange.begin(flat[0])
        scaling = settings.attributes.bind(
            hyper[layout.hyper_size():], state[layout.state_size():],
            exchange.statistics if exchange else None)

        stored = trainable
        if exchange is not None:
            trainable = exchange.whole_weights(stored)
        trainable = [t.detach().requires_grad_() for t in trainable]
        params = layout.merge(trainable, frozen)
        with torch.enable_grad(), call.bound(params, buffers):
            losses, outputs, written = forward(params, buffers, inputs)
            value = losses if combine_losses is None else \
                combine_losses(losses)
            value = scaling.scale_loss(value,
                                       settings.gradients.loss_factor())
            grads = _gradients(value, trainable)
        if gradient_divisor != 1.0:
            grads = torch._foreach_div(grads, gradient_divisor)
        outputs = [t.detach() for t in outputs]
        if rows_done:
            grads = exchange.reduce_micro_batch(
                settings.gradients.in_buffer_dtypes(running, grads))
        if accumulated:
            grads = (settings.gradients.add(running, grads) if trainable
                     else running)
        flags = []
        if not update:
            if settings.finite_checks:
                flags = [step_flags(losses, grads if check_gradients
                                    else None, None, len(trainable))]
            return written + grads + flags + outputs
        checked = list(grads)
        grads = settings.gradients.gradients(grads)
        if exchange is not None:
            grads = exchange.reduce(grads, rows_done)
        new_params, new_state, applied = _apply_update(
            layout, settings, scaling, stored, grads, state, hyper,
            exchange)
        if settings.finite_checks:
            flags = [step_flags(losses, checked if check_gradients else None,
                                new_params, len(trainable))]
        return new_params + written + new_state + flags + outputs + applied

    flat = (example["trainable"] + example["frozen"] + example["buffers"] +
            example["state"] + example["hyper"] + running + example["inputs"])
    with capture_scope(call.module, training_flags):
        graph = trace_user_code(step, flat)
    _name_tensors(graph, call.param_names, layout,
                  len(analysis.written_buffers), update, exchange)
    if exchange is not None:
        gather_weights_before_use(graph.graph)
        start_all_reduces_early(graph.graph)
        graph.recompile()
    return graph


def accumulated_like(trainable: List[torch.Tensor],
                     exchange: Optional[GradientExchange]
                     ) -> List[torch.Tensor]:
    """Tensors shaped as the running gradient buffer holds the
    ``trainable`` parameters' gradients (rows, when the exchange shards
    it)."""
    if exchange is None:
        return trainable
    return exchange.accumulators(trainable)


def _name_tensors(graph: torch.fx.GraphModule, param_names: List[str],
                  layout: TrainingLayout, written: int, update: bool,
                  exchange: Optional[GradientExchange]) -> None:
    """Mark PopART's names of the step's parameters (its first inputs:
    trainable, then frozen) and, for the trainable ones, of the gradients
    the optimizer applies (the update step's last outputs, taken off here),
    the updated values (its first outputs) and the optimizer state after the
    update (after the ``written`` buffers). The step that only accumulates
    gradients has the names, without values (``names.py``). With a sharding
    ``exchange``, the parameters, gradients and state that are this
    process's rows are marked with their whole shapes."""
    trainable = [param_names[i] for i in layout.trainable]
    params = trainable + [param_names[i] for i in layout.frozen]
    inputs, gradients, updated = ([None] * len(params),
                                  [None] * len(trainable),
                                  [None] * len(trainable))
    state = [None] * layout.state_size()
    if update:
        gradients = _take_last_outputs(graph, len(trainable))
        inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
        outputs = graph.graph.output_node().args[0]
        updated = outputs[:len(trainable)]
        start = len(trainable) + written
        state = outputs[start:start + layout.state_size()]
    named = dict(zip(params, inputs))
    named.update(zip(map(gradient_name, trainable), gradients))
    named.update(zip(map(updated_name, trainable), updated))
    position_of = {}
    for position, name in enumerate(trainable):
        for long_name in (name, gradient_name(name), updated_name(name)):
            position_of[long_name] = position
    for group, group_state in zip(layout.groups,
                                  layout.unflatten_state(state)):
        for state_name, nodes in group_state.items():
            for position, node in zip(group.positions, nodes):
                name = optimizer_state_name(group.rule, state_name,
                                            trainable[position])
                if name is not None:
                    named[name] = node
                    position_of[name] = position
    rows = {}
    if exchange is not None and update:
        rows = exchange.row_shapes({
            name: (named[name], position)
            for name, position in position_of.items()})
    mark_named_tensors(graph, named, rows)


def _take_last_outputs(graph: torch.fx.GraphModule,
                       count: int) -> List[torch.fx.Node]:
    """Remove the last ``count`` outputs of ``graph`` and return them."""
    output = graph.graph.output_node()
    values = list(output.args[0])
    cut = len(values) - count
    output.args = (values[:cut],)
    graph.recompile()
    return values[cut:]


def step_donation(example: Dict[str, List[torch.Tensor]], running: int,
                  written: int, update: bool) -> Donation:
    """The inputs of a traced training step that the device loop drops
    after the step (``backends/in_place.py``). The update step replaces the
    trainable parameters and the optimizer state by their new values, and
    the ``running`` gradient buffer tensors are scratch (the next optimizer
    step starts a new buffer); the accumulate step replaces the running
    buffer by its new sum, after the ``written`` buffers in its outputs."""
    trainable, state = len(example["trainable"]), len(example["state"])
    state_start = trainable + len(example["frozen"]) + len(example["buffers"])
    running_start = state_start + state + len(example["hyper"])
    running_inputs = range(running_start, running_start + running)
    if not update:
        return Donation({i: written + k for k, i in enumerate(running_inputs)})
    return _update_donation(trainable, state, state_start,
                            trainable + written, running_inputs)


def trace_update_step(layout: TrainingLayout, settings: StepSettings,
                      example: Dict[str, List[torch.Tensor]],
                      partial: Optional[PartialGradients] = None,
                      exchange: Optional[GradientExchange] = None
                      ) -> torch.fx.GraphModule:
    """The optimizer step alone, for gradients computed outside the graph
    (multi-stage models, ``staging/staged_execution.py``):
    (trainable, summed gradients, state, hyper) -> (new trainable, new
    state). The gradients are those of the scaled loss combined over the
    step's micro-batches as the running gradient buffer combines them (a
    sum, or the running mean; in the buffer's dtype). With ``partial``, the
    other processes hold the step's other gradients; ``exchange`` combines
    the gradients with other processes' first and, when it shards, updates
    this process's rows (as in ``trace_training_step``). With ``settings.finite_checks`` and
    parameters to update, the floating-point flags of the gradients and the
    updated values follow (``floating_point_checks.py``; no loss flag)."""
    trainable = example["trainable"]
    sizes = [len(trainable), len(trainable), len(example["state"])]
    check_gradients = settings.attributes.automatic is None

    def update(*flat):
        params, grads, state, hyper = split_flat(flat, sizes)
        if exchange is not None and flat:
            exchange.begin(flat[0])
            grads = exchange.reduce(grads)
        scaling = settings.attributes.bind(
            hyper[layout.hyper_size():], state[layout.state_size():],
            exchange.statistics if exchange else partial)
        new_params, new_state, _ = _apply_update(
            layout, settings, scaling, params, grads, state, hyper, exchange)
        flags = []
        if settings.finite_checks and params:
            flags = [step_flags(params[0].new_zeros(0),
                                grads if check_gradients else None,
                                new_params, len(params))]
        return new_params + new_state + flags

    grads = settings.gradients.start(trainable)[:len(trainable)]
    return trace(update, trainable + grads + example["state"] +
                 example["hyper"])


def update_donation(example: Dict[str, List[torch.Tensor]]) -> Donation:
    """The inputs of ``trace_update_step``'s graph that the caller drops
    after it: the trainable parameters and the optimizer state, replaced by
    the outputs, and the gradients (scratch)."""
    trainable, state = len(example["trainable"]), len(example["state"])
    return _update_donation(trainable, state, 2 * trainable, trainable,
                            range(trainable, 2 * trainable))


def _update_donation(trainable: int, state: int, state_input: int,
                     state_output: int, scratch: Sequence[int]) -> Donation:
    """An update step's donation: the ``trainable`` parameters (first in
    inputs and outputs) and the ``state`` optimizer state tensors (from
    input ``state_input``, output ``state_output``) are replaced by their
    new values; the ``scratch`` inputs (gradients) hold nothing read
    again."""
    replaced = {i: i for i in range(trainable)}
    replaced.update({state_input + k: state_output + k for k in range(state)})
    return Donation(replaced, frozenset(scratch))
