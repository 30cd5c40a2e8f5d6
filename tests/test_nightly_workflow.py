""".github/workflows/nightly-gate.yml, executed step by step as GitHub Actions would run its one job: each `run:`
script in bash (`-eo pipefail`, the job's and the step's environment, $GITHUB_OUTPUT, $GITHUB_STEP_SUMMARY), each
`if:` evaluated, each `uses:` action replaced by a stand-in that does what the action does to the files
(checkout: nothing, the workspace is fresh; upload-artifact: copies the listed files; the JUnit publisher:
parses the XML). The GPU steps' `evalgate` is a stand-in that runs the real CLI on stored synthetic runs:
`gate` decides a stored candidate against the baseline it finds in $EVALGATE_BASELINES, `calibrate` records
the synthetic W4A8 baseline there; `pip install` does nothing (evalgate is installed).

No runner for workflows installs here from a package registry (`act` is a Go binary from GitHub releases).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from synthetic_runs import write_pair

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "nightly-gate.yml"
EXPRESSION = re.compile(r"\$\{\{\s*(.+?)\s*\}\}")
POLICY = """alpha: 0.05
multiple_comparisons: holm
ci_method: tango
tasks:
  gsm8k: {{profile: gsm8k-lmeval-v3, metric: "exact_match,strict-match", margin_pp: {m}, max_invalid_rise_pp: 100, max_truncation_rise_pp: 100}}
  humaneval: {{profile: humaneval-completion-codex, metric: "pass@1", margin_pp: {m}, max_invalid_rise_pp: 100, max_truncation_rise_pp: 100}}
"""
# the verdict each stored candidate gives: (items the candidate loses every n-th of, margin in pp)
SCENARIOS = {"PASS": (1000, 60), "FAIL": (2, 5), "INCONCLUSIVE": (9, 5)}

# The stand-in for `evalgate` on the GPU runner: logs its arguments, then runs the real CLI on stored runs.
STAND_IN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
real = [{python!r}, "-m", "evalgate"]
if args[:1] == ["gate"]:
    report = args[args.index("--report-dir") + 1]
    args = ["gate", "--candidate", os.environ["STANDIN_CANDIDATE"], "--allow-uncalibrated", "--thresholds",
            os.environ["STANDIN_POLICY"], "--report-dir", report]
elif args[:1] == ["calibrate"]:
    args = ["baseline", "record", os.environ["STANDIN_BASELINE"]]
sys.exit(subprocess.run(real + args).returncode)
"""


@dataclass
class Job:
    conclusion: str  # success | failure
    ran: list[str] = field(default_factory=list)  # names of the steps that ran
    failed: str | None = None
    logs: dict[str, str] = field(default_factory=dict)
    uploaded: dict[str, str] = field(default_factory=dict)
    junit: ET.Element | None = None
    summary: str = ""


class _Context(dict):
    """A GitHub expression context: missing keys read as empty strings, as in Actions."""

    def __getattr__(self, name):
        value = self.get(name, "")
        return _Context(value) if isinstance(value, dict) else value


def _evaluate(expr: str, contexts: dict, workspace: Path):
    """The expressions this workflow uses: context lookups, 'literals', ||, &&, !=, ==, always(), hashFiles()."""
    python = expr.replace("||", " or ").replace("&&", " and ").replace("!", " not ").replace(" not =", " !=")
    names = {k: _Context(v) for k, v in contexts.items() if isinstance(v, dict)}
    names["always"] = lambda: True
    names["success"] = lambda: contexts["job_ok"]
    names["hashFiles"] = lambda pattern: "hash" if (workspace / pattern).is_file() else ""
    return eval(python, {"__builtins__": {}}, names)  # noqa: S307 (the workflow's own, reviewed expressions)


def _interpolate(text: str, contexts: dict, workspace: Path) -> str:
    return EXPRESSION.sub(lambda m: str(_evaluate(m.group(1), contexts, workspace)), str(text))


def _stand_in_bin(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in [("evalgate", STAND_IN.format(python=sys.executable)), ("pip", "#!/bin/sh\nexit 0\n")]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_job(workspace: Path, env: dict, inputs: dict) -> Job:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    output, summary = workspace / ".github_output", workspace / ".step_summary"
    summary.write_text("")
    contexts = {"inputs": inputs, "github": {"run_id": "4242", "run_attempt": "1"}, "vars": {}, "steps": {},
                "job_ok": True}
    job_env = {k: _interpolate(v, contexts, workspace) for k, v in job.get("env", {}).items()}
    result = Job(conclusion="success")
    for step in job["steps"]:
        name = step.get("name") or step.get("uses")
        condition = step.get("if", "success()")
        if not _evaluate(EXPRESSION.sub(r"\1", str(condition)), contexts, workspace):
            continue
        result.ran.append(name)
        ok = True
        if "run" in step:
            output.write_text("")
            step_env = {k: _interpolate(v, contexts, workspace) for k, v in step.get("env", {}).items()}
            proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                                  cwd=workspace, capture_output=True, text=True, timeout=600,
                                  env={**env, **job_env, **step_env, "GITHUB_OUTPUT": str(output),
                                       "GITHUB_STEP_SUMMARY": str(summary)})
            result.logs[name] = proc.stdout + proc.stderr
            ok = proc.returncode == 0
            if "id" in step:
                pairs = [line.split("=", 1) for line in output.read_text().splitlines() if "=" in line]
                contexts["steps"][step["id"]] = {"outputs": dict(pairs)}
        elif step["uses"].startswith("actions/checkout@"):
            pass
        elif step["uses"].startswith("actions/upload-artifact@"):
            for path in step["with"]["path"].split():
                if (workspace / path).is_file():
                    result.uploaded[path] = (workspace / path).read_text(encoding="utf-8")
                elif step["with"].get("if-no-files-found", "warn") == "error":
                    ok = False
        elif step["uses"].startswith("mikepenz/action-junit-report@"):
            result.junit = ET.parse(workspace / step["with"]["report_paths"]).getroot()
        else:
            raise AssertionError(f"no stand-in for {step['uses']}")
        if not ok:
            contexts["job_ok"] = False
            result.conclusion = "failure"
            result.failed = result.failed or name
    result.summary = summary.read_text(encoding="utf-8")
    return result


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("nightly-runs")
    runs = {}
    for verdict, (lost_every, margin) in SCENARIOS.items():
        base, cand = write_pair(root / verdict, n_gsm8k=60, n_humaneval=20, lost_every=lost_every,
                                gained_every=1000)
        (root / verdict / "policy.yaml").write_text(POLICY.format(m=margin))
        runs[verdict] = (base, cand, root / verdict / "policy.yaml")
    return runs


