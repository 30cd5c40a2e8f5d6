"""The ``evalgate`` command line. Exit codes: 0 pass/ok, 1 fail, 2 error or not comparable.

Every command lives in its own module beside this one and is registered here, by name.
"""

from __future__ import annotations

import logging
import sys

import click

from evalgate.cli import baseline, calibrate, gate, kernels, report, run, selfcheck, selftest, serve
from evalgate.errors import UserError

# Import-time chatter of optional third-party parts (torchao's CUDA extensions on a CPU machine, torch's
# pytree deprecation notice from torchao) is not the user's business; their errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class EvalgateGroup(click.Group):
    """Turns user errors into one line on stderr and exit 2, from any command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"evalgate: error: {exc}", err=True)
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

if __name__ == "__main__":
    main()
