"""Exported executables: ``compileAndExport`` / ``save`` write them,
``loadExecutable`` and ``poptorch.load`` read them.

File format: a zip archive holding

* ``manifest.json``: ``"format": "poptorch-executable"``, the format
  version, the poptorch and torch versions, training or inference, the
  backend, the device, the options that affect compilation, the input
  signature (argument structure as a pytree spec, tensor shapes and dtypes,
  constant values), the parameter and buffer names, shapes and dtypes, the
  optimizer's structure, and per captured step (``inference``, or
  ``update`` and ``accumulate``) its executable key and member names;
* ``graphs/<step>.json``: each captured step in the JSON graph format
  (``graph_format.py``);
* ``tensors.pt``: tensors only (``torch.save`` of a dict of tensors, read
  with ``torch.load(weights_only=True)``): the graphs' constant tensors,
  the random generator state (``save_rng_state=True``) and the optimizer
  state (with the model);
* with ``export_model=True`` only: ``model.pt``, the pickled torch module,
  optimizer and options, and ``executables/<step>.bin``, the backend's
  portable executable (``inductor``: its artifact and compiled kernels).

Loading checks the format and that the versions match exactly, then
captures the model again (its graphs are a fraction of a second to capture)
and requires each step to have the exported executable key: a model whose
code, parameters, optimizer or options differ raises ``poptorch.Error``
naming the difference instead of running a stale executable. The
executables are then taken from the file (``poptorch.load``) or compiled
(``loadExecutable``, through the executable cache when enabled).

Trust: ``loadExecutable`` reads only JSON and tensors. ``model.pt`` and the
compiled executables are pickled Python objects and generated code, read
only by ``poptorch.load``: load only files you trust, as with
``torch.load``.
"""
import dataclasses
import io
import json
import os
import tempfile
import zipfile
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

from .._version import __version__
from ..errors import Error
from . import compile_session
from .options.groups import copy_stored, set_stored
from .signature import CallArguments, InputSignature, TensorLeaf, rebuild_call
from .graph_format import GraphFormatError, serialize_graph

