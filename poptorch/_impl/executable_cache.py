"""The executable cache (``Options.enableExecutableCaching(path)`` or
``POPTORCH_CACHE_DIR``).

Each compiled step of a backend that keeps executables (``inductor``) is
stored under a key that covers everything that changes the executable: the
captured graph itself (its operations, arguments and constant values), the
shapes, strides and dtypes of its inputs, the backend and its own
configuration (Inductor's ``torch._inductor.config``, as its
``TORCHINDUCTOR_*`` environment variables set it), the options that affect
compilation, the poptorch, torch and Python versions and the device (type
and, for CUDA, the GPU's name and compute capability). A later
compilation of the same step, in this process or another, loads it instead
of compiling.

The model's name (``Options.modelName``, default ``"inference"`` or
``"training"``) is not part of the key: models of different names share
entries. The index names them: ``index.json`` maps each model name to the
entries its steps wrote or loaded, so that a model's entries can be found.

Layout of the directory::

    <key>.pexe     one compiled step: a header line of JSON (format, key,
                   versions, payload size and SHA-256, the name of the model
                   and of the step that wrote it), then the payload (the
                   backend's serialized executable)
    index.json     {model name: {entry file: step name}}, e.g.
                   {"net": {"<key>.pexe": "update"}}
    .index.lock    taken (flock) while a process updates the index
    inductor/      Inductor's own cache (compiled kernels), kept here so
                   that the cache is complete in one directory

Entries and the index are written to a temporary file and renamed, so a
reader never sees a partial one; a process updates the index under the lock,
merging its entries into the index it reads, so concurrent processes lose
none. An index that cannot be read is started again (a warning); failing to
update it only warns. An entry that cannot be read (truncated, corrupted,
checksum mismatch, written by another version, or refused by the backend)
logs a warning and is compiled again and replaced; it never stops the
compilation. PopTorch never deletes entries: remove the directory to clear
it. Entries hold compiled code, so use a directory only you can write to.
"""
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import sys
import tempfile
from typing import Any, Dict, List, Optional

import torch

from .._version import __version__
from ..errors import Error
from .backends.backend import Backend, CompiledStep
from .backends.in_place import Donation
from .logger import logger
from .graph_format import graph_fingerprint, tensor_metadata
from .profiling.ranges import profile_range

_MAGIC = "poptorch-executable-cache"
_FORMAT_VERSION = 2
#: The file name ending of a cache entry.
ENTRY_SUFFIX = ".pexe"
_INDEX = "index.json"
_INDEX_LOCK = ".index.lock"


class CacheEntryError(Exception):
    """A cache entry that cannot be used (the message says why)."""


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else \
            torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return (f"cuda:{properties.name}:{properties.major}."
                f"{properties.minor}")
    return f"{device.type}:{platform.machine()}"


