"""How many threads in-process generation and the HumanEval sandbox may use: the cores this process can
actually run on (CPU affinity, the cgroup's CPU quota), never the machine's core count.

Why: PyTorch's OpenMP pool defaults to every core of the machine. Each operator ends on a barrier, so when
one of those cores is busy with another process (or outside the container's quota) every barrier waits for
the thread the scheduler parked there, and a small model's decoding slows down by 10-20x.

``intra_op_threads`` decides, in this order: an explicit request (``--threads``, which the run's options hand
to the model's loader), then ``EVALGATE_THREADS``, then ``OMP_NUM_THREADS``, then the available cores, capped
by what the model can use (``useful_threads``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

ENV_THREADS = "EVALGATE_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# One intra-op thread per this many hidden units. Below it an operator's work is too small for a second
# thread to pay: on two cores the canary (hidden 256) decodes 40 GSM8K items in 7.0 s on two threads and
# 8.4 s on one, but beside one busy process two threads took over 270 s and one thread 7.9 s
# (benchmarks/bench_contention.py). Every extra thread is one more barrier a co-tenant can stall.
HIDDEN_PER_THREAD = 1024

def affinity_cores() -> int:
    """Cores the scheduler may run this process on (``taskset``, cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _own_cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """controller ("" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _quota_v2(text: str) -> float | None:
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _candidates(base: Path, own: str | None) -> list[Path]:
    """Our own cgroup folder and its parents (a quota on a parent limits us too), then the mount's root
    (inside a container the mount's root is our cgroup)."""
    found = []
    if own:
        here = base / own.lstrip("/")
        while True:
            found.append(here)
            if here == base:
                break
            here = here.parent
    if base not in found:
        found.append(base)
    return found


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in cores) over this process's cgroup and its parents, v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us``; None when there is none or it cannot be read."""
    own = _own_cgroup_paths(proc_cgroup)
    limits = []
    for folder in _candidates(root, own.get("")):  # v2: unified hierarchy
        try:
            limit = _quota_v2((folder / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1
        base = root / mount
        for folder in _candidates(base, own.get("cpu")):
            try:
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                period = int((folder / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def available_cores() -> int:
    """Whole cores this process can count on: affinity, lowered to the cgroup quota (1.5 cores -> 1)."""
    cores = affinity_cores()
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def useful_threads(hidden_size: int | None) -> int | None:
    """The most intra-op threads a model of this hidden size profits from; None when unknown (no cap)."""
    if not hidden_size:
        return None
    return max(1, hidden_size // HIDDEN_PER_THREAD)


def _positive_int(value: str | None) -> int | None:
    try:
        n = int(value) if value not in (None, "") else None
    except ValueError:
        return None
    return n if n and n > 0 else None


def intra_op_threads(hidden_size: int | None = None, requested: int | None = None) -> tuple[int, str]:
    """(threads, why): ``requested`` (--threads), else EVALGATE_THREADS, else OMP_NUM_THREADS, else the
    available cores capped by the model."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be at least 1, got {requested}")
        return requested, "--threads"
    env = _positive_int(os.environ.get(ENV_THREADS))
    if env is not None:
        return env, ENV_THREADS
    omp = _positive_int(os.environ.get("OMP_NUM_THREADS"))
    if omp is not None:
        return omp, "OMP_NUM_THREADS"
    cores = available_cores()
    cap = useful_threads(hidden_size)
    if cap is not None and cap < cores:
        return cap, f"hidden size {hidden_size} (of {cores} available cores)"
    return cores, "available cores"


def configure_torch(hidden_size: int | None = None, requested: int | None = None) -> dict[str, Any]:
    """Set PyTorch's intra-op threads for a model of ``hidden_size`` (``requested``: --threads); returns what
    was chosen and why."""
    import torch

    threads, why = intra_op_threads(hidden_size, requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return {"threads": threads, "why": why, "available_cores": available_cores()}


ENV_WORKERS = "EVALGATE_WORKERS"
MAX_WORKERS = 4  # decoding processes of one in-process run (the canary saturates well before)


def generation_workers(threads: int | None = None) -> tuple[int, str]:
    """(processes, why) for in-process decoding: ``EVALGATE_WORKERS``, else the available cores divided by the
    intra-op threads each process uses, at most MAX_WORKERS. Processes, unlike threads, share no barrier: a
    co-tenant busy on one core slows the process it shares that core with, never the other one
    (``benchmarks/bench_contention.py --workers``)."""
    env = _positive_int(os.environ.get(ENV_WORKERS))
    if env is not None:
        return env, ENV_WORKERS
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    cores = available_cores()
    return max(1, min(MAX_WORKERS, cores // max(1, threads))), f"{cores} available cores, {threads} thread(s) each"
