"""The ``poptorch`` logger, its level names and log-once helpers.

Levels follow the spec ("Environment variables"): OFF, ERR, WARN, INFO
(default), DEBUG, TRACE and TRACE_ALL. ``POPTORCH_LOG_LEVEL`` sets the level
at import; ``poptorch.setLogLevel`` changes it later. An integer level indexes
``INT_LEVELS`` (0 = TRACE ... 5 = OFF).
"""
import logging
import os
import sys
from typing import Set, Union

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
_handler = logging.StreamHandler(sys.stdout)
_handler.setFormatter(logging.Formatter("[poptorch:%(levelname)s] %(message)s"))
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
