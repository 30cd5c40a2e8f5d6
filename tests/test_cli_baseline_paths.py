"""`gate --candidate RUN --baseline PATH` takes what the Python API takes: a baseline folder, a baselines root,
a model or profile folder under one, or a gate's output folder — each decides as the baseline folders do."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from evalgate.cli.main import main
from gate_helpers import policy
from synthetic_runs import write_pair


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    base, cand = write_pair(root / "runs", n_gsm8k=40, n_humaneval=10, lost_every=2)
    result = CliRunner().invoke(main, ["baseline", "record", str(base), "--baselines-root", str(root / "baselines")])
    assert result.exit_code == 0, result.output
    return root, cand, policy(root, margin=5.0)


def _gate(cand, pol, *args):
    return CliRunner().invoke(main, ["gate", "--candidate", str(cand), "--allow-uncalibrated", "--thresholds",
                                     str(pol), *args])


def test_every_kind_of_baseline_path_decides_alike(recorded, tmp_path):
    root, cand, pol = recorded
    stored = sorted(str(p.parent) for p in (root / "baselines").glob("*/*/*/manifest.json"))
    first = _gate(cand, pol, *[a for d in stored for a in ("--baseline", d)], "--report-dir", str(tmp_path / "g"))
    assert first.exit_code == 1, first.output
    expected = json.loads((tmp_path / "g" / "gate.json").read_text())["decision"]["tasks"]
    model = next((root / "baselines").iterdir())
    for i, given in enumerate([[root / "baselines"], [model], sorted(model.iterdir()), [tmp_path / "g"]]):
        out = tmp_path / f"r{i}"
        result = _gate(cand, pol, *[a for p in given for a in ("--baseline", str(p))], "--report-dir", str(out))
        assert result.exit_code == 1, (given, result.output)
        gate = json.loads((out / "gate.json").read_text())
        assert sorted(gate["baseline_dirs"]) == stored and gate["decision"]["tasks"] == expected


def test_a_path_that_holds_no_baseline_says_what_is_accepted(recorded, tmp_path):
    root, cand, pol = recorded
    (tmp_path / "empty").mkdir()
    result = _gate(cand, pol, "--baseline", str(tmp_path / "empty"))
    assert result.exit_code == 2
    assert "holds no baseline; pass a baseline or run folder (with manifest.json), a baselines root" in result.output
    result = _gate(cand, pol, "--baseline", str(root / "baselines"), "--baselines-root", str(root / "baselines"))
    assert result.exit_code == 2 and "give one" in result.output


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Baselines as calibrate leaves them: each with its A/A run (``aa/``, a run folder of every task) beside."""
    from evalgate.run.baselines import record, write_aa

    root = tmp_path_factory.mktemp("calibrated")
    base, cand = write_pair(root / "runs", n_gsm8k=40, n_humaneval=10, lost_every=2)
    for path in record(base, root / "baselines"):
        (task,) = json.loads((path / "manifest.json").read_text())["tasks"]
        write_aa(path, {"tasks": {task: {"psi0": 0.0, "n": 40 if task == "gsm8k" else 10, "flips": [],
                                         "verdict": "PASS"}}}, base)
    return root, cand, policy(root, margin=5.0, rate=50.0)


def test_a_calibrated_baselines_model_or_profile_folder_is_a_baseline_to_the_gate_and_the_api(calibrated,
                                                                                                 tmp_path):
    import evalgate

    root, cand, pol = calibrated
    model = next((root / "baselines").iterdir())
    for i, given in enumerate([[root / "baselines"], [model], sorted(model.iterdir())]):
        result = _gate(cand, pol, *[a for p in given for a in ("--baseline", str(p))], "--report-dir",
                       str(tmp_path / f"r{i}"))
        assert result.exit_code == 1 and "verdict: FAIL" in result.output, (given, result.output, result.exception)
    cmp = evalgate.compare(model, cand)  # a model folder, as the gate takes it
    assert cmp.tasks == ["gsm8k", "humaneval"] and all(str(model) in str(d) for d in cmp.baseline_dirs)


def test_report_takes_every_baseline_path_the_gate_takes(calibrated, tmp_path):
    root, cand, pol = calibrated
    model = next((root / "baselines").iterdir())
    verdicts = set()
    for i, given in enumerate([[root / "baselines"], [model], sorted(model.iterdir())]):
        result = CliRunner().invoke(main, ["report", "--candidate", str(cand), "--thresholds", str(pol), "--html",
                                           str(tmp_path / f"r{i}.html"), *[a for p in given for a in ("--baseline", str(p))]])
        assert result.exit_code == 1 and "verdict: FAIL" in result.output, (given, result.output, result.exception)
        verdicts.add((tmp_path / f"r{i}.html").read_text().count("FAIL") > 0)
    assert verdicts == {True}
