"""``python -m evalgate ARGS`` as a process of its own, without paying a fresh interpreter's imports each time.

A CLI test needs a real process: its exit code, its stdout and stderr, signals sent to it, a SIGKILL mid-run.
What a fresh ``python -m evalgate`` spends before it does anything is importing torch and transformers (7–10 s
on a two-core CI host, most of a tiny model's run). So the tests' CLI processes are forked from a server that
imported torch and transformers' DeepSeek-V4 once and runs nothing else; the child chdirs, takes the
caller's environment, stdin/stdout/stderr and session, reseeds its random generators, and runs
``python -m evalgate`` as the interpreter would (``runpy``, ``sys.path[0]`` the working directory), exiting
through the interpreter's own shutdown.

What a preloaded module reads from the environment when it is imported (thread counts, the instruction set,
the hub's cache and offline switches, PYTHONPATH) is the server's, so a server serves one environment, up to
the keys the preloaded modules never read (``LATE_KEYS``). The first call in an environment runs as a fresh
interpreter; the second starts that environment's server, up to ``MAX_SERVERS`` a test process (beyond them,
fresh interpreters). What the preloaded imports print (torchao's notices) went to the server's log, not to
the child's stderr: tests/test_quiet_imports.py holds a fresh interpreter's import of evalgate quiet, and each
environment's first CLI call here is a fresh interpreter.

``run`` mirrors ``subprocess.run``; ``start`` mirrors ``subprocess.Popen`` for what the tests use (pid,
poll, wait, communicate, kill, send_signal; stdout and stderr as PIPE, DEVNULL, a file or inherited).
"""

from __future__ import annotations

import os
import pickle
import random
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

EVALGATE = [sys.executable, "-m", "evalgate"]
PRELOAD = ["torch", "transformers.models.deepseek_v4.modeling_deepseek_v4"]
# Environment keys no preloaded module reads when it is imported: evalgate's own (evalgate is imported fresh in
# each child) and pytest's.
LATE_KEYS = ("EVALGATE_", "PYTEST_")
MAX_SERVERS = 4
_HEADER = struct.Struct("!Q")
PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL


def _early_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_KEYS)))


class _Server:
    """A server process: listens on a Unix socket; each connection is one request, answered with the child's
    pid and, when the child ends, its wait status."""

    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="evalgate-cli-")
        self.path = os.path.join(self.dir, "socket")
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "wb") as log:
            # its stdin is a pipe from here: when this process ends, the server reads EOF and ends
            self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=subprocess.PIPE,
                                         stdout=log, stderr=log, cwd=self.dir)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                with open(self.log, errors="replace") as log:
                    tail = log.read()[-2000:]
                raise RuntimeError(f"the CLI fork server did not start (exit code {self.proc.poll()}):\n{tail}")
            time.sleep(0.02)

    def request(self, payload: dict, fds: list[int]) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        data = pickle.dumps(payload)
        socket.send_fds(conn, [_HEADER.pack(len(data))], fds)
        conn.sendall(data)
        return conn


_servers: dict[tuple, _Server] = {}
_calls: dict[tuple, int] = {}


def _server_for(env: dict[str, str]) -> _Server | None:
    """The server for this environment; None: run a fresh interpreter (its first call, or too many servers)."""
    key = _early_env(env)
    _calls[key] = _calls.get(key, 0) + 1
    if key not in _servers:
        if _calls[key] < 2 or len(_servers) >= MAX_SERVERS:
            return None
        _servers[key] = _Server(env)
    return _servers[key]


def _stream(spec: Any, default_fd: int, files: list, text: bool = False) -> tuple[int, Any]:
    """The fd the child gets for one of its standard streams, and where a PIPE is read from."""
    if spec is None:
        return default_fd, None
    if spec == DEVNULL:
        f = open(os.devnull, "r+b")
        files.append(f)
        return f.fileno(), None
    if spec == PIPE:
        # a file, not a pipe: the child never blocks on a reader, and what it wrote can be read at any time
        # (the writer appends, the reader keeps its own offset; the name is gone once both are open)
        fd, name = tempfile.mkstemp(prefix="evalgate-cli-out-")
        os.close(fd)
        f = open(name, "ab")
        reader = open(name, "r" if text else "rb")
        os.unlink(name)
        files.append(f)
        return f.fileno(), reader
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


