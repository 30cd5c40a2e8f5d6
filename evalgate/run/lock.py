"""The run folder's lock: one command writes a run folder at a time, and the lock ends with that command.

The lock is a ``flock`` on the folder itself, held through one descriptor of the command's process. A
``flock`` belongs to the open file, which a fork shares: a forked decoding worker would keep the lock after
its parent was killed (``kill -9``, the OOM killer), and a worker blocked on a pipe nobody reads keeps it for
ever, so no rerun could resume the run. Every fork therefore closes its copy of the descriptor at once
(``os.register_at_fork``), and an exec'd child never gets it (``os.open`` makes it non-inheritable): the lock
is released by the death of the process that took it, whatever its children do.

A refused command names the process that holds the lock (from ``/proc/locks``), so a user can see whether it
is still running.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from evalgate.errors import EnvironmentFailure, UserError

PROC_LOCKS = Path("/proc/locks")

_held: set[int] = set()  # descriptors of the locks this process holds


def _forget_in_child() -> None:
    """A forked child closes its copies of the lock descriptors: the parent's own keep the locks."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def holder_pid(folder: str | Path) -> int | None:
    """The process that took the ``flock`` on ``folder`` (Linux's /proc/locks), or None when unknown."""
    try:
        st = os.stat(folder)
        lines = PROC_LOCKS.read_text().splitlines()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not the holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].lower() == device:
            try:
                return int(fields[4])
            except ValueError:
                return None
    return None


def _refusal(out: Path) -> UserError:
    pid = holder_pid(out)
    who = f"another evalgate command (pid {pid})" if pid else "another evalgate command"
    return UserError(f"{str(out)!r} is being written by {who}; wait for it to finish, or choose another --out")


@contextmanager
def run_lock(out: str | Path) -> Iterator[Path]:
    """Hold an exclusive lock on the run folder ``out`` (created if missing) while a command writes it; a
    second command on the same folder is refused at once (exit 2), naming the holder's pid. The folder is
    removed again when the command leaves it empty (it stopped before writing anything)."""
    out = Path(out)
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
            raise EnvironmentFailure(f"cannot create the run folder {str(out)!r} ({os.strerror(exc.errno)}); "
                                     "choose a writable --out") from None
        raise
    _held.add(fd)  # before the lock is taken: a fork from now on closes its copy
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(out) from None
        yield out
    finally:
        _held.discard(fd)
        os.close(fd)
        if made:
            try:
                out.rmdir()  # only when empty: nothing was written
            except OSError:
                pass
