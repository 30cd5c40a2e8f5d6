"""Atomic file replacement, shared by the run store and the baseline migration: a crash leaves the old file
or the new one, never a mix; and the one rule for reading a JSONL file of records."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from evalgate.errors import UserError


RERUN = "restore it, or rerun into a new --out"


def parse_lines(data: bytes, source: str, remedy: str = RERUN) -> tuple[list[Any], list[bytes]]:
    """The records of a JSONL file's bytes and their lines, by the project's one rule: a last line without
    its newline is a torn write (the writer died mid-append) and is left out; any other line that is not JSON
    is damage, refused in one line naming it and ``remedy`` (what a record must hold is the record models' to say)."""
    records, lines = [], []
    *complete, _torn = data.split(b"\n")  # the part after the last newline: empty, or a torn write
    for number, body in enumerate(complete, 1):
        try:
            records.append(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{source} line {number} is not JSON (a damaged file); {remedy}") from None
        lines.append(body + b"\n")
    return records, lines


def read_jsonl(path: Path) -> list[Any]:
    """The records of a JSONL file (``parse_lines``' rule); a missing file holds none."""
    return parse_lines(path.read_bytes(), repr(str(path)))[0] if path.exists() else []


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it: set and restore at once, here at import (one thread)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a temp file beside it, fsync, rename, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes 0600: a stored file gets the modes open() gives
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
