"""The ``PoplarExecutor`` methods of compiled execution (API reference
11.4): precompilation (``compileAndExport``, ``save``, ``loadExecutable``),
tensor names and anchored tensors, and the timings of the last call.

``PoplarExecutor`` inherits them; they work on its compiled model
(``compiled_model.py``) through ``export.py``, ``names.py``
and ``perf_counters.py``.
"""
from typing import Dict, List, Tuple

import torch

from ..errors import Error
from .names import tensor_names
from .perf_counters import require_timer
from . import export
from .signature import CallArguments


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
            self._compiled.signature.check(
                CallArguments(self._module.forward, args, kwargs))
        else:
            self.compile(*args, **kwargs)
        self.save(filename, export_model=export_model)

    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Save the compiled model to ``filename`` (see
        ``compileAndExport``); ``save_rng_state`` also saves the random
        number generator's seed and state, which loading restores."""
        compiled = self._require_compiled("save")
        export.check_destination(filename, "save")
        _check_bool("save export_model", export_model)
        _check_bool("save save_rng_state", save_rng_state)
        if export_model:
            self.copyWeightsToHostIfNeeded()
        export.write(str(filename), self._wrapped(), compiled, export_model,
                     save_rng_state)

    def loadExecutable(self, filename: str) -> None:
        """Load an executable previously saved by ``compileAndExport`` or
        ``save`` into this (not yet compiled) model. The model, its
        optimizer and the options that affect compilation must be those it
        was exported with; the weights are this model's. Only JSON and
        tensors are read from the file (no pickle, no compiled code): with
        the inductor backend the executable is compiled again, or loaded
        from the executable cache."""
        load_exported(self, export.read(str(filename), trusted=False),
                      with_optimizer=False)

    def _wrapped(self) -> export.WrappedModel:
        return export.WrappedModel(self._module, self._optimizer, self._plan,
                                   self._options, self._training,
                                   self._training_flags)

    # --- tensor names and anchors -------------------------------------------
    def getTensorNames(self) -> List[str]:
        """The names of the tensors the compiled graph computes (see
        ``names.py`` for the naming scheme): the parameters and, for a
        training model, their ``Gradient___``, ``UpdatedVar___`` and
        optimizer-state names, then the operations' tensors of the step
        that applies the optimizer update (of the forward pass when the
        model's blocks form several stages)."""
        compiled = self._require_compiled("getTensorNames")
        graph = compiled.engine.tensor_names_graph(compiled.session)
        return list(tensor_names(graph, self._options.module_namescope))

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value, in the last call, of the tensor anchored as
        ``short_name`` with ``Options.anchorTensor``, combined over the
        call's iterations per the anchor's output mode."""
        compiled = self._require_compiled("getAnchoredTensor")
        return compiled.session.anchors.get(short_name)

    # --- timings of the last call -------------------------------------------
    def getPerfCounters(self) -> Dict[str, List[List[float]]]:
        """Timestamps (fractional seconds, undefined reference point) of
        the last call: ``input``, ``input_complete``, ``output`` and
        ``output_complete``, each a list per input (output) tensor of one
        value per device iteration."""
        return require_timer(self._last_timer(), "getPerfCounters").counters()

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
        return require_timer(self._last_timer(), what).latencies()[kind]

    def _last_timer(self):
        return self._compiled.timer if self._compiled is not None else None


def load_exported(executor, exported: export.ExportedFile,
                  with_optimizer: bool) -> None:
    """Compile ``executor`` (a ``PoplarExecutor``) from an exported file
    (``loadExecutable``, ``poptorch.load``): the file's steps replace
    compilation, and its random generator state (and, with
    ``with_optimizer``, optimizer state) is restored."""
    if executor.isCompiled():
        raise Error("loadExecutable: this model is already compiled; "
                    "call destroy() first, or load into a new model")
    exported.check_matches(executor._wrapped())
    call = exported.example_call(executor.model.forward)
    executor._compile(call, exported.precompiled_steps(), exported.filename)
    exported.restore_state(executor._compiled, with_optimizer)


def _check_bool(what: str, value) -> None:
    if not isinstance(value, bool):
        raise Error(f"{what} must be a bool (True or False), got {value!r}")