class Process:
    """A forked ``python -m evalgate``: what the tests use of ``subprocess.Popen``."""

    def __init__(self, server: _Server, args: list[str], *, env: dict, cwd: str | os.PathLike | None,
                 stdin: Any, stdout: Any, stderr: Any, text: bool, start_new_session: bool,
                 input_bytes: bytes | None = None):
        self.args = [*EVALGATE, *args]
        self.returncode: int | None = None
        files: list = []
        try:
            if input_bytes is not None:
                tmp = tempfile.TemporaryFile()
                tmp.write(input_bytes)
                tmp.seek(0)
                files.append(tmp)
                in_fd = tmp.fileno()
            else:  # stdin not given: /dev/null (pytest gives a test nothing to read either)
                in_fd, _ = _stream(stdin if stdin is not None else DEVNULL, 0, files)
            out_fd, self.stdout = _stream(stdout, 1, files, text)
            self.stderr = None
            if stderr == subprocess.STDOUT:
                err_fd = out_fd
            else:
                err_fd, self.stderr = _stream(stderr, 2, files, text)
            payload = {"args": args, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                       "new_session": start_new_session}
            self._conn = server.request(payload, [in_fd, out_fd, err_fd])
        finally:
            for f in files:
                f.close()
        self.pid = struct.unpack("!q", _recv_exactly(self._conn, 8))[0]

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._conn, 0):
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        data = _recv_exactly(self._conn, 8, allow_eof=True)
        self._conn.close()
        if data is None:
            raise RuntimeError("the CLI fork server ended before the process did")
        self.returncode = os.waitstatus_to_exitcode(struct.unpack("!q", data)[0])

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self._conn, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        return tuple(stream.read() if stream is not None else None  # type: ignore[return-value]
                     for stream in (self.stdout, self.stderr))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc) -> None:
        if self.poll() is None:
            self.kill()
            self.wait()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()


def _readable(conn: socket.socket, timeout: float | None) -> bool:
    with selectors.DefaultSelector() as ready:
        ready.register(conn, selectors.EVENT_READ)
        return bool(ready.select(timeout))


def start(args: list, *, env: dict | None = None, cwd: str | os.PathLike | None = None, stdin: Any = None,
          stdout: Any = None, stderr: Any = None, text: bool = False,
          start_new_session: bool = False) -> Process | subprocess.Popen:
    """``subprocess.Popen(["python", "-m", "evalgate", *args], ...)``."""
    env = dict(os.environ if env is None else env)
    args = [str(a) for a in args]
    server = _server_for(env)
    if server is None:
        return subprocess.Popen([*EVALGATE, *args], env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                text=text, start_new_session=start_new_session)
    return Process(server, args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                   start_new_session=start_new_session)


def run(args: list, *, env: dict | None = None, cwd: str | os.PathLike | None = None, input: Any = None,
        capture_output: bool = False, stdout: Any = None, stderr: Any = None, text: bool = False,
        timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run(["python", "-m", "evalgate", *args], ...)``."""
    env = dict(os.environ if env is None else env)
    args = [str(a) for a in args]
    server = _server_for(env)
    if server is None:
        return subprocess.run([*EVALGATE, *args], env=env, cwd=cwd, input=input, capture_output=capture_output,
                              stdout=stdout, stderr=stderr, text=text, timeout=timeout, check=check)
    if capture_output:
        stdout = stderr = PIPE
    data = input.encode() if isinstance(input, str) else input
    with Process(server, args, env=env, cwd=cwd, stdin=None, stdout=stdout, stderr=stderr, text=text,
                 start_new_session=False, input_bytes=data) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _recv_exactly(conn: socket.socket, n: int, allow_eof: bool = False) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            if allow_eof and not data:
                return None
            raise RuntimeError("the CLI fork server closed the connection")
        data += chunk
    return data


# ---- the server (this file run as a script) ----

def _serve(path: str) -> dict | None:
    """Answer requests until stdin closes (the tests' process ended). In a forked child: its request."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the path: it appears once the server listens
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 1):
                    return None
                continue
            conn, _ = listener.accept()
            conn.setblocking(True)
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            request = pickle.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
            pid = os.fork()
            if pid == 0:
                for other in (listener, *children.values()):
                    other.close()
                sel.close()
                conn.close()
                request["fds"] = fds
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!q", pid))
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(struct.pack("!q", status))
            except OSError:
                pass
            conn.close()


def _child(request: dict) -> None:
    """Become ``python -m evalgate ARGS`` started with the request's environment, cwd and streams."""
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path.insert(0, request["cwd"])  # what `python -m` puts first
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.argv = ["-m", *request["args"]]
    runpy.run_module("evalgate", run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    sys.path.pop(0)  # this folder: the child's first path is its working directory
    child_request = _serve(sys.argv[1])
    if child_request is None:  # the tests' process ended: its folder (socket, log) goes too
        shutil.rmtree(os.path.dirname(sys.argv[1]), ignore_errors=True)
    else:
        _child(child_request)
