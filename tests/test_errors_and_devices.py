"""Error types, log levels and the mapping of IPU concepts to devices."""
import logging
import subprocess
import sys

import pytest
import torch

import poptorch
from poptorch._impl import logger as logger_module
from poptorch._impl.devices import select_device
from conftest import make_data, options


def test_errors_carry_message_type_and_location():
    error = poptorch.Error("bad thing", location="model.py:3")
    assert (error.message, error.location) == ("bad thing", "model.py:3")
    assert error.type and "bad thing" in str(error)
    recoverable = poptorch.RecoverableError("retry", "PARTITION_RESET")
    assert isinstance(recoverable, poptorch.Error)
    assert recoverable.recovery_action == "PARTITION_RESET"
    assert isinstance(poptorch.UnrecoverableError("x"), poptorch.Error)


@pytest.mark.parametrize("name,level", [
    ("OFF", logger_module.OFF), ("ERR", logging.ERROR),
    ("WARN", logging.WARNING), ("INFO", logging.INFO),
    ("DEBUG", logging.DEBUG), ("TRACE", logger_module.TRACE),
    ("TRACE_ALL", logger_module.TRACE_ALL), (1, logging.DEBUG),
    (5, logger_module.OFF)])
def test_set_log_level_accepts_names_and_integers(name, level, monkeypatch):
    monkeypatch.setattr(logger_module.logger, "level",
                        logger_module.logger.level)
    poptorch.setLogLevel(name)
    assert logger_module.logger.level == level


@pytest.mark.parametrize("bad", ["LOUD", 9, -1, True])
def test_set_log_level_rejects_others_listing_valid_values(bad):
    with pytest.raises(ValueError, match="TRACE_ALL.*OFF"):
        poptorch.setLogLevel(bad)


def test_log_level_comes_from_the_environment():
    code = ("import logging, poptorch; from poptorch._impl.logger import "
            "logger; print(logger.level == logging.DEBUG)")
    result = subprocess.run([sys.executable, "-c", code], check=True,
                            capture_output=True, text=True,
                            env={"POPTORCH_LOG_LEVEL": "DEBUG",
                                 "PATH": ""})
    assert result.stdout.strip() == "True"


def test_ipu_model_selects_the_cpu():
    assert select_device(use_ipu_model=True) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_accelerator_no_hardware_is_reported():
    assert not poptorch.ipuHardwareIsAvailable()
    with pytest.raises(poptorch.Error, match="no accelerator"):
        poptorch.ipuHardwareVersion()
    assert select_device(use_ipu_model=False) == torch.device("cpu")


class _FakeGpus:
    """``count`` CUDA devices as torch.cuda reports them, and the device
    made current."""

    def __init__(self, monkeypatch, count):
        self.current = None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device",
                            lambda index: setattr(self, "current", index))
        for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("variable", ["LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_RANK"])
def test_each_process_of_a_host_takes_the_gpu_of_its_local_rank(
        monkeypatch, variable):
    gpus = _FakeGpus(monkeypatch, 2)
    monkeypatch.setenv(variable, "3")
    assert select_device(use_ipu_model=False) == torch.device("cuda", 1)
    assert gpus.current == 1
    assert select_device(use_ipu_model=True) == torch.device("cpu")


def test_a_single_process_takes_the_current_gpu(monkeypatch):
    gpus = _FakeGpus(monkeypatch, 2)
    assert select_device(use_ipu_model=False) == torch.device("cuda", 0)
    assert gpus.current is None


def test_a_local_rank_that_is_not_an_integer_is_reported(monkeypatch):
    _FakeGpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(poptorch.Error, match="LOCAL_RANK must hold an "
                                             "integer.*got 'first'"):
        select_device(use_ipu_model=False)


@pytest.mark.parametrize("local_processes, backend", [(2, "nccl"),
                                                      (4, "gloo")])
def test_processes_sharing_a_gpu_use_gloo(monkeypatch, local_processes,
                                          backend):
    from poptorch._impl.distributed.environment import ProcessEnvironment
    _FakeGpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))
    assert ProcessEnvironment.backend(torch.device("cuda", 0)) == backend
    assert ProcessEnvironment.backend(torch.device("cpu")) == "gloo"


def test_cpu_models_refuse_an_existing_nccl_group(monkeypatch):
    import torch.distributed as dist
    from poptorch._impl.distributed import process_group
    from poptorch._impl.distributed.environment import ProcessEnvironment
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    environment = ProcessEnvironment.for_process(0, 2)
    with pytest.raises(poptorch.Error, match="initialised with the nccl "
                                             "backend.*model on the CPU"):
        process_group.check_existing_group(environment,
                                            torch.device("cpu"))
    process_group.check_existing_group(environment,
                                        torch.device("cuda", 0))


def test_cycle_count_explains_there_is_no_counter(mlp):
    model = poptorch.inferenceModel(mlp)
    model(make_data(2)[0])
    with pytest.raises(poptorch.Error, match="no cycle counter"):
        model.cycleCount()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_matches_cpu(mlp, twin):
    x, y = make_data(16)
    gpu = poptorch.trainingModel(mlp, options(4), torch.optim.SGD(
        mlp.parameters(), lr=0.1, momentum=0.9))
    cpu = poptorch.trainingModel(twin, options(4, useIpuModel=True),
                                 torch.optim.SGD(twin.parameters(), lr=0.1,
                                                 momentum=0.9))
    gpu_out, gpu_loss = gpu(x, y)
    cpu_out, cpu_loss = cpu(x, y)
    assert gpu_out.device.type == "cpu"
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(mlp.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    gpu.detachFromDevice()
    gpu.attachToDevice()
    torch.testing.assert_close(gpu(x, y)[1], cpu(x, y)[1], rtol=1e-4,
                               atol=1e-5)
