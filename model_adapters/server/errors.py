"""What a served run raises when its server fails, importable without the client (and without torch): the
command line catches it around a run to exit with the environment code."""

from __future__ import annotations

from evalgate.errors import UserError

RESUME_HINT = "finished items are saved, restart the server and rerun with --resume"


class ServerError(UserError):
    """The server failed a request after every retry; ``finished`` holds what completed before."""

    def __init__(self, message: str, finished: dict | None = None):
        super().__init__(message)
        self.finished = finished or {}
