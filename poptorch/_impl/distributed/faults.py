"""Stopping cleanly when another process of the run fails.

Every process publishes on the run's rendezvous store (under ``poptorch/``):

* ``host/<rank>``: its host name and process id, so that a process on the
  same host sees at once that a peer no longer exists;
* ``alive/<rank>``: a counter a background thread increments every
  ``HEARTBEAT_INTERVAL`` seconds; a peer whose counter stops for
  ``STALE_AFTER`` seconds has stopped (killed, or on a lost host);
* ``exit/<rank>``: why it ended, written at exit: "raised <exception>" when
  an exception ended the program, else "exited" (the process hosting the
  store then stays until the others have ended, at most the timeout);
* ``seq/<rank>``: how many collective operations it has started.

``FaultMonitor.wait`` waits for one collective operation: it returns when
the operation completes, and raises ``poptorch.Error`` naming the failed
process(es) when a peer is known to have ended or stopped, or when the
run's timeout passes (naming the processes that did not start the
operation). With gloo the wait is the backend's own (it fails at once when
a peer disconnects, and after the timeout), then the monitor names the
culprit; with NCCL the monitor polls the operation and the peers.
``FaultMonitor.explaining`` names the culprit in the same way for work that
exchanges data otherwise (the transfers of a pipeline over processes).
"""
import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional

from ...errors import Error
from ..logger import logger

HEARTBEAT_INTERVAL = 0.5
STALE_AFTER = 10.0
_CHECK_INTERVAL = 0.25


