"""Errors a user can cause. The CLI prints them as one line and exits 2; anything else is a bug."""


class UserError(Exception):
    """Bad input: a wrong path, a bad file, an unknown name. The message names the problem and the fix."""

    exit_code = 2


class NotComparable(UserError):
    """Two runs that must not be compared (different profile, model, items...)."""
