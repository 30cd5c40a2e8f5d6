"""The sandbox: failure classes, and a hostile-program suite.

Every hostile program must be scored as not passed, the harness (this pytest process) must live on, no
process of the sandbox uids may be left, and nothing outside the sandbox's own temp dir may change.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from evalgate.tasks.humaneval import sandbox
from evalgate.tasks.humaneval.sandbox import Limits, run_program, run_programs

pytestmark = pytest.mark.skipif(not sandbox.sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

T = 1.5  # seconds: short, so the hostile suite stays fast


def sandbox_processes() -> list[int]:
    """Processes owned by any sandbox slot uid (root mode), i.e. anything that escaped."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid >= sandbox.SLOT_UID_BASE:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def run(source: str, timeout: float = T, **limits):
    outcome = run_program(textwrap.dedent(source), timeout=timeout, **limits)
    assert not sandbox_processes(), "a sandboxed process outlived its run"
    return outcome


# ---- ordinary outcomes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source,failure_class", [
    ("def check(c):\n    assert c(1) == 1\ncheck(lambda x: x)", "passed"),
    ("assert 1 == 2, 'no'", "failed:assertion"),
    ("def f(:\n    pass", "failed:syntax"),
    ("def f():\n  x = 1\n    return x", "failed:syntax"),  # IndentationError
    ("undefined_name + 1", "failed:name"),
    ("import no_such_module_evalgate", "failed:name"),
    ("from math import no_such_thing", "failed:name"),
    ("1 / 0", "failed:exception"),
    ("raise KeyError('k')", "failed:exception"),
])
def test_failure_classes(source, failure_class):
    outcome = run(source)
    assert outcome.failure_class == failure_class, outcome.result
    assert outcome.passed is (failure_class == "passed")


def test_outcome_fields_and_output_capture():
    outcome = run("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nassert False, 'boom'")
    assert outcome.stdout == "to stdout\n"
    assert "to stderr" in outcome.stderr and "AssertionError: boom" in outcome.stderr
    assert outcome.returncode == 1 and outcome.signal is None and not outcome.timed_out
    assert outcome.result == "failed: AssertionError: boom"
    assert outcome.network_isolation in ("netns", "sockets-disabled")
    assert outcome.duration_s > 0
    assert set(outcome.to_dict()) >= {"passed", "failure_class", "returncode", "signal", "stdout", "stderr",
                                      "duration_s", "timed_out", "network_isolation"}


def test_fixed_hash_seed_makes_set_order_reproducible():
    src = "print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}), hash('evalgate'))"
    assert run(src).stdout == run(src).stdout


def test_standard_library_is_importable_and_site_packages_are_not():
    assert run("import hashlib, math, re, collections, itertools, functools, heapq, string").passed
    assert run("import numpy").failure_class == "failed:name"
    assert run("import evalgate").failure_class == "failed:name"


def test_run_programs_keeps_order_and_per_program_timeouts():
    sources = ["assert True", "assert False", "while True: pass", "x = 1"]
    outcomes = run_programs(sources, [T, T, 0.5, T], workers=2)
    assert [o.failure_class for o in outcomes] == ["passed", "failed:assertion", "timed_out", "passed"]
    with pytest.raises(ValueError):
        run_programs(sources, [T], workers=2)


# ---- hostile programs --------------------------------------------------------------------------------

def test_infinite_loop_times_out():
    started = time.monotonic()
    outcome = run("while True:\n    pass", timeout=1.0)
    assert outcome.failure_class == "timed_out" and outcome.timed_out and not outcome.passed
    assert time.monotonic() - started < 1.0 + 3.0


def test_sigterm_ignoring_loop_is_still_killed():
    outcome = run("""
        import signal
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        while True:
            pass
        """, timeout=1.0)
    assert outcome.failure_class == "timed_out"


