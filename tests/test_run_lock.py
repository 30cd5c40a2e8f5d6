"""The run folder's lock ends with the process that took it, whatever its forked workers do; forked
workers die with their parent; a refusal names the holder's pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError

# Takes the lock, forks a worker (as the decoding workers are forked) that outlives it unless it asks to die
# with its parent, prints the worker's pid, then waits to be killed.
HOLDER = """
import multiprocessing, os, sys, time
from evalgate.cli.preflight import run_lock

def worker(parent, die):
    if die:
        from evalgate.lifetime import die_with_parent
        die_with_parent(parent)
    time.sleep(120)

with run_lock(sys.argv[1]):
    (open(sys.argv[1] + "/records.jsonl", "w")).close()
    child = multiprocessing.get_context("fork").Process(target=worker, args=(os.getpid(), sys.argv[2] == "die"))
    child.start()
    print(child.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _holder(folder: Path, die: str):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), die], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    return proc, worker


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_commands_lock_is_free_at_once_though_its_worker_lives(tmp_path):
    from evalgate.cli.preflight import run_lock

    folder = tmp_path / "run"
    proc, worker = _holder(folder, "live")
    try:
        with pytest.raises(UserError, match=rf"another evalgate command \(pid {proc.pid}\)"):
            with run_lock(folder):
                pass
        proc.kill()
        proc.wait()
        assert _alive(worker)  # the orphaned worker still runs, as a blocked decoding worker would
        with run_lock(folder):  # and yet the folder is free: a rerun resumes
            assert (folder / "records.jsonl").exists()
    finally:
        _end(worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_forked_worker_dies_with_its_parent(tmp_path):
    proc, worker = _holder(tmp_path / "run", "die")
    try:
        assert _alive(worker)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(worker)
    finally:
        _end(worker)
