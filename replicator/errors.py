"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

import re


class UserError(Exception):
    """A mistake the user can fix: bad input, missing object, unreachable server."""


class TargetUnavailable(Exception):
    """The target cannot take a batch now (a broker restarting): the consumer rolls the batch back
    and applies it again after a pause, as when the source goes away."""


def first_line(error: BaseException) -> str:
    """An error's first line, for a log line or a message (its type's name if it has no text)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# Control characters, and the characters that end a line besides them (NEL, LINE/PARAGRAPH SEPARATOR)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """text with each control character escaped as Python escapes it (a newline as \\n): a name
    read from a database or a command line cannot split a log line or an error, nor forge one."""
    return _CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)
