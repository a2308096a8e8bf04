"""How the dataset of an ``AsynchronousDataAccessor`` reaches its worker.

One rule per ``poptorch.SharingStrategy``:

* ``SharedMemory``: the worker is spawned (a fresh interpreter) and the
  dataset is pickled with the multiprocessing pickler, which moves its
  tensors into shared memory instead of copying them.
* ``FileSystem``: the worker is spawned and the dataset is saved with
  ``torch.save`` to a temporary file that the worker loads and deletes.
* ``Fork``: the worker is forked; it inherits the dataset and nothing is
  pickled (unsafe if the parent runs threads that hold locks).
* ``ForkServer``: the worker is forked from multiprocessing's single-threaded
  fork server; the dataset is pickled as for ``SharedMemory``.

Pickling happens in the parent while the worker starts, when the accessor
is built, so a dataset that the strategy cannot send fails there, with a
message naming the strategy. The worker unpickles the dataset itself, so
that a failure there reaches the user as an error with its traceback.
Pickling while the worker starts (rather than earlier) lets a dataset hold
objects that multiprocessing only shares with a starting process, such as a
``multiprocessing.Value``.

The pickle of a tensor refers to its shared memory by a file descriptor
that the starting process hands to the worker after pickling, and that
stays open only while the tensor lives. Tensors created by the pickling
itself (a ``__getstate__`` returning ``self.x.clone()``, the state of a
``torch.Generator``) would die before that, and the worker would receive a
closed or reused descriptor: garbage data, or a failed start. So every
object the pickling meets is kept until the worker has started.
"""
import io
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import tempfile
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...enums import SharingStrategy
from ...errors import Error

WORKER_MODULE = "poptorch._impl.data.worker"

_START_METHODS = {
    SharingStrategy.SharedMemory: "spawn",
    SharingStrategy.FileSystem: "spawn",
    SharingStrategy.Fork: "fork",
    SharingStrategy.ForkServer: "forkserver",
}


def start_context(strategy: SharingStrategy):
    """The multiprocessing context that starts the worker for ``strategy``."""
    method = _START_METHODS[strategy]
    if method not in multiprocessing.get_all_start_methods():
        raise Error(f"sharing_strategy={strategy_name(strategy)} needs the "
                    f"'{method}' start method, which this platform does not "
                    "provide; use SharingStrategy.SharedMemory or "
                    "SharingStrategy.FileSystem")
    if method == "forkserver":
        _preload_worker_in_fork_server()
    return multiprocessing.get_context(method)


def _preload_worker_in_fork_server() -> None:
    """Have the fork server import torch and the worker once, so that each
    worker it forks starts in milliseconds instead of importing torch again.
    Adds to the preload list rather than replacing it; has no effect once
    the server runs."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    if WORKER_MODULE not in preload:
        multiprocessing.forkserver.set_forkserver_preload(
            preload + [WORKER_MODULE])


def strategy_name(strategy: SharingStrategy) -> str:
    """``SharingStrategy.<name>``, as the user writes it."""
    return f"SharingStrategy.{strategy.name}"


class DatasetSource:
    """The dataset packaged for the worker process of one strategy: the
    object itself (``Fork``, and in the parent), its pickle (after being
    sent to the worker) or the file it was saved to (``FileSystem``)."""

    def __init__(self, dataset: Any, strategy: SharingStrategy) -> None:
        self.strategy = strategy
        self.path: Optional[str] = None
        self._dataset = None
        self._pickled: Optional[bytes] = None
        self._pickled_objects: Optional[List[Any]] = None
        if strategy == SharingStrategy.FileSystem:
            self.path = _save_to_file(dataset)
        else:
            self._dataset = dataset

    def __getstate__(self) -> Dict[str, Any]:
        """The state sent to the worker: the dataset pickled with the
        multiprocessing pickler. Keeps the objects the pickling met (see
        the module documentation) until ``worker_started()``."""
        state = dict(self.__dict__, _dataset=None, _pickled_objects=None)
        if self._dataset is not None:
            state["_pickled"], self._pickled_objects = _pickle_for_process(
                self._dataset, self.strategy)
        return state

    def worker_started(self) -> None:
        """Release the objects kept by ``__getstate__``: once the worker
        process has started it holds its own copies of the file
        descriptors of their shared memory."""
        self._pickled_objects = None

    def load(self) -> Any:
        """The dataset, in the worker process."""
        if self._pickled is not None:
            return pickle.loads(self._pickled)
        if self.strategy == SharingStrategy.FileSystem:
            try:
                return torch.load(self.path, weights_only=False)
            finally:
                os.remove(self.path)
        return self._dataset

    def discard(self) -> None:
        """Release what was made to send the dataset: the objects kept by
        ``__getstate__`` and the temporary file if the worker did not load
        it."""
        self._pickled_objects = None
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)


class _RetainingPickler(ForkingPickler):
    """The multiprocessing pickler, keeping a reference to every object it
    pickles other than the basic types (numbers, strings, containers), so
    that tensors created during pickling outlive it."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.pickled_objects: List[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        """Keep ``obj``, then pickle it as ``ForkingPickler`` does."""
        self.pickled_objects.append(obj)
        return NotImplemented


def _pickle_for_process(dataset: Any,
                        strategy: SharingStrategy) -> Tuple[bytes, List[Any]]:
    """The pickle of ``dataset`` and the objects that must stay alive
    until the worker process has started."""
    buffer = io.BytesIO()
    pickler = _RetainingPickler(buffer)
    try:
        pickler.dump(dataset)
    except Exception as error:
        raise Error(_cannot_send_message(dataset, strategy, error)) from error
    return buffer.getvalue(), pickler.pickled_objects


def _save_to_file(dataset: Any) -> str:
    handle, path = tempfile.mkstemp(prefix="poptorch_dataset_", suffix=".pt")
    os.close(handle)
    try:
        torch.save(dataset, path)
    except Exception as error:
        os.remove(path)
        raise Error(_cannot_send_message(dataset, SharingStrategy.FileSystem,
                                         error)) from error
    return path


def _cannot_send_message(dataset: Any, strategy: SharingStrategy,
                         error: Exception) -> str:
    alternative = ("SharingStrategy.Fork, which does not pickle the dataset"
                   if "fork" in multiprocessing.get_all_start_methods() else
                   "a dataset defined at module level")
    return (f"AsynchronousDataAccessor: sharing_strategy="
            f"{strategy_name(strategy)} must "
            f"pickle the dataset ({type(dataset).__name__}) to send it to the "
            f"worker process, and pickling failed: "
            f"{type(error).__name__}: {error}. Make the dataset picklable "
            f"(define its class at module level, drop open files, locks and "
            f"lambdas) or use {alternative}.")