def test_fork_bomb_is_contained():
    outcome = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """, timeout=1.0)
    assert not outcome.passed and outcome.failure_class in ("timed_out", "crashed", "failed:exception")
    assert outcome.survivors == 0


def test_memory_bomb_hits_the_address_space_limit():
    outcome = run("""
        hog = []
        while True:
            hog.append(bytearray(16 << 20))
        """, timeout=10, memory_bytes=512 << 20)
    assert outcome.failure_class == "crashed", outcome.result
    assert "MemoryError" in outcome.result
    assert run("x = bytearray(1 << 40)").failure_class == "crashed"  # default 4 GiB limit


def test_deep_recursion_crashes_or_fails_but_never_passes():
    outcome = run("""
        import sys
        sys.setrecursionlimit(10 ** 8)
        def down(n):
            return down(n + 1) + 1
        down(0)
        """, timeout=5, memory_bytes=256 << 20)
    # 3.11 keeps Python frames off the C stack, so this ends in MemoryError (crashed) or a C-stack SIGSEGV
    assert outcome.failure_class in ("crashed", "failed:exception"), outcome.result


def test_ctypes_segfault_is_a_crash():
    outcome = run("import ctypes\nctypes.string_at(0)")
    assert outcome.failure_class == "crashed" and outcome.signal == signal.SIGSEGV


def test_printing_gigabytes_is_capped():
    outcome = run("""
        import sys
        line = 'x' * (1 << 20)
        for _ in range(4096):
            print(line)
        """, timeout=10)
    assert outcome.failure_class == "crashed" and "File too large" in outcome.result
    assert len(outcome.stdout) < 3 * sandbox.EXCERPT_BYTES


def test_files_outside_the_work_dir_are_untouched(tmp_path):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("original")
    tmp_path.chmod(0o777)  # even a world-writable directory outside the sandbox must stay out of reach
    repo_target = Path(__file__).resolve().parent / "SANDBOX_WAS_HERE"
    outcome = run(f"""
        import os, shutil
        errors = []
        for attack in (
            lambda: open({str(sentinel)!r}, "w").write("owned"),
            lambda: os.remove({str(sentinel)!r}),
            lambda: shutil.rmtree({str(tmp_path)!r}),
            lambda: open({str(repo_target)!r}, "w").write("owned"),
            lambda: open("/etc/evalgate-owned", "w").write("owned"),
            lambda: os.chmod("/etc/passwd", 0o777),
        ):
            try:
                attack()
            except OSError as exc:
                errors.append(exc)
        assert not errors, errors
        """)
    assert not outcome.passed
    assert sentinel.read_text() == "original"
    assert not repo_target.exists() and not Path("/etc/evalgate-owned").exists()
    assert oct(Path("/etc/passwd").stat().st_mode & 0o777) == oct(0o644)


def test_writes_inside_the_sandbox_work_but_vanish(tmp_path):
    before = set(os.listdir(tempfile.gettempdir()))
    outcome = run("""
        import os, tempfile
        open("scratch.txt", "w").write("mine")
        assert open("scratch.txt").read() == "mine"
        open(os.path.join(tempfile.gettempdir(), "evalgate-sandbox-scratch"), "w").write("x")
        """)
    assert outcome.passed, outcome.result
    after = set(os.listdir(tempfile.gettempdir()))
    assert not {n for n in after - before if n.startswith("evalgate-s")}
    assert not Path(tempfile.gettempdir(), "evalgate-sandbox-scratch").exists()


def test_harness_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("EVALGATE_TEST_SECRET", "s3cr3t-value")
    outcome = run(f"""
        import os
        print(sorted(os.environ))
        found = [k for k in os.environ if "SECRET" in k]
        try:
            found.append(open("/proc/{os.getpid()}/environ", "rb").read())
        except OSError:
            pass
        assert found, "nothing found"
        """)
    assert outcome.failure_class == "failed:assertion"
    assert "s3cr3t" not in outcome.stdout + outcome.stderr
    assert "EVALGATE_TEST_SECRET" not in outcome.stdout


@pytest.mark.parametrize("mode", ["root", "userns", "none"])
def test_network_connection_never_arrives(monkeypatch, mode):
    if (mode == "root") != (os.geteuid() == 0) and mode != "none":
        pytest.skip("root mode needs root; the user-namespace mode is for unprivileged harnesses")
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: mode)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        outcome = run(f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            s.sendall(b"exfiltrated")
            """)
        assert not outcome.passed
        if mode == "none":
            assert outcome.network_isolation == "sockets-disabled"
        else:
            assert outcome.network_isolation in ("netns", "sockets-disabled")
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_killing_the_parent_and_the_harness_fails():
    outcome = run(f"""
        import os, signal
        for target in (os.getppid(), {os.getpid()}, {os.getppid()}):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(0, signal.SIGKILL)
        except OSError:
            pass
        assert False, "still here"
        """)
    assert not outcome.passed  # and this test process is still alive to say so


