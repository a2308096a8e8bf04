"""popdist, popdist.poptorch.Options and a real 2-instance poprun run."""
import os
import subprocess
import sys

import pytest
import torch

import popdist
import popdist.poptorch
import poptorch
import distributed_program as program

_POPDIST_VARIABLES = ("POPDIST_NUM_INSTANCES", "POPDIST_NUM_TOTAL_REPLICAS",
                      "POPDIST_NUM_LOCAL_REPLICAS",
                      "POPDIST_NUM_IPUS_PER_REPLICA", "RANK")


@pytest.fixture
def no_launcher(monkeypatch):
    for variable in _POPDIST_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def instance_one_of_two(monkeypatch):
    """The environment poprun gives instance 1 of 2 with 6 replicas."""
    for variable, value in [("POPDIST_NUM_INSTANCES", "2"),
                            ("POPDIST_NUM_TOTAL_REPLICAS", "6"),
                            ("POPDIST_NUM_LOCAL_REPLICAS", "3"),
                            ("POPDIST_NUM_IPUS_PER_REPLICA", "1"),
                            ("RANK", "1"), ("WORLD_SIZE", "2")]:
        monkeypatch.setenv(variable, value)


def test_outside_the_launcher_a_program_is_one_instance(no_launcher):
    assert not popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances(),
            popdist.getNumLocalReplicas(), popdist.getNumTotalReplicas(),
            popdist.getReplicaIndexOffset()) == (0, 1, 1, 1, 0)
    popdist.init()
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    assert opts.replication_factor == 1
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == \
        (0, 1)
    assert popdist.execute_on_instances({0}, lambda a, b: a + b, 1, b=2) == 3


def test_an_instance_reads_its_place_from_the_launcher(instance_one_of_two):
    assert popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances(),
            popdist.getNumLocalReplicas(), popdist.getNumTotalReplicas(),
            popdist.getReplicaIndexOffset()) == (1, 2, 3, 6, 3)
    opts = popdist.poptorch.Options(ipus_per_replica=1)
    assert opts.replication_factor == 3
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == \
        (1, 2)
    calls = []
    assert popdist.execute_on_instances({0}, calls.append, "x") is None
    assert popdist.execute_on_instances([1], calls.append, "y") is None
    assert calls == ["y"]


def test_options_must_match_the_launchers_ipus_per_replica(
        instance_one_of_two):
    with pytest.raises(poptorch.Error, match="ipus_per_replica is 2 but "
                       "poprun was started with --ipus-per-replica 1"):
        popdist.poptorch.Options(ipus_per_replica=2)
    with pytest.raises(poptorch.Error, match="must be an int >= 1, got 0"):
        popdist.poptorch.Options(ipus_per_replica=0)


def test_bad_launcher_variables_are_errors(instance_one_of_two, monkeypatch):
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "three")
    with pytest.raises(poptorch.Error, match="POPDIST_NUM_LOCAL_REPLICAS must "
                       "hold an integer, got 'three'"):
        popdist.getNumLocalReplicas()


def _rows(batches):
    """Which dataset samples the batches hold, in order."""
    samples = program.dataset().tensors[0]
    return [int((samples == row).all(1).nonzero()) for x, _ in batches
            for row in x]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["graph", "inductor"])
def test_two_instances_train_like_one_process_with_two_replicas(tmp_path,
                                                               backend):
    """poprun --num-instances 2 --num-replicas 2 with popdist: each instance
    reads its contiguous half of the dataset, and the final weights equal
    one process running 2 replicas on the same micro-batches (process 0's
    initial weights; atol 1e-6). The gradients are all-reduced in two
    buckets (fc2's, then fc1's), the first started during the backward
    pass; Inductor compiles the steps with those collectives too."""
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "2", program.__file__, str(tmp_path), "--popdist",
         "--device-iterations", "2", "--bucket-bytes", "100"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, POPTORCH_BACKEND=backend))
    assert result.returncode == 0, result.stderr
    runs = [torch.load(tmp_path / f"process{i}.pt") for i in range(2)]
    half = program.SAMPLES // 2
    assert _rows(runs[0]["batches"]) == list(range(half))
    assert _rows(runs[1]["batches"]) == list(range(half, 2 * half))
    for name, value in runs[0]["state"].items():
        torch.testing.assert_close(value, runs[1]["state"][name])

    torch.manual_seed(1)
    net = program.Net()
    opts = poptorch.Options().replicationFactor(2).deviceIterations(2)
    model = poptorch.trainingModel(net, opts, program.optimizer(net))
    for (x0, y0), (x1, y1) in zip(runs[0]["batches"], runs[1]["batches"]):
        per_step = [torch.stack([a, b], 1).flatten(0, 2) for a, b in
                    ((x0.unflatten(0, (2, -1)), x1.unflatten(0, (2, -1))),
                     (y0.unflatten(0, (2, -1)), y1.unflatten(0, (2, -1))))]
        model(*per_step)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(runs[0]["state"][name], value, atol=1e-6,
                                   rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (one instance per GPU, NCCL)")
def test_two_instances_on_two_gpus_train_one_model(tmp_path):
    """Each instance uses its own GPU (LOCAL_RANK) and the gradients are
    all-reduced with NCCL: both end with the same weights."""
    result = subprocess.run(
        [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
         "--num-replicas", "4", program.__file__, str(tmp_path),
         "--popdist"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    runs = [torch.load(tmp_path / f"process{i}.pt") for i in range(2)]
    for name, value in runs[0]["state"].items():
        torch.testing.assert_close(value, runs[1]["state"][name])
