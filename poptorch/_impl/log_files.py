"""The log options of a model (``Options.logDir``, ``Options.maxRepeatLogs``)
applied to the process's ``poptorch`` logger when the model is created.

The logger is one per process, so the latest model's options win.

``logDir(path)``: the logger also writes to a file in ``path`` (created if
missing), besides the console: ``poptorch.log``, or ``poptorch.rank<R>.log``
in process R of a multi-process run (``options.Distributed``: OpenMPI's or
torchrun's variables, or ``configureProcessId``). The file is appended to;
its lines are the console's with a timestamp in front, at the logger's level
(``setLogLevel``). One file at a time: a model with another ``logDir`` moves
the logging to its file, one with the same directory changes nothing, and
one without ``logDir`` leaves the file as it is.

``maxRepeatLogs(n)``: see ``logger.RepeatLimit``.
"""
import logging
import os

from ..errors import Error
from .logger import CONSOLE_FORMAT, logger, repeat_limit


class LogFile(logging.FileHandler):
    """The ``poptorch`` logger's log file (``logDir``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(logging.Formatter("%(asctime)s " + CONSOLE_FORMAT))


def apply_log_options(options) -> None:
    """Make the ``poptorch`` logger follow ``options.log_dir`` and
    ``options.max_repeat_logs``; ``poptorch.Error`` naming ``logDir`` when
    the log file cannot be opened."""
    repeat_limit.set_limit(options.max_repeat_logs)
    if options.log_dir is not None:
        write_log_file(log_file_path(options.log_dir,
                                     options.Distributed.processId,
                                     options.Distributed.numProcesses))


def log_file_path(directory: str, process_id: int, num_processes: int) -> str:
    """``directory/poptorch.log``, or ``poptorch.rank<process_id>.log`` when
    the run has several processes."""
    name = "poptorch.log" if num_processes <= 1 else \
        f"poptorch.rank{process_id}.log"
    return os.path.abspath(os.path.join(directory, name))


def write_log_file(path: str) -> None:
    """Send the logger's records to ``path`` too, instead of any other log
    file; nothing changes when they already go there."""
    current = [handler for handler in logger.handlers
               if isinstance(handler, LogFile)]
    if any(handler.baseFilename == path for handler in current):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        log_file = LogFile(path)
    except OSError as error:
        raise Error(f"logDir: cannot write the log file {path}: "
                    f"{error}. Give logDir() a directory this process can "
                    "create and write to.") from error
    for handler in current:
        logger.removeHandler(handler)
        handler.close()
    logger.addHandler(log_file)
