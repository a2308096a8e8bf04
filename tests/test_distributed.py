"""Training over several processes: process ids, the rendezvous, start-up
checks and faults. The multi-process tests start real processes (gloo on
the CPU) and are marked slow."""
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import poptorch
from poptorch._impl.distributed import consistency, faults
from poptorch._impl.distributed.environment import (
    ProcessEnvironment, warn_of_other_replica_count)
from poptorch._impl.optimizers.plan import plan_optimizer
from poptorch.run import main as poprun
from poptorch.run import parse as parse_poprun, topology
from conftest import free_port

PROGRAM = os.path.join(os.path.dirname(__file__), "distributed_program.py")


# --- process environment -------------------------------------------------

def test_process_ids_come_from_options_and_the_rendezvous_has_defaults(
        monkeypatch):
    for variable in ("MASTER_ADDR", "MASTER_PORT",
                     "POPTORCH_DISTRIBUTED_TIMEOUT"):
        monkeypatch.delenv(variable, raising=False)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(1, 3)
    environment = ProcessEnvironment.from_options(opts)
    assert (environment.process_id, environment.num_processes) == (1, 3)
    assert (environment.master_addr, environment.master_port,
            environment.timeout) == ("127.0.0.1", 29500, 60.0)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("POPTORCH_DISTRIBUTED_TIMEOUT", "2.5")
    environment = ProcessEnvironment.from_options(opts)
    assert (environment.master_addr, environment.master_port,
            environment.timeout) == ("10.0.0.5", 1234, 2.5)


def test_torchrun_variables_give_the_process_ids(monkeypatch):
    for variable in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    environment = ProcessEnvironment.from_options(poptorch.Options())
    assert (environment.process_id, environment.num_processes) == (2, 4)
    opts = poptorch.Options()
    opts.Distributed.disable()
    assert not ProcessEnvironment.from_options(opts).distributed


@pytest.mark.parametrize("replicas, warned", [(1, True), (2, False),
                                              (4, True)])
def test_a_replica_count_poprun_did_not_ask_for_is_warned(
        monkeypatch, poptorch_log, replicas, warned):
    """poprun --num-instances 2 --num-replicas 4: each instance runs 2
    replicas (plain poptorch.Options() keeps 1, a replicationFactor of
    the total gives 4 per instance)."""
    monkeypatch.setenv("POPDIST_NUM_INSTANCES", "2")
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    warn_of_other_replica_count(replicas)
    messages = [r.getMessage() for r in poptorch_log.records]
    expected = (f"the model's replicationFactor is {replicas}: the run "
                f"trains {2 * replicas} replicas")
    assert any(expected in m for m in messages) == warned


@pytest.mark.parametrize("variable, value, message", [
    ("POPTORCH_DISTRIBUTED_TIMEOUT", "soon",
     "POPTORCH_DISTRIBUTED_TIMEOUT must hold a number of seconds > 0, got "
     "'soon'"),
    ("POPTORCH_DISTRIBUTED_TIMEOUT", "0",
     "POPTORCH_DISTRIBUTED_TIMEOUT must hold a number of seconds > 0"),
    ("MASTER_PORT", "http", "MASTER_PORT must hold a port number")])
def test_bad_rendezvous_variables_are_errors(monkeypatch, variable, value,
                                             message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(poptorch.Error, match=message):
        ProcessEnvironment.from_options(poptorch.Options())


def test_differences_name_each_setting_and_the_processes_values():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    other = poptorch.Options().deviceIterations(2)
    other.Distributed.configureProcessId(1, 2)
    names = {"parameter": ["w"], "input": ["0"]}
    mine = consistency.describe(opts, names, {
        "parameter": [torch.zeros(3, 2)], "input": [torch.zeros(4, 3)]})
    theirs = consistency.describe(other, names, {
        "parameter": [torch.zeros(3, 2)], "input": [torch.zeros(4, 5)]})
    assert consistency.differences([mine, mine]) == []
    assert consistency.differences([mine, theirs]) == [
        "model.input 0: [[4, 3], \"torch.float32\"] on process 0, "
        "[[4, 5], \"torch.float32\"] on process 1",
        "options.device_iterations: 1 on process 0, 2 on process 1"]


def test_differences_name_the_optimizer_settings():
    """Processes updating with different learning rates would drift apart
    without a word."""
    weight = torch.nn.Parameter(torch.zeros(3, 2))
    plans = [plan_optimizer(poptorch.optim.SGD([weight], lr=lr, momentum=0.9),
                            [weight]) for lr in (0.1, 0.2)]
    names = {"parameter": ["w"]}
    mine, theirs = (consistency.describe(poptorch.Options(), names,
                                         {"parameter": [weight]}, plan)
                    for plan in plans)
    assert consistency.differences([mine, mine]) == []
    assert consistency.differences([mine, theirs]) == [
        "optimizer.group 0.lr: 0.1 on process 0, 0.2 on process 1"]


class _GroupedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1, 3, 1))

    def forward(self, x):
        return poptorch.identity_loss(x @ self.weight, "mean")


