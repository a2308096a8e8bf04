"""The log options: ``logDir`` adds a log file to the console,
``maxRepeatLogs`` suppresses runs of repeated messages, and ``modelName``
names the executable-cache entries in the cache's index."""
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
from poptorch._impl import logger as logger_module
from poptorch._impl.executable_cache import ExecutableCache
from poptorch._impl.log_files import LogFile
from conftest import BatchNormNet, make_images, options
from test_cache import counting  # noqa: F401 (the counting backend fixture)

logger = logger_module.logger
repeat_limit = logger_module.repeat_limit
TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


class _Collector(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def log_state(monkeypatch):
    """The logger's handlers, filters, level and repeat limit as they were,
    after each test; log-once memory emptied."""
    monkeypatch.setattr(logger_module, "_said_once", set())
    handlers, filters = list(logger.handlers), list(logger.filters)
    level, limit = logger.level, repeat_limit.limit
    repeat_limit.end_run()
    yield
    repeat_limit.end_run()
    repeat_limit.limit = limit
    for handler in logger.handlers:
        if handler not in handlers:
            handler.close()
    logger.handlers[:] = handlers
    logger.filters[:] = filters
    logger.setLevel(level)


@pytest.fixture
def console(monkeypatch):
    """What the console handler writes."""
    handler = next(h for h in logger.handlers
                   if type(h) is logging.StreamHandler)
    stream = io.StringIO()
    monkeypatch.setattr(handler, "stream", stream)
    return stream


@pytest.fixture
def messages():
    """The messages that pass the logger's filters."""
    collector = _Collector()
    logger.addHandler(collector)
    return collector.messages


def _model(opts):
    return poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)


def _lines(path):
    return path.read_text().splitlines()


def _messages_in(path):
    return [line.split("] ", 1)[1] for line in _lines(path)]


# --- logDir ---

def test_log_dir_writes_to_a_file_as_well_as_the_console(tmp_path, console):
    directory = tmp_path / "logs" / "run"
    _model(poptorch.Options().logDir(str(directory)))
    logger.warning("a message %d", 7)
    [line] = _lines(directory / "poptorch.log")
    assert re.fullmatch(TIMESTAMP + re.escape("[poptorch:WARNING] a message 7"),
                        line)
    assert console.getvalue() == "[poptorch:WARNING] a message 7\n"


def test_models_with_the_same_log_dir_write_each_line_once(tmp_path):
    opts = poptorch.Options().logDir(tmp_path)
    _model(opts)
    _model(opts.clone())
    poptorch.inferenceModel(torch.nn.Linear(2, 2),
                            poptorch.Options().logDir(str(tmp_path)))
    logger.info("once")
    assert len([h for h in logger.handlers if isinstance(h, LogFile)]) == 1
    assert len(_lines(tmp_path / "poptorch.log")) == 1


def test_the_latest_log_dir_receives_the_messages(tmp_path):
    _model(poptorch.Options().logDir(tmp_path / "first"))
    logger.info("to the first")
    _model(poptorch.Options().logDir(tmp_path / "second"))
    _model(poptorch.Options())
    logger.info("to the second")
    assert _messages_in(tmp_path / "first" / "poptorch.log") == [
        "to the first"]
    assert _messages_in(tmp_path / "second" / "poptorch.log") == [
        "to the second"]


def test_the_log_file_follows_the_log_level(tmp_path):
    _model(poptorch.Options().logDir(tmp_path))
    poptorch.setLogLevel("WARN")
    logger.info("hidden")
    logger.warning("shown")
    poptorch.setLogLevel("DEBUG")
    logger.debug("shown too")
    assert _messages_in(tmp_path / "poptorch.log") == ["shown", "shown too"]


def test_each_process_of_a_run_writes_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    _model(poptorch.Options().logDir(tmp_path))
    logger.info("from process 3")
    assert os.listdir(tmp_path) == ["poptorch.rank3.log"]


def test_without_log_dir_no_file_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert poptorch.Options().log_dir is None
    _model(poptorch.Options())
    logger.warning("console only")
    assert os.listdir(tmp_path) == []
    assert not [h for h in logger.handlers if isinstance(h, LogFile)]


