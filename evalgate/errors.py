"""Exit codes and the errors a command ends with. The CLI prints an error as one line; anything else is a bug.

One meaning per exit code, for a CI job as for a person: a verdict (0, 1, 3), bad input (2), or the
command could not finish (4 environment, 130/143 interrupted) — the last two are never a verdict, and the
run they leave resumes by running the same command again.
"""

import errno

PASS = 0
FAIL = 1
USAGE = 2
INCONCLUSIVE = 3
ENVIRONMENT = 4  # could not finish: disk full, read-only folder, out of memory, the server gone
INTERRUPTED = 130  # SIGINT (Ctrl-C), as shells report it: 128 + 2
TERMINATED = 143  # SIGTERM: 128 + 15
INTERNAL = 70  # a bug (EX_SOFTWARE): a traceback is printed, and it is not a FAIL

EXIT_CODES = {PASS: "PASS", FAIL: "FAIL (the kernel is worse, or does not compute what it declares)",
              USAGE: "bad input or usage error; no verdict", INCONCLUSIVE: "INCONCLUSIVE (the data show neither)",
              ENVIRONMENT: "could not finish: environment (disk, permissions, memory, server); rerun resumes",
              INTERRUPTED: "interrupted (Ctrl-C); rerun resumes", TERMINATED: "terminated (SIGTERM); rerun resumes",
              INTERNAL: "internal error (a bug; traceback printed)"}

# The exit codes in one line, for every command's --help (click rewraps it: no code is split from its word).
EXIT_CODES_HELP = ("Exit codes: 0 PASS, 1 FAIL, 2 bad input, 3 INCONCLUSIVE, 4 could not finish (disk, "
                   "permissions, memory, server; rerun resumes), 130 interrupted, 143 terminated, 70 a bug.")

# errno values that mean the machine, not the input, stopped the command
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                                errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EFBIG})


class UserError(Exception):
    """Bad input: a wrong path, a bad file, an unknown name. The message names the problem and the fix."""

    exit_code = USAGE


class NotComparable(UserError):
    """Two runs that must not be compared (different profile, model, items...)."""


class EnvironmentFailure(Exception):
    """The command could not finish for a reason outside its input: no space, a read-only or forbidden
    folder, no memory, a server that went away. The message names the path or resource and what to do."""

    exit_code = ENVIRONMENT


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt: the run's writers close and its
    manifest says ``interrupted``, then the command exits 143."""

    exit_code = TERMINATED


def describe_os_error(exc: OSError) -> str | None:
    """One line for an OSError the environment caused (None for any other): what failed, on which path."""
    if exc.errno not in ENVIRONMENT_ERRNOS:
        return None
    path = exc.filename if exc.filename is not None else None
    where = f" on {str(path)!r}" if path is not None else ""
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EIO: "input/output error",
            errno.ENOMEM: "out of memory", errno.EMFILE: "too many open files",
            errno.ENFILE: "too many open files", errno.EFBIG: "file too large"}[exc.errno]
    return what + where