def test_grouped_weights_are_refused_in_a_distributed_run():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    model = poptorch.trainingModel(_GroupedModel(), opts)
    model.weight.replicaGrouping(
        poptorch.CommGroupType.NoGrouping, 0,
        poptorch.VariableRetrievalMode.OnePerGroup)
    with pytest.raises(poptorch.Error, match="replicaGrouping is not "
                       "supported in a distributed run"):
        model(torch.ones(2, 3))


# --- launcher arguments -----------------------------------------------------

@pytest.mark.parametrize("arguments, message", [
    (["--num-instances", "2", "--num-replicas", "3", "x.py"],
     r"--num-replicas \(3\) must be a multiple of --num-instances \(2\)"),
    (["--num-instances", "4", "--num-replicas", "2", "--ipus-per-replica",
      "3", "x.py"], r"--ipus-per-replica \(3\) must split evenly"),
    (["--num-instances", "2", "--num-replicas", "2"], "no program given"),
    (["--num-instances", "3", "--num-replicas", "3", "--num-hosts", "2",
      "x.py"], r"--num-instances \(3\) must be a multiple of --num-hosts"),
    (["--num-instances", "2", "--num-replicas", "2", "--num-hosts", "2",
      "--host-rank", "2", "x.py"], "--host-rank must be between 0 and 1")])
def test_inconsistent_launcher_arguments(capsys, arguments, message):
    assert poprun(arguments) == 2
    assert re.search(message, capsys.readouterr().err)


def test_popruns_command_lines_parse_with_options_without_effect():
    """A PopRun command line as IPU-POD scripts write it: partition and MPI
    options are taken off (reported), the program keeps its arguments."""
    arguments, ignored = parse_poprun([
        "-vv", "--vipu-partition=p1", "--vipu-server-host", "10.1.2.3",
        "--mpi-global-args=--tag-output --allow-run-as-root",
        "--mpi-local-args", "-x OPAL_PREFIX", "--numa-aware",
        "--num-instances", "2", "--num-replicas", "4",
        "--only-output-from-instance", "0", "--executable-cache-path",
        "/tmp/cache", "--print-topology", "--reset-partition=no",
        "python", "train.py", "--numa-aware", "--lr", "0.1"])
    assert ignored == ["--vipu-partition", "--vipu-server-host",
                       "--mpi-global-args", "--mpi-local-args",
                       "--numa-aware", "--reset-partition"]
    assert arguments.program == ["python", "train.py", "--numa-aware",
                                 "--lr", "0.1"]
    assert (arguments.num_instances, arguments.num_replicas) == (2, 4)
    assert arguments.verbose == 2 and arguments.print_topology is True
    assert arguments.only_output_from_instance == 0
    assert arguments.executable_cache_path == "/tmp/cache"


@pytest.mark.parametrize("words, shown", [
    (["--print-topology", "yes"], True), (["--print-topology", "no"], False),
    (["--print-topology", "Off"], False), (["--print-topology=no"], False),
    (["--print-topology"], True)])
