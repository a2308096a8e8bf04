"""One profiled model: the top-level ranges it records, the facts of its
compilation and the files it writes (docs/profiling.md).

Files go to the switches' directory, named after ``modelName`` (by
default ``training`` or ``inference``; a later model of the same name
writing to the same directory in this process gets ``-2``, ``-3``...), with
``.rank<k>`` in a multi-process run:

* ``<name>.trace.json`` — the timeline, Chrome trace-event JSON, for
  Perfetto, ``chrome://tracing`` or TensorBoard's profiler;
* ``<name>.report.json``, ``<name>.summary.md``, ``<name>.timeline.svg`` —
  the report (``report.py``).
"""
import bisect
import contextlib
import json
import os
import threading
import time
from typing import (Any, ContextManager, Dict, Iterator, List, Optional,
                    Tuple)

import torch

from ..logger import logger
from .facts import StepFacts, step_facts
from .ranges import profile_range, unprofiled_range
from .report import write_atomically, write_report
from .session import SESSION
from .switches import ProfilingSwitches
from .trace_events import Interval, RecordedRange, chrome_events

_names_taken: Dict[Tuple[str, str], int] = {}


class ModelProfile:
    """The profile of one model in this process."""

    def __init__(self, switches: ProfilingSwitches, name: str,
                 options) -> None:
        self.switches = switches
        self.name = _unique(switches.directory, name)
        processes = options.Distributed.numProcesses
        rank = options.Distributed.processId
        self.stem = (self.name if processes <= 1
                     else f"{self.name}.rank{rank}")
        self.model: Dict[str, Any] = {
            "name": self.name,
            "process": {"rank": rank, "world_size": processes,
                        "pid": os.getpid()}}
        self._starts: Dict[int, List[int]] = {}
        self._ends: Dict[int, List[int]] = {}
        self._events: List[Dict] = []
        self._timeline = False
        self._steps: Dict[str, StepFacts] = {}
        self._memory: List[Dict[str, Any]] = []
        self._joined = False
        self._join()

    def _join(self) -> None:
        if not self._joined:
            SESSION.join(self, self.switches.operators)
            self._joined = True

    # --- recording ----------------------------------------------------------
    @contextlib.contextmanager
    def top_range(self, name: str) -> Iterator[None]:
        """A range of this model on the timeline (a compilation, a call, a
        weight copy): the ranges inside it are this model's."""
        self._join()
        thread, start = threading.get_native_id(), time.time_ns()
        try:
            with profile_range(name):
                yield
        finally:
            self._starts.setdefault(thread, []).append(start)
            self._ends.setdefault(thread, []).append(time.time_ns())

    def owns(self, recorded: RecordedRange) -> bool:
        """Whether ``recorded`` is inside one of this model's ranges."""
        starts = self._starts.get(recorded.thread, [])
        index = bisect.bisect_right(starts, recorded.start) - 1
        return index >= 0 and Interval(
            recorded.thread, starts[index],
            self._ends[recorded.thread][index]).holds(recorded)

    def take(self, ranges: Optional[List[RecordedRange]],
             channels: List[str]) -> None:
        """Keep ``ranges`` (this model's and the process's) for the files;
        None: the user's profiler recorded them."""
        self._starts.clear()
        self._ends.clear()
        if ranges is None:
            return
        self._timeline = True
        self._events.extend(chrome_events(ranges, channels))

    # --- facts --------------------------------------------------------------
    def compiled(self, compiled) -> None:
        """Take the facts of a compilation (a ``CompiledModel``): layout,
        backend, the steps' operators and FLOPs, memory per stage."""
        layout = compiled.layout
        self.model.update({
            "training": compiled.spec.training,
            "backend": compiled.session.backend.name,
            "device": str(compiled.state.device),
            "layout": {"device_iterations": layout.device_iterations,
                       "gradient_accumulation": layout.gradient_accumulation,
                       "replicas": layout.replicas,
                       "micro_batch_size": None}})
        self._steps = {name: step_facts(graph)
                       for name, graph in compiled.session.graphs.items()}
        staged = getattr(compiled.engine, "execution", None)
        if staged is not None:
            # The stages' graphs instead of the whole forward graph they
            # were cut from, which is never run as such.
            self._steps.pop("forward", None)
            for index, stage in enumerate(staged.graph.stages):
                self._steps[f"stage {index} forward"] = step_facts(
                    stage.module)
        self._memory = stage_memory(compiled, self._steps)

    def called(self, host_inputs: List[torch.Tensor], layout) -> None:
        """Note the micro-batch size from a call's inputs."""
        shape = self.model.get("layout")
        if shape is None or shape["micro_batch_size"] is not None:
            return
        batched = [t for t in host_inputs if t.dim() > 0]
        if batched:
            rows = layout.device_iterations * layout.gradient_accumulation \
                * layout.data_replicas
            shape["micro_batch_size"] = batched[0].shape[0] // rows

    # --- files --------------------------------------------------------------
    def write(self) -> None:
        """Write this model's files with everything recorded so far."""
        directory = self.switches.directory
        try:
            os.makedirs(directory, exist_ok=True)
            if self.switches.timeline and self._timeline:
                self._write_trace(directory)
            if self.switches.report and "layout" in self.model:
                write_report(directory, self.stem, self.model, self._steps,
                             self._memory, self._events)
        except Exception as error:  # pylint: disable=broad-except
            # Profiling must never stop the training it observes.
            logger.warning("Could not write the profile of %s in %s: %s: %s",
                           self.name, directory, type(error).__name__, error)

    def _write_trace(self, directory: str) -> None:
        trace = {"traceEvents": self._events, "displayTimeUnit": "ms",
                 "otherData": {"poptorch_model": self.model}}
        write_atomically(os.path.join(directory, f"{self.stem}.trace.json"),
                         json.dumps(trace))

    def close(self) -> None:
        """The model is destroyed: write its files, stop recording for it."""
        SESSION.leave(self)
        self._joined = False


