"""A gate folder is read from anywhere: `gate.json` names its runs relative to where the gate ran, and they are
found again from another directory, and in a copy of the run (a CI artifact) after the original is gone."""

from __future__ import annotations

import shutil

import evalgate
from gate_helpers import policy
from synthetic_runs import write_pair
import cli_process


def test_a_gate_folder_is_read_from_another_directory_and_from_a_copy_of_its_run(cli_env, tmp_path, monkeypatch):
    work, baselines = tmp_path / "work", tmp_path / "baselines"  # the baselines live apart, as on a runner
    write_pair(work / "runs", n_gsm8k=40, n_humaneval=10, lost_every=2)
    pol = policy(tmp_path, margin=5.0, rate=50.0)
    for args in (["baseline", "record", "runs/base", "--baselines-root", str(baselines)],
                 ["gate", "--candidate", "runs/cand", "--baselines-root", str(baselines), "--allow-uncalibrated",
                  "--thresholds", str(pol)]):  # relative paths, as a user types them
        proc = cli_process.run([*args], cwd=work, env=cli_env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode in (0, 1, 3), proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    here = evalgate.compare(work / "runs" / "cand" / "gate")
    assert here.candidate.path.resolve() == (work / "runs" / "cand").resolve()
    flips = len(here.flips())

    artifact = tmp_path / "artifact" / "cand"
    shutil.copytree(work / "runs" / "cand", artifact)
    shutil.rmtree(work)
    copied = evalgate.compare(artifact / "gate")
    assert copied.candidate.path.resolve() == artifact.resolve() and len(copied.flips()) == flips > 0
