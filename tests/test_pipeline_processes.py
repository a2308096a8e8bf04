"""Pipelines over several processes, one stage per process
(``_impl/distributed/pipeline_processes.py``): started by ``poprun`` or with
torchrun's variables, the processes train one model like plain PyTorch on
one process, and every process returns the outputs and holds the trained
weights. The tests start real processes (gloo on the CPU), so they are
marked slow."""
import math
import os
import subprocess
import sys
import time
from typing import Optional

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


def _plain_training(stages: int, pipelines: int, calls: int = 2,
                    tied: bool = False, clip: Optional[float] = None,
                    loss_scale: Optional[float] = None, scales=None,
                    momentum: float = 0.9):
    """The same training in plain PyTorch: process 0's initial weights,
    each optimizer step averaging the gradients of every pipeline's G
    micro-batches (clipped to ``clip``; with automatic loss scaling by
    ``torch.amp.GradScaler`` from ``loss_scale``, whose scale before each
    step and at the end goes to ``scales``); the outputs and losses of each
    pipeline, and its first linear layer's outputs in the last call."""
    torch.manual_seed(1)
    net = program.Chain(stages, annotate=False, tied=tied,
                        loud=loss_scale is not None)
    sgd = program.optimizer(net, poptorch_optimizer=False,
                            momentum=momentum)
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale or 1.0,
                                  enabled=loss_scale is not None)
    accumulation = program.accumulation(stages)
    batches = [program.data(stages, calls, p) for p in range(pipelines)]
    outputs = [[] for _ in range(pipelines)]
    losses = [[] for _ in range(pipelines)]
    first_layer = []
    net.layers[0][0].register_forward_hook(
        lambda _, args, output: first_layer.append(output.detach()))
    for call in range(calls):
        first_layer.clear()
        per_call = [([], []) for _ in range(pipelines)]
        for iteration in range(program.ITERATIONS):
            sgd.zero_grad()
            for pipeline in range(pipelines):
                x, y = batches[pipeline][call]
                for step in range(accumulation):
                    first = (iteration * accumulation + step) * program.BATCH
                    rows = slice(first, first + program.BATCH)
                    out, loss = net(x[rows], y[rows])
                    scaler.scale(loss / (accumulation * pipelines)).backward()
                    per_call[pipeline][0].append(out.detach())
                    per_call[pipeline][1].append(loss.detach())
            if clip is not None:
                scaler.unscale_(sgd)
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            if scales is not None:
                scales.append(scaler.get_scale())
            scaler.step(sgd)
            scaler.update()
        for pipeline, (outs, call_losses) in enumerate(per_call):
            outputs[pipeline].append(torch.stack(outs))
            losses[pipeline].append(torch.stack(call_losses))
    if scales is not None:
        scales.append(scaler.get_scale())
    momentum = [sgd.state[p]["momentum_buffer"] for p in net.parameters()
                if p in sgd.state]
    per_step = pipelines * accumulation
    anchored = [torch.cat([first_layer[index] for index in
                           range(len(first_layer))
                           if index % per_step // accumulation == pipeline])
                for pipeline in range(pipelines)]
    return net.state_dict(), momentum, outputs, losses, anchored


def _check_processes(output, stages: int, pipelines: int,
                     per_pipeline: Optional[int] = None, **settings) -> None:
    """Every process returned its pipeline's outputs and holds the trained
    weights and optimizer state (of the training ``settings``); with several
    pipelines, each keeps its own BatchNorm statistics
    (``broadcastBuffers(False)``), the same in all its processes. A pipeline
    has ``per_pipeline`` processes (default: one per stage)."""
    per_pipeline = per_pipeline or stages
    weights, momentum, outputs, losses, anchored = _plain_training(
        stages, pipelines, **settings)
    parameters = {name for name, _ in program.Chain(
        stages, loud=settings.get("loss_scale") is not None
    ).named_parameters()}
    for process in range(per_pipeline * pipelines):
        saved = torch.load(os.path.join(output, f"process{process}.pt"))
        pipeline = process // per_pipeline
        for got, expected in zip(saved["losses"], losses[pipeline]):
            torch.testing.assert_close(got.reshape(expected.shape),
                                       expected, **TOLERANCE)
        for got, expected in zip(saved["outputs"], outputs[pipeline]):
            torch.testing.assert_close(got.reshape(expected.shape),
                                       expected, **TOLERANCE)
        torch.testing.assert_close(saved["anchored"], anchored[pipeline],
                                   **TOLERANCE)
        for name, value in weights.items():
            if pipelines == 1 or name in parameters:
                torch.testing.assert_close(saved["weights"][name], value,
                                           **TOLERANCE)
        first = torch.load(os.path.join(
            output, f"process{pipeline * per_pipeline}.pt"))
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
def test_an_optimizer_without_state_trains_the_pipeline(tmp_path):
    """Plain SGD keeps no optimizer state (the stages' share of it was
    looked up for every weight, a KeyError)."""
    for code, err in _run(tmp_path, 2, "--momentum", "0"):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=1, momentum=0.0)


@pytest.mark.slow
def test_four_processes_run_two_pipelines_of_two_stages(tmp_path):
    for code, err in _run(tmp_path, 4):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=2)


@pytest.mark.slow
def test_two_pipelines_share_a_tied_weight_and_clip_the_global_norm(
        tmp_path):
    """The first block's weight, also read by the last stage, gets the
    gradients of both stages and stays equal in both processes; clipping
    uses the norm of every stage's gradients (the norm is above the clip in
    every step, so clipping by one stage's norm would differ)."""
    for code, err in _run(tmp_path, 4, "--tied", "--clip", "0.05"):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=2, tied=True, clip=0.05)


