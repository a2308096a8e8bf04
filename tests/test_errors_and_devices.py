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