class Unprofiled:
    """A model that its options do not profile: its ranges still reach a
    torch profiler the user runs."""

    @staticmethod
    def top_range(name: str) -> ContextManager:
        return unprofiled_range(name)

    def compiled(self, compiled) -> None:
        pass

    def called(self, host_inputs, layout) -> None:
        pass

    def close(self) -> None:
        pass


def stage_memory(compiled, steps: Dict[str, StepFacts]
                 ) -> List[Dict[str, Any]]:
    """Bytes of parameters, optimizer state and saved activations per
    pipeline stage (one stage for a single-graph model). A staged model's
    saved activations are bounded by its stage's intermediate tensors."""
    staged = getattr(compiled.engine, "execution", None)
    owners = (staged.graph.param_owners() if staged is not None
              else [[0]] * len(compiled.state.params))
    count = staged.stage_count if staged is not None else 1
    memory = [{"stage": k, "parameter_bytes": 0, "optimizer_state_bytes": 0,
               "saved_activation_bytes": 0} for k in range(count)]
    stage_of = [stages[0] if stages else 0 for stages in owners]
    for index, param in enumerate(compiled.state.params):
        memory[stage_of[index]]["parameter_bytes"] += _bytes(param)
    if compiled.training is not None:
        trainable = compiled.training.layout.trainable
        states = compiled.training.optimizer_state.per_param(
            compiled.state.optimizer)
        for position, state in enumerate(states):
            memory[stage_of[trainable[position]]]["optimizer_state_bytes"] \
                += sum(_bytes(t) for t in state.values())
    for k, entry in enumerate(memory):
        entry["saved_activation_bytes"] = (
            _intermediate_bytes(staged.graph.stages[k].module)
            if staged is not None and compiled.training is not None
            else max((s.saved_activation_bytes for s in steps.values()),
                     default=0))
    return memory


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _intermediate_bytes(graph: torch.fx.GraphModule) -> int:
    total = 0
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(value, torch.Tensor):
            total += _bytes(value)
    return total


def _unique(directory: str, name: str) -> str:
    key = (os.path.abspath(directory), name)
    count = _names_taken.get(key, 0) + 1
    _names_taken[key] = count
    return name if count == 1 else f"{name}-{count}"
