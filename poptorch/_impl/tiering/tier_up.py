"""The tiers of the ``auto`` backend (docs/compiled_execution.md, "Tiered
compilation"): a model's steps start on the ``graph`` backend, which
compiles nothing, and move to Inductor's compiled steps once the model has
spent long enough in calls to repay the compilation (``threshold.py``).

Inductor compiles in another process (``background.py``) that writes the
executable cache; this process loads the entries from there between two
calls and switches every step of the model at once, so that a call runs on
one tier throughout. The steps of both tiers are compiled from the same
captured graph (with the gradients summed into the device loop's buffer, as
the graph backend wants), and the device state is the loop's, so the state
carries over exactly. Entries already in the cache (a warm cache, another
process of a ``poprun`` run) are used from the first call.

While its worker compiles, the process gives the worker one of its
intra-op threads (``torch.set_num_threads``, one fewer, restored at the
switch): a worker competing with the training loop's threads for the
cores stalls every parallel operation of the loop, which costs far more
than one thread fewer.

Only one process compiles a set of steps: it holds a lock file next to the
cache entries (``<key>.compiling``, with its pid); the other processes of
the run wait for the entries. A failed compilation (an Inductor error, a
killed worker, a full disk) logs one warning and the model stays on the
graph tier.
"""
import os
import sys
import weakref
from typing import Dict, List, Optional

import torch

from ...errors import Error
from ..backends import get_backend
from ..distributed.faults import process_exists
from ..backends.in_place import Donation
from ..backends.inductor import kernel_threads, random_numbers_as_aten
from ..executable_cache import (ExecutableCache, entry_key, executable_key,
                                ENTRY_SUFFIX, load_cached, prepare_directory,
                                trusted_directory)
from ..logger import logger
from ..profiling.ranges import profile_range
from .background import FAILED, RUNNING, BackgroundCompile, StepJob, release
from .threshold import TierUpThreshold, lends_a_thread


class TieredStep:
    """A step the device loop calls: ``current`` is the graph tier's until
    the model switches it to Inductor's."""

    def __init__(self, step) -> None:
        self.current = step

    def __call__(self, *inputs: torch.Tensor):
        return self.current(*inputs)


