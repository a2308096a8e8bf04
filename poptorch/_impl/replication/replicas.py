"""How the R replicas of one process run (docs/semantics.md, "Replication").

Each replica holds the same weights (or its group's value of a grouped
weight, ``grouping.py``), reads its own slice of every call's data
and, with ``broadcastBuffers(False)``, keeps its own buffers. Three paths:

* single: R = 1 and no grouped weight; the step runs as captured.
* vectorised (the default for R > 1): each step runs all replicas as ONE
  computation. The R micro-batches are stacked into one [R, S, ...] batch
  and the model's forward pass runs once under ``torch.func.vmap`` over the
  replica dimension; the backward pass starts from the replicas' losses
  combined (see below). vmap's batching rules merge the replica dimension into the batch
  dimension of matrix multiplications and convolutions, so a model without
  ops that couple samples runs as one batch of R x S samples, and
  reductions over the batch stay per replica: each replica's loss (a
  mean-reduced loss is the mean over its own S samples), BatchNorm
  statistics and outputs are exactly those of a replica run on its own
  (BatchNorm in training runs each replica's slice through PyTorch's kernel
  without the batching rule's copies, ``batch_norm.py``; CPU
  attention runs as operations vmap batches, ``attention.py``).
  The backward pass starts from the sum of the replicas' losses, so that
  each replica's starts from its own loss as on the sequential path, and
  for ``ReductionType.Mean`` the gradients are divided by R: the step is
  one micro-batch of the G in an optimizer step (``step_replicas``), whose
  gradients are the mean over its R micro-batches of the sequential path's,
  with no running gradient buffer when G = 1. Per-replica written buffers
  are stacked along the replica dimension for the call. This is the fused batch with an exact
  loss correction, without analysing the loss: the per-replica losses exist
  in the graph, so every ``OutputMode`` gets them.
* sequential: the replicas' steps run one after another in the device
  loop. It is used when vectorising would change the results (``forward``
  writes its input tensors in place, or a parameter has gradient hooks,
  ``parameter_hooks.py``) or when
  vmap cannot trace the model (for example an ``autograd.Function`` without
  a vmap rule, ``torch.utils.checkpoint``, which recomputes part of the
  forward pass in the backward pass, outside vmap, gradient hooks on
  activations, ``autograd_queries.py``, or an operation whose values or
  gradient vmap computes wrongly, ``misbatched_ops.py``): the first step
  is traced vectorised and, if that fails, traced again on the sequential
  path; the reason is logged at DEBUG.

Outputs keep the [D, G, R] order: the vectorised step returns [R, ...]
stacked outputs and hands each replica's slice to the output collector.
"""
import contextlib
import dataclasses
import functools
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.nn.modules.batchnorm import _NormBase

from ...enums import (MeanReductionStrategy, ReductionType,
                      VariableRetrievalMode)
from ...errors import Error
from ..batching import BatchLayout
from ..capture import (ModelAnalysis, ModelCall, capture_scope, clone_written,
                       split_flat, tensor_outputs, trace_inference_step,
                       trace_user_code)
from ..distributed.gradients import GradientExchange
from ..logger import logger
from ..optimizers.gradient_reduction import GradientReduction
from ..outputs import OutputCollector
from .attention import batched_attention
from .autograd_queries import answered_per_replica
from .batch_norm import per_replica_statistics
from .grouping import GroupedWeights, ReplicaGrouping
from .misbatched_ops import refused_in_vmap
from ..training_step import micro_batch_forward, trace_training_step
from ..weight_sync import host_reads_suspended

SINGLE = "single"
VECTORISED = "vectorised"
SEQUENTIAL = "sequential"


def check_layout(layout: BatchLayout) -> None:
    """The input group size must be a factor of the replication factor."""
    if layout.replicas % layout.input_group_size:
        raise Error(
            f"inputReplicaGrouping input_group_size "
            f"({layout.input_group_size}) must be a factor of "
            f"replicationFactor ({layout.replicas})")


def buffer_sets(options, module: torch.nn.Module,
                training_flags: Dict[str, bool]) -> int:
    """One set of buffers, or one per replica: with
    ``broadcastBuffers(False)``, and when normalisation layers in training
    mode update their running statistics, which each replica keeps for
    itself as on IPUs (the host sees the first replica's)."""
    if options.broadcast_buffers and not _running_statistics(
            module, training_flags):
        return 1
    return options.replication_factor


