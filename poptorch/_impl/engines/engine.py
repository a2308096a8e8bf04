"""The engine interface: how a compiled model's captured steps run.

A compiled model (``compiled_model.py``) captures the model once, then
hands the pieces to one engine, which compiles them and runs every call:

* ``SingleGraphEngine`` (``single_graph.py``): the whole model as one
  captured step per micro-batch, run by the device loop
  (``device_loop.py``) over the call's D x G x R micro-batches, replicas
  vectorised or one after another (``replication/replicas.py``), optionally
  replayed as one CUDA graph per call;
* ``StagedEngine`` (``staged.py``): a model whose blocks form several
  stages, each a separate partition run in the execution strategy's order
  (``staging/staged_execution.py``), with one captured optimizer step per
  G x R micro-batches.

Both read and replace the same device state (``DeviceState``: weights,
buffers, optimizer state), so the compiled model around them (state in and
out, rollback of failed calls, outputs) is the same.
"""
import abc
import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from ..batching import BatchLayout
from ..capture import ModelAnalysis, ModelCall
from ..device_loop import TrainingState
from ..device_state import DeviceState
from ..failed_calls import CallProgress
from ..floating_point_checks import StepFlags
from ..outputs import OutputCollector
from ..replication.replicas import ReplicaExecution
from ..training_step import StepSettings, TrainingLayout


@dataclasses.dataclass
class CompileInputs:
    """What an engine compiles from: the captured model and one call."""
    model_call: ModelCall
    analysis: ModelAnalysis
    state: DeviceState
    micro: List[torch.Tensor]       # one micro-batch of the call
    inputs: List[torch.Tensor]      # the call's inputs, [D, G, R', S, ...]
    layout: BatchLayout
    replicas: ReplicaExecution
    session: object                 # the CompileSession
    training_flags: Dict[str, bool]


@dataclasses.dataclass
class TrainingSetup:
    """What a training model's engine compiles besides ``CompileInputs``:
    which parameters train, the step's settings (``settings_for(replicas)``
    gives them for another number of replicas per step), example inputs of
    the step, and the run's processes (``distributed.start_training``)."""
    layout: TrainingLayout
    settings: StepSettings
    settings_for: Callable[[int], StepSettings]
    example: Dict[str, List[torch.Tensor]]
    processes: object
    stage_per_process: bool


class Engine(abc.ABC):
    """Compiles a captured model's steps and runs its calls."""

    #: Whether the training update writes the new weights and optimizer
    #: state into the old tensors (a failed call then needs copies).
    overwrites_training_state: bool = False
    #: Whether each step of a call is one micro-batch of one replica (else
    #: all replicas at once, or a whole optimizer step).
    steps_name_replicas: bool = True
    #: Whether the engine's steps are optimizer steps through several
    #: stages rather than micro-batches.
    runs_stages: bool = False
    #: The stages the model runs as.
    stage_count: int = 1

    @abc.abstractmethod
    def step_replicas(self, layout: BatchLayout) -> int:
        """Replicas per micro-batch step of the training step's
        reduction."""

    @abc.abstractmethod
    def compile_inference(self, inputs: CompileInputs) -> None:
        """Capture and compile the inference step(s)."""

    @abc.abstractmethod
    def compile_training(self, inputs: CompileInputs,
                         setup: TrainingSetup) -> None:
        """Capture and compile the training step(s)."""

    @abc.abstractmethod
    def run_inference(self, params: List[torch.Tensor],
                      buffer_sets: List[List[torch.Tensor]],
                      split: List[torch.Tensor], layout: BatchLayout,
                      collector: OutputCollector, progress: CallProgress,
                      flags: Optional[StepFlags]) -> None:
        """One inference call, outputs handed to ``collector``."""

    @abc.abstractmethod
    def run_training(self, state: TrainingState,
                     split: List[torch.Tensor], layout: BatchLayout,
                     collector: OutputCollector, progress: CallProgress,
                     flags: Optional[StepFlags]) -> None:
        """One training call, ``state`` replaced as the steps run."""

    @abc.abstractmethod
    def step_flags(self, param_names: List[str],
                   training: Optional[TrainingLayout]) -> StepFlags:
        """Where a training call's floating-point flags go."""

    @abc.abstractmethod
    def tensor_names_graph(self, session) -> torch.fx.GraphModule:
        """The graph whose tensors ``getTensorNames`` lists."""

    @property
    @abc.abstractmethod
    def executable(self) -> object:
        """The compiled steps (``PoplarExecutor._executable``)."""

    def cuda_graphs_allowed(self) -> Optional[str]:
        """Why this engine's calls cannot replay as CUDA graphs, or None
        when the general conditions decide (``cuda_graphs.py``)."""
        return None

    def moved(self, device: torch.device) -> None:
        """The model's state moved to ``device``: move what the engine keeps
        there itself."""
