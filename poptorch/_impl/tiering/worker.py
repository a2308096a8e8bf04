"""The background compilation process of the ``auto`` backend:

    python -m poptorch._impl.tiering.worker JOB_DIRECTORY

reads the job that ``background.py`` wrote (``job.json``: the cache
directory, the model's name, the threads the kernels are for, whether
random operations draw as the graph tier's do and, per
step, its executable key, graph and input metadata; ``constants.pt``: the
graphs' constant tensors), compiles each step with the Inductor backend and
writes it to the executable cache under its key (atomically: a reader never
sees half an entry). It exits 0 when every step is in the cache.

The process runs at a lower priority on one thread, so that the training
loop that started it keeps its cores; its kernels are generated for the
training process's threads, which run them. It ends itself when that
process is gone (no orphan compiles on).
"""
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

import torch

from ..backends import get_backend
from ..backends.inductor import (generating_kernels_for,
                                 random_numbers_as_aten)
from ..executable_cache import ExecutableCache
from ..graph_format import deserialize_graph

_PARENT_CHECK_SECONDS = 0.5


def main(job_directory: str) -> int:
    parent = os.getppid()
    threading.Thread(target=_end_with_parent, args=(parent,),
                     daemon=True).start()
    with open(os.path.join(job_directory, "job.json"),
              encoding="utf-8") as stream:
        job = json.load(stream)
    constants = torch.load(os.path.join(job_directory, "constants.pt"),
                           weights_only=True)
    cache = ExecutableCache(job["cache_directory"], job["model_name"])
    backend = get_backend("inductor")
    with backend.storage(cache.backend_directory), \
            generating_kernels_for(job["kernel_threads"]), \
            random_numbers_as_aten(job["random_numbers_as_aten"]):
        for step in job["steps"]:
            _compile_step(backend, cache, step, constants[step["name"]])
    return 0


def _compile_step(backend, cache: ExecutableCache, step: Dict[str, Any],
                  constants: Dict[str, torch.Tensor]) -> None:
    graph = deserialize_graph(step["graph"], constants)
    compiled = backend.compile(graph, _example_inputs(step["inputs"]))
    cache.write(step["key"], backend.serialize(compiled), step["name"])


def _example_inputs(metadata: List[Dict[str, Any]]) -> List[torch.Tensor]:
    return [torch.empty_strided(item["shape"], item["stride"],
                                dtype=getattr(torch, item["dtype"]),
                                device=item["device"])
            for item in metadata]


def _end_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_SECONDS)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
