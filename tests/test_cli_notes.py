"""Choices a command makes that the user did not spell out are said in one note line on stderr."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from evalgate.canary import canary_path
from evalgate.gate.policy import default_thresholds_path
from evalgate.run import baselines

# each gate below is refused (no baseline for --limit 20) before any model loads: only its notes matter
QUICK = ["gate", "--limit", "20"]


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(baselines.ROOT_ENV, raising=False)
    monkeypatch.delenv("EVALGATE_THRESHOLDS", raising=False)
    return tmp_path


def gate(*flags):
    from evalgate.cli.main import main

    return CliRunner().invoke(main, [*QUICK, *flags])


def test_a_local_thresholds_file_a_canary_gate_skips_is_noted(here):
    (here / "thresholds.yaml").write_text(default_thresholds_path().read_text() + "\n# my own\n")
    result = gate("--out", str(here / "run"))
    assert result.exit_code == 2, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("evalgate: note:")]
    assert len(notes) == 1 and "./thresholds.yaml is not used" in notes[0], result.output


def test_no_note_without_a_local_file_or_for_the_packaged_copy(here):
    assert "evalgate: note:" not in gate("--out", str(here / "a")).output
    shutil.copy(default_thresholds_path(), here / "thresholds.yaml")  # a source checkout's root
    assert "evalgate: note:" not in gate("--out", str(here / "b")).output


def test_model_naming_the_canary_says_it_runs_the_full_profiles(here):
    result = gate("--model", str(canary_path()), "--out", str(here / "run"))
    assert result.exit_code == 2, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("evalgate: note:")]
    assert len(notes) == 1 and "full profiles" in notes[0], result.output
    # the note's own advice, followed, is the canary's own profiles: no note
    advice = notes[0].split("pass ", 1)[1].split()
    quiet = gate("--model", str(canary_path()), *advice, "--out", str(here / "run2"))
    assert "evalgate: note:" not in quiet.output and quiet.exit_code == 2, quiet.output
