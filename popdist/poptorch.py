"""``popdist.poptorch.Options``: PopTorch options for this instance."""
from typing import Optional

import poptorch as _poptorch
from poptorch.errors import Error

import popdist


def Options(ipus_per_replica: Optional[int] = None) -> _poptorch.Options:
    """A ``poptorch.Options`` pre-set for this instance of a ``poprun``
    run: ``replicationFactor`` is this instance's share of the replicas and
    ``Distributed.configureProcessId`` its index and the instance count.
    ``ipus_per_replica``, when given, must match ``poprun
    --ipus-per-replica``."""
    if ipus_per_replica is not None:
        expected = popdist.getNumIpusPerReplica()
        if not isinstance(ipus_per_replica, int) or \
                isinstance(ipus_per_replica, bool) or ipus_per_replica < 1:
            raise Error("popdist.poptorch.Options ipus_per_replica must be an "
                        f"int >= 1, got {ipus_per_replica!r}")
        if popdist.isPopdistEnvSet() and ipus_per_replica != expected:
            raise Error(f"popdist.poptorch.Options: ipus_per_replica is "
                        f"{ipus_per_replica} but poprun was started with "
                        f"--ipus-per-replica {expected}")
    options = _poptorch.Options()
    options.replicationFactor(popdist.getNumLocalReplicas())
    options.Distributed.configureProcessId(popdist.getInstanceIndex(),
                                           popdist.getNumInstances())
    return options
