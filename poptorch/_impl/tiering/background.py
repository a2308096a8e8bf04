"""One background compilation: the steps of a model compiled by Inductor in
another process (``worker.py``), which writes them to the executable
cache; this process then loads them from there.

The job is written to a temporary directory (graphs as JSON, constants as
tensors, the executable keys, the threads the kernels are for) and the
worker started at a lower priority with one thread. ``poll`` says whether
it is still running, done or failed (with the end of its error output). A
process that exits while its worker runs stops it (``atexit``), as does a
model dropped without ``destroy()`` (``tier_up.py``); a worker whose parent
is gone ends itself. The cache's atomic writes mean a stopped
worker leaves no half-written entry.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from typing import Dict, List, Optional

import torch

from ..graph_format import serialize_graph
from ..intra_op_threads import give_back_one, lend_one

RUNNING, DONE, FAILED = "running", "done", "failed"
_ERROR_TAIL = 2000

_running: "weakref.WeakSet[BackgroundCompile]" = weakref.WeakSet()


class StepJob:
    """One step to compile: its name, captured graph and executable cache
    key (None until known; written for the worker when a compilation
    starts)."""

    def __init__(self, name: str, graph: torch.fx.GraphModule,
                 key: Optional[str] = None) -> None:
        self.name = name
        self.graph = graph
        self.key = key

    def input_values(self) -> List[torch.Tensor]:
        """The graph's inputs as the capture recorded them (fake
        tensors: shapes, strides, dtypes and devices, no data)."""
        return [node.meta["val"] for node in self.graph.graph.nodes
                if node.op == "placeholder"]

    def inputs(self) -> List[Dict[str, object]]:
        return [{"shape": list(t.shape), "stride": list(t.stride()),
                 "dtype": str(t.dtype).split(".")[-1],
                 "device": str(t.device)} for t in self.input_values()]


class BackgroundCompile:
    """A worker process compiling ``steps`` into ``cache_directory``."""

    def __init__(self, steps: List[StepJob], cache_directory: str,
                 model_name: str, lock: str, kernel_threads: int,
                 random_numbers_as_aten: bool) -> None:
        self._lock = lock
        self._lent = False
        self._directory = tempfile.mkdtemp(prefix="poptorch-tier-up-")
        self._write_job(steps, cache_directory, model_name, kernel_threads,
                        random_numbers_as_aten)
        self._errors = open(os.path.join(self._directory, "stderr"), "w+b")
        self._process: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-m", "poptorch._impl.tiering.worker",
             self._directory],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._errors, env=_worker_environment(),
            preexec_fn=_lower_priority)
        _running.add(self)

    def _write_job(self, steps: List[StepJob], cache_directory: str,
                   model_name: str, kernel_threads: int,
                   random_numbers_as_aten: bool) -> None:
        documents = {s.name: serialize_graph(s.graph) for s in steps}
        job = {"cache_directory": cache_directory, "model_name": model_name,
               "kernel_threads": kernel_threads,
               "random_numbers_as_aten": random_numbers_as_aten,
               "steps": [{"name": s.name, "key": s.key,
                          "graph": documents[s.name][0],
                          "inputs": s.inputs()} for s in steps]}
        with open(os.path.join(self._directory, "job.json"), "w",
                  encoding="utf-8") as stream:
            json.dump(job, stream)
        torch.save({name: constants
                    for name, (_, constants) in documents.items()},
                   os.path.join(self._directory, "constants.pt"))

    def poll(self) -> str:
        """``RUNNING``, ``DONE`` or ``FAILED``."""
        if self._process is None:
            return FAILED
        code = self._process.poll()
        if code is None:
            return RUNNING
        return DONE if code == 0 else FAILED

    def error(self) -> str:
        """The end of the worker's error output, and how it ended."""
        code = self._process.returncode if self._process else None
        self._errors.seek(0)
        text = self._errors.read().decode(errors="replace")[-_ERROR_TAIL:]
        return f"exit status {code}: {text.strip() or 'no output'}"

    def lend_a_thread(self) -> None:
        """Run this process on one intra-op thread fewer while the worker
        compiles (if more than one is left); ``stop`` gives it back."""
        self._lent = lend_one()

    def stop(self) -> None:
        """End the worker (if running), remove the job's files, release
        the compile lock (``lock``, which this process holds) and give back
        the lent thread."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._errors.close()
        shutil.rmtree(self._directory, ignore_errors=True)
        release(self._lock)
        _running.discard(self)
        if self._lent:
            self._lent = False
            give_back_one()


def release(lock: Optional[str]) -> None:
    """Remove the compile lock file ``lock`` (if there)."""
    if lock is not None:
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass


def _worker_environment() -> Dict[str, str]:
    environment = dict(os.environ)
    environment.update({"TORCHINDUCTOR_COMPILE_THREADS": "1",
                        "OMP_NUM_THREADS": "1"})
    return environment


def _lower_priority() -> None:
    os.nice(10)


@atexit.register
def _stop_workers() -> None:
    for compile_job in list(_running):
        compile_job.stop()
