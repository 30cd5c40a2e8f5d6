"""Inputs a user can type that once ended in exit 70 (a bug): each is one `evalgate: error:` line and exit 2,
and where the line suggests a command, that command, typed as suggested, works."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

EVALGATE = [sys.executable, "-m", "evalgate"]


def _cli(args, env, cwd):
    return subprocess.run(EVALGATE + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("evalgate: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["run", "--out", "{long}"], ["gate", "--out", "runs/{long}/r"],
                                  ["gate", "--report-dir", "{long}"], ["baseline", "record", "{cwd}", "--root", "{long}"]],
                         ids=["run-out", "gate-out", "report-dir", "baselines-root"])
def test_a_name_longer_than_the_file_system_allows_is_bad_input(args, cli_env, tmp_path):
    long = "x" * 300
    (tmp_path / "manifest.json").write_text("{}")  # `baseline record` reaches the root only past a run folder
    line = _one_line_exit_2(_cli([a.format(long=long, cwd=tmp_path) for a in args], cli_env, tmp_path))
    assert "has 300 characters" in line and "choose a shorter path" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # nothing made


def test_a_dataset_on_the_canary_names_a_profile_that_scores_it_and_that_profile_does(cli_env, data_dir, tmp_path):
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    (tmp_path / "mine.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = ["run", "--dataset", "gsm8k=mine.jsonl", "--limit", "1", "--max-new-tokens", "2"]
    line = _one_line_exit_2(_cli(args + ["--out", "first"], cli_env, tmp_path))
    assert not (tmp_path / "first").exists()
    suggested = shlex.split(re.search(r"with (--profile \S+)", line).group(1))
    proc = _cli(args + suggested + ["--out", "second"], cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "second" / "gsm8k.jsonl").read_text().count("\n") == 1