FORMAT = "poptorch-executable"
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_TENSORS = "tensors.pt"
_MODEL = "model.pt"
#: Backends whose exported files hold the graphs alone (no executables):
#: a file of one loads into a model of the other.
GRAPH_DOCUMENTS_ONLY = frozenset({"graph", "auto"})


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise Error(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


# --- writing --------------------------------------------------------------

def _signature_document(signature: InputSignature) -> Dict[str, Any]:
    leaves = []
    for path, leaf in zip(signature.paths, signature.leaves):
        if isinstance(leaf, TensorLeaf):
            leaves.append({"shape": list(leaf.shape),
                           "dtype": _dtype_name(leaf.dtype)})
        elif leaf.value is None or isinstance(leaf.value,
                                              (bool, int, float, str)):
            leaves.append({"value": leaf.value})
        else:
            raise Error(f"Cannot export the model: its argument {path!r} is "
                        f"a {type(leaf.value).__name__}, which the file "
                        "format cannot hold without pickle (only tensors, "
                        "numbers, strings, booleans and None can be)")
    try:
        spec = pytree.treespec_dumps(signature.spec)
    except Exception as error:
        raise Error(f"Cannot export the model: the structure of its "
                    f"arguments cannot be written ({error})") from error
    return {"spec": spec, "paths": list(signature.paths), "leaves": leaves}


def _tensor_list(names: List[str], tensors: List[torch.Tensor]) -> List:
    return [[name, list(t.shape), _dtype_name(t.dtype)]
            for name, t in zip(names, tensors)]


@dataclasses.dataclass
class WrappedModel:
    """What a wrapped model is besides its compiled state: the module, its
    optimizer and optimizer plan (training models), the options, and the
    train/eval flags of the module and its sub-modules that the model runs
    with (those at wrapping, whatever the module's are now)."""
    module: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    plan: Any
    options: Any
    training: bool
    training_flags: Optional[Dict[str, bool]]


def _optimizer_structure(plan) -> Optional[str]:
    if plan is None:
        return None
    return repr((plan.structure(), sorted(plan.constant_attrs.items(),
                                          key=lambda item: item[0])))


def check_destination(filename: str, method: str) -> None:
    """Raise ``poptorch.Error`` when ``filename`` cannot name the file to
    write because it is a directory (before anything is compiled)."""
    if os.path.isdir(filename):
        raise Error(f"{method}: {str(filename)!r} is a directory; give the "
                    "path of the file to write, for example "
                    f"{os.path.join(filename, 'model.poptorch')!r}")


def write(filename: str, wrapped: WrappedModel, compiled, export_model: bool,
          save_rng_state: bool) -> None:
    """Write the ``compiled`` model (``CompiledModel``) of ``wrapped`` to
    ``filename``; with ``export_model``, the host copy of the weights must
    be up to date."""
    session = compiled.session
    state = compiled.state
    members: Dict[str, bytes] = {}
    tensors: Dict[str, torch.Tensor] = {}
    steps = {}
    for name, graph in session.graphs.items():
        try:
            document, constants = serialize_graph(graph)
        except GraphFormatError as error:
            raise Error(f"Cannot export the model: its {name} step "
                        f"{error}") from error
        members[f"graphs/{name}.json"] = json.dumps(document).encode()
        for attribute, tensor in constants.items():
            tensors[f"constants/{name}/{attribute}"] = tensor.cpu()
        executable = None
        if export_model and name in session.steps:
            data = session.backend.serialize(session.steps[name],
                                             portable=True)
            if data is not None:
                executable = f"executables/{name}.bin"
                members[executable] = data
        steps[name] = {"key": session.key(name),
                       "graph": f"graphs/{name}.json",
                       "executable": executable}
    if save_rng_state:
        tensors["rng_state"] = compiled.rng.state.cpu()
    if export_model and wrapped.training:
        whole = compiled.training.optimizer_state.whole_state()
        for index, tensor in enumerate(whole):
            tensors[f"optimizer_state/{index}"] = tensor.detach().cpu()
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "poptorch_version": __version__, "torch_version": torch.__version__,
        "training": wrapped.training,
        "backend": session.backend.name,
        "device_type": session.device.type,
        "export_model": export_model,
        "options": session.options,
        "signature": _signature_document(compiled.signature),
        "params": _tensor_list(state.param_names,
                               state.whole_shaped_params()),
        "buffers": _tensor_list(state.buffer_names, state.buffers[0]),
        "optimizer": _optimizer_structure(wrapped.plan),
        "optimizer_state_size": (len(state.optimizer)
                                 if export_model and wrapped.training
                                 else None),
        "rng_seed": compiled.rng.seed if save_rng_state else None,
        "steps": steps,
    }
    members[_MANIFEST] = json.dumps(manifest, indent=1).encode()
    members[_TENSORS] = _saved_tensors(tensors)
    if export_model:
        members[_MODEL] = _saved_model(wrapped)
    _write_zip(filename, members)


