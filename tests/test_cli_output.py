"""Output a person can copy: `evalgate kernels list` never splits a kernel name or an environment setting
across lines, at any terminal width (a narrow one gets a list instead of a table); every command's --help
names the exit codes and every option says what it does."""

from __future__ import annotations

import io

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from evalgate.cli.main import main
from evalgate.errors import EXIT_CODES_HELP


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_kernel_names_and_settings_are_never_split(width):
    from evalgate.cli.kernels import _kernel_rows, print_kernel_rows

    rows = _kernel_rows(True)
    buf = io.StringIO()
    print_kernel_rows(rows, Console(file=buf, width=width, force_terminal=True, color_system=None))
    lines = buf.getvalue().splitlines()
    for r in rows:
        assert any(r["name"] in line for line in lines), (width, r["name"])
        for key, value in r["env"].items():
            assert any(f"{key}={value}" in line for line in lines), (width, key)


def _commands(command: click.Command, path: list[str]):
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, path + [name])
    else:
        yield path, command


COMMANDS = list(_commands(main, []))


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_help_names_the_exit_codes_and_every_option_has_help(path, command):
    result = CliRunner().invoke(main, [*path, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert " ".join(EXIT_CODES_HELP.split()) in " ".join(result.output.split())
    undocumented = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not p.help]
    assert undocumented == []


def test_the_report_highlights_only_differences_a_valid_comparison_forbids(tmp_path):
    import json

    from synthetic_runs import write_pair

    from evalgate.report.html import manifest_rows

    base, cand = write_pair(tmp_path, n_gsm8k=5, n_humaneval=0)
    b, c = (json.loads((p / "manifest.json").read_text()) for p in (base, cand))
    b["model"]["path"] = "/home/someone-else/models/canary"  # recorded on another machine
    rows = {(r["section"], r["key"]): r for r in manifest_rows(b, c)}
    assert not rows[("model", "path")]["differs"] and not rows[("kernel", "id")]["differs"]
    c["model"]["dtype"] = "float32"
    rows = {(r["section"], r["key"]): r for r in manifest_rows(b, c)}
    assert rows[("model", "dtype")]["differs"]
