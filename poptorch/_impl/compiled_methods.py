"""The ``PoplarExecutor`` methods of compiled execution (API reference
11.4): precompilation (``compileAndExport``, ``save``, ``loadExecutable``),
tensor names and anchored tensors, and the timings of the last call.

``PoplarExecutor`` inherits them; they work on its compiled state through
``serialization/export.py``, ``names.py`` and ``perf_counters.py``.
"""
from typing import Dict, List, Tuple

import torch

from ..errors import Error
from .names import tensor_names
from .perf_counters import require_timer
from .serialization import export


class CompiledExecutionMethods:
    """Mixed into ``PoplarExecutor``."""

    # --- precompilation -----------------------------------------------------
    def compileAndExport(self, filename: str, *args,
                         export_model: bool = True, **kwargs) -> None:
        """Precompile an executable for these arguments (the same as the
        wrapped model's ``__call__`` takes) and save it to ``filename``.

        With ``export_model=True`` the torch model (and its weights, the
        optimizer and the options) is saved alongside, and
        ``poptorch.load(filename)`` restores everything. With False, only
        the executable is saved: re-create the model with
        ``poptorch.inferenceModel`` / ``trainingModel`` and call
        ``loadExecutable(filename)``. Works with
        ``connectionType(ConnectionType.Never)`` / ``useOfflineIpuTarget``,
        which compile without running.
        """
        export.check_destination(filename, "compileAndExport")
        if self.isCompiled():
            from .signature import CallArguments
            self._signature.check(
                CallArguments(self._module.forward, args, kwargs))
        else:
            self.compile(*args, **kwargs)
        self.save(filename, export_model=export_model)

    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Save the compiled model to ``filename`` (see
        ``compileAndExport``); ``save_rng_state`` also saves the random
        number generator's seed and state, which loading restores."""
        self._require_compiled("save")
        export.check_destination(filename, "save")
        _check_bool("save export_model", export_model)
        _check_bool("save save_rng_state", save_rng_state)
        export.write(str(filename), self, export_model, save_rng_state)

    def loadExecutable(self, filename: str) -> None:
        """Load an executable previously saved by ``compileAndExport`` or
        ``save`` into this (not yet compiled) model. The model, its
        optimizer and the options that affect compilation must be those it
        was exported with; the weights are this model's. Only JSON and
        tensors are read from the file (no pickle, no compiled code): with
        the inductor backend the executable is compiled again, or loaded
        from the executable cache."""
        self._load_exported(export.read(str(filename), trusted=False),
                            with_optimizer=False)

    def _load_exported(self, exported: export.ExportedFile,
                       with_optimizer: bool) -> None:
        if self.isCompiled():
            raise Error("loadExecutable: this model is already compiled; "
                        "call destroy() first, or load into a new model")
        exported.check_matches(self)
        call = exported.example_call(self._module.forward)
        self._compile(call, exported.precompiled_steps(), exported.filename)
        exported.restore_state(self, with_optimizer)

    # --- tensor names and anchors -------------------------------------------
    def getTensorNames(self) -> List[str]:
        """The names of the tensors the compiled graph computes (see
        ``names.py`` for the naming scheme): the parameters and, for a
        training model, their ``Gradient___``, ``UpdatedVar___`` and
        optimizer-state names, then the operations' tensors of the step
        that applies the optimizer update (of the forward pass when the
        model's blocks form several stages)."""
        self._require_compiled("getTensorNames")
        if self._staged is not None:
            graph = self._staged.forward_graph
        else:
            graphs = self._session.graphs
            graph = graphs.get("inference", graphs.get("update"))
        return list(tensor_names(graph, self._options.module_namescope))

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value, in the last call, of the tensor anchored as
        ``short_name`` with ``Options.anchorTensor``, combined over the
        call's iterations per the anchor's output mode."""
        self._require_compiled("getAnchoredTensor")
        return self._session.anchors.get(short_name)

    # --- timings of the last call -------------------------------------------
    def getPerfCounters(self) -> Dict[str, List[List[float]]]:
        """Timestamps (fractional seconds, undefined reference point) of
        the last call: ``input``, ``input_complete``, ``output`` and
        ``output_complete``, each a list per input (output) tensor of one
        value per device iteration."""
        return require_timer(self._timer, "getPerfCounters").counters()

    def getLatency(self) -> Tuple[float, float, float]:
        """Round-trip latency of the last call: (min, max, average) over
        its iterations, in seconds."""
        return self._latency("getLatency", "round_trip")

    def getHostIpuLatency(self) -> Tuple[float, float, float]:
        """Host-to-device latency of the last call: (min, max, average)."""
        return self._latency("getHostIpuLatency", "host_ipu")

    def getComputeLatency(self) -> Tuple[float, float, float]:
        """Compute latency of the last call: (min, max, average)."""
        return self._latency("getComputeLatency", "compute")

    def getIpuHostLatency(self) -> Tuple[float, float, float]:
        """Device-to-host latency of the last call: (min, max, average)."""
        return self._latency("getIpuHostLatency", "ipu_host")

    def _latency(self, what: str, kind: str) -> Tuple[float, float, float]:
        return require_timer(self._timer, what).latencies()[kind]

    # --- state of CUDA graph replays ------------------------------------------
    def _state_io(self):
        """(read, write) the flat device state a call reads and replaces:
        parameters, buffers of every set, optimizer state and
        hyper-parameters."""
        state = self._state
        sizes = [len(state.params)] + [len(b) for b in state.buffers]

        def read() -> List[torch.Tensor]:
            tensors = list(state.params)
            for buffers in state.buffers:
                tensors += buffers
            if self._training:
                tensors += list(state.optimizer) + list(self._hyper)
            return tensors

        def write(tensors: List[torch.Tensor]) -> None:
            start = 0
            for index, size in enumerate(sizes):
                part = tensors[start:start + size]
                if index == 0:
                    state.params[:] = part
                else:
                    state.buffers[index - 1][:] = part
                start += size
            if self._training:
                count = len(state.optimizer)
                state.optimizer = list(tensors[start:start + count])
                self._hyper = list(tensors[start + count:])

        return read, write


def _check_bool(what: str, value) -> None:
    if not isinstance(value, bool):
        raise Error(f"{what} must be a bool (True or False), got {value!r}")
