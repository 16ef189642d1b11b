"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix: bad input, missing object, unreachable server."""


def first_line(error: BaseException) -> str:
    """An error's first line, for a log line or a message (its type's name if it has no text)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
