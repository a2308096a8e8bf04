"""The ``poptorch`` logger, its level names and log-once helpers.

Levels follow the spec ("Environment variables"): OFF, ERR, WARN, INFO
(default), DEBUG, TRACE and TRACE_ALL. ``POPTORCH_LOG_LEVEL`` sets the level
at import; ``poptorch.setLogLevel`` changes it later. An integer level indexes
``INT_LEVELS`` (0 = TRACE ... 5 = OFF).

``repeat_limit`` suppresses often-repeated entries (``maxRepeatLogs``).
"""
import atexit
import logging
import os
import sys
import threading
from typing import Optional, Set, Tuple, Union

TRACE_ALL = 1
TRACE = 5
OFF = logging.CRITICAL + 10

LEVELS = {
    "TRACE_ALL": TRACE_ALL,
    "TRACE": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERR": logging.ERROR,
    "OFF": OFF,
}
INT_LEVELS = ("TRACE", "DEBUG", "INFO", "WARN", "ERR", "OFF")

logging.addLevelName(TRACE_ALL, "TRACE_ALL")
logging.addLevelName(TRACE, "TRACE")

logger = logging.getLogger("poptorch")
logger.propagate = False
#: The console's line format (log files add a timestamp in front).
CONSOLE_FORMAT = "[poptorch:%(levelname)s] %(message)s"
_handler = logging.StreamHandler(sys.stdout)
_handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
logger.addHandler(_handler)

_said_once: Set[str] = set()


def level_from_name(level: Union[str, int]) -> int:
    """Python logging level for a PopTorch level name or integer."""
    if isinstance(level, bool):
        raise ValueError(_bad_level_message(level))
    if isinstance(level, int):
        if 0 <= level < len(INT_LEVELS):
            return LEVELS[INT_LEVELS[level]]
        raise ValueError(_bad_level_message(level))
    if isinstance(level, str) and level.upper() in LEVELS:
        return LEVELS[level.upper()]
    raise ValueError(_bad_level_message(level))


def _bad_level_message(level) -> str:
    names = ", ".join(LEVELS)
    ints = ", ".join(f"{i} ({n})" for i, n in enumerate(INT_LEVELS))
    return (f"Unknown log level {level!r}: valid levels are {names} "
            f"or an integer {ints}")


def setLogLevel(level: Union[str, int]) -> None:
    """Change the volume of messages printed on the console (stdout).

    ``level`` is one of TRACE, DEBUG, INFO, WARN, ERR, OFF (or TRACE_ALL), or
    an integer index into that list (0 = TRACE ... 5 = OFF).
    """
    logger.setLevel(level_from_name(level))


def info_once(message: str) -> None:
    """Log ``message`` at INFO the first time it is seen in this process."""
    if message not in _said_once:
        _said_once.add(message)
        logger.info(message)


def warn_once(message: str) -> None:
    """Log ``message`` at WARN the first time it is seen in this process."""
    if message not in _said_once:
        _said_once.add(message)
        logger.warning(message)


def _level_from_environment() -> int:
    value = os.environ.get("POPTORCH_LOG_LEVEL")
    if value is None or value == "":
        return logging.INFO
    return level_from_name(int(value) if value.isdigit() else value)


logger.setLevel(_level_from_environment())


class RepeatLimit(logging.Filter):
    """``Options.maxRepeatLogs(n)``: for often-repeated log entries, the
    number of repeats logged before they are suppressed.

    A run is a sequence of records of the ``poptorch`` logger with the same
    message template (``record.msg``, whatever its arguments) and no other
    record between them; records below the logger's level (``setLogLevel``)
    take no part. The first ``limit`` records of a run are logged, on the
    console and in the log file alike; the following ones are suppressed
    and counted. When the run ends (a record of another template, a new
    limit, or the end of the process) one line at the run's level says
    ``"<last suppressed message>" was suppressed K times (maxRepeatLogs(n))``.
    ``limit`` None (``maxRepeatLogs(None)``) logs every record.
    """

    def __init__(self) -> None:
        super().__init__()
        self.limit: Optional[int] = None
        self._lock = threading.Lock()
        self._template: Optional[str] = None
        self._count = 0
        self._last_suppressed: Optional[logging.LogRecord] = None
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False):
            return True
        template = str(record.msg)
        with self._lock:
            ended = None
            if template != self._template:
                ended = self._end_run_locked()
                self._template = template
            self._count += 1
            keep = self.limit is None or self._count <= self.limit
            if not keep:
                self._last_suppressed = record
                self._suppressed += 1
        _report_suppressed(ended)
        return keep

    def set_limit(self, limit: Optional[int]) -> None:
        """Log at most ``limit`` records of a run (None: all); a new limit
        ends the current run."""
        if limit != self.limit:
            self.end_run()
            self.limit = limit

    def end_run(self) -> None:
        """End the current run, saying how many of its records were
        suppressed, if any."""
        with self._lock:
            ended = self._end_run_locked()
        _report_suppressed(ended)

    def _end_run_locked(self) -> Optional[Tuple[logging.LogRecord, int, int]]:
        ended = None
        if self._suppressed:
            ended = (self._last_suppressed, self._suppressed, self.limit)
        self._template, self._count = None, 0
        self._last_suppressed, self._suppressed = None, 0
        return ended


#: Marks the line that ends a run of suppressed records.
_SUMMARY = "poptorch_suppressed_repeats"


def _report_suppressed(
        ended: Optional[Tuple[logging.LogRecord, int, int]]) -> None:
    if ended is None:
        return
    record, count, limit = ended
    logger.log(record.levelno, '"%s" was suppressed %d time%s '
               "(maxRepeatLogs(%d))", record.getMessage(), count,
               "" if count == 1 else "s", limit, extra={_SUMMARY: True})


repeat_limit = RepeatLimit()
logger.addFilter(repeat_limit)
atexit.register(repeat_limit.end_run)