def test_yes_no_options_take_a_yes_no_word_after_them(words, shown):
    """``--print-topology yes`` is the option's value, not the program (which
    was Unix ``yes``, printing forever in every instance); partition
    switches without effect take such a word too."""
    arguments, ignored = parse_poprun([
        "--num-instances", "2", "--num-replicas", "2", *words,
        "--reset-partition", "no", "--numa-aware", "yes", "--update-partition",
        "python", "train.py"])
    assert arguments.print_topology is shown
    assert arguments.program == ["python", "train.py"]
    assert ignored == ["--reset-partition", "--numa-aware",
                       "--update-partition"]


def test_topology_lists_each_instances_replicas_or_stages():
    arguments, _ = parse_poprun(["--num-instances", "4", "--num-replicas",
                                 "8", "--num-hosts", "2", "x.py"])
    assert topology(arguments) == [
        "instance 0: host 0, replicas 0-1", "instance 1: host 0, replicas 2-3",
        "instance 2: host 1, replicas 4-5", "instance 3: host 1, replicas 6-7"]
    arguments, _ = parse_poprun(["--num-instances", "4", "--num-replicas",
                                 "2", "--ipus-per-replica", "4", "x.py"])
    assert topology(arguments) == [
        "instance 0: host 0, replica 0, IPUs 0-1",
        "instance 1: host 0, replica 0, IPUs 2-3",
        "instance 2: host 0, replica 1, IPUs 0-1",
        "instance 3: host 0, replica 1, IPUs 2-3"]


