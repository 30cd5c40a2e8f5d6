"""The gate end to end on stored runs of the tiny model: identical runs pass, broken items fail with the
reason, mismatches are refused with exit 2, baselines are immutable and never half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from evalgate.run import baselines
from evalgate.errors import NotComparable, UserError
from evalgate.gate.decide import gate_runs
from evalgate.run.baselines import load_baseline
from evalgate.run.store import load_run
from evalgate.gate.policy import load_thresholds
from gate_helpers import derive_run, policy
import cli_process

REPO = Path(__file__).resolve().parents[1]
N = 40


@pytest.fixture(scope="module")
def tiny_run(tiny_model, tmp_path_factory, data_dir):
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    out = tmp_path_factory.mktemp("runs") / "real"
    spec = RunSpec(model=str(tiny_model), kernel="w4a8", tasks=["gsm8k"], limit=N, batch_size=20,
                   data_dir=str(data_dir), max_new_tokens=2)
    from evalgate.run.progress import Progress

    return execute(spec, out, in_process_adapter(spec), progress=Progress(enabled=False, stream=open(os.devnull, "w")))


def evalgate_cli(args, cwd, env=None):
    env = {**os.environ, **(env or {})}
    return cli_process.run([*args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_identical_runs_pass_and_write_every_output(tiny_run, tmp_path):
    right = [i % 4 != 0 for i in range(N)]
    base = derive_run(tiny_run, tmp_path / "base", right)
    cand = derive_run(tiny_run, tmp_path / "cand", right, kernel="w4a4_packed")
    summary = tmp_path / "step-summary.md"
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base), "--thresholds",
                         str(policy(tmp_path)), "--allow-uncalibrated", "--report-dir", str(tmp_path / "rep")],
                        tmp_path, {"GITHUB_STEP_SUMMARY": str(summary)})
    assert proc.returncode == 0, proc.stderr
    assert "verdict: PASS" in proc.stdout
    gate = json.loads((tmp_path / "rep/gate.json").read_text())
    assert gate["verdict"] == "PASS" and gate["decision"]["tasks"]["gsm8k"]["statistics"]["counts"]["b"] == 0
    assert gate["flips"]["gsm8k"] == []
    suite = ET.parse(tmp_path / "rep/junit.xml").getroot()
    cases = suite.findall(".//testcase")
    assert [c.get("name") for c in cases] == ["gsm8k"] and not suite.findall(".//failure")
    assert "PASS" in (tmp_path / "rep/report.md").read_text()
    assert summary.read_text() == (tmp_path / "rep/report.md").read_text() + "\n"


def test_broken_items_fail_with_the_reason_and_the_flips(tiny_run, tmp_path):
    right = [True] * N
    broken = [i >= 12 for i in range(N)]  # the candidate loses the first 12 items
    base = derive_run(tiny_run, tmp_path / "base", right)
    cand = derive_run(tiny_run, tmp_path / "cand", broken, kernel="faulty/x",
                      invalid=[not ok for ok in broken])
    rep = tmp_path / "rep"
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base), "--thresholds",
                         str(policy(tmp_path, margin=10.0, rate=1.0)), "--allow-uncalibrated", "--report-dir", str(rep)], tmp_path)
    assert proc.returncode == 1, proc.stderr
    gate = json.loads((rep / "gate.json").read_text())
    reasons = " ".join(gate["decision"]["tasks"]["gsm8k"]["outcome"]["reasons"])
    assert "shown worse than the margin" in reasons and "invalid rate" in reasons
    flips = gate["flips"]["gsm8k"]
    assert len(flips) == 12 and {f["direction"] for f in flips} == {"lost"} and [f["doc_id"] for f in flips] == list(range(12))
    failure = ET.parse(rep / "junit.xml").getroot().find(".//failure")
    assert failure is not None and "shown worse than the margin" in failure.get("message")
    md = (rep / "report.md").read_text()
    assert "FAIL" in md and "12 flipped item(s)" in md


def test_profile_mismatch_is_not_comparable(tiny_run, tmp_path):
    right = [True] * N
    base = derive_run(tiny_run, tmp_path / "base", right)
    cand = derive_run(tiny_run, tmp_path / "cand", right)
    manifest = json.loads((cand / "manifest.json").read_text())
    manifest["tasks"]["gsm8k"]["profile_id"] = "0" * 64
    (cand / "manifest.json").write_text(json.dumps(manifest))
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base), "--thresholds",
                         str(policy(tmp_path)), "--allow-uncalibrated"], tmp_path)
    assert proc.returncode == 2
    assert "not comparable" in proc.stderr and "profile_id differs" in proc.stderr


@pytest.mark.parametrize("damage", ["missing items", "other model", "unfinished"])
def test_incomplete_or_foreign_candidates_are_refused(tiny_run, tmp_path, damage):
    right = [True] * N
    base = derive_run(tiny_run, tmp_path / "base", right)
    cand = derive_run(tiny_run, tmp_path / "cand", right)
    manifest = json.loads((cand / "manifest.json").read_text())
    if damage == "missing items":
        lines = (cand / "gsm8k.jsonl").read_text().splitlines()
        (cand / "gsm8k.jsonl").write_text("\n".join(lines[:-3]) + "\n")
        expected = "37 of 40 items"
    elif damage == "other model":
        manifest["model"]["fingerprint"] = "feedfacefeedface"
        expected = "model fingerprint differs"
    else:
        manifest["tasks"]["gsm8k"]["n_items"] = N + 5
        expected = "crashed or unfinished"
    (cand / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NotComparable, match=expected):
        gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path)), allow_uncalibrated=True)


def test_without_an_aa_calibration_the_gate_refuses(tiny_run, tmp_path):
    right = [True] * N
    base = derive_run(tiny_run, tmp_path / "base", right)
    cand = derive_run(tiny_run, tmp_path / "cand", right)
    with pytest.raises(NotComparable, match="no A/A calibration"):
        gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path)))


def test_aa_flips_are_marked_and_a_failed_aa_is_refused(tiny_run, tmp_path):
    right = [True] * N
    cand_right = [i != 3 for i in range(N)]
    root = tmp_path / "baselines"
    src = derive_run(tiny_run, tmp_path / "base-run", right)
    (stored,) = baselines.record(src, root)
    aa = {"tasks": {"gsm8k": {"psi0": 0.025, "delta0": 0.0, "n": N, "b": 1, "c": 0, "flips": [3], "verdict": "PASS"}}}
    baselines.write_aa(stored, aa, src)
    cand = derive_run(tiny_run, tmp_path / "cand", cand_right)
    verdict = gate_runs(load_baseline(stored), load_run(cand), load_thresholds(policy(tmp_path)))
    flips = verdict.comparison.flips("gsm8k")
    assert list(flips["doc_id"]) == [3] and bool(flips["flips_in_aa"].iloc[0])
    aa["tasks"]["gsm8k"]["verdict"] = "FAIL"
    baselines.write_aa(stored, aa, src)
    with pytest.raises(NotComparable, match="A/A pair failed"):
        gate_runs(load_baseline(stored), load_run(cand), load_thresholds(policy(tmp_path)))


def test_record_is_immutable_without_force(tiny_run, tmp_path):
    root = tmp_path / "baselines"
    src = derive_run(tiny_run, tmp_path / "base-run", [True] * N)
    (stored,) = baselines.record(src, root)
    assert stored.relative_to(root).parts[-1] == "w4a8" and (stored / "gsm8k.jsonl").is_file()
    before = (stored / "gsm8k.jsonl").read_bytes()
    other = derive_run(tiny_run, tmp_path / "other-run", [False] * N)
    with pytest.raises(UserError, match="immutable"):
        baselines.record(other, root)
    assert (stored / "gsm8k.jsonl").read_bytes() == before
    baselines.record(other, root, force=True)
    assert (stored / "gsm8k.jsonl").read_bytes() != before
    assert not list(stored.parent.glob(".tmp-*"))


def test_record_refuses_an_unfinished_run(tiny_run, tmp_path):
    src = derive_run(tiny_run, tmp_path / "run", [True] * N)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="not a complete run"):
        baselines.record(src, tmp_path / "b")


KILL_AT_INSTALL = """
import os, signal, sys
real_rename = os.rename
def rename(src, dst):
    if ".tmp-" in str(src):  # the moment the temp folder would become the baseline
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(src, dst)
os.rename = rename
sys.argv = ["evalgate", "baseline", "record", sys.argv[1], "--root", sys.argv[2]]
from evalgate.cli.main import main
main()
"""


def test_a_killed_record_leaves_no_baseline(tiny_run, tmp_path):
    src = derive_run(tiny_run, tmp_path / "run", [True] * N)
    root = tmp_path / "baselines"
    proc = subprocess.run([sys.executable, "-c", KILL_AT_INSTALL, str(src), str(root)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9
    assert baselines.list_baselines(root) == []
    assert list(root.glob("*/*/.tmp-*"))  # the half-written folder is only ever a .tmp- folder
    (stored,) = baselines.record(src, root)  # the next record cleans up and succeeds
    assert len(baselines.list_baselines(root)) == 1 and not list(root.glob("*/*/.tmp-*"))


def test_aggregate_only_baseline(tiny_run, tmp_path):
    cand = derive_run(tiny_run, tmp_path / "cand", [i % 10 != 0 for i in range(N)])
    agg = baselines.import_aggregate("gsm8k", 0.962, 1319, "dsv4-flash-4xb200", "unknown", source="published",
                                     root=tmp_path / "b")
    assert json.loads((agg / "manifest.json").read_text())["aggregate_only"] is True
    with pytest.raises(NotComparable, match="aggregate-only"):
        gate_runs(load_baseline(agg), load_run(cand), load_thresholds(policy(tmp_path)))
    verdict = gate_runs(load_baseline(agg), load_run(cand), load_thresholds(policy(tmp_path, paired="false")))
    assert verdict.unpaired["gsm8k"]["paired"] is False
    assert "aggregate-only" in " ".join(verdict.notes)
    from evalgate.report.text import markdown

    assert "unpaired" in markdown(verdict)


def test_bad_thresholds_file_is_exit_2(tiny_run, tmp_path):
    base = derive_run(tiny_run, tmp_path / "base", [True] * N)
    bad = tmp_path / "bad.yaml"
    bad.write_text("alpha: 2\ntasks: {}\n")
    proc = evalgate_cli(["gate", "--candidate", str(base), "--baseline", str(base), "--thresholds", str(bad)], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("evalgate: error:") == 1 and "alpha" in proc.stderr


def test_nightly_workflow_is_valid_yaml():
    wf = yaml.safe_load((REPO / ".github/workflows/nightly-gate.yml").read_text())
    jobs = wf["jobs"]
    steps = [s for job in jobs.values() for s in job["steps"]]
    runs = " ".join(s.get("run", "") for s in steps)
    assert "evalgate gate" in runs and any("upload-artifact" in s.get("uses", "") for s in steps)
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads the bare key `on` as true
    assert "schedule" in triggers


@pytest.mark.slow
def test_calibrate_then_gate_from_a_model(tiny_model, tmp_path, data_dir):
    common = ["--model", str(tiny_model), "--tasks", "gsm8k", "--limit", "6", "--max-new-tokens", "6",
              "--batch-size", "3", "--thresholds", str(policy(tmp_path))]
    env = {"EVALGATE_DATA_DIR": str(data_dir)}
    proc = evalgate_cli(["gate", "--kernel", "w4a4", *common], tmp_path, env)
    assert proc.returncode == 2 and "evalgate calibrate" in proc.stderr  # no baseline yet: fail closed
    proc = evalgate_cli(["calibrate", "--kernel", "w4a8", *common], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert "A/A flip rate" in proc.stdout
    (row,) = baselines.list_baselines(tmp_path / "results/baselines")
    assert row["kernel"] == "w4a8" and row["aa_psi0"] is not None and row["n_items"] == 6
    proc = evalgate_cli(["gate", "--kernel", "w4a4", "--out", str(tmp_path / "cand"), *common], tmp_path, env)
    assert proc.returncode in (0, 1), proc.stderr
    gate = json.loads((tmp_path / "cand/gate/gate.json").read_text())
    assert gate["candidate"]["kernel"]["name"] == "w4a4" and gate["baseline"]["kernel"]["name"] == "w4a8"
    assert gate["aa"]["gsm8k"]["n"] == 6
    assert (tmp_path / "cand/gate/junit.xml").is_file() and (tmp_path / "cand/gate/report.md").is_file()


# ---------------------------------------------------------------------------- issue 32, finding 5: inputs that
# cannot be decided are exit 2 in one line; the A/A record is checked and pooled


def _stored_pair(tmp_path, n_gsm8k=200, n_humaneval=40):
    from synthetic_runs import write_pair

    return write_pair(tmp_path, n_gsm8k=n_gsm8k, n_humaneval=n_humaneval)


def _one_line_exit_2(proc):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evalgate: error: ") and "Traceback" not in proc.stderr
    return lines[0]


def _write_aa(base, tasks: dict):
    (base / "aa.json").write_text(json.dumps({"schema_version": 3, "tasks": tasks}))


def test_a_task_with_no_items_is_exit_2_in_one_line(tmp_path):
    base, cand = _stored_pair(tmp_path)
    for run in (base, cand):
        m = json.loads((run / "manifest.json").read_text())
        m["tasks"]["humaneval"]["n_items"] = 0
        (run / "manifest.json").write_text(json.dumps(m))
        (run / "humaneval.jsonl").write_text("")
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base), "--allow-uncalibrated"], tmp_path)
    assert "humaneval" in _one_line_exit_2(proc) and "no items" in proc.stderr


@pytest.mark.parametrize("field, value", [("psi0", 1.5), ("n", 0)])
def test_a_corrupt_aa_record_is_exit_2_in_one_line(tmp_path, field, value):
    base, cand = _stored_pair(tmp_path)
    entry = {"psi0": 0.01, "n": 200, "flips": [], "verdict": "PASS"}
    _write_aa(base, {"gsm8k": {**entry, field: value}, "humaneval": {**entry, "n": 40}})
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base)], tmp_path)
    assert "A/A record is corrupt" in _one_line_exit_2(proc) and f"{field} = " in proc.stderr


def test_min_aa_runs_is_enforced_and_several_runs_are_pooled(tmp_path):
    base, cand = _stored_pair(tmp_path)
    text = (REPO / "thresholds.yaml").read_text().replace("min_aa_runs: 1", "min_aa_runs: 2")
    (tmp_path / "thresholds.yaml").write_text(text)  # the policy in the current directory
    one = {"psi0": 0.02, "n": 200, "flips": [], "verdict": "PASS"}
    _write_aa(base, {"gsm8k": one, "humaneval": {**one, "n": 40}})
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base)], tmp_path)
    assert "min_aa_runs" in _one_line_exit_2(proc)
    runs = [{"psi0": 0.02, "n": 200}, {"psi0": 0.04, "n": 200}]
    _write_aa(base, {"gsm8k": {**one, "runs": runs}, "humaneval": {**one, "n": 40, "runs": [{"psi0": 0.0, "n": 40}] * 2}})
    rep = tmp_path / "rep"
    proc = evalgate_cli(["gate", "--candidate", str(cand), "--baseline", str(base), "--report-dir", str(rep)], tmp_path)
    assert proc.returncode in (0, 1, 3), proc.stderr
    gsm = json.loads((rep / "gate.json").read_text())["decision"]["tasks"]["gsm8k"]
    assert gsm["resolution"]["aa_psi0"] == pytest.approx(0.03) and gsm["resolution"]["aa_n"] == 400


def test_the_aa_mde_of_a_k_sample_task_uses_the_k_sample_formula():
    import numpy as np
    from scipy.stats import norm

    from evalgate.gate.rule import TaskData, TaskRule, decide_task

    rng = np.random.default_rng(5)
    base = rng.integers(0, 5, 164) / 4
    cand = np.clip(base + rng.choice([-0.25, 0, 0.25], 164, p=[0.05, 0.9, 0.05]), 0, 1)
    dec = decide_task(TaskData("humaneval", base, cand, n_samples=4, aa_psi0=0.01, aa_n=164), TaskRule(margin=0.05))
    assert dec.statistics.n_samples == 4 and dec.resolution.mde_method == "score"
    expected = (norm.ppf(0.95) + norm.ppf(0.8)) * np.sqrt(dec.resolution.aa_psi0_upper / 164)
    assert dec.resolution.aa_mde == pytest.approx(expected)