class TieredCompilation:
    """The tiers of one compiled model's steps."""

    def __init__(self, cache: ExecutableCache, options: Dict,
                 show_progress: bool, seeded: bool) -> None:
        self._cache = cache
        self._options = options
        # With randomSeed, the Inductor tier draws the random numbers the
        # graph tier draws: a seeded run is the same whenever it tiers up.
        self._aten_random = seeded
        self._show_progress = show_progress
        self._threshold = TierUpThreshold()
        self._inductor = get_backend("inductor")
        self._steps: Dict[str, TieredStep] = {}
        self._jobs: List[StepJob] = []
        self._seconds = 0.0
        self._compile: Optional[BackgroundCompile] = None
        self._waiting = False
        self._given_up = False
        self._lock: Optional[str] = None
        self._bar = None
        self._stop_compile: Optional[weakref.finalize] = None

    def add(self, name: str, graph: torch.fx.GraphModule,
            example_inputs: List[torch.Tensor],
            donation: Optional[Donation]) -> TieredStep:
        """The step ``name``: Inductor's from the cache when it is there,
        else the graph tier's until the tier-up. The cache is looked up only
        when it holds entries: the key needs Inductor's settings, whose
        import alone takes seconds."""
        job = StepJob(name, graph)
        compiled = None
        if self._cache_has_entries():
            job.key = self._key(job)
            with self._inductor.storage(self._cache.backend_directory):
                compiled = load_cached(self._cache, self._inductor, job.key,
                                       name)
        if compiled is None:
            compiled = get_backend("graph").compile(graph, example_inputs,
                                                    donation)
            self._jobs.append(job)
        step = TieredStep(compiled)
        self._steps[name] = step
        return step

    def _key(self, job: StepJob) -> str:
        with random_numbers_as_aten(self._aten_random):
            return entry_key(self._inductor, executable_key(
                self._inductor, job.graph, job.input_values(),
                self._options))

    def _cache_has_entries(self) -> bool:
        directory = self._cache.directory
        if not (os.path.isdir(directory) and trusted_directory(directory)):
            return False
        with os.scandir(directory) as entries:
            return any(entry.name.endswith(ENTRY_SUFFIX) for entry in entries)

    @property
    def on_fast_tier(self) -> bool:
        """Whether every step runs Inductor's compiled code."""
        return not self._jobs and not self._given_up

    def after_call(self, seconds: float, completed: bool) -> None:
        """A call of ``seconds`` ended (``completed``, or failed): start the
        tier-up when the model has spent the threshold in calls."""
        if not self._jobs or self._compile or self._waiting:
            return
        self._threshold.after_call(seconds, completed)
        self._seconds += seconds
        if self._threshold.reached(self._seconds):
            self._start()

    def before_call(self) -> None:
        """Between calls: switch to the compiled steps once they are
        ready."""
        if self._compile is not None:
            self._after_compile()
        elif self._waiting and self._ready():
            self._switch()
        elif self._waiting and not _lock_alive(self._lock):
            self._waiting = False
            self._start()
        elif self._jobs:
            self._threshold.before_call()

    def _after_compile(self) -> None:
        """Switch, or give up, once this process's worker has ended."""
        state = self._compile.poll()
        if state == RUNNING:
            return
        error = self._compile.error() if state == FAILED else None
        self._end_compile()
        if error is not None:
            self._give_up(error)
        elif not self._ready():
            self._give_up("the compiled steps did not reach the executable "
                          f"cache {self._cache.directory}")
        else:
            self._switch()

    def _start(self) -> None:
        try:
            prepare_directory(self._cache.directory)
        except (Error, OSError) as error:
            self._give_up(str(error))
            return
        for job in self._jobs:
            job.key = job.key or self._key(job)
        self._lock = self._cache.path(self._jobs[0].key) + ".compiling"
        if not _claim(self._lock):
            self._waiting = True
            return
        try:
            with profile_range("start background compile"):
                self._compile = BackgroundCompile(
                    self._jobs, self._cache.directory,
                    self._cache.model_name, self._lock, kernel_threads(),
                    self._aten_random)
        except Exception as error:  # pylint: disable=broad-except
            # Whatever stops the compilation must not stop the training.
            release(self._lock)
            self._give_up(f"{type(error).__name__}: {error}")
            return
        if lends_a_thread():
            self._compile.lend_a_thread()
        # A model dropped without destroy() stops its worker too.
        self._stop_compile = weakref.finalize(self, self._compile.stop)
        self._progress_start()
        logger.debug("Compiling %s in the background (inductor)",
                     ", ".join(job.name for job in self._jobs))

    def _ready(self) -> bool:
        return all(os.path.exists(self._cache.path(job.key))
                   for job in self._jobs)

    def _switch(self) -> None:
        """Load every compiled step, then switch them all."""
        with profile_range("switch to inductor"), \
                self._inductor.storage(self._cache.backend_directory):
            loaded = {job.name: load_cached(self._cache, self._inductor,
                                            job.key, job.name)
                      for job in self._jobs}
        if any(step is None for step in loaded.values()):
            self._give_up("its executable cache entries could not be loaded")
            return
        for name, step in loaded.items():
            self._steps[name].current = step
        self._jobs, self._waiting = [], False
        self._progress_end("switched to inductor")
        logger.debug("The model's steps switched to inductor")

    def _give_up(self, reason: str) -> None:
        logger.warning("Background compilation with inductor failed (%s); "
                       "the model goes on with the graph backend", reason)
        self._jobs, self._waiting, self._given_up = [], False, True
        self._progress_end("failed")

    def close(self) -> None:
        """Stop a running compilation (the model is destroyed)."""
        if self._compile is not None:
            self._end_compile()
        self._progress_end("stopped")

    def _end_compile(self) -> None:
        self._stop_compile()
        self._compile = None

    def _progress_start(self) -> None:
        if self._show_progress:
            from tqdm import tqdm
            self._bar = tqdm(total=1, desc="Background compilation "
                             "(inductor)", unit="step set", file=sys.stderr,
                             leave=False)

    def _progress_end(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)
            self._bar.close()
            self._bar = None


def _claim(lock: str) -> bool:
    """Create the lock file (this process compiles), or see a live
    holder's; a dead holder's lock is taken over."""
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _lock_alive(lock):
                return False
            release(lock)
            continue
        with os.fdopen(descriptor, "w") as stream:
            stream.write(str(os.getpid()))
        return True
    return False


def _lock_alive(lock: Optional[str]) -> bool:
    try:
        with open(lock, encoding="utf-8") as stream:
            pid = int(stream.read().strip() or 0)
    except (OSError, TypeError, ValueError):
        return False
    return pid > 0 and process_exists(pid)
