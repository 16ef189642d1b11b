"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix: bad input, missing object, unreachable server."""
