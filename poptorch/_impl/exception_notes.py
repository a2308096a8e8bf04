"""Notes added to exceptions that reach the user as their own type (a
capture failure's source line, where in a call a step failed)."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10, which has no ``add_note``
    and prints no notes, the note is kept in ``error.__notes__`` as 3.11
    keeps it."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]
