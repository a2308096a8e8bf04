"""This process's rows of sharded optimizer state, sent to a process that
gathers the whole state without the others' help.

``optimizer.state_dict()`` of a model whose optimizer state is sharded
(``sharding.py``) needs every process's rows, and PopTorch programs often
call it on one process only: a checkpoint written by process 0, during
training or after the last call, when the other processes may be about to
exit. So the rows travel without the other processes' main threads:

* each model publishes its rows here after every change (its build, each
  call, a loaded state dict), with the number of calls it has completed;
* every process of a sharded run answers requests in a background thread.
  A request, on the run's rendezvous store, names the model (its number
  among the process's sharded models, the same on every process), the
  requesting process and how many calls its model has completed. The
  answering process waits until its own model has published as many (it
  can at most be finishing that call: the next one needs the requesting
  process), then sends the published rows on a gloo group of their own,
  tagged with the request's number. A process that is in its next call
  cannot have changed them yet: every call meets the others in a
  collective before its first update;
* a model that is destroyed or collected is retired; its rows are kept
  until every process has retired it, as another may still ask for them;
* at exit, a process with sharded models stays until every other process
  has finished too, or failed, at most the run's timeout, so that a
  checkpoint saved after the others' last call still finds their rows.
"""
import atexit
import datetime
import itertools
import json
import threading
import time
import weakref
from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from ..logger import logger

_REQUESTS = "state_requests"
_RETIRED = "state_retired"
_LINGERING = "lingering"
#: Seconds between the server's looks for a request (the store serves
#: one call at a time, so the server polls rather than blocks in it).
_POLL = 0.05
_POLLS_PER_CLEANUP = 20


class StateService:
    """The rows this process serves, and the gathering of others'."""

    def __init__(self, group) -> None:
        self.group = group
        self.store = group.store
        self.rank, self.size = group.rank, group.size
        self.timeout = group.environment.timeout
        self.transfers = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._published: Dict[int, Tuple[int, List[torch.Tensor]]] = {}
        self._retired: Set[int] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="poptorch-state-service")
        self._thread.start()
        atexit.register(self._linger)

    def register(self, state) -> int:
        """A number for the sharded optimizer state ``state`` (an
        ``OptimizerDeviceState``), the same on every process; the state is
        retired when it is collected."""
        number = next(self._numbers)
        weakref.finalize(state, self._retire, number)
        return number

    def publish(self, number: int, calls: int,
                rows: List[torch.Tensor]) -> None:
        """Model ``number``'s ``rows`` after ``calls`` calls."""
        with self._lock:
            self._published[number] = (calls, list(rows))

    # --- gathering ----------------------------------------------------------
    def gather(self, number: int, calls: int,
               rows: List[torch.Tensor]) -> List[List[torch.Tensor]]:
        """Every process's ``rows`` of model ``number`` after ``calls``
        calls, in rank order (this process's are ``rows``)."""
        request = self.store.add(_REQUESTS, 1) - 1
        self.store.set(f"{_REQUESTS}/{request}", json.dumps(
            {"from": self.rank, "model": number, "calls": calls}))
        gathered = []
        for peer in range(self.size):
            if peer == self.rank:
                gathered.append(rows)
                continue
            packed = _empty_packed(rows)
            with self.group.monitor.explaining(
                    f"the gather of the sharded optimizer state from process "
                    f"{peer}", collective=False):
                for flat in packed:
                    dist.recv(flat, src=peer, group=self.transfers,
                              tag=request)
            gathered.append(_unpacked(packed, rows))
        return gathered

    # --- serving ------------------------------------------------------------
    def _serve(self) -> None:
        try:
            for request in itertools.count():
                key = f"{_REQUESTS}/{request}"
                polls = 0
                while not self.store.check([key]):
                    if self._stopped.wait(_POLL):
                        return
                    polls += 1
                    if polls % _POLLS_PER_CLEANUP == 0:
                        self._forget_retired()
                asked = json.loads(self.store.get(key))
                if asked["from"] != self.rank:
                    self._answer(request, asked)
        except Exception as error:  # the run is over, or failed
            logger.debug("The optimizer state service stops: %s", error)

    def _answer(self, request: int, asked: Dict) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with self._lock:
                calls, rows = self._published.get(asked["model"], (-1, []))
            if calls >= asked["calls"]:
                for packed in _packed(rows):
                    dist.send(packed, dst=asked["from"],
                              group=self.transfers, tag=request)
                return
            if self._stopped.wait(_POLL):
                return

    def _retire(self, number: int) -> None:
        try:
            self.store.set(f"{_RETIRED}/{number}/{self.rank}", "1")
            with self._lock:
                self._retired.add(number)
        except Exception:  # the run is over: nothing to keep
            return

    def _forget_retired(self) -> None:
        """Drop the rows of models every process has retired."""
        with self._lock:
            retired = list(self._retired)
        for number in retired:
            if all(self.store.check([f"{_RETIRED}/{number}/{rank}"])
                   for rank in range(self.size)):
                with self._lock:
                    self._published.pop(number, None)
                    self._retired.discard(number)

    def _linger(self) -> None:
        """At exit: stay until every other process has finished or failed
        (at most the timeout), answering their requests meanwhile; then
        stop serving, before the process group goes."""
        try:
            self.store.set(f"{_LINGERING}/{self.rank}", "1")
            deadline = time.monotonic() + self.timeout
            peers = [p for p in range(self.size) if p != self.rank]
            while time.monotonic() < deadline and not all(
                    p in self.group.monitor.failed_processes()
                    or self.store.check([f"{_LINGERING}/{p}"])
                    for p in peers):
                time.sleep(_POLL)
        except Exception as error:  # the store went away: the run is over
            logger.debug("Leaving without waiting for the others: %s", error)
        self._stopped.set()
        self._thread.join(self.timeout)


def _packed(rows: List[torch.Tensor]) -> List[torch.Tensor]:
    """``rows`` as one flat CPU tensor per dtype, in order of first use."""
    dtypes = list(dict.fromkeys(t.dtype for t in rows))
    return [torch.cat([t.detach().reshape(-1).cpu() for t in rows
                       if t.dtype == dtype]) for dtype in dtypes]


def _empty_packed(like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Empty CPU tensors shaped as ``_packed(like)``, to receive into."""
    dtypes = list(dict.fromkeys(t.dtype for t in like))
    return [torch.empty(sum(t.numel() for t in like if t.dtype == dtype),
                        dtype=dtype) for dtype in dtypes]


def _unpacked(packed: List[torch.Tensor],
              like: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors shaped as ``like`` (on its devices) from ``packed``."""
    dtypes = list(dict.fromkeys(t.dtype for t in like))
    pieces = {dtype: iter(flat.split([t.numel() for t in like
                                      if t.dtype == dtype]))
              for dtype, flat in zip(dtypes, packed)}
    return [next(pieces[t.dtype]).view(t.shape).to(t.device) for t in like]
