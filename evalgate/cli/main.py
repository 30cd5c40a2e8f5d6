"""The ``evalgate`` command line. Exit codes (evalgate.errors): 0 PASS, 1 FAIL, 2 bad input or usage error,
3 INCONCLUSIVE, 4 could not finish (environment), 130 interrupted, 143 terminated, 70 a bug.

Every command lives in its own module beside this one and is registered here, by name.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import traceback

import click

from evalgate.cli import baseline, calibrate, explain, gate, kernels, report, run, selfcheck, selftest, serve
from evalgate.cli.options import resume_note
from evalgate.errors import (ENVIRONMENT, EXIT_CODES_HELP, INTERNAL, INTERRUPTED, USAGE, EnvironmentFailure,
                             Interrupted, UserError, describe_os_error)


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's (CUDA) out-of-memory error when torch is loaded."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


def _fail(message: str, code: int) -> None:
    click.echo(message.replace("\r", " ").replace("\n", " "), err=True)  # one line, whatever a server sent
    sys.exit(code)


class EvalgateGroup(click.Group):
    """Ends every command with one meaning per exit code: user errors and usage errors as one
    ``evalgate: error:`` line (exit 2); a full disk, a read-only folder, no memory or a lost server as one
    ``evalgate: could not finish:`` line (exit 4); Ctrl-C and SIGTERM as one line (130, 143), each naming
    the run to resume when there is one; any other exception is a bug: its traceback, exit 70 (never 1,
    which is a FAIL)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            _fail(f"evalgate: error: {exc}", exc.exit_code)
        except click.UsageError as exc:
            _fail(f"evalgate: error: {exc.format_message()}", exc.exit_code)
        except click.ClickException as exc:  # click's own input errors (a file it could not open): exit 2, not 1
            _fail(f"evalgate: error: {exc.format_message()}", USAGE)
        except (click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except EnvironmentFailure as exc:
            _fail(f"evalgate: could not finish: {exc}{resume_note(ctx)}", exc.exit_code)
        except KeyboardInterrupt:
            _fail(f"evalgate: interrupted{resume_note(ctx) or ''}", INTERRUPTED)
        except Interrupted as exc:
            _fail(f"evalgate: terminated{resume_note(ctx) or ''}", exc.exit_code)
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:  # a name the user typed: input, not the environment
                _fail(f"evalgate: error: {_too_long(exc)}", USAGE)
            what = describe_os_error(exc)
            if what is None:
                raise _Bug(exc) from exc
            _fail(f"evalgate: could not finish: {what}{resume_note(ctx)}", ENVIRONMENT)
        except Exception as exc:
            if _out_of_memory(exc):
                what = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                _fail(f"evalgate: could not finish: out of memory ({what}); "
                      f"lower --batch-size or free memory{resume_note(ctx)}", ENVIRONMENT)
            raise _Bug(exc) from exc


def _too_long(exc: OSError) -> str:
    """The name over the file system's limit, shortened, and the limit."""
    path = str(exc.filename or "")
    longest = max(path.split(os.sep), key=len) if path else ""
    try:
        limit = os.pathconf(os.path.dirname(os.path.abspath(path)) or ".", "PC_NAME_MAX") if path else 255
    except (OSError, ValueError):
        limit = 255
    shown = f"{longest[:40]}…" if len(longest) > 40 else longest
    return (f"the name {shown!r} in {path[:60] + '…' if len(path) > 60 else path!r} has {len(longest)} characters; "
            f"the file system allows {limit}: choose a shorter path")


class _Bug(Exception):
    """An exception no command expects: printed with its traceback, exit 70."""


@click.group(cls=EvalgateGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evalgate")
def main():
    """Gate a new low-precision MoE kernel: run GSM8K and HumanEval with it, compare every item with a
    stored W4A8 baseline, and answer PASS or FAIL with the flips that explain it."""


main.add_command(run.run)
main.add_command(gate.gate)
main.add_command(calibrate.calibrate)
main.add_command(baseline.baseline)
main.add_command(report.report)
main.add_command(kernels.kernels_group)
main.add_command(selftest.selftest_group)
main.add_command(selfcheck.selfcheck)
main.add_command(serve.serve)
main.add_command(explain.explain)


def _with_exit_codes(command: click.Command) -> None:
    """Every command's --help ends with the exit codes (one table for all: evalgate.errors)."""
    command.epilog = EXIT_CODES_HELP
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _with_exit_codes(sub)


_with_exit_codes(main)


def _terminate_as_exception(main_pid: int):
    """SIGTERM raises Interrupted in this process, so the run's writers close and its manifest says
    ``interrupted``, as after Ctrl-C. A forked worker (decoding, sandbox) inherits the handler: there the
    signal keeps its default meaning."""

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Interrupted()

    return handler


def _run_main() -> int:
    try:
        main()  # standalone: click ends with SystemExit carrying the exit code
        return 0
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # before or after a command ran (its own are handled in EvalgateGroup)
        click.echo("evalgate: interrupted", err=True)
        return INTERRUPTED
    except Interrupted as exc:
        click.echo("evalgate: terminated", err=True)
        return exc.exit_code
    except _Bug as exc:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"evalgate: internal error (a bug, exit {INTERNAL}): {type(exc.__cause__).__name__}: "
              f"{str(exc.__cause__).splitlines()[0][:300] if str(exc.__cause__) else ''}", file=sys.stderr)
        return INTERNAL
    if code is None:
        return 0
    if not isinstance(code, int):  # sys.exit("message"): printed, exit 1, as Python does
        print(code, file=sys.stderr)
        return 1
    return code


def entry() -> None:
    """The console script: the command, its atexit handlers, then a plain process exit. Tearing down an
    interpreter that loaded a model (freeing every torch and transformers object one by one) took ~2 s of
    each gate's wall time and does nothing a finished command needs; output is flushed first."""
    import atexit

    from evalgate import collector
    from evalgate.allocator import keep_freed_memory

    signal.signal(signal.SIGTERM, _terminate_as_exception(os.getpid()))
    # one progress style: evalgate's own; transformers' and the hub's tqdm bars (weights loading) stay off
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    collector.pause()  # until the model is loaded: the imports' full collections find no garbage
    keep_freed_memory()  # before any tensor: decoding reuses its memory instead of faulting it in every step
    code = _run_main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
