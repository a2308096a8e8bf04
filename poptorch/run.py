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
``popdist.poptorch.Options`` read; a training model whose
``replicationFactor`` is not the instance's share of ``--num-replicas``
(plain ``poptorch.Options()`` keeps 1) is warned of once.
``OMP_NUM_THREADS`` defaults to 1 when one host runs several instances, as
with torchrun.

With more instances than replicas, each replica's ``--ipus-per-replica``
IPUs spread over ``num-instances / num-replicas`` consecutive instances:

    poprun --num-instances 2 --num-replicas 1 --ipus-per-replica 2 train.py

runs a model of two pipeline stages as two processes, one stage each
(``_impl/distributed/pipeline_processes.py``); every instance has one local
replica.

If an instance fails, the agent stops the others and ``poprun`` exits
with a non-zero status naming the failed instance(s).

PopRun's other options: ``--only-output-from-instance N`` sends the other
instances' output to log files (their directory is printed);
``--executable-cache-path PATH`` sets ``POPTORCH_CACHE_DIR`` for the
instances; ``--print-topology`` prints which instance runs which replicas;
``-v`` / ``--verbose`` prints the launch plan; ``--host`` may only name one
host (see below). Options about IPU-POD partitions (``--vipu-*``,
``--reset-partition``...), MPI (``--mpi-global-args``...) and NUMA placement
are accepted and reported as having no effect
(``_impl/distributed/poprun_options.py``).

Several hosts: run ``poprun`` on every host with the same
``--num-instances``/``--num-replicas``, ``--num-hosts H``, this host's
``--host-rank`` (0 to H-1) and ``--master-addr``/``--master-port`` of host
0; each host starts ``num-instances / H`` instances. Unlike PopRun,
``poprun`` cannot start instances on other hosts itself (it has no MPI), so
``--host`` with several hosts is an error saying so.
"""
import argparse
import os
import signal
import sys
import tempfile
import uuid
from typing import List, Optional, Sequence, Tuple

from .errors import Error
from ._impl.distributed import poprun_options

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
    result.add_argument("--only-output-from-instance", type=int,
                        default=None, metavar="N",
                        help="show only instance N's output; the others' "
                        "goes to log files")
    result.add_argument("--executable-cache-path", default=None,
                        help="executable cache directory of the instances "
                        "(POPTORCH_CACHE_DIR)")
    result.add_argument("--print-topology", type=_yes_no, default=False,
                        help="print which instance runs which replicas")
    result.add_argument("--host", "-H", default=None,
                        help="the host to run on (one only: poprun starts "
                        "the instances of its own host)")
    result.add_argument("-v", "--verbose", action="count", default=0,
                        help="print the launch plan")
    result.add_argument("program", nargs=argparse.REMAINDER,
                        help=_PROGRAM_HELP)
    return result


def _yes_no(text: str) -> bool:
    value = text.lower()
    if value in poprun_options.YES_WORDS:
        return True
    if value in poprun_options.NO_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"must be yes or no, got {text!r}")


#: poprun's yes/no options, which may be given without a value.
_SWITCHES = ("--print-topology",)


def parse(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """The parsed command line, and the PopRun options it gave that have
    no effect here."""
    command = parser()
    takes_value = [option for action in command._actions
                   if action.nargs is None and action.option_strings
                   for option in action.option_strings
                   if option not in _SWITCHES]
    options, program, ignored = poprun_options.split_ignored(
        argv, takes_value, _SWITCHES)
    arguments = command.parse_args(options)
    # The program's own arguments are its own, even where they read as an
    # abbreviation of a poprun option (--n, --master).
    arguments.program = program[1:] if program[:1] == ["--"] else program
    return arguments, ignored


def check_arguments(arguments: argparse.Namespace) -> None:
    """Raise ``poptorch.Error`` for an inconsistent command line."""
    if not arguments.program:
        raise Error(f"poprun: no program given ({_PROGRAM_HELP})")
    hosts = sorted(set(filter(None, (arguments.host or "").split(","))))
    if len(hosts) > 1:
        raise Error(f"poprun: --host names {len(hosts)} hosts "
                    f"({', '.join(hosts)}), but poprun only starts the "
                    "instances of the host it runs on: run it on each host "
                    "with --num-hosts, --host-rank and --master-addr")
    chosen = arguments.only_output_from_instance
    if chosen is not None and not 0 <= chosen < arguments.num_instances:
        raise Error(f"poprun: --only-output-from-instance must be between 0 "
                    f"and {arguments.num_instances - 1}, got {chosen}")
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
    if arguments.executable_cache_path is not None:
        os.environ["POPTORCH_CACHE_DIR"] = arguments.executable_cache_path
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
        max_restarts=0, monitor_interval=0.1,
        logs_specs=_logs_specs(arguments, per_host))


def _logs_specs(arguments: argparse.Namespace, per_host: int):
    """With ``--only-output-from-instance``, the other local instances'
    output goes to log files."""
    from torch.distributed.elastic.multiprocessing import (DefaultLogsSpecs,
                                                           Std)
    chosen = arguments.only_output_from_instance
    if chosen is None:
        return None
    first = arguments.host_rank * per_host
    quiet = {local: Std.ALL for local in range(per_host)
             if first + local != chosen}
    log_dir = tempfile.mkdtemp(prefix="poprun-logs-")
    print(f"poprun: output of instances other than {chosen} goes to "
          f"{log_dir}", file=sys.stderr)
    return DefaultLogsSpecs(log_dir=log_dir, redirects=quiet)


def topology(arguments: argparse.Namespace) -> List[str]:
    """Which instance runs which replicas (or pipeline stages), a line
    each."""
    instances, replicas = arguments.num_instances, arguments.num_replicas
    per_host = instances // arguments.num_hosts
    lines = []
    for instance in range(instances):
        host = instance // per_host
        if replicas >= instances:
            local = replicas // instances
            first = instance * local
            work = (f"replicas {first}-{first + local - 1}" if local > 1
                    else f"replica {first}")
        else:
            span = instances // replicas
            work = (f"replica {instance // span}, IPUs "
                    f"{instance % span * arguments.ipus_per_replica // span}"
                    f"-{(instance % span + 1) * arguments.ipus_per_replica // span - 1}")
        lines.append(f"instance {instance}: host {host}, {work}")
    return lines


def _command(program: List[str]) -> List[str]:
    if program[0].endswith(".py"):
        return [sys.executable, *program]
    return program


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``poprun``; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import \
        ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    arguments, ignored = parse(sys.argv[1:] if argv is None else argv)
    try:
        check_arguments(arguments)
    except Error as error:
        print(error, file=sys.stderr)
        return 2
    if ignored:
        print(f"poprun: {', '.join(ignored)} ha{'s' if len(ignored) == 1 else 've'} "
              "no effect here: there are no IPU-POD partitions, MPI or "
              "NUMA placement to configure", file=sys.stderr)
    per_host = arguments.num_instances // arguments.num_hosts
    if arguments.print_topology:
        print("\n".join(topology(arguments)))
    _instance_environment(arguments, per_host)
    command = _command(arguments.program)
    if arguments.verbose:
        print(f"poprun: starting {per_host} of {arguments.num_instances} "
              f"instance(s) on host {arguments.host_rank} of "
              f"{arguments.num_hosts}: {' '.join(command)}", file=sys.stderr)
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