class FaultMonitor:
    """Watches the other processes of a run for this process."""

    def __init__(self, store, rank: int, size: int, timeout: float,
                 hosts_store: bool) -> None:
        self._store = store
        self._hosts_store = hosts_store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._stale_after = min(STALE_AFTER, timeout)
        self._sequence = 0
        self._seen: Dict[int, tuple] = {}
        self._hosts: Dict[int, tuple] = {}
        self._stopped = threading.Event()
        store.set(f"host/{rank}", f"{socket.gethostname()} {os.getpid()}")
        store.add(f"alive/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="poptorch-heartbeat")
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._mark_exception
        atexit.register(self._mark_exit, "exited")

    # --- this process ---------------------------------------------------
    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_INTERVAL):
            try:
                self._store.add(f"alive/{self._rank}", 1)
            except Exception:  # the store went away: the run is over
                return

    def _mark_exit(self, reason: str) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self._store.set(f"exit/{self._rank}", reason)
        except Exception:  # the store may already be gone at exit
            return
        if self._hosts_store:
            self._linger()

    def _linger(self) -> None:
        """The process hosting the rendezvous store stays until the others
        have ended or failed (at most the timeout), so that their last
        store calls find it."""
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            try:
                ended = {rank for rank in self._peers()
                         if self._store.check([f"exit/{rank}"])}
                if ended | set(self.failed_processes()) >= set(self._peers()):
                    return
            except Exception:
                return
            time.sleep(_CHECK_INTERVAL)

    def _mark_exception(self, kind, value, traceback) -> None:
        self._mark_exit(f"raised {kind.__name__}: {value}")
        self._previous_hook(kind, value, traceback)

    # --- other processes --------------------------------------------------
    def _peers(self) -> List[int]:
        return [r for r in range(self._size) if r != self._rank]

    def failed_processes(self) -> Dict[int, str]:
        """Peers known to have ended or stopped, with the reason."""
        failed = {}
        now = time.monotonic()
        for rank in self._peers():
            if self._store.check([f"exit/{rank}"]):
                failed[rank] = self._store.get(f"exit/{rank}").decode()
            elif self._gone_from_this_host(rank):
                failed[rank] = "died (its OS process no longer exists)"
            else:
                count = self._store.add(f"alive/{rank}", 0)
                last_count, since = self._seen.get(rank, (count, now))
                if count != last_count:
                    since = now
                self._seen[rank] = (count, since)
                if now - since > self._stale_after:
                    failed[rank] = (f"stopped responding (no heartbeat for "
                                    f"{now - since:.0f} s)")
        return failed

    def _gone_from_this_host(self, rank: int) -> bool:
        if rank not in self._hosts:
            if not self._store.check([f"host/{rank}"]):
                return False
            host, pid = self._store.get(f"host/{rank}").decode().split()
            self._hosts[rank] = (host, int(pid))
        host, pid = self._hosts[rank]
        return host == socket.gethostname() and not process_exists(pid)

    def _processes_behind(self, sequence: Optional[int]) -> List[int]:
        if sequence is None:
            return []
        behind = []
        for rank in self._peers():
            key = f"seq/{rank}"
            reached = (int(self._store.get(key)) if self._store.check([key])
                       else 0)
            if reached < sequence:
                behind.append(rank)
        return behind

    # --- waiting ----------------------------------------------------------
    def _describe(self, failed: Dict[int, str]) -> str:
        return "; ".join(f"process {rank} {reason}"
                         for rank, reason in sorted(failed.items()))

    def _failure(self, what: str, failed: Dict[int, str]) -> Error:
        return Error(
            f"Distributed run: {self._describe(failed)}. Process "
            f"{self._rank} of {self._size} stops ({what} cannot complete "
            "without it).")

    def start(self) -> int:
        """Announce the start of the next collective operation."""
        self._sequence += 1
        self._store.set(f"seq/{self._rank}", str(self._sequence))
        return self._sequence

    def wait_until(self, done: Callable[[], bool], what: str,
                   sequence: Optional[int] = None) -> None:
        """Poll ``done()`` until True; raise ``poptorch.Error`` when a peer
        fails or the timeout passes."""
        start = time.monotonic()
        next_check = start + _CHECK_INTERVAL
        pause = 1e-4
        while not done():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_INTERVAL
                failed = self._checked(what)
                if failed:
                    raise self._failure(what, failed)
            if now - start > self._timeout:
                raise self._timeout_error(what, sequence)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _checked(self, what: str) -> Dict[int, str]:
        try:
            return self.failed_processes()
        except Exception as error:
            raise Error(
                f"Distributed run: process {self._rank} lost contact with the "
                f"run's rendezvous store during {what} ({error}); the process "
                "hosting it (process 0, or the launcher) has stopped"
            ) from error

    def _timeout_error(self, what: str, sequence: Optional[int]) -> Error:
        behind = self._processes_behind(sequence)
        who = (f"process(es) {', '.join(map(str, behind))} did not start it"
               if behind else "the other processes did not finish it")
        return Error(
            f"Distributed run: {what} timed out after {self._timeout:.0f} s "
            f"on process {self._rank}: {who}. Set "
            "POPTORCH_DISTRIBUTED_TIMEOUT to wait longer.")

    @contextlib.contextmanager
    def explaining(self, what: str,
                   collective: bool = True) -> Iterator[None]:
        """Run work that exchanges data with the other processes (a
        pipeline schedule's sends and receives, its collectives): a
        ``RuntimeError`` from the backend (a peer disconnected, a timeout)
        becomes ``poptorch.Error`` naming the failed process. Work that is
        not ``collective`` (one process asking another, which every process
        does not do) is not counted among the collectives started."""
        sequence = self.start() if collective else None
        started = time.monotonic()
        try:
            yield
        except RuntimeError as error:
            raise self._explain(what, error, sequence, started) from error

    def wait(self, work, what: str, sequence: int, blocking: bool) -> None:
        """Wait for a torch.distributed ``Work`` (async collective).
        ``blocking``: the backend itself fails the operation when a peer
        disconnects or the run's timeout passes (gloo), so wait in it,
        which is quickest; otherwise (NCCL) poll it and check the peers."""
        started = time.monotonic()
        if not blocking:
            self.wait_until(work.is_completed, what, sequence)
        try:
            work.wait()
        except Exception as error:
            raise self._explain(what, error, sequence, started) from error

    def _explain(self, what: str, error: Exception, sequence: Optional[int],
                 started: float) -> Error:
        """The error of a collective that failed after waiting since
        ``started``, naming the failed peer once it is known (at most
        ``STALE_AFTER`` seconds). A peer that has not started the
        operation is named as the cause only when the wait lasted the
        run's timeout: a peer killed before it started looks the same
        until its end is seen."""
        timed_out = time.monotonic() - started >= self._timeout
        deadline = time.monotonic() + self._stale_after + 1.0
        while time.monotonic() < deadline:
            failed = self._checked(what)
            if failed:
                return self._failure(what, failed)
            if timed_out and self._processes_behind(sequence):
                return self._timeout_error(what, sequence)
            time.sleep(_CHECK_INTERVAL)
        logger.debug("Collective failure without a known failed peer: %s",
                     error)
        behind = self._processes_behind(sequence)
        not_started = (f"; process(es) {', '.join(map(str, behind))} had not "
                       "started it" if behind else "")
        return Error(f"Distributed run: {what} failed on process "
                     f"{self._rank}: {error}{not_started}")


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie waiting
    for its parent to collect it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
