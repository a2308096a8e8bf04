"""One compilation of a model: the backend that runs its captured steps,
the executable cache, executables read from an exported file, anchored
tensors, the progress bar and source locations of capture errors.

The executor opens a session around capture and compilation; the compiled
model and its engine hand it each captured graph (``graph``, which adds
anchored tensors to its outputs) and each graph to compile (``compile``). The session keeps the graphs and
their executable keys for export (``export.py``).
"""
import contextlib
import dataclasses
import sys
from typing import Any, Dict, Iterator, List, Optional

import torch

from ..errors import Error
from . import compile_errors, traced_warnings, tracing_context
from .backends.backend import CompiledStep
from .backends.in_place import Donation
from .backends.selection import ENVIRONMENT_VARIABLE, select_backend
from .backends.tiered import TieredBackend
from .devices import select_device
from .executable_cache import (ExecutableCache, compile_cached,
                               default_cache_directory, executable_key)
from .names import Anchors
from .options.effects import model_name
from .profiling.ranges import profile_range
from .tiering import TieredCompilation
from .graph_format import serialize_graph

#: Options left out of the executable key: those that do not change the
#: compiled executable (they may differ between compilation and
#: ``loadExecutable``; ``poptorch.load`` takes them from ``edit_opts_fn``),
#: PopART's options (``_Popart``, without effect here) and ``backend``,
#: whose resolved name the key holds instead.
RUNTIME_OPTIONS = frozenset({
    "connection_type", "ipu_id", "use_ipu_model", "offline_ipu_version",
    "executable_cache_dir", "show_compilation_progress_bar", "log_dir",
    "max_repeat_logs", "profile_dir", "log_cycle_count", "model_name",
    "relax_optimizer_attributes_checks", "random_seed", "sync_pattern",
    "source_location_excludes", "backend", "cuda_graphs",
    "updatable_named_buffers", "Distributed", "_Popart"})


def compile_time_options(options) -> Dict[str, Any]:
    """``options.toDict()`` without the runtime options."""
    return {name: value for name, value in options.toDict().items()
            if name not in RUNTIME_OPTIONS}


@dataclasses.dataclass
class PrecompiledStep:
    """A step read from an exported file: its executable key, its graph
    (as JSON) and, when the file may be trusted with code, the backend's
    executable."""
    key: str
    graph: Dict[str, Any]
    executable: Optional[bytes]