def _saved_tensors(tensors: Dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _saved_model(wrapped: WrappedModel) -> bytes:
    from . import weight_sync
    buffer = io.BytesIO()
    with weight_sync.host_reads_suspended():
        torch.save({"module": wrapped.module,
                    "optimizer": wrapped.optimizer,
                    "options": wrapped.options.clone(),
                    "training_flags": wrapped.training_flags}, buffer)
    return buffer.getvalue()


def _write_zip(filename: str, members: Dict[str, bytes]) -> None:
    directory = os.path.dirname(os.path.abspath(filename))
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            with zipfile.ZipFile(stream, "w",
                                 compression=zipfile.ZIP_DEFLATED) as archive:
                for name, data in members.items():
                    archive.writestr(name, data)
        os.replace(temporary, filename)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


# --- reading --------------------------------------------------------------

@dataclasses.dataclass
class ExportedFile:
    """An exported file, read and checked."""
    filename: str
    manifest: Dict[str, Any]
    graphs: Dict[str, Dict[str, Any]]
    tensors: Dict[str, torch.Tensor]
    executables: Dict[str, bytes]
    model_data: Optional[bytes]

    def precompiled_steps(self) -> Dict[str,
                                        compile_session.PrecompiledStep]:
        return {name: compile_session.PrecompiledStep(
                    key=entry["key"], graph=self.graphs[name],
                    executable=self.executables.get(name))
                for name, entry in self.manifest["steps"].items()}

    def example_call(self, forward: Callable) -> CallArguments:
        """Arguments of the exported signature (zeros for tensors)."""
        signature = self.manifest["signature"]
        leaves = [torch.zeros(leaf["shape"], dtype=_dtype(leaf["dtype"]))
                  if "shape" in leaf else leaf["value"]
                  for leaf in signature["leaves"]]
        spec = pytree.treespec_loads(signature["spec"])
        args, kwargs = rebuild_call(spec, leaves)
        return CallArguments(forward, args, kwargs)

    def check_matches(self, wrapped: WrappedModel) -> None:
        """Raise ``poptorch.Error`` naming what differs between the file
        and the ``wrapped`` model."""
        from .backends.selection import ENVIRONMENT_VARIABLE, select_backend
        from .devices import select_device
        manifest = self.manifest
        options = wrapped.options
        device_type = select_device(options.use_ipu_model).type
        backend_name = select_backend(options.backend,
                                      ENVIRONMENT_VARIABLE).name
        if manifest["training"] != wrapped.training:
            kinds = {True: "a training", False: "an inference"}
            raise self._error(f"it holds {kinds[manifest['training']]} "
                              f"model, not {kinds[wrapped.training]} "
                              "model")
        if manifest["device_type"] != device_type:
            raise self._error(
                f"it was compiled for the {manifest['device_type']} device "
                f"and this model runs on {device_type} (useIpuModel(True) "
                "or POPTORCH_IPU_MODEL=1 select the CPU)")
        if manifest["backend"] != backend_name and not {
                manifest["backend"], backend_name} <= GRAPH_DOCUMENTS_ONLY:
            raise self._error(
                f"it was compiled with the {manifest['backend']!r} backend "
                f"and the model's options select {backend_name!r} "
                "(setBackend or POPTORCH_BACKEND)")
        _check_same_options(self, manifest["options"],
                            compile_session.compile_time_options(options))
        self._check_state(wrapped.module)
        if manifest["optimizer"] != _optimizer_structure(wrapped.plan):
            raise self._error(
                "the optimizer differs from the exported one (its type, "
                "param groups or compile-time attributes)")

    def _check_state(self, module: torch.nn.Module) -> None:
        from . import weight_sync
        with weight_sync.host_reads_suspended():
            params = [[name, list(t.shape), _dtype_name(t.dtype)]
                      for name, t in module.named_parameters()]
            buffers = [[name, list(t.shape), _dtype_name(t.dtype)]
                       for name, t in module.named_buffers()]
        for kind, stored, current in (("parameters", self.manifest["params"],
                                       params),
                                      ("buffers", self.manifest["buffers"],
                                       buffers)):
            if stored != current:
                detail = _first_difference(stored, current)
                raise self._error(f"the model's {kind} differ: {detail}")

    def restore_state(self, compiled, with_optimizer: bool) -> None:
        """Put the exported random generator (and optimizer) state into
        the freshly ``compiled`` model (``CompiledModel``)."""
        if self.manifest.get("rng_seed") is not None:
            compiled.rng.seed = self.manifest["rng_seed"]
            compiled.rng.state = self.tensors["rng_state"].clone()
        if with_optimizer and self.manifest.get("optimizer_state_size"):
            current = compiled.state.optimizer
            if len(current) != self.manifest["optimizer_state_size"]:
                raise self._error(
                    f"it holds {self.manifest['optimizer_state_size']} "
                    f"optimizer state tensors; the model has {len(current)}")
            optimizer_state = compiled.training.optimizer_state
            optimizer_state.replace(optimizer_state.placed([
                self.tensors[f"optimizer_state/{index}"].to(
                    device=tensor.device, dtype=tensor.dtype)
                for index, tensor in enumerate(current)]))

    def model(self) -> Dict[str, Any]:
        """The pickled module, optimizer and options (trusted files only)."""
        if self.model_data is None:
            raise Error(
                f"{self.filename} was exported with export_model=False: it "
                "holds no model. Re-create the model with "
                "poptorch.trainingModel / poptorch.inferenceModel and call "
                "loadExecutable() on it.")
        try:
            return torch.load(io.BytesIO(self.model_data), weights_only=False)
        except Exception as error:
            raise self._error(f"its model cannot be unpickled: "
                              f"{type(error).__name__}: {error}") from error

    def _error(self, detail: str) -> Error:
        return Error(f"{self.filename} does not match this model: {detail}")


def _first_difference(stored: List, current: List) -> str:
    for old, new in zip(stored, current):
        if old != new:
            return (f"exported {old[0]} {tuple(old[1])} {old[2]}, now "
                    f"{new[0]} {tuple(new[1])} {new[2]}")
    return f"{len(stored)} exported, {len(current)} now"


def _flatten(document: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    flat = {}
    for key, value in document.items():
        if isinstance(value, dict) and key[:1].isupper():
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _check_same_options(exported: ExportedFile, stored: Dict[str, Any],
                        current: Dict[str, Any]) -> None:
    stored, current = _flatten(stored), _flatten(current)
    for name in sorted(set(stored) | set(current)):
        if stored.get(name) != current.get(name):
            raise exported._error(
                f"the option {name} was {stored.get(name)!r} when the file "
                f"was exported and is {current.get(name)!r} now (options "
                "that change compilation must match)")


def read(filename: str, trusted: bool) -> ExportedFile:
    """Read and check ``filename``; ``trusted`` also reads the pickled
    model and the compiled executables."""
    try:
        with zipfile.ZipFile(filename) as archive:
            manifest = _read_manifest(filename, archive)
            graphs = {name: json.loads(archive.read(entry["graph"]))
                      for name, entry in manifest["steps"].items()}
            tensors = torch.load(io.BytesIO(archive.read(_TENSORS)),
                                 weights_only=True)
            executables = {}
            model_data = None
            if trusted and manifest["export_model"]:
                executables = {name: archive.read(entry["executable"])
                               for name, entry in manifest["steps"].items()
                               if entry["executable"]}
                model_data = archive.read(_MODEL)
    except FileNotFoundError:
        raise Error(f"{filename}: no such file") from None
    except zipfile.BadZipFile as error:
        raise Error(f"{filename} is not a PopTorch executable file, or it is "
                    f"truncated or corrupted ({error})") from error
    except (KeyError, ValueError, EOFError, RuntimeError,
            zipfile.LargeZipFile) as error:
        raise Error(f"{filename} is corrupted or incomplete: "
                    f"{type(error).__name__}: {error}") from error
    return ExportedFile(filename, manifest, graphs, tensors, executables,
                        model_data)


def _read_manifest(filename: str, archive: zipfile.ZipFile) -> Dict:
    try:
        manifest = json.loads(archive.read(_MANIFEST))
    except KeyError:
        raise Error(f"{filename} is not a PopTorch executable file (it has "
                    f"no {_MANIFEST})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Error(f"{filename} is not a PopTorch executable file (its "
                    f"manifest is not of format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION or \
            manifest.get("poptorch_version") != __version__ or \
            manifest.get("torch_version") != torch.__version__:
        raise Error(
            f"{filename} was exported by poptorch "
            f"{manifest.get('poptorch_version')} with torch "
            f"{manifest.get('torch_version')} (file format version "
            f"{manifest.get('format_version')}); this is poptorch "
            f"{__version__} with torch {torch.__version__} (format version "
            f"{FORMAT_VERSION}). The versions must match exactly: export the "
            "model again with this version.")
    return manifest


def merge_load_options(exported_options, edit_opts_fn, backend: str):
    """The options of ``poptorch.load``: the exported ones, with the runtime
    options that ``edit_opts_fn`` sets (the others keep the exported
    values, as the executable was compiled for them)."""
    from ..enums import ConnectionType
    options = exported_options.clone()
    options.connectionType(ConnectionType.Always)
    set_stored(options, offline_ipu_version=None)
    edited = options.clone()
    if edit_opts_fn is not None:
        edit_opts_fn(edited)
    copy_stored(options, edited, compile_session.RUNTIME_OPTIONS)
    copy_stored(options.Distributed, edited.Distributed,
                ("processId", "numProcesses"))
    set_stored(options, backend=backend)
    return options
