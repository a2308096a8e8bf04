"""Pipelines over several processes, one stage per process
(``_impl/distributed/pipeline_processes.py``): started by ``poprun`` or with
torchrun's variables, the processes train one model like plain PyTorch on
one process, and every process returns the outputs and holds the trained
weights. The tests start real processes (gloo on the CPU), so they are
marked slow."""
import os
import subprocess
import sys

import pytest
import torch

import pipeline_program as program
from conftest import free_port

PROGRAM = os.path.join(os.path.dirname(__file__), "pipeline_program.py")
TOLERANCE = dict(atol=1e-5, rtol=1e-4)   # sums over pipelines reorder



def _run(output, processes: int, *extra):
    """Start ``processes`` processes with torchrun's variables; return
    their (exit code, stderr)."""
    port = str(free_port())
    started = []
    for rank in range(processes):
        environment = dict(os.environ, RANK=str(rank),
                           WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, OMP_NUM_THREADS="1",
                           POPTORCH_DISTRIBUTED_TIMEOUT="60")
        started.append(subprocess.Popen(
            [sys.executable, PROGRAM, str(output), *extra], env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for process in started:
        _, err = process.communicate(timeout=180)
        results.append((process.returncode, err))
    return results


def _plain_training(stages: int, pipelines: int, calls: int = 2):
    """The same training in plain PyTorch: process 0's initial weights,
    each optimizer step averaging the gradients of every pipeline's G
    micro-batches; the outputs and losses of each pipeline."""
    torch.manual_seed(1)
    net = program.Chain(stages, annotate=False)
    sgd = program.optimizer(net, poptorch_optimizer=False)
    accumulation = program.accumulation(stages)
    batches = [program.data(stages, calls, p) for p in range(pipelines)]
    outputs = [[] for _ in range(pipelines)]
    losses = [[] for _ in range(pipelines)]
    for call in range(calls):
        per_call = [([], []) for _ in range(pipelines)]
        for iteration in range(program.ITERATIONS):
            sgd.zero_grad()
            for pipeline in range(pipelines):
                x, y = batches[pipeline][call]
                for step in range(accumulation):
                    first = (iteration * accumulation + step) * program.BATCH
                    rows = slice(first, first + program.BATCH)
                    out, loss = net(x[rows], y[rows])
                    (loss / (accumulation * pipelines)).backward()
                    per_call[pipeline][0].append(out.detach())
                    per_call[pipeline][1].append(loss.detach())
            sgd.step()
        for pipeline, (outs, call_losses) in enumerate(per_call):
            outputs[pipeline].append(torch.stack(outs))
            losses[pipeline].append(torch.stack(call_losses))
    momentum = [sgd.state[p]["momentum_buffer"] for p in net.parameters()]
    return net.state_dict(), momentum, outputs, losses


def _check_processes(output, stages: int, pipelines: int) -> None:
    """Every process returned its pipeline's outputs and holds the trained
    weights and optimizer state; with several pipelines, each keeps its own
    BatchNorm statistics (``broadcastBuffers(False)``), the same in all its
    processes."""
    weights, momentum, outputs, losses = _plain_training(stages, pipelines)
    parameters = {name for name, _ in
                  program.Chain(stages).named_parameters()}
    for process in range(stages * pipelines):
        saved = torch.load(os.path.join(output, f"process{process}.pt"))
        pipeline = process // stages
        for got, expected in zip(saved["losses"], losses[pipeline]):
            torch.testing.assert_close(got.reshape(expected.shape),
                                       expected, **TOLERANCE)
        for got, expected in zip(saved["outputs"], outputs[pipeline]):
            torch.testing.assert_close(got.reshape(expected.shape),
                                       expected, **TOLERANCE)
        for name, value in weights.items():
            if pipelines == 1 or name in parameters:
                torch.testing.assert_close(saved["weights"][name], value,
                                           **TOLERANCE)
        first = torch.load(os.path.join(output, f"process{pipeline * stages}"
                                                ".pt"))
        for name, value in first["weights"].items():
            torch.testing.assert_close(saved["weights"][name], value)
        assert len(saved["momentum"]) == len(momentum)
        for got, expected in zip(saved["momentum"], momentum):
            torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.slow
def test_two_processes_run_the_two_stages_of_one_pipeline(tmp_path):
    for code, err in _run(tmp_path, 2):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=1)


@pytest.mark.slow
def test_four_processes_run_two_pipelines_of_two_stages(tmp_path):
    for code, err in _run(tmp_path, 4):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=2)


@pytest.mark.slow
def test_three_processes_run_a_three_stage_pipeline(tmp_path):
    for code, err in _run(tmp_path, 3, "--stages", "3", "--calls", "1"):
        assert code == 0, err
    weights, _, _, losses = _plain_training(3, 1, calls=1)
    saved = torch.load(os.path.join(tmp_path, "process1.pt"))
    torch.testing.assert_close(saved["losses"][0], losses[0][0],
                               **TOLERANCE)
    for name, value in weights.items():
        torch.testing.assert_close(saved["weights"][name], value, **TOLERANCE)


@pytest.mark.slow
def test_processes_of_a_pipeline_with_different_inputs_all_fail(tmp_path):
    for code, err in _run(tmp_path, 2, "--different-inputs"):
        assert code != 0
        assert "were called with different inputs" in err


@pytest.mark.slow
def test_poprun_starts_one_process_per_stage(tmp_path):
    command = [sys.executable, "-m", "poptorch.run", "--num-instances", "2",
               "--num-replicas", "1", "--ipus-per-replica", "2", PROGRAM,
               str(tmp_path)]
    environment = dict(os.environ, POPTORCH_DISTRIBUTED_TIMEOUT="60")
    finished = subprocess.run(command, capture_output=True, text=True,
                              timeout=240, env=environment)
    assert finished.returncode == 0, finished.stderr
    _check_processes(tmp_path, stages=2, pipelines=1)


@pytest.mark.slow
def test_poprun_pipelines_read_their_part_of_a_dataloader(tmp_path):
    """Two replicas of a 2-stage pipeline over 4 instances: the
    poptorch.DataLoader gives both processes of a replica its part."""
    command = [sys.executable, "-m", "poptorch.run", "--num-instances", "4",
               "--num-replicas", "2", "--ipus-per-replica", "2", PROGRAM,
               str(tmp_path), "--dataloader"]
    environment = dict(os.environ, POPTORCH_DISTRIBUTED_TIMEOUT="60")
    finished = subprocess.run(command, capture_output=True, text=True,
                              timeout=240, env=environment)
    assert finished.returncode == 0, finished.stderr
    _check_processes(tmp_path, stages=2, pipelines=2)
