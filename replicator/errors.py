"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix: bad input, missing object, unreachable server."""


class TargetUnavailable(Exception):
    """The target cannot take a batch now (a broker restarting): the consumer rolls the batch back
    and applies it again after a pause, as when the source goes away."""


def first_line(error: BaseException) -> str:
    """An error's first line, for a log line or a message (its type's name if it has no text)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
