"""The ``evalgate`` command line. Exit codes: 0 PASS/ok, 1 FAIL, 2 bad input or usage error, 3 INCONCLUSIVE.

Every command lives in its own module beside this one and is registered here, by name.
"""

from __future__ import annotations

import sys

import click

from evalgate.cli import baseline, calibrate, gate, kernels, report, run, selfcheck, selftest, serve
from evalgate.errors import UserError


class EvalgateGroup(click.Group):
    """Turns user errors and a command's usage errors (an unknown kernel, a bad option value) into one line
    on stderr and exit 2, from any command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"evalgate: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            click.echo(f"evalgate: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)


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


def entry() -> None:
    """The console script: the command, its atexit handlers, then a plain process exit. Tearing down an
    interpreter that loaded a model (freeing every torch and transformers object one by one) took ~2 s of
    each gate's wall time and does nothing a finished command needs; output is flushed first."""
    import atexit
    import os

    from evalgate import collector
    from evalgate.allocator import keep_freed_memory

    collector.pause()  # until the model is loaded: the imports' full collections find no garbage
    keep_freed_memory()  # before any tensor: decoding reuses its memory instead of faulting it in every step
    try:
        main()  # standalone: click ends with SystemExit carrying the exit code
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, exit 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
