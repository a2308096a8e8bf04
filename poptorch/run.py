"""``poprun``: start the instances (processes) of a distributed PopTorch
program.

    poprun --num-instances 2 --num-replicas 4 python train.py --epochs 3
    python -m poptorch.run --num-instances 2 --num-replicas 4 train.py

starts 2 processes of ``train.py`` (a program path ending in ``.py`` runs
with this Python), each with 4 / 2 = 2 replicas, through
torch.distributed.run's elastic agent. Each process gets torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and PopDist's (``POPDIST_NUM_INSTANCES``,
``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_NUM_LOCAL_REPLICAS``,
``POPDIST_NUM_IPUS_PER_REPLICA``), which ``popdist`` and
``popdist.poptorch.Options`` read. ``OMP_NUM_THREADS`` defaults to 1 when
one host runs several instances, as with torchrun.

With more instances than replicas, each replica's ``--ipus-per-replica``
IPUs spread over ``num-instances / num-replicas`` consecutive instances:

    poprun --num-instances 2 --num-replicas 1 --ipus-per-replica 2 train.py

runs a model of two pipeline stages as two processes, one stage each
(``_impl/distributed/pipeline_processes.py``); every instance has one local
replica.

If an instance fails, the agent stops the others and ``poprun`` exits
with a non-zero status naming the failed instance(s).

Several hosts: run ``poprun`` on every host with the same
``--num-instances``/``--num-replicas``, ``--num-hosts H``, this host's
``--host-rank`` (0 to H-1) and ``--master-addr``/``--master-port`` of host
0; each host starts ``num-instances / H`` instances.
"""
import argparse
import os
import signal
import sys
import uuid
from typing import List, Optional, Sequence

from .errors import Error

_PROGRAM_HELP = ("the program and its arguments; a path ending in .py runs "
                 "with this Python")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got "
                                         f"{text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, "
                                         f"got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="poprun", description="Start the instances of a distributed "
        "PopTorch program (torch.distributed elastic agent).")
    result.add_argument("--num-instances", type=_positive, required=True,
                        help="number of processes in total")
    result.add_argument("--num-replicas", type=_positive, required=True,
                        help="number of replicas in total, split evenly "
                        "between the instances")
    result.add_argument("--ipus-per-replica", type=_positive, default=1,
                        help="IPUs (devices) each replica uses (default 1)")
    result.add_argument("--num-hosts", type=_positive, default=1,
                        help="hosts the instances are spread over "
                        "(default 1)")
    result.add_argument("--host-rank", type=int, default=0,
                        help="this host's index, 0 to num-hosts - 1")
    result.add_argument("--master-addr", default="127.0.0.1",
                        help="address of host 0 (several hosts)")
    result.add_argument("--master-port", type=_positive, default=29400,
                        help="rendezvous port on host 0 (several hosts)")
    result.add_argument("--timeout", type=_seconds, default=None,
                        help="seconds an instance waits for the others "
                        "before failing (POPTORCH_DISTRIBUTED_TIMEOUT, "
                        "default 60)")
    result.add_argument("program", nargs=argparse.REMAINDER,
                        help=_PROGRAM_HELP)
    return result


def check_arguments(arguments: argparse.Namespace) -> None:
    """Raise ``poptorch.Error`` for an inconsistent command line."""
    if not arguments.program:
        raise Error(f"poprun: no program given ({_PROGRAM_HELP})")
    if arguments.num_replicas % arguments.num_instances and \
            not _replicas_span_instances(arguments):
        raise Error(f"poprun: --num-replicas ({arguments.num_replicas}) must "
                    "be a multiple of --num-instances "
                    f"({arguments.num_instances}), so that each instance "
                    "runs the same number of replicas, or each replica's "
                    f"--ipus-per-replica ({arguments.ipus_per_replica}) "
                    "must split evenly over num-instances / num-replicas "
                    "instances (one pipeline stage per instance)")
    if arguments.num_instances % arguments.num_hosts:
        raise Error(f"poprun: --num-instances ({arguments.num_instances}) "
                    f"must be a multiple of --num-hosts "
                    f"({arguments.num_hosts})")
    if not 0 <= arguments.host_rank < arguments.num_hosts:
        raise Error(f"poprun: --host-rank must be between 0 and "
                    f"{arguments.num_hosts - 1}, got {arguments.host_rank}")


def _replicas_span_instances(arguments: argparse.Namespace) -> bool:
    """Whether each replica spreads its IPUs (pipeline stages) evenly over
    several instances."""
    if arguments.num_instances % arguments.num_replicas:
        return False
    per_replica = arguments.num_instances // arguments.num_replicas
    return arguments.ipus_per_replica % per_replica == 0


def _instance_environment(arguments: argparse.Namespace,
                          per_host: int) -> None:
    """What every instance finds in its environment."""
    os.environ["POPDIST_NUM_INSTANCES"] = str(arguments.num_instances)
    os.environ["POPDIST_NUM_TOTAL_REPLICAS"] = str(arguments.num_replicas)
    os.environ["POPDIST_NUM_LOCAL_REPLICAS"] = str(
        max(1, arguments.num_replicas // arguments.num_instances))
    os.environ["POPDIST_NUM_IPUS_PER_REPLICA"] = str(
        arguments.ipus_per_replica)
    if arguments.timeout is not None:
        os.environ["POPTORCH_DISTRIBUTED_TIMEOUT"] = str(arguments.timeout)
    if per_host > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def _launch_config(arguments: argparse.Namespace, per_host: int):
    from torch.distributed.launcher.api import LaunchConfig
    if arguments.num_hosts == 1:
        backend, endpoint, configs = "c10d", "localhost:0", {}
    else:
        backend = "static"
        endpoint = f"{arguments.master_addr}:{arguments.master_port}"
        configs = {"rank": arguments.host_rank}
    return LaunchConfig(
        min_nodes=arguments.num_hosts, max_nodes=arguments.num_hosts,
        nproc_per_node=per_host, run_id=f"poprun-{uuid.uuid4().hex[:12]}",
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=configs,
        max_restarts=0, monitor_interval=0.1)


def _command(program: List[str]) -> List[str]:
    if program[0].endswith(".py"):
        return [sys.executable, *program]
    return program


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``poprun``; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import \
        ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    arguments = parser().parse_args(argv)
    try:
        check_arguments(arguments)
    except Error as error:
        print(error, file=sys.stderr)
        return 2
    per_host = arguments.num_instances // arguments.num_hosts
    _instance_environment(arguments, per_host)
    command = _command(arguments.program)
    try:
        elastic_launch(_launch_config(arguments, per_host),
                       command[0])(*command[1:])
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        print(f"poprun: instance {rank} failed first "
              f"({_exit_description(failure.exitcode)}); the other "
              "instances were stopped", file=sys.stderr)
        return 1
    return 0


def _exit_description(exit_code: int) -> str:
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit status {exit_code}"


def console_main() -> None:
    """Entry point of the ``poprun`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
