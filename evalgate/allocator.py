"""Keep freed memory in the process instead of handing it back to the kernel after every large tensor.

glibc's malloc serves a block above its mmap threshold (128 KiB, raised adaptively up to 32 MiB) with a
mapping of its own and unmaps it on free, and it trims the top of the heap once 128 KiB are free there.
Decoding allocates and frees tensors of a few MiB every step (KV-cache copies, float64 operands), so every
step page-faults the same memory in again: a default gate spent ~17 of its ~118 CPU-seconds in the kernel.
A fixed threshold at glibc's maximum and no trimming keep that memory mapped for the next step. The process
keeps what it peaked at, which it needs again anyway. On other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Set the two thresholds once per process (forked children inherit them). True where glibc took them."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