@pytest.mark.slow
def test_a_tied_weight_keeps_the_running_mean_across_processes(tmp_path):
    """With MeanReductionStrategy.Running, the tied weight's gradient parts
    of each stage are combined in their own process and summed over the
    pipeline: the mean over the step's micro-batches, as in plain
    PyTorch."""
    for code, err in _run(tmp_path, 2, "--tied", "--running-mean"):
        assert code == 0, err
    _check_processes(tmp_path, stages=2, pipelines=1, tied=True)


def _scale_overflowing_one_stage(stages: int) -> float:
    """A power of two under which the last stage's gradients overflow in
    the first optimizer step (by a factor of 1.5 to 3) and the other
    stages' stay finite (checked in plain PyTorch), so that only a step
    skipped in every process matches one process."""
    torch.manual_seed(1)
    net = program.Chain(stages, annotate=False, loud=True)
    x, y = program.data(stages, 1)[0]
    accumulation = program.accumulation(stages)

    def stage_maxima(scale: float):
        net.zero_grad()
        for step in range(accumulation):
            rows = slice(step * program.BATCH, (step + 1) * program.BATCH)
            _, loss = net(x[rows], y[rows])
            (loss * scale / accumulation).backward()
        last = [net.loud] + list(net.layers[-1].parameters())
        others = [p for layer in net.layers[:-1] for p in layer.parameters()]
        return [max(p.grad.abs().max().item() for p in part)
                for part in (last, others)]

    largest = torch.finfo(torch.float32).max
    scale = 2.0 ** math.ceil(
        math.log2(1.5 * largest / stage_maxima(1.0)[0]))
    last, others = stage_maxima(scale)
    assert math.isinf(last) and others < largest / 8
    return scale


@pytest.mark.slow
def test_automatic_loss_scaling_skips_a_step_overflowing_in_one_stage(
        tmp_path):
    """The first step overflows in the last stage only: every process skips
    it and backs off, then applies the second step, as GradScaler does on
    one process."""
    scale = _scale_overflowing_one_stage(2)
    for code, err in _run(tmp_path, 2, "--loss-scale", str(scale),
                          "--calls", "1"):
        assert code == 0, err
    scales = []
    _plain_training(2, 1, calls=1, loss_scale=scale, scales=scales)
    assert scales == [scale, scale / 2, scale / 2]
    _check_processes(tmp_path, stages=2, pipelines=1, calls=1,
                     loss_scale=scale)


@pytest.mark.slow
def test_three_processes_run_a_three_stage_pipeline(tmp_path):
    for code, err in _run(tmp_path, 3, "--stages", "3", "--calls", "1"):
        assert code == 0, err
    weights, _, _, losses, _ = _plain_training(3, 1, calls=1)
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
def test_a_batch_norm_that_two_processes_run_is_refused(tmp_path):
    """The first block's BatchNorm runs again in the last stage: the first
    stage's next micro-batch would have to read the last stage's update,
    which another process makes at the same time."""
    for code, err in _run(tmp_path, 2, "--shared-norm"):
        assert code != 0
        assert ("stages read buffers that a later stage writes: "
                "'layers.0.1.running_mean' (read by stage 0, written by "
                "stage 1)") in err


def _poprun(output, instances: int, replicas: int, *extra) -> None:
    """Run the program under ``poprun`` (2 IPUs per replica); it must
    succeed."""
    command = [sys.executable, "-m", "poptorch.run", "--num-instances",
               str(instances), "--num-replicas", str(replicas),
               "--ipus-per-replica", "2", PROGRAM, str(output), *extra]
    environment = dict(os.environ, POPTORCH_DISTRIBUTED_TIMEOUT="60")
    finished = subprocess.run(command, capture_output=True, text=True,
                              timeout=240, env=environment)
    assert finished.returncode == 0, finished.stderr


@pytest.mark.slow
def test_poprun_starts_one_process_per_stage(tmp_path):
    _poprun(tmp_path, 2, 1)
    _check_processes(tmp_path, stages=2, pipelines=1)


@pytest.mark.slow
def test_poprun_pipelines_read_their_part_of_a_dataloader(tmp_path):
    """Two replicas of a 2-stage pipeline over 4 instances: the
    poptorch.DataLoader gives both processes of a replica its part."""
    _poprun(tmp_path, 4, 2, "--dataloader")
    _check_processes(tmp_path, stages=2, pipelines=2)


@pytest.mark.slow
def test_poprun_instances_of_whole_replicas_run_every_stage(tmp_path):
    """Two replicas of a 2-stage model on two instances: each instance runs
    both stages of its replica (PopDist's layout) and the updates average
    the replicas' gradients (with a weight two stages read, clipped to the
    global norm)."""
    _poprun(tmp_path, 2, 2, "--dataloader", "--tied", "--clip", "0.05")
    _check_processes(tmp_path, stages=2, pipelines=2, per_pipeline=1,
                     tied=True, clip=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("how, reason", [
    ("kill", "process 1 died"),
    ("raise", "process 1 raised ValueError: process 1 gives up")])
def test_the_other_stage_stops_naming_a_failed_process(tmp_path, how,
                                                        reason):
    start = time.monotonic()
    (code, err), _ = _run(tmp_path, 2, "--fail", how)
    assert code != 0
    assert "poptorch.errors.Error: Distributed run: " + reason in err
    assert "Process 0 of 2 stops (the pipeline's call cannot complete" in err
    assert time.monotonic() - start < 60
