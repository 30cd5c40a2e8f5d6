"""A forked worker's life ends with its parent's.

A worker whose parent was killed (``kill -9``, the OOM killer, a CI cancel) is re-parented to PID 1 and may
block for ever on a pipe write nobody reads, holding memory (and, before ``evalgate.run.lock``, the run
folder's lock). Linux's parent-death signal kills it the moment its parent dies; elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a forked worker: SIGKILL this process when the one that forked it dies.
    ``parent_pid``: that process's pid, read before the fork (it may have died already)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        os._exit(1)