def check_buffers_unwritten(module: torch.nn.Module,
                            training_flags: Dict[str, bool],
                            buffer_names: List[str], written: List[int],
                            broadcast: bool) -> None:
    """Buffers broadcast to several replicas (``broadcast``) cannot be
    written by the model's own code (PopTorch refuses them too);
    normalisation statistics are kept per replica instead."""
    statistics = _running_statistics(module, training_flags)
    names = [buffer_names[i] for i in written
             if buffer_names[i] not in statistics]
    if broadcast and names:
        raise Error(
            f"The model writes to its buffers "
            f"({', '.join(names)}) and buffers are broadcast to several "
            "replicas: a broadcast buffer cannot be written by the model. "
            "Set options.broadcastBuffers(False) so that each replica "
            "keeps its own buffers.")


def _running_statistics(module: torch.nn.Module,
                        training_flags: Dict[str, bool]) -> Set[str]:
    """The names of the running-statistics buffers that the module's
    normalisation layers (BatchNorm, InstanceNorm with
    ``track_running_stats``) update in training mode."""
    with host_reads_suspended():
        return {f"{path}{'.' if path else ''}{name}"
                for path, layer in module.named_modules()
                if isinstance(layer, _NormBase) and layer.track_running_stats
                and training_flags.get(path, True)
                for name, _ in layer.named_buffers(recurse=False)}


class _ReplicaOutputs:
    """Hands the slices of stacked [R, ...] outputs to the collector, one
    replica at a time (the device loop sees one vectorised "replica")."""

    def __init__(self, collector: OutputCollector, replicas: int) -> None:
        self._collector = collector
        self._replicas = replicas

    def add(self, iteration: int, replica: int,
            outputs: List[torch.Tensor]) -> None:
        if not self._collector.wants(iteration):
            return
        for index in range(self._replicas):
            self._collector.add(iteration, index,
                                [t[index] for t in outputs])


@dataclasses.dataclass
class LoopArguments:
    """What the device loop runs with: a layout, the split inputs, the
    buffer sets and the output collector."""
    layout: BatchLayout
    inputs: List[torch.Tensor]
    buffer_sets: List[List[torch.Tensor]]
    collector: object


