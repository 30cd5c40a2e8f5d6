"""One click parameter type for kernel names: an unknown one is a usage error (exit 2) on one line listing
the known kernels, in every command that takes one."""

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from evalgate.cli.main import main
from evalgate.cli.options import KERNEL, KernelName

KNOWN = ["bf16", "w4a8", "w4a4_packed", "faulty/w4a4_packed-drop-slot"]

COMMANDS = [
    ("run", "--kernel"),
    ("calibrate", "--kernel"),
    ("serve", "--kernel"),
    ("selfcheck", "--kernels"),
    ("kernels check --shape tiny", "--kernels"),
    ("baseline import --task gsm8k --score 0.5 --n 10 --model-id m --profile p", "--kernel"),
]


@pytest.mark.parametrize("command, flag", COMMANDS, ids=[c.split()[0] + " " + f for c, f in COMMANDS])
def test_unknown_kernel_is_one_usage_line(command, flag):
    value = "w4a3" if flag == "--kernel" else "bf16,w4a3"
    res = CliRunner().invoke(main, [*command.split(), flag, value])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("evalgate: error:")]
    assert len(errors) == 1 and len(res.output.splitlines()) == 1, res.output
    assert f"Invalid value for '{flag}': unknown kernel 'w4a3'; choose one of: " in errors[0]
    assert all(name in errors[0] for name in KNOWN)


def test_known_names_pass_and_lists_split():
    from evalgate.cli.options import KERNELS

    assert KERNEL.convert("faulty/w4a4_packed-scale-exp", None, None) == "faulty/w4a4_packed-scale-exp"
    assert KERNELS.convert(" bf16, w4a8 ,", None, None) == ["bf16", "w4a8"]
    with pytest.raises(click.BadParameter, match="is empty"):
        KERNELS.convert(" , ", None, None)


def _kernel_options(command: click.Command, prefix=()):
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _kernel_options(sub, (*prefix, name))
        return
    for param in command.params:
        if isinstance(param.type, KernelName):
            yield " ".join(prefix), param


def test_every_default_is_a_known_kernel():
    # defaults are taken as written (no registry import), so each must name a registered kernel
    from evalgate.kernels import kernel_names

    options = list(_kernel_options(main))
    assert {name for name, _ in options} >= {"run", "calibrate", "serve", "selfcheck", "kernels check",
                                             "baseline import"}
    for name, param in options:
        assert param.default is None or param.default in kernel_names(), (name, param.name)


TINY = """
import sys, click
from click.testing import CliRunner
from evalgate.cli.options import KERNEL

@click.command()
@click.option("--kernel", type=KERNEL, default="w4a8")
def cmd(kernel):
    click.echo(kernel)

res = CliRunner().invoke(cmd, sys.argv[1:])
print(res.exit_code, res.output.strip().splitlines()[-1], "torch" in sys.modules)
"""


def test_the_default_imports_no_torch():
    def run(*args):
        return subprocess.run([sys.executable, "-c", TINY, *args], capture_output=True, text=True, timeout=120).stdout

    assert run() == "0 w4a8 False\n"
    assert run("--kernel", "nope").startswith("2 Error: Invalid value for '--kernel': unknown kernel 'nope'")
