"""Host-wide kernel counters a program could move and a later program read back: a store that outlives the
program, its namespaces, its control group and its uid (issue 46).

For each counter a writer program moves it by a chosen amount through every route known, and a reader program
run right after it tries every route that reads it. Each route runs in a forked child, so that a route the
system-call filter refuses (the child is killed by SIGSYS) does not end the program before the others are
tried; the program prints one line per route: ``<route> value <n>``, ``<route> error <class>`` or
``<route> killed <signal>``. A route that reads a number is a breach, and so is a move that is not refused
where a refusal is what closes the counter.

- the kernel's internal shmem mount: every shared anonymous map (or shared map of /dev/zero) is a file of it
  and takes the next inode number, shown in /proc/self/maps;
- pidfs: every process or thread made takes the next inode number, read with fstat of a pidfd
  (clone(CLONE_PIDFD), pidfd_open, SO_PEERPIDFD on the channel; SO_PASSPIDFD hands one with each message);
- get_next_ino: procfs entries (looked up fresh, as /proc/self/task/<tid>/*), pipes and sockets take the next
  number, read in any procfs entry's st_ino or with fstat of the channel's socket.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import textwrap

import pytest

from evalgate.tasks.humaneval import sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0
                                or platform.machine() != "x86_64",
                                reason="the full sandbox needs Linux and root; its system-call filter, x86-64")

SIGSYS = 31
MOVES = 2000  # by how much a writer moves a counter

ROUTES = textwrap.dedent("""
    import ctypes, mmap, os, threading
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def attempt(name, route):
        pid = os.fork()
        if pid == 0:
            try:
                print(name, "value", int(route()), flush=True)
            except BaseException as exc:
                print(name, "error", type(exc).__name__, flush=True)
            os._exit(0)
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status):
            print(name, "killed", os.WTERMSIG(status), flush=True)

    def checked(result):
        if result < 0:
            raise OSError(ctypes.get_errno(), "refused")
        return result

    # the shmem counter
    def shared_map_inode(fd=-1, flags=0x21):  # MAP_SHARED | MAP_ANONYMOUS
        address = checked(libc.syscall(9, 0, 4096, 3, flags, fd, 0))
        with open("/proc/self/maps") as maps:
            for line in maps:
                if int(line.split("-")[0], 16) == address:
                    return int(line.split()[4])
        raise LookupError("no such map")

    def move_shmem():
        for _ in range(MOVES):
            libc.munmap(ctypes.c_void_p(checked(libc.syscall(9, 0, 4096, 3, 0x21, -1, 0))), 4096)
        return MOVES

    def move_shmem_through_dev_zero():
        fd = os.open("/dev/zero", os.O_RDWR)
        for _ in range(MOVES):
            mmap.mmap(fd, 4096).close()  # MAP_SHARED
        return MOVES

    # pidfs
    def clone_pidfd():
        pidfd = ctypes.c_int(-1)
        pid = checked(libc.syscall(56, 0x1000 | 17, 0, ctypes.byref(pidfd), 0, 0))  # CLONE_PIDFD | SIGCHLD
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return os.fstat(pidfd.value).st_ino

    def pidfd_open():
        return os.fstat(checked(libc.syscall(434, os.getpid(), 0))).st_ino

    def peer_pidfd():
        fd, size = ctypes.c_int(-1), ctypes.c_uint(4)
        checked(libc.getsockopt(3, 1, 77, ctypes.byref(fd), ctypes.byref(size)))  # SO_PEERPIDFD
        return os.fstat(fd.value).st_ino

    def pass_pidfd():
        one = ctypes.c_int(1)
        return checked(libc.setsockopt(3, 1, 76, ctypes.byref(one), 4)) + 1  # SO_PASSPIDFD: settable is a breach

    def move_pidfs():
        for _ in range(MOVES // 10):
            threads = [threading.Thread(target=int) for _ in range(10)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return MOVES

    # get_next_ino
    def move_procfs():
        done = 0
        while done < MOVES:
            box = []
            t = threading.Thread(target=lambda: box.append(threading.get_native_id()) or __import__("time").sleep(0.01))
            t.start()
            while not box:
                pass
            for entry in os.listdir(f"/proc/self/task/{box[0]}"):
                os.stat(f"/proc/self/task/{box[0]}/{entry}")
                done += 1
            t.join()
        return done

    def proc_inode():
        return os.stat("/proc/self").st_ino

    def proc_entry_inode():
        return os.stat("/proc/self/status").st_ino

    def channel_inode():
        return os.fstat(3).st_ino

    def channel_copy_inode():
        return os.fstat(os.dup(3)).st_ino
""")

COUNTERS = {
    "shmem": {"moves": ["move_shmem", "move_shmem_through_dev_zero"], "reads": ["shared_map_inode"]},
    "pidfs": {"moves": [], "reads": ["clone_pidfd", "pidfd_open", "peer_pidfd", "pass_pidfd"]},
    "get_next_ino": {"moves": ["move_procfs"],
                     "reads": ["channel_inode", "channel_copy_inode", "proc_inode", "proc_entry_inode"]},
}


def program(reads: list[str], moves: list[str] = (), extra: str = "") -> str:
    lines = [f"attempt({name!r}, {name})" for name in [*reads, *moves]] + [extra]
    return ROUTES.replace("MOVES", str(MOVES)) + "\n".join(lines) + "\n"


def routes(stdout: str) -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2], m[3]) for m in re.finditer(r"^(\w+) (value|error|killed) (\S+)$", stdout, re.M)}


@pytest.fixture(scope="module")
def runs():
    """For each counter, its writer then its reader, one after the other (one worker)."""
    programs = []
    for counter in COUNTERS.values():
        # the pidfs writer moves by making threads, which no filter refuses: what closes pidfs is that no
        # route gives a pidfd to read it with
        extra = "print('moved', move_pidfs())" if not counter["moves"] else ""
        programs += [program(counter["reads"], counter["moves"], extra), program(counter["reads"])]
    outcomes = sandbox.run_programs(programs, 20.0, workers=1)
    return {name: (outcomes[2 * i], outcomes[2 * i + 1]) for i, name in enumerate(COUNTERS)}


@pytest.mark.slow
@pytest.mark.parametrize("counter", list(COUNTERS))
def test_a_counter_moved_by_one_program_reads_nothing_in_the_next(counter, runs):
    writer, reader = runs[counter]
    for outcome in (writer, reader):
        assert outcome.passed, (outcome.result, outcome.stderr[-1500:])
    written, read = routes(writer.stdout), routes(reader.stdout)
    names = COUNTERS[counter]["reads"]
    assert set(names) <= set(written) and set(names) <= set(read), (writer.stdout, reader.stdout)
    for name in COUNTERS[counter]["moves"]:  # the writer's moves are refused (a value is the count it moved)
        assert written[name][0] != "value", (name, writer.stdout)
    for name in names:  # and no route reads the counter, in either program
        assert written[name][0] != "value" and read[name][0] != "value", (name, written[name], read[name])
    refused = [n for n in [*names, *COUNTERS[counter]["moves"]] if written[n] == ("killed", str(SIGSYS))]
    assert refused, writer.stdout  # at least one route of each counter is the filter's refusal, not a missing file


@pytest.mark.slow
def test_the_program_sees_no_procfs_and_cannot_catch_a_refusal():
    """/proc is an empty read-only directory; a handler for SIGSYS is itself refused, so a refused call ends the
    process rather than returning its own number as a result (whose buffer the C library would then read)."""
    source = ROUTES + textwrap.dedent("""
        print("proc", os.listdir("/proc"), os.cpu_count() is not None, flush=True)
        import signal
        attempt("handler", lambda: signal.signal(signal.SIGSYS, lambda *a: None) is None)
        attempt("ignored", lambda: signal.signal(signal.SIGSYS, signal.SIG_IGN) is None)
        try:
            open("/proc/x", "w")
        except OSError as exc:
            print("write", type(exc).__name__, flush=True)
    """)
    outcome = sandbox.run_program(source, 20.0)
    assert outcome.passed, (outcome.result, outcome.stderr[-1500:])
    assert "proc [] True" in outcome.stdout and "write OSError" in outcome.stdout, outcome.stdout
    assert routes(outcome.stdout) == {"handler": ("killed", str(SIGSYS)), "ignored": ("killed", str(SIGSYS))}, \
        outcome.stdout
    assert outcome.isolation["proc"] == "none (an empty read-only directory)"