class ReplicaExecution:
    """The replica path of one compiled model and what it needs to trace
    and run its steps."""

    def __init__(self, layout: BatchLayout, analysis: ModelAnalysis,
                 grouped: GroupedWeights, path: str, reason: str) -> None:
        self.layout = layout
        self.analysis = analysis
        self.grouped = grouped
        self.path = path
        self.reason = reason
        self._input_grouping = ReplicaGrouping(
            layout.input_group_type, layout.input_group_size,
            VariableRetrievalMode.OnePerGroup)
        logger.debug("Replicas: %d replica(s) run on the %s path (%s)",
                     layout.replicas, path, reason)

    @staticmethod
    def choose(layout: BatchLayout, analysis: ModelAnalysis, training: bool,
               grouped: GroupedWeights,
               hooked: List[str]) -> "ReplicaExecution":
        """Pick the path for this model (``hooked``: the names of its
        parameters with gradient hooks). A vectorised model may still fall
        back to the sequential path when its first step is traced
        (``fall_back``): vmap cannot trace every model."""
        path, reason = _path_for(layout, analysis, training, grouped, hooked)
        if path == SEQUENTIAL and grouped:
            raise Error(_grouped_needs_vectorised(reason))
        return ReplicaExecution(layout, analysis, grouped, path, reason)

    @property
    def step_replicas(self) -> int:
        """Replicas per captured micro-batch step: R on the sequential
        path; 1 on the vectorised path, whose step is one micro-batch of
        the replicas' combined gradients (``_combined_loss``)."""
        return 1 if self.path == VECTORISED else self.layout.replicas

    @property
    def step_losses(self) -> int:
        """Losses per captured micro-batch step: R on the vectorised path,
        1 on the others."""
        return self.layout.replicas if self.path == VECTORISED else 1

    # --- what the traced steps see --------------------------------------
    def _written_dims(self, count: int) -> List[Optional[int]]:
        written = set(self.analysis.written_buffers)
        return [0 if i in written else None for i in range(count)]

    def _stacked_buffers(self, buffer_sets: List[List[torch.Tensor]]
                         ) -> List[torch.Tensor]:
        """Written buffers stacked along a replica dimension (one [R, ...]
        tensor each); the others are the same for every replica."""
        return [torch.stack([s[i] for s in buffer_sets]) if dim == 0
                else buffer_sets[0][i]
                for i, dim in enumerate(self._written_dims(
                    len(buffer_sets[0])))]

    @staticmethod
    def _example_inputs(split: List[torch.Tensor]) -> List[torch.Tensor]:
        return [(t if t.dim() == 0 else t[0, 0]).clone() for t in split]

    def _per_replica(self, params, inputs,
                     reduction: Optional[ReductionType]):
        """Grouped weights and grouped inputs expanded to one value per
        replica, with the vmap dimensions of params and inputs."""
        replicas = self.layout.replicas
        params = [self.grouped.per_replica(i, p, reduction)
                  if i in self.grouped.groupings else p
                  for i, p in enumerate(params)]
        if self.layout.input_group_size > 1:
            inputs = [t if t.dim() == 0 else
                      self._input_grouping.to_replicas(t, replicas)
                      for t in inputs]
        param_dims = [0 if i in self.grouped.groupings else None
                      for i in range(len(params))]
        input_dims = [None if t.dim() == 0 else 0 for t in inputs]
        return params, inputs, param_dims, input_dims

    def _vectorised_forward(self, call: ModelCall,
                            reduction: Optional[ReductionType]) -> Callable:
        """(params, buffers, inputs) -> (the replicas' [R] losses, [R, ...]
        outputs, [R, ...] written buffers), in one vmap over replicas."""
        micro = functools.partial(micro_batch_forward, call, self.analysis)

        def forward(params, buffers, inputs):
            params, inputs, param_dims, input_dims = self._per_replica(
                params, inputs, reduction)
            dims = (param_dims, self._written_dims(len(buffers)), input_dims)
            with per_replica_statistics(), batched_attention(), \
                    answered_per_replica(), refused_in_vmap(training=True):
                return torch.func.vmap(micro, in_dims=dims,
                                       randomness="different")(
                                           params, buffers, inputs)

        return forward

    @staticmethod
    def _combined_loss(gradients: GradientReduction, replicas: int
                       ) -> Tuple[Callable, float]:
        """How the vectorised step's backward pass starts from the
        replicas' [R] losses, and what its gradients are then divided by.
        Each replica's backward pass starts from its own loss, as on the
        sequential path and in PopTorch, so that a custom backward that is
        not linear in its incoming gradient sees the same gradient: the
        losses are summed, and for ``ReductionType.Mean`` the gradients
        divided by R (the step is one micro-batch of the G, see
        ``step_replicas``). The deprecated
        ``MeanReductionStrategy.PostAndLoss`` divides the loss by R before
        the backward pass: the step starts from the losses' mean."""
        if gradients.reduction == ReductionType.Sum:
            return torch.sum, 1.0
        if gradients.strategy == MeanReductionStrategy.PostAndLoss:
            return torch.mean, 1.0
        return torch.sum, float(replicas)

    # --- tracing ------------------------------------------------------------
    def trace_training(self, call: ModelCall, training, settings,
                       example: Dict[str, List[torch.Tensor]],
                       buffer_sets: List[List[torch.Tensor]],
                       split: List[torch.Tensor],
                       flags: Dict[str, bool], update: bool,
                       accumulated: bool,
                       exchange: Optional[GradientExchange] = None
                       ) -> torch.fx.GraphModule:
        """``trace_training_step`` for this path. ``example`` holds one
        replica's micro-batch and buffers (what the sequential path
        traces with)."""
        if self.grouped:
            self.grouped.check_update(training, settings)
        if self.path == VECTORISED:
            vector_example = dict(example,
                                  buffers=self._stacked_buffers(buffer_sets),
                                  inputs=self._example_inputs(split))
            combine, divisor = self._combined_loss(
                settings.gradients, self.layout.replicas)
            with _vmap_failures_as_errors():
                return trace_training_step(
                    call, self.analysis, training, settings, vector_example,
                    flags, update=update, accumulated=accumulated,
                    forward=self._vectorised_forward(call,
                                                     settings.reduction),
                    combine_losses=combine, gradient_divisor=divisor,
                    exchange=exchange)
        return trace_training_step(call, self.analysis, training, settings,
                                   example, flags, update=update,
                                   accumulated=accumulated,
                                   exchange=exchange)

    def trace_inference(self, call: ModelCall, params: List[torch.Tensor],
                        buffer_sets: List[List[torch.Tensor]],
                        split: List[torch.Tensor], flags: Dict[str, bool]
                        ) -> Tuple[torch.fx.GraphModule, List[torch.Tensor]]:
        """The inference step for this path and its example inputs."""
        if self.path == VECTORISED:
            example = (params + self._stacked_buffers(buffer_sets) +
                       self._example_inputs(split))
            try:
                with _vmap_failures_as_errors():
                    return self._trace_vectorised_inference(
                        call, len(params), len(buffer_sets[0]), example,
                        flags), example
            except Error as error:
                self.fall_back(error)
        params = self.grouped.replica_params(params)
        micro = [(t if t.dim() == 0 else t[0, 0, 0]).clone() for t in split]
        graph = trace_inference_step(call, self.analysis, params,
                                     buffer_sets[0], micro, flags)
        return graph, params + buffer_sets[0] + micro

    def _trace_vectorised_inference(self, call: ModelCall, num_params: int,
                                    num_buffers: int, example, flags
                                    ) -> torch.fx.GraphModule:
        written = self.analysis.written_buffers

        def micro(params, buffers, inputs):
            buffers = clone_written(buffers, written)
            return ([buffers[i] for i in written],
                    tensor_outputs(call(params, buffers, inputs)))

        def step(*flat):
            params, buffers, inputs = split_flat(flat,
                                                 [num_params, num_buffers])
            params, inputs, param_dims, input_dims = self._per_replica(
                params, inputs, None)
            dims = (param_dims, self._written_dims(num_buffers), input_dims)
            with per_replica_statistics(), batched_attention(), \
                    refused_in_vmap(training=False):
                new_buffers, outputs = torch.func.vmap(
                    micro, in_dims=dims, randomness="different")(
                        params, buffers, inputs)
            return new_buffers + outputs

        with capture_scope(call.module, flags):
            return trace_user_code(step, example)

    def fall_back(self, error: Error) -> None:
        """Run the replicas on the sequential path, because vmap could not
        trace the vectorised step (``error``)."""
        reason = f"vmap could not trace the model: {error}"
        if self.grouped:
            raise Error(_grouped_needs_vectorised(reason)) from error
        self.path, self.reason = SEQUENTIAL, reason
        logger.debug("Replicas: falling back to the sequential path (%s)",
                     reason)

    # --- running ------------------------------------------------------------
    @contextlib.contextmanager
    def loop(self, split: List[torch.Tensor],
             buffer_sets: List[List[torch.Tensor]],
             collector: OutputCollector) -> Iterator[LoopArguments]:
        """The device loop's arguments for one call. On the vectorised path
        the loop sees one "replica" whose micro-batch is the stacked
        [R', S, ...] slice; per-replica buffers are stacked for the call and
        unstacked afterwards."""
        if self.path != VECTORISED:
            yield LoopArguments(self.layout, split, buffer_sets, collector)
            return
        stacked = self._stacked_buffers(buffer_sets)
        layout = BatchLayout(self.layout.device_iterations,
                             self.layout.gradient_accumulation, 1)
        yield LoopArguments(
            layout, [t if t.dim() == 0 else t.unsqueeze(2) for t in split],
            [stacked], _ReplicaOutputs(collector, self.layout.replicas))
        for index in self.analysis.written_buffers:
            for replica, values in enumerate(buffer_sets):
                values[index] = stacked[index][replica]