def test_a_log_dir_that_cannot_be_created_raises_naming_the_option(
        tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(poptorch.Error, match="logDir"):
        _model(poptorch.Options().logDir(blocker / "logs"))


# --- maxRepeatLogs ---

def test_repeats_beyond_the_limit_are_counted_in_one_line(tmp_path,
                                                          messages):
    _model(poptorch.Options().maxRepeatLogs(2).logDir(tmp_path))
    for step in range(5):
        logger.warning("step %d failed", step)
    logger.warning("another message")
    summary = '"step 4 failed" was suppressed 3 times (maxRepeatLogs(2))'
    expected = ["step 0 failed", "step 1 failed", summary, "another message"]
    assert messages == expected
    assert _messages_in(tmp_path / "poptorch.log") == expected


def test_another_message_between_repeats_starts_a_new_run(messages):
    _model(poptorch.Options().maxRepeatLogs(2))
    for message in ["a", "a", "b", "a", "a", "b"]:
        logger.warning(message)
    assert messages == ["a", "a", "b", "a", "a", "b"]


def test_the_default_limit_is_four(messages):
    _model(poptorch.Options())
    for _ in range(6):
        logger.warning("again")
    repeat_limit.end_run()
    assert messages == ["again"] * 4 + [
        '"again" was suppressed 2 times (maxRepeatLogs(4))']


def test_none_logs_every_repeat_and_the_latest_model_wins(messages):
    _model(poptorch.Options().maxRepeatLogs(1))
    _model(poptorch.Options().maxRepeatLogs(None))
    for _ in range(6):
        logger.warning("again")
    assert messages == ["again"] * 6


def test_messages_below_the_level_take_no_part(messages):
    _model(poptorch.Options().maxRepeatLogs(1))
    logger.warning("again")
    logger.debug("hidden")
    logger.warning("again")
    repeat_limit.end_run()
    assert messages == ["again",
                        '"again" was suppressed 1 time (maxRepeatLogs(1))']


@pytest.mark.slow
def test_the_suppressed_count_is_logged_at_exit():
    script = textwrap.dedent("""
        import torch, poptorch
        from poptorch._impl.logger import logger
        poptorch.inferenceModel(torch.nn.Linear(2, 2),
                                poptorch.Options().maxRepeatLogs(1))
        for _ in range(3):
            logger.warning("again")
    """)
    result = subprocess.run([sys.executable, "-c", script], check=True,
                            capture_output=True, text=True)
    assert result.stdout.splitlines() == [
        "[poptorch:WARNING] again",
        '[poptorch:WARNING] "again" was suppressed 2 times (maxRepeatLogs(1))']


# --- modelName and the executable cache's index ---

def _trained(cache_dir, name=None):
    torch.manual_seed(0)
    net = BatchNormNet()
    opts = options(2).setBackend("counting").enableExecutableCaching(
        str(cache_dir))
    if name is not None:
        opts.modelName(name)
    model = poptorch.trainingModel(net, opts,
                                   torch.optim.SGD(net.parameters(), lr=0.1))
    model(*make_images(4))


def _index(cache_dir):
    return json.loads((cache_dir / "index.json").read_text())


def test_the_cache_index_names_the_models_of_its_entries(counting, tmp_path):
    _trained(tmp_path, "net")
    [entry] = [name for name in os.listdir(tmp_path)
               if name.endswith(".pexe")]
    assert _index(tmp_path) == {"net": {entry: "update"}}
    with open(tmp_path / entry, "rb") as stream:
        header = json.loads(stream.readline())
    assert (header["model"], header["step"]) == ("net", "update")
    _trained(tmp_path, "other")
    _trained(tmp_path)
    assert counting.compiles == 1 and counting.loads == 2
    assert _index(tmp_path) == {"net": {entry: "update"},
                                "other": {entry: "update"},
                                "training": {entry: "update"}}


def _index_entries(directory, model):
    cache = ExecutableCache(directory, model)
    for number in range(20):
        cache.index(f"{number:064x}", "inference")


def test_processes_indexing_at_once_lose_no_entry(tmp_path):
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_index_entries,
                                 args=(str(tmp_path), f"model{number}"))
                 for number in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    index = _index(tmp_path)
    assert sorted(index) == [f"model{number}" for number in range(4)]
    assert all(len(entries) == 20 for entries in index.values())


def test_an_unreadable_index_is_started_again(tmp_path, messages):
    (tmp_path / "index.json").write_text("{not json")
    ExecutableCache(str(tmp_path), "net").index("0" * 64, "inference")
    assert _index(tmp_path) == {"net": {"0" * 64 + ".pexe": "inference"}}
    assert any("cannot be read" in message for message in messages)
