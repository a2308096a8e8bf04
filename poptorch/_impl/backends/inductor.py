"""The "inductor" backend: compile the captured graph with TorchInductor.

The graph is compiled ahead of its first step with
``torch._inductor.standalone_compile`` (AOTAutograd functionalizes it, so
in-place writes to inputs, such as BatchNorm's running statistics or a
``forward`` that writes to its argument, still reach the caller; Inductor
then fuses the operations into generated C++ (CPU) or Triton (CUDA)
kernels). The result is a bundled artifact that can be turned into bytes
and loaded in another process without compiling the graph again. The
kernels' binaries live in Inductor's cache directory (``storage`` points it
into the executable cache); portable bytes (exported files) also carry
them, so that loading on another machine of the same kind compiles
nothing. The cache also remembers Inductor's check of the CPU's vector
instruction sets (``vector_isa.py``).

Compilation takes seconds (10-25 s for small models on 2 CPU cores), so the
backend pays off for long runs; the executable cache and exported files
keep the result.
"""
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, Iterator, List, Optional

import torch

from ...errors import Error
from ..intra_op_threads import own_threads
from ..logger import logger
from . import inductor_passes
from .backend import Backend, CompiledStep, register
from .in_place import Donation
from .vector_isa import remembered_check

_PORTABLE = b"poptorch-inductor-portable\n"
_ARTIFACT = "artifact.bin"
_KERNELS = "kernels/"


class InductorStep:
    """A compiled step: Inductor's bundled artifact, called positionally,
    with the graph's constant tensors passed after the step's inputs."""

    def __init__(self, artifact, constants: List[torch.Tensor]) -> None:
        self.artifact = artifact
        self.constants = constants
        self._call = artifact.inner_fn

    def __call__(self, *inputs: torch.Tensor):
        return self._call(*inputs, *self.constants)


class InductorBackend(Backend):
    name = "inductor"
    keeps_executables = True

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor],
                donation: Optional[Donation] = None) -> CompiledStep:
        """Inductor plans its own buffer reuse: ``donation`` is not used."""
        from torch._inductor import standalone_compile
        graph, constants = _constants_as_inputs(graph)
        inductor_passes.apply(graph)
        with generating_kernels_for(kernel_threads()):
            artifact = standalone_compile(
                graph, list(example_inputs) + constants,
                dynamic_shapes="from_example_inputs", aot=True)
        return InductorStep(artifact, constants)

    def settings_fingerprint(self) -> str:
        """Inductor's configuration (``torch._inductor.config``, which its
        ``TORCHINDUCTOR_*`` environment variables set), without the values
        that do not travel between processes, the threads its CPU kernels
        are generated for, and the passes ``compile`` applies first."""
        from torch._inductor import config
        settings = json.dumps({"config": config.save_config_portable(),
                               "kernel threads": kernel_threads(),
                               "graph passes": inductor_passes.PASSES},
                              sort_keys=True, default=repr)
        return hashlib.sha256(settings.encode()).hexdigest()

    def serialize(self, step: CompiledStep,
                  portable: bool = False) -> Optional[bytes]:
        if not isinstance(step, InductorStep):
            raise Error("inductor backend: can only serialize steps it "
                        "compiled")
        artifact = step.artifact.serialize()
        data = _with_constants(artifact, step.constants)
        if not portable:
            return data
        return _PORTABLE + _bundle(data, _kernel_files(artifact))

    def deserialize(self, data: bytes) -> CompiledStep:
        from torch._inductor.standalone_compile import AOTCompiledArtifact
        if data.startswith(_PORTABLE):
            data = _install_kernels(data[len(_PORTABLE):])
        artifact, constants = _split_constants(data)
        return InductorStep(AOTCompiledArtifact.deserialize(artifact),
                            constants)

    @contextlib.contextmanager
    def storage(self, directory: Optional[str]) -> Iterator[None]:
        if directory is None:
            yield
            return
        from torch._inductor.runtime.cache_dir_utils import \
            temporary_cache_dir
        with temporary_cache_dir(directory), remembered_check(directory):
            yield


def _constants_as_inputs(graph: torch.fx.GraphModule):
    """A copy of ``graph`` whose constant tensors (plain tensor attributes
    and closure tensors the model reads) are inputs after its own, and
    those tensors: Inductor's serialized artifact does not keep a graph's
    constants, so a step loaded from the cache or a file gets them as
    inputs."""
    constants, lifted = [], torch.fx.Graph()
    values = {}
    attributes = [node for node in graph.graph.nodes if node.op == "get_attr"
                  and isinstance(getattr(graph, node.target, None),
                                 torch.Tensor)]
    placeholders = [node for node in graph.graph.nodes
                    if node.op == "placeholder"]
    for node in placeholders:
        values[node] = lifted.node_copy(node, values.__getitem__)
    for node in attributes:
        values[node] = lifted.placeholder(f"constant_{len(constants)}")
        constants.append(getattr(graph, node.target))
    for node in graph.graph.nodes:
        if node not in values:
            values[node] = lifted.node_copy(node, values.__getitem__)
    return torch.fx.GraphModule(graph, lifted), constants