@contextlib.contextmanager
def _vmap_failures_as_errors() -> Iterator[None]:
    """Any failure of a vectorised trace as a ``poptorch.Error``, which
    sends the model to the sequential path (``fall_back``): a failure of
    the model's own code shows there again, as itself."""
    try:
        yield
    except Error:
        raise
    except Exception as error:
        raise Error(f"{type(error).__name__}: {error}") from error


def _path_for(layout: BatchLayout, analysis: ModelAnalysis, training: bool,
              grouped: GroupedWeights,
              hooked: List[str]) -> Tuple[str, str]:
    if layout.replicas == 1 and not grouped:
        return SINGLE, "one replica"
    if training and hooked:
        return SEQUENTIAL, (f"parameters have gradient hooks ({hooked[0]}"
                            f"{', ...' if len(hooked) > 1 else ''}), which "
                            "apply to each replica's own gradients")
    if analysis.written_inputs:
        return SEQUENTIAL, ("forward writes to its input tensors in place; "
                            "each replica writes its own slice in turn")
    return VECTORISED, ("the replicas' forward passes run as one batch "
                        "under torch.func.vmap, followed by one backward "
                        "pass" if training else
                        "the replicas' forward passes run as one batch "
                        "under torch.func.vmap")


def _grouped_needs_vectorised(reason: str) -> str:
    return ("replicaGrouping: grouped weights need the vectorised replica "
            f"path, which this model cannot use: {reason}")
