"""Exception types of the PopTorch API (features chapter "Error handling")."""
from typing import Optional


class Error(RuntimeError):
    """An error in the program or a misuse of the API.

    Attributes (as in PopTorch):
      * ``message``: the error message without context,
      * ``type``: the part of the stack that raised it and its category,
      * ``location``: where the error was raised (the user's file and line
        when it is known).
    """

    def __init__(self, message: str, type: str = "poptorch_python_error",
                 location: Optional[str] = None) -> None:
        self.message = message
        self.type = type
        self.location = location or ""
        text = message if not location else f"{message}\n  at {location}"
        super().__init__(text)


class RecoverableError(Error):
    """A transient runtime error; ``recovery_action`` says how to recover:
    ``IPU_RESET``, ``PARTITION_RESET`` or ``FULL_RESET``."""

    def __init__(self, message: str, recovery_action: str = "IPU_RESET",
                 type: str = "poptorch_recoverable_error",
                 location: Optional[str] = None) -> None:
        self.recovery_action = recovery_action
        super().__init__(message, type, location)


class UnrecoverableError(Error):
    """A runtime error that is likely to persist."""

    def __init__(self, message: str,
                 type: str = "poptorch_unrecoverable_error",
                 location: Optional[str] = None) -> None:
        super().__init__(message, type, location)