_CONSTANTS = b"poptorch-inductor-constants\n"


def _with_constants(artifact: bytes, constants: List[torch.Tensor]) -> bytes:
    stream = io.BytesIO()
    torch.save(constants, stream)
    saved = stream.getvalue()
    return _CONSTANTS + len(saved).to_bytes(8, "little") + saved + artifact


def _split_constants(data: bytes):
    """(artifact, constants) of ``_with_constants``'s bytes."""
    if not data.startswith(_CONSTANTS):
        raise Error("inductor executable: written by an older version of "
                    "poptorch; compile the model again")
    start = len(_CONSTANTS) + 8
    size = int.from_bytes(data[len(_CONSTANTS):start], "little")
    constants = torch.load(io.BytesIO(data[start:start + size]),
                           weights_only=True)
    return data[start + size:], constants


def kernel_threads() -> int:
    """The threads Inductor's CPU kernels are generated for: its
    ``cpp.threads``, else this process's own intra-op threads (those lent
    included). A kernel's parallel loops are compiled for that many
    threads, so a step compiled by a process with fewer (a background
    compilation's worker) would run its loops on fewer."""
    from torch._inductor import config
    return config.cpp.threads if config.cpp.threads >= 1 else own_threads()


@contextlib.contextmanager
def generating_kernels_for(threads: int) -> Iterator[None]:
    """Compile CPU kernels for ``threads`` threads, whatever this process
    runs on."""
    from torch._inductor import config
    with config.patch({"cpp.threads": threads}):
        yield


@contextlib.contextmanager
def random_numbers_as_aten(enabled: bool) -> Iterator[None]:
    """With ``enabled``, Inductor's random operations call PyTorch's own
    (its ``fallback_random``): from the same generator state they draw the
    numbers the ``graph`` backend draws, where Inductor's own algorithm
    draws others (faster: it fuses them into its kernels)."""
    if not enabled:
        yield
        return
    from torch._inductor import config
    with config.patch({"fallback_random": True}):
        yield


_LOAD_INTO = """
import sys
import poptorch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch._inductor.standalone_compile import AOTCompiledArtifact
with open(sys.argv[1], "rb") as stream:
    artifact = stream.read()
with temporary_cache_dir(sys.argv[2]):
    AOTCompiledArtifact.deserialize(artifact)
"""


def _kernel_files(artifact: bytes) -> Dict[str, bytes]:
    """The files Inductor's cache needs to load ``artifact`` without
    compiling: a new process (whose in-memory caches are empty) loads it
    into an empty cache directory, which compiles its kernels there, and
    the files it leaves are returned. When that fails (a custom operator
    only the user's program registers, say), the bundle carries no kernels
    and loading compiles them."""
    files = {}
    with tempfile.TemporaryDirectory() as directory:
        artifact_path = os.path.join(directory, "artifact.bin")
        cache = os.path.join(directory, "cache")
        with open(artifact_path, "wb") as stream:
            stream.write(artifact)
        result = subprocess.run(
            [sys.executable, "-c", _LOAD_INTO, artifact_path, cache],
            capture_output=True, text=True, check=False)
        if result.returncode != 0:
            logger.warning("The compiled kernels could not be bundled with "
                           "the executable (loading it will compile them): "
                           "%s", result.stderr.strip().splitlines()[-1:])
            return files
        for root, _, names in os.walk(cache):
            for name in names:
                path = os.path.join(root, name)
                relative = os.path.relpath(path, cache)
                if not relative.startswith("locks"):
                    with open(path, "rb") as stream:
                        files[relative] = stream.read()
    return files


def _bundle(artifact: bytes, kernels: Dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(_ARTIFACT, artifact)
        for relative, content in kernels.items():
            archive.writestr(_KERNELS + relative, content)
    return buffer.getvalue()


def _install_kernels(bundle: bytes) -> bytes:
    """Put the bundled kernel files into Inductor's current cache directory
    (existing files are kept) and return the artifact."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    target = os.path.realpath(cache_dir())
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        for name in archive.namelist():
            if not name.startswith(_KERNELS):
                continue
            path = os.path.realpath(os.path.join(target,
                                                 name[len(_KERNELS):]))
            if not path.startswith(target + os.sep):
                raise Error(f"inductor executable: the kernel file {name!r} "
                            "would be written outside the cache directory")
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                _write_new(path, archive.read(name))
        return archive.read(_ARTIFACT)


def _write_new(path: str, data: bytes) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as stream:
        stream.write(data)
    os.replace(temporary, path)


register(InductorBackend())