@pytest.mark.parametrize("arguments, message", [
    (["--host", "pod1,pod2"], "--host names 2 hosts .pod1, pod2., but "
                              "poprun only starts the instances of the host "
                              "it runs on"),
    (["--only-output-from-instance", "2"],
     "--only-output-from-instance must be between 0 and 1, got 2"),
])
def test_popruns_options_with_an_effect_are_checked(capsys, arguments,
                                                    message):
    assert poprun(["--num-instances", "2", "--num-replicas", "2",
                   *arguments, "x.py"]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_launcher_shows_one_instances_output_and_sets_the_cache(tmp_path):
    program = tmp_path / "report.py"
    program.write_text("import os\nprint('instance', os.environ['RANK'], "
                       "os.environ['POPTORCH_CACHE_DIR'])\n")
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "2", "--vipu-partition=pod16",
         "--only-output-from-instance", "1", "--executable-cache-path",
         str(tmp_path / "cache"), "--print-topology", str(program)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"instance 1 {tmp_path / 'cache'}" in result.stdout
    assert "instance 0 " not in result.stdout
    assert "instance 0: host 0, replica 0" in result.stdout
    assert "--vipu-partition has no effect here" in result.stderr


@pytest.mark.parametrize("separator", [[], ["--"]])
def test_the_programs_arguments_reach_it_unchanged(separator):
    """Even those that read as an abbreviated poprun option."""
    program = ["train.py", "--n", "100", "--master", "a", "--num", "2"]
    arguments, _ = parse_poprun(["--num-instances", "2", "--num-replicas",
                                 "2", *separator, *program])
    assert arguments.program == program
    assert (arguments.num_instances, arguments.num_replicas) == (2, 2)


def test_launcher_rejects_non_positive_counts(capsys):
    with pytest.raises(SystemExit) as stopped:
        poprun(["--num-instances", "0", "--num-replicas", "2", "x.py"])
    assert stopped.value.code == 2
    assert "must be an integer >= 1, got '0'" in capsys.readouterr().err


# --- several processes --------------------------------------------------


def _start_pair(output, *extra, timeout="60", per_process=None):
    """Start processes 0 and 1 of a 2-process run (torchrun variables,
    without a launcher); ``per_process[i]`` adds arguments to process i."""
    port = str(free_port())
    processes = []
    for rank in range(2):
        environment = dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS="1",
                           POPTORCH_DISTRIBUTED_TIMEOUT=timeout)
        arguments = [sys.executable, PROGRAM, str(output), *extra,
                     *((per_process or {}).get(rank, []))]
        processes.append(subprocess.Popen(
            arguments, env=environment, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    return processes


def _finish(processes, limit=120):
    results = []
    for process in processes:
        _, err = process.communicate(timeout=limit)
        results.append((process.returncode, err))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("how, reason", [
    ("kill", "process 1 died"),
    ("raise", "process 1 raised ValueError: process 1 gives up")])
def test_the_others_stop_naming_a_failed_process(tmp_path, how, reason):
    start = time.monotonic()
    processes = _start_pair(tmp_path, "--fail", how, "--fail-step", "2",
                            timeout="30")
    (code, err), _ = _finish(processes)
    assert code != 0
    assert "poptorch.errors.Error: Distributed run: " + reason in err
    assert "Process 0 of 2 stops" in err
    assert time.monotonic() - start < 60


def _monitor_of_process_0(monkeypatch, peer_pid):
    """Process 0's monitor of a two-process run whose process 1 (``peer_pid``
    on this host) has started no collective operation."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    store = torch.distributed.HashStore()
    store.set("host/1", f"{socket.gethostname()} {peer_pid}")
    monitor = faults.FaultMonitor(store, 0, 2, timeout=30.0,
                                  hosts_store=False)
    monitor._stopped.set()                   # no heartbeat thread needed
    return monitor, monitor.start()


def test_a_peer_killed_before_a_collective_is_named_not_a_timeout(
        monkeypatch):
    """The backend reports the lost connection a moment before the peer's
    end can be seen; it had not started the operation, but it died."""
    peer = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(60)"])
    monitor, sequence = _monitor_of_process_0(monkeypatch, peer.pid)
    killer = threading.Timer(0.5, lambda: (peer.kill(), peer.wait()))
    killer.start()
    error = monitor._explain("the gradient all-reduce",
                             RuntimeError("Connection reset by peer"),
                             sequence, started=time.monotonic())
    killer.join()
    assert "process 1 died" in str(error)
    assert "timed out" not in str(error)


def test_a_peer_that_never_starts_a_collective_is_named_at_the_timeout(
        monkeypatch):
    monitor, sequence = _monitor_of_process_0(monkeypatch, os.getpid())
    error = monitor._explain("the gradient all-reduce",
                             RuntimeError("Timed out waiting"), sequence,
                             started=time.monotonic() - 30.0)
    assert ("the gradient all-reduce timed out after 30 s on process 0: "
            "process(es) 1 did not start it") in str(error)


@pytest.mark.slow
def test_a_process_that_never_arrives_times_out_naming_it(tmp_path):
    processes = _start_pair(tmp_path, "--fail", "hang", "--fail-step", "1",
                            timeout="4")
    (code, err), = _finish(processes[:1])
    processes[1].kill()
    processes[1].communicate()
    assert code != 0
    assert ("the gradient all-reduce timed out after 4 s on process 0: "
            "process(es) 1 did not start it") in err


@pytest.mark.slow
def test_different_options_are_an_error_on_every_process(tmp_path):
    processes = _start_pair(tmp_path, per_process={
        1: ["--device-iterations", "2"]})
    for code, err in _finish(processes):
        assert code != 0
        assert "the processes compile different models or options" in err
        assert ("options.device_iterations: 1 on process 0, 2 on process 1"
                in err)


@pytest.mark.slow
def test_launcher_exits_non_zero_when_an_instance_dies(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "2", "--timeout", "30", PROGRAM, str(tmp_path),
         "--popdist", "--fail", "kill", "--fail-step", "2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "poprun: instance 1 failed first (killed by SIGKILL)" in \
        result.stderr
    assert time.monotonic() - start < 90


class _Noise(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


def test_each_process_draws_its_own_random_numbers():
    """Process i of n uses randomSeed + i: process 1 of 2 with seed 5 draws
    what a lone process with seed 6 draws (inference models run without
    joining the run)."""
    x = torch.zeros(4, 3)
    opts = poptorch.Options().randomSeed(5)
    opts.Distributed.configureProcessId(1, 2)
    second = poptorch.inferenceModel(_Noise(), opts)(x)
    alone = poptorch.inferenceModel(_Noise(), poptorch.Options().randomSeed(6))
    first = poptorch.Options().randomSeed(5)
    first.Distributed.configureProcessId(0, 2)
    torch.testing.assert_close(second, alone(x))
    assert not torch.equal(second, poptorch.inferenceModel(_Noise(), first)(x))