def executable_key(backend: Backend, graph: torch.fx.GraphModule,
                   example_inputs: List[torch.Tensor],
                   options: Dict[str, Any]) -> str:
    """A digest of everything that changes the compiled executable of
    ``graph``: the graph, its inputs' metadata, the backend, the options
    that affect compilation, the versions and the device."""
    device = next((t.device for t in example_inputs), torch.device("cpu"))
    parts = {
        "format": _FORMAT_VERSION,
        "poptorch": __version__,
        "torch": torch.__version__,
        "python": sys.version,
        "device": device_description(device),
        "backend": backend.key_name,
        "graph": graph_fingerprint(graph),
        "inputs": tensor_metadata(example_inputs),
        "options": options,
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class ExecutableCache:
    """One cache directory, used by the model ``model_name``."""
    directory: str
    model_name: str

    @property
    def backend_directory(self) -> str:
        return os.path.join(self.directory, "inductor")

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    def read(self, key: str) -> Optional[bytes]:
        """The payload stored under ``key``; None when there is none. Raises
        ``CacheEntryError`` when the entry exists but cannot be used."""
        try:
            with open(self.path(key), "rb") as stream:
                header_line = stream.readline()
                payload = stream.read()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise CacheEntryError(f"cannot be read: {error}") from error
        return _checked_payload(header_line, payload, key)

    def write(self, key: str, payload: bytes, step: str) -> None:
        """Store ``payload``, the step ``step``, atomically and index it;
        failures only log a warning."""
        header = {"magic": _MAGIC, "format": _FORMAT_VERSION, "key": key,
                  "poptorch": __version__, "torch": torch.__version__,
                  "size": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest(),
                  "model": self.model_name, "step": step}
        try:
            os.makedirs(self.directory, exist_ok=True)
            _write_atomically(self.path(key),
                              json.dumps(header).encode() + b"\n" + payload)
        except OSError as error:
            logger.warning("Could not write the executable cache entry %s: "
                           "%s", self.path(key), error)
            return
        self.index(key, step)

    def index(self, key: str, step: str) -> None:
        """Record in ``index.json`` that the entry ``key`` holds the step
        ``step`` of this model; failures only log a warning."""
        entry = os.path.basename(self.path(key))
        lock_path = os.path.join(self.directory, _INDEX_LOCK)
        try:
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                index = self.read_index()
                if index.get(self.model_name, {}).get(entry) == step:
                    return
                index.setdefault(self.model_name, {})[entry] = step
                _write_atomically(
                    os.path.join(self.directory, _INDEX),
                    json.dumps(index, indent=1, sort_keys=True).encode())
        except OSError as error:
            logger.warning("Could not update the executable cache index in "
                           "%s: %s", self.directory, error)

    def read_index(self) -> Dict[str, Dict[str, str]]:
        """``index.json``: {model name: {entry file: step name}}; empty when
        there is none, or when it cannot be read (a warning)."""
        path = os.path.join(self.directory, _INDEX)
        try:
            with open(path, encoding="utf-8") as stream:
                index = json.load(stream)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning("The executable cache index %s cannot be read "
                           "(%s); starting a new one", path, error)
            return {}
        if not _is_index(index):
            logger.warning("The executable cache index %s is not a poptorch "
                           "index; starting a new one", path)
            return {}
        return index


def _checked_payload(header_line: bytes, payload: bytes, key: str) -> bytes:
    try:
        header = json.loads(header_line)
    except ValueError as error:
        raise CacheEntryError("has no valid header") from error
    if not isinstance(header, dict) or header.get("magic") != _MAGIC:
        raise CacheEntryError("is not a poptorch executable cache entry")
    if header.get("format") != _FORMAT_VERSION or header.get("key") != key:
        raise CacheEntryError(f"has format {header.get('format')!r} and key "
                              f"{header.get('key')!r}, expected format "
                              f"{_FORMAT_VERSION} and key {key}")
    if header.get("size") != len(payload):
        raise CacheEntryError(f"is truncated ({len(payload)} of "
                              f"{header.get('size')} bytes)")
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise CacheEntryError("is corrupted (checksum mismatch)")
    return payload


def _write_atomically(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _is_index(index: Any) -> bool:
    return isinstance(index, dict) and all(
        isinstance(entries, dict) and all(
            isinstance(step, str) for step in entries.values())
        for entries in index.values())


def compile_cached(cache: Optional[ExecutableCache], backend: Backend,
                   graph: torch.fx.GraphModule,
                   example_inputs: List[torch.Tensor],
                   key: str, donation: Optional[Donation] = None, *,
                   step: str) -> CompiledStep:
    """``backend.compile(graph, example_inputs, donation)``, through the
    cache when there is one and the backend keeps executables; ``key`` is
    the step's ``executable_key``, ``step`` its name (``"inference"``,
    ``"update"``...), which the index records with the model's name."""
    if cache is None or not backend.keeps_executables:
        return backend.compile(graph, example_inputs, donation)
    key = entry_key(backend, key)
    with backend.storage(cache.backend_directory):
        compiled = load_cached(cache, backend, key, step)
        if compiled is not None:
            return compiled
        with profile_range("executable cache miss"):
            compiled = backend.compile(graph, example_inputs, donation)
            cache.write(key, backend.serialize(compiled), step)
    return compiled


def default_cache_directory() -> str:
    """The cache of the ``auto`` backend's compiled steps when the options
    name none: ``<temporary directory>/poptorch-<uid>/executables``, in a
    directory private to the user (``prepare_directory``), next to where
    Inductor keeps its own kernels."""
    return os.path.join(tempfile.gettempdir(), f"poptorch-{os.getuid()}",
                        "executables")


def prepare_directory(directory: str) -> None:
    """Create the cache ``directory``; the default one's parent is created
    private (0700), and ``poptorch.Error`` says so when another user owns
    it (its entries hold code this process would run)."""
    if directory == default_cache_directory():
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        if not trusted_directory(directory):
            raise Error(f"The executable cache directory "
                        f"{os.path.dirname(directory)} belongs to another "
                        "user; set POPTORCH_CACHE_DIR or "
                        "opts.enableExecutableCaching(path) to a directory "
                        "of your own")
    os.makedirs(directory, exist_ok=True)


def trusted_directory(directory: str) -> bool:
    """False for the default cache directory when another user owns its
    parent (its entries must not be loaded)."""
    if directory != default_cache_directory():
        return True
    try:
        return os.stat(os.path.dirname(directory)).st_uid == os.getuid()
    except FileNotFoundError:
        return True


def entry_key(backend: Backend, key: str) -> str:
    """The cache entry's key of a step whose ``executable_key`` is ``key``:
    with the backend's settings in this process."""
    settings = backend.settings_fingerprint()
    if settings:
        key = hashlib.sha256(f"{key}/{settings}".encode()).hexdigest()
    return key


def load_cached(cache: ExecutableCache, backend: Backend, key: str,
                step: str) -> Optional[CompiledStep]:
    """The step stored under the entry key ``key`` (an
    ``executable cache hit`` range), or None when there is none or it
    cannot be used (a warning); call inside ``backend.storage``."""
    if not os.path.exists(cache.path(key)):
        return None
    with profile_range("executable cache hit"):
        compiled = _load_entry(cache, backend, key)
    if compiled is not None:
        logger.debug("Loaded the compiled step %s from the executable "
                     "cache", key)
        cache.index(key, step)
    return compiled


def _load_entry(cache: ExecutableCache, backend: Backend,
                key: str) -> Optional[CompiledStep]:
    try:
        payload = cache.read(key)
        if payload is None:
            return None
        return backend.deserialize(payload)
    except CacheEntryError as error:
        reason = str(error)
    except Exception as error:  # the backend refused the payload
        reason = f"could not be loaded: {type(error).__name__}: {error}"
    logger.warning("The executable cache entry %s %s; compiling again and "
                   "replacing it", cache.path(key), reason)
    return None