def test_os_exit_zero_before_the_asserts_does_not_pass():
    outcome = run("""
        def check(candidate):
            assert candidate(2) == 5
        import os
        os._exit(0)
        check(lambda x: x)
        """)
    assert outcome.returncode == 0 and not outcome.passed
    assert outcome.failure_class == "failed:exception" and "before the check finished" in outcome.result


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "raise SystemExit", "raise SystemExit(0)",
                                       "import atexit, os; atexit.register(os._exit, 0); assert False",
                                       "import os, signal; signal.signal(signal.SIGALRM, lambda *a: os._exit(0)); signal.setitimer(signal.ITIMER_REAL, 0.05)\nwhile True: pass"])
def test_exiting_early_does_not_pass(exit_call):
    outcome = run("def check(c):\n    assert False\n" + exit_call + "\ncheck(1)")
    assert not outcome.passed, outcome.result


def test_replacing_assertion_error_changes_nothing():
    outcome = run("""
        import builtins
        class Harmless(Exception):
            pass
        builtins.AssertionError = Harmless
        AssertionError = Harmless
        assert 1 == 2
        """)
    assert outcome.failure_class == "failed:assertion"


def test_a_fake_assertion_class_is_not_an_assertion():
    outcome = run("class AssertionError(Exception):\n    pass\nraise AssertionError('fake')")
    assert outcome.failure_class == "failed:exception"


def test_neutering_the_check_through_the_runner_fails():
    outcome = run("""
        import os, sys
        # try to reach the runner's reporter and its fds, then leave "successfully"
        frame = sys._getframe()
        while frame.f_back is not None:
            frame = frame.f_back
        for fd in range(3, 1024):
            try:
                os.write(fd, b"0" * 32 + b"\\t1\\tdone\\t{}\\n")
            except OSError:
                pass
        os._exit(0)
        """)
    assert not outcome.passed


def test_a_forked_child_cannot_pass_for_its_parent():
    outcome = run("""
        import os
        if os.fork() == 0:
            pass  # the child runs to the end and its runner code writes a marker...
        else:
            os.wait()
            os._exit(0)  # ...while the program itself leaves without finishing
        """)
    assert not outcome.passed


def test_closing_stdout_and_stderr_still_reports():
    assert run("import os, sys\nsys.stdout.close()\nos.close(1)\nos.close(2)\nassert False").failure_class == "failed:assertion"
    assert run("import os, sys\nos.close(1)\nos.close(2)\nx = 1").passed
    # closing every fd (the marker channel too) fails closed
    assert not run("import os\nos.closerange(0, 65536)").passed


def test_a_subprocess_that_outlives_the_check_is_dead_afterwards():
    marker = f"{time.time_ns() % 10**6}.5"
    outcome = run(f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{marker}"])
            os._exit(0)
        """)
    assert outcome.passed, outcome.result  # legitimate as far as the check goes...
    assert outcome.survivors == 0
    time.sleep(0.1)
    for entry in os.listdir("/proc"):  # ...but nothing it started may live on
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            assert marker.encode() not in cmdline, f"pid {entry} survived: {cmdline!r}"


def test_runner_isolation_report():
    outcome = run("pass")
    if os.geteuid() == 0:
        assert outcome.isolation["network"] == "netns" and outcome.isolation["pid"] == "pidns"
        assert outcome.isolation["mount"] == "mountns" and "/tmp" in outcome.isolation["tmpfs"]
    assert Limits().memory_bytes == 4 << 30