def _night(tmp_path: Path, stored_runs, cli_env, inputs=None, baselines: Path | None = None,
           candidate: Path | None = None) -> tuple[Job, list[list[str]], Path]:
    base, cand, policy_file = stored_runs
    workspace = tmp_path / "workspace"
    workspace.mkdir(parents=True)
    log = tmp_path / "stand-in.log"
    env = {**cli_env, "PATH": f"{_stand_in_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "STANDIN_LOG": str(log), "STANDIN_CANDIDATE": str(candidate or cand), "STANDIN_BASELINE": str(base),
           "STANDIN_POLICY": str(policy_file)}
    job = run_job(workspace, env, inputs or {})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return job, calls, workspace


@pytest.fixture(autouse=True)
def _own_baselines_folder(tmp_path, monkeypatch):
    """The workflow's /data/evalgate/... folders, moved under this test's tmp_path."""
    text = WORKFLOW.read_text()
    moved = text.replace("/data/evalgate", str(tmp_path / "data"))
    copy = tmp_path / "nightly-gate.yml"
    copy.write_text(moved)
    monkeypatch.setattr(sys.modules[__name__], "WORKFLOW", copy)


REPORTS = {"gate-report/gate.json", "gate-report/report.md", "gate-report/report.html", "gate-report/junit.xml"}


@pytest.mark.slow
@pytest.mark.parametrize("verdict, conclusion", [("PASS", "success"), ("FAIL", "failure"),
                                                 ("INCONCLUSIVE", "success")])
def test_a_night_uploads_the_reports_and_ends_as_its_verdict_says(verdict, conclusion, stored, cli_env, tmp_path):
    job, calls, workspace = _night(tmp_path, stored[verdict], cli_env)
    assert job.conclusion == conclusion, job.logs.get("Gate")
    assert set(job.uploaded) == REPORTS  # uploaded whatever the exit code
    assert json.loads(job.uploaded["gate-report/gate.json"])["verdict"] == verdict
    assert job.junit is not None and job.junit.tag == "testsuites"
    assert job.summary.startswith(f"# evalgate: ") and verdict in job.summary.splitlines()[0]
    # the first night records the baseline (calibrate), then gates on two GPUs with the default kernel
    commands = [c[0] for c in calls]
    assert commands == ["baseline", "calibrate", "gate"], calls
    gate = calls[-1]
    assert gate[gate.index("--kernel") + 1] == "w4a4_packed" and gate[gate.index("--device-map") + 1] == "auto"
    verdict_log = job.logs["Verdict"]
    if verdict == "INCONCLUSIVE":
        assert "::warning title=evalgate INCONCLUSIVE::" in verdict_log
        assert re.search(r"--samples \d+ --temperature 0.7 --seed 0", verdict_log), verdict_log
    if verdict == "FAIL":
        assert job.failed == "Verdict" and "::error title=evalgate FAIL::" in verdict_log


@pytest.mark.slow
def test_a_second_night_finds_the_recorded_baseline_and_a_night_without_a_verdict_is_red(stored, cli_env,
                                                                                            tmp_path):
    first, _, workspace = _night(tmp_path / "one", stored["PASS"], cli_env)
    assert first.conclusion == "success"
    # the same runner the next night: the baseline folder persists, nothing is recorded again
    job, calls, _ = _night(tmp_path / "two", stored["PASS"], cli_env,
                           candidate=tmp_path / "missing-run")  # the gate ends without a verdict (exit 2)
    assert [c[0] for c in calls] == ["baseline", "gate"]
    assert job.conclusion == "failure" and job.failed == "Verdict"
    assert "## evalgate: no verdict (exit 2)" in job.summary
    assert "Upload reports" in job.ran and job.uploaded == {}


def test_inputs_reach_the_scripts_through_the_environment_only():
    """No `${{ }}` inside a run: script (a script-injection pattern); the kernel input is an env variable."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    for step in job["steps"]:
        assert "${{" not in step.get("run", ""), step.get("name")
    assert "inputs.kernel" in job["env"]["KERNEL"]
    assert any('--kernel "$KERNEL"' in step.get("run", "") for step in job["steps"])


@pytest.mark.slow
def test_a_hostile_kernel_input_is_an_argument_not_a_command(stored, cli_env, tmp_path):
    hostile = 'w4a4_packed"; touch pwned; echo "'
    job, calls, workspace = _night(tmp_path, stored["PASS"], cli_env, inputs={"kernel": hostile})
    gate = calls[-1]
    assert gate[gate.index("--kernel") + 1] == hostile
    assert not (workspace / "pwned").exists()
