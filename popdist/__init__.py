"""PopDist compatibility: the process layout of a run started by ``poprun``.

``poprun`` (``poptorch.run``) starts the instances (processes) of a program
and tells each one its place through environment variables; these
functions read them. Outside ``poprun`` a program is one instance with one
replica: ``isPopdistEnvSet()`` is False, ``getInstanceIndex()`` is 0 and
``getNumInstances()``, ``getNumLocalReplicas()`` and
``getNumTotalReplicas()`` are 1.
"""
import os
from typing import Any, Callable, Collection, Optional

from poptorch.errors import Error

__all__ = ["isPopdistEnvSet", "init", "getInstanceIndex", "getNumInstances",
           "getNumLocalReplicas", "getNumTotalReplicas",
           "getReplicaIndexOffset", "getNumIpusPerReplica",
           "execute_on_instances"]


def _integer(variable: str, default: int) -> int:
    text = os.environ.get(variable)
    if text is None or not isPopdistEnvSet():
        return default
    try:
        return int(text)
    except ValueError:
        raise Error(f"popdist: the environment variable {variable} must hold "
                    f"an integer, got {text!r}") from None


def isPopdistEnvSet() -> bool:
    """True inside an instance started by ``poprun``."""
    return "POPDIST_NUM_INSTANCES" in os.environ and "RANK" in os.environ


def getInstanceIndex() -> int:
    """This instance's index, 0 to ``getNumInstances() - 1``."""
    return _integer("RANK", 0)


def getNumInstances() -> int:
    """The number of instances of the run."""
    return _integer("POPDIST_NUM_INSTANCES", 1)


def getNumLocalReplicas() -> int:
    """The replicas this instance runs."""
    return _integer("POPDIST_NUM_LOCAL_REPLICAS", 1)


def getNumTotalReplicas() -> int:
    """The replicas of all instances together."""
    return _integer("POPDIST_NUM_TOTAL_REPLICAS", 1)


def getReplicaIndexOffset() -> int:
    """The global index of this instance's first replica."""
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:
    """The IPUs (devices) each replica uses, as given to ``poprun``."""
    return _integer("POPDIST_NUM_IPUS_PER_REPLICA", 1)


def init() -> None:
    """Make this instance's GPU (``LOCAL_RANK``) the current CUDA device and
    join the run's torch.distributed process group now, for the CPU when
    ``POPTORCH_IPU_MODEL=1`` (training models otherwise join when they are
    compiled). Does nothing outside ``poprun``."""
    if not isPopdistEnvSet() or getNumInstances() == 1:
        return
    from poptorch._impl.devices import select_device
    from poptorch._impl.distributed import process_group
    from poptorch._impl.distributed.environment import ProcessEnvironment
    process_group.join(
        ProcessEnvironment.for_process(getInstanceIndex(), getNumInstances()),
        select_device(
            use_ipu_model=os.environ.get("POPTORCH_IPU_MODEL") == "1"))


def execute_on_instances(instances: Collection[int], fn: Callable[..., Any],
                         *args, **kwargs) -> Optional[Any]:
    """Call ``fn(*args, **kwargs)`` on the instances whose index is in
    ``instances`` and return its result there; other instances skip it and
    get None."""
    if getInstanceIndex() in set(instances):
        return fn(*args, **kwargs)
    return None
