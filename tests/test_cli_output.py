"""Output a person can copy: `evalgate kernels list` never splits a kernel name or a serving line (its
environment settings and flags) across lines, at any terminal width; every command's --help names the exit
codes and every option says what it does."""

from __future__ import annotations

import io
import re

import click
import pytest
from click.testing import CliRunner
from rich.cells import cell_len
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
        for served in r["served_by"]:
            assert any(line.endswith(f"served by: {served}") for line in lines), (width, served)


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


@pytest.mark.parametrize("width", [60, 80, 140])
def test_a_verdict_on_a_terminal_never_splits_a_value(width, tmp_path, monkeypatch):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.rows import task_rows, verdict_reason
    from evalgate.report.text import psi_text, verdict_lines
    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path, n_gsm8k=60, n_humaneval=20, lost_every=9, gained_every=1000)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    from evalgate.report.text import print_verdict

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setenv("COLUMNS", str(width))  # the terminal's width, as rich reads it
    print_verdict(verdict, stream)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue()).splitlines()  # without the colours
    assert all(cell_len(line.rstrip()) <= width for line in lines), max(cell_len(line.rstrip()) for line in lines)
    text = "\n".join(lines)
    words = [w for line in [verdict_reason(verdict), *verdict_lines(verdict)] for w in line.split()
             if any(ch.isdigit() for ch in w)]
    assert words and all(w in text for w in words)  # every number whole on one line
    for r in task_rows(verdict):
        for value in psi_text(r).split():
            assert value in text


def test_progress_lines_in_a_log_say_elapsed_and_left(monkeypatch):
    from evalgate.run import progress as progress_module

    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    with progress_module.Progress(enabled=False, stream=stream) as bars:
        bar = bars.task("gsm8k [w4a4_packed]", total=200)
        now[0] = 30.0
        bar.advance(50)  # 30 s for 50 items
        now[0] = 60.0
        bar.advance(150)
    assert stream.getvalue().splitlines() == ["gsm8k [w4a4_packed]: 0/200",
                                              "gsm8k [w4a4_packed]: 50/200, 0:30 elapsed, about 1:30 left",
                                              "gsm8k [w4a4_packed]: 200/200, 1:00 elapsed"]