class _Progress:
    """The compilation progress bar (``showCompilationProgressBar``), shown
    from the first time the number of stages to compile is known."""

    def __init__(self, show: bool) -> None:
        self._show = show
        self._bar = None

    def expect(self, stages: int) -> None:
        if not self._show:
            return
        if self._bar is None:
            from tqdm import tqdm
            self._bar = tqdm(total=stages, desc="Graph compilation",
                             unit="stage", file=sys.stderr, leave=False)
        else:
            self._bar.total += stages
            self._bar.refresh()

    def advance(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class CompileSession:
    """What one compilation of a model uses and produces."""

    def __init__(self, options, training: bool,
                 precompiled: Optional[Dict[str, PrecompiledStep]] = None,
                 precompiled_source: str = "") -> None:
        self.device = select_device(options.use_ipu_model)
        self.backend = select_backend(options.backend, ENVIRONMENT_VARIABLE)
        self.options = compile_time_options(options)
        cache_dir = options.executable_cache_dir
        self.cache = (ExecutableCache(cache_dir,
                                      model_name(options, training))
                      if cache_dir else None)
        self.tiers = (TieredCompilation(
            self.cache or ExecutableCache(default_cache_directory(),
                                          model_name(options, training)),
            self.options, options.show_compilation_progress_bar,
            seeded=options.random_seed is not None)
            if isinstance(self.backend, TieredBackend) else None)
        self.anchors = Anchors(
            options.anchored_tensors, options.module_namescope,
            options.Training.gradient_accumulation if training else 1)
        if self.anchors and options.replication_factor > 1:
            raise Error("anchorTensor: anchored tensors are only available "
                        "with replicationFactor(1), got "
                        f"{options.replication_factor}")
        self.training = training
        self.precompiled = precompiled
        self.precompiled_source = precompiled_source
        self.graphs: Dict[str, torch.fx.GraphModule] = {}
        self.steps: Dict[str, CompiledStep] = {}
        self.keys: Dict[str, str] = {}
        self._progress = _Progress(options.show_compilation_progress_bar)

    def graph(self, name: str,
              graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """A captured step's graph, with the anchored tensors added to its
        outputs."""
        graph = self.anchors.add_outputs(graph, name)
        self.graphs[name] = graph
        self._progress.expect(2)
        self._progress.advance(f"captured the {name} step")
        return graph

    def compile(self, name: str, graph: torch.fx.GraphModule,
                donation: Optional[Donation] = None) -> CompiledStep:
        """The backend's compiled form of ``graph`` (from the exported file
        or the executable cache when they hold it); ``donation``: the
        inputs the device loop drops after each step."""
        with profile_range("backend compile"):
            step = self._compiled_step(name, graph, donation)
        self.steps[name] = step
        self._progress.advance(f"compiled the {name} step "
                               f"({self.backend.name})")
        return step

    def _compiled_step(self, name: str, graph: torch.fx.GraphModule,
                       donation: Optional[Donation]) -> CompiledStep:
        example_inputs = _example_inputs(graph)
        if self.precompiled is not None:
            return self._precompiled_step(name, graph, example_inputs,
                                          donation)
        if self.tiers is not None:
            return self.tiers.add(name, graph, example_inputs, donation)
        if self.cache is not None and self.backend.keeps_executables:
            return compile_cached(self.cache, self.backend, graph,
                                  example_inputs, self.key(name), donation,
                                  step=name)
        return self.backend.compile(graph, example_inputs, donation)

    def record(self, name: str, graph: torch.fx.GraphModule) -> None:
        """Keep ``graph``, a step that runs as captured rather than
        compiled (the forward pass of a multi-stage model), for export;
        when loading an exported file, check that the file holds the same
        step."""
        self.graphs[name] = graph
        if self.precompiled is not None:
            self._stored_step(name, graph)

    def key(self, name: str) -> str:
        """The executable key of the step ``name`` (see
        ``executable_cache.executable_key``)."""
        if name not in self.keys:
            graph = self.graphs[name]
            self.keys[name] = executable_key(
                self.backend, graph, _example_inputs(graph), self.options)
        return self.keys[name]

    def _stored_step(self, name: str,
                     graph: torch.fx.GraphModule) -> PrecompiledStep:
        """The exported file's step ``name``; ``poptorch.Error`` saying what
        differs unless it is ``graph``'s."""
        stored = self.precompiled.get(name)
        if stored is None or stored.key != self.key(name):
            raise Error(
                f"The model does not match the executable in "
                f"{self.precompiled_source}: its {name} step "
                f"{_difference(stored, graph)}. Re-create the model exactly "
                "as it was when it was exported (same code, parameters, "
                "optimizer and options), or export it again.")
        return stored

    def _precompiled_step(self, name: str, graph: torch.fx.GraphModule,
                          example_inputs: List[torch.Tensor],
                          donation: Optional[Donation]) -> CompiledStep:
        stored = self._stored_step(name, graph)
        if stored.executable is None and self.tiers is not None:
            return self.tiers.add(name, graph, example_inputs, donation)
        if stored.executable is None:
            return compile_cached(self.cache, self.backend, graph,
                                  example_inputs, stored.key, donation,
                                  step=name)
        directory = self.cache.backend_directory if self.cache else None
        with self.backend.storage(directory):
            return self.backend.deserialize(stored.executable)

    def close(self) -> None:
        self._progress.close()


def _example_inputs(graph: torch.fx.GraphModule) -> List[torch.Tensor]:
    """Uninitialised tensors with the shapes, strides, dtypes and devices of
    the graph's inputs, as recorded by the capture."""
    values = [node.meta["val"] for node in graph.graph.nodes
              if node.op == "placeholder"]
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                device=v.device) for v in values]


def _difference(stored: Optional[PrecompiledStep],
                graph: torch.fx.GraphModule) -> str:
    if stored is None:
        return "is not in the file"
    nodes = serialize_graph(graph)[0]["nodes"]
    exported = stored.graph.get("nodes", [])
    for index, (old, new) in enumerate(zip(exported, nodes)):
        old = {k: v for k, v in old.items() if k != "custom"}
        new = {k: v for k, v in new.items() if k != "custom"}
        if old != new:
            return (f"differs from the exported one at operation {index} "
                    f"({old.get('name')} {old.get('target')} exported, "
                    f"{new.get('name')} {new.get('target')} now)")
    if len(exported) != len(nodes):
        return (f"has {len(nodes)} operations where the exported one has "
                f"{len(exported)}")
    return ("computes the same operations but on inputs of other shapes or "
            "dtypes (parameters, buffers, optimizer state or arguments), or "
            "for another device")


@contextlib.contextmanager
def compile_session(options, training: bool,
                    precompiled: Optional[Dict[str, PrecompiledStep]] = None,
                    precompiled_source: str = ""
                    ) -> Iterator[CompileSession]:
    """A session for one compilation, with capture errors and warnings
    located by the options' ``sourceLocationExcludes`` (the warnings issued
    when it ends, ``traced_warnings.py``) and the model's constant tensors
    captured on its device."""
    session = CompileSession(options, training, precompiled,
                             precompiled_source)
    with traced_warnings.compilation():
        try:
            with compile_errors.source_location_excludes(
                    options.source_location_excludes), \
                    tracing_context.capture_device(session.device):
                yield session
        finally:
            session.close()
