"""The "inductor" backend: compile the captured graph with TorchInductor.

The graph is compiled ahead of its first step with
``torch._inductor.standalone_compile`` (AOTAutograd functionalizes it, so
in-place writes to inputs, such as BatchNorm's running statistics or a
``forward`` that writes to its argument, still reach the caller; Inductor
then fuses the operations into generated C++ (CPU) or Triton (CUDA)
kernels). The result is a bundled artifact that can be turned into bytes
and loaded in another process without compiling the graph again; the
kernels' shared objects live in Inductor's cache directory, which
``storage`` can point into the executable cache.

Compilation takes seconds (10-20 s for small models on 2 CPU cores), so the
backend pays off for long runs; the executable cache and exported files
keep the result.
"""
import contextlib
from typing import Iterator, List, Optional

import torch

from ...errors import Error
from .backend import Backend, CompiledStep, register


class InductorStep:
    """A compiled step: Inductor's bundled artifact, called positionally."""

    def __init__(self, artifact) -> None:
        self.artifact = artifact
        self._call = artifact.inner_fn

    def __call__(self, *inputs: torch.Tensor):
        return self._call(*inputs)


class InductorBackend(Backend):
    name = "inductor"
    keeps_executables = True

    def compile(self, graph: torch.fx.GraphModule,
                example_inputs: List[torch.Tensor]) -> CompiledStep:
        from torch._inductor import standalone_compile
        artifact = standalone_compile(graph, list(example_inputs),
                                      dynamic_shapes="from_example_inputs",
                                      aot=True)
        return InductorStep(artifact)

    def serialize(self, step: CompiledStep) -> Optional[bytes]:
        if not isinstance(step, InductorStep):
            raise Error("inductor backend: can only serialize steps it "
                        "compiled")
        return step.artifact.serialize()

    def deserialize(self, data: bytes) -> CompiledStep:
        from torch._inductor.standalone_compile import AOTCompiledArtifact
        return InductorStep(AOTCompiledArtifact.deserialize(data))

    @contextlib.contextmanager
    def storage(self, directory: Optional[str]) -> Iterator[None]:
        if directory is None:
            yield
            return
        from torch._inductor.runtime.cache_dir_utils import \
            temporary_cache_dir
        with temporary_cache_dir(directory):
            yield


register(InductorBackend())
