""".github/workflows/nightly-gate.yml, executed step by step as GitHub Actions would run its one job: each `run:`
script in bash (`-eo pipefail`, the job's and the step's environment, $GITHUB_OUTPUT, $GITHUB_STEP_SUMMARY), each
`if:` evaluated, each `uses:` action replaced by a stand-in that does what the action does to the files
(checkout: nothing, the workspace is fresh; upload-artifact: copies the listed files; the JUnit publisher:
parses the XML). The runner holds nothing but what the workflow declares: the model folder, python3, and a
/data/evalgate it may write (moved under the test's tmp_path, created by nobody but the job).

The GPU steps' `evalgate` is a stand-in that runs the real CLI on stored synthetic runs: `gate` decides a stored
candidate against the baseline it finds in $EVALGATE_BASELINES, `baseline find` asks the real lookup for the
baseline of that candidate's model and profiles, `calibrate` records the synthetic W4A8 baseline there with an
A/A record; `python3 -m pip install` does nothing (evalgate is installed).

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
    candidate = os.environ.get("STANDIN_GATE_CANDIDATE") or os.environ["STANDIN_CANDIDATE"]
    args = ["gate", "--candidate", candidate, "--thresholds", os.environ["STANDIN_POLICY"], "--report-dir", report]
elif args[:2] == ["baseline", "find"]:  # the baseline of the candidate's model and profiles, as the gate finds it
    assert args[args.index("--model") + 1] == os.environ["MODEL_DIR"], args
    args = ["baseline", "find", "--candidate", os.environ["STANDIN_CANDIDATE"], "--kernel",
            args[args.index("--kernel") + 1]]
elif args[:1] == ["calibrate"]:  # the W4A8 baseline and an A/A record beside it
    from evalgate.run.baselines import record, user_root, write_aa
    base = os.environ["STANDIN_BASELINE"]
    for path in record(base, user_root(), force=True):
        (task,) = json.load(open(os.path.join(path, "manifest.json")))["tasks"]
        n = sum(1 for line in open(os.path.join(base, task + ".jsonl")) if line.strip())
        write_aa(path, {{"tasks": {{task: {{"psi0": 0.0, "n": n, "flips": [], "verdict": "PASS"}}}}}}, base)
    sys.exit(0)
sys.exit(subprocess.run(real + args).returncode)
"""
# python3 on the runner: `-m pip` installs nothing (evalgate is installed), anything else is the real python
PYTHON3 = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi
exec {python} "$@"
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
    for name, text in [("evalgate", STAND_IN.format(python=sys.executable)),
                       ("python3", PYTHON3.format(python=sys.executable))]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_job(workspace: Path, env: dict, inputs: dict, variables: dict | None = None) -> Job:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    output, summary = workspace / ".github_output", workspace / ".step_summary"
    summary.write_text("")
    contexts = {"inputs": inputs, "github": {"run_id": "4242", "run_attempt": "1"}, "vars": variables or {}, "steps": {},
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


def _night(tmp_path: Path, stored_runs, cli_env, inputs=None, variables=None,
           candidate: Path | None = None) -> tuple[Job, list[list[str]], Path]:
    """One night on the runner; ``candidate``: the stored run the gate decides instead of the one it runs."""
    base, cand, policy_file = stored_runs
    workspace = tmp_path / "workspace"
    workspace.mkdir(parents=True)
    log = tmp_path / "stand-in.log"
    env = {**cli_env, "PATH": f"{_stand_in_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "STANDIN_LOG": str(log), "STANDIN_CANDIDATE": str(cand), "STANDIN_GATE_CANDIDATE": str(candidate or ""),
           "STANDIN_BASELINE": str(base), "STANDIN_POLICY": str(policy_file)}
    env.pop("EVALGATE_DATA_DIR", None)  # the runner has nothing the workflow does not declare
    job = run_job(workspace, env, inputs or {}, variables)
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
    assert job.summary.startswith("# evalgate: ") and verdict in job.summary.splitlines()[0]
    # the first night records the baseline (calibrate), then gates on two GPUs with the default kernel
    commands = [c[0] for c in calls]
    assert commands == ["baseline", "calibrate", "gate"], calls
    gate = calls[-1]
    assert gate[gate.index("--kernel") + 1] == "w4a4_packed" and gate[gate.index("--device-map") + 1] == "auto"
    verdict_log = job.logs["Verdict"]
    if verdict == "INCONCLUSIVE":
        assert "::warning title=evalgate INCONCLUSIVE::" in verdict_log
        asked = re.search(r"--samples (\d+) --temperature 0.2 --seed 0", verdict_log)
        assert asked, verdict_log
        tasks = json.loads(job.uploaded["gate-report/gate.json"])["decision"]["tasks"].values()
        needed = [t["resolution"]["samples_needed"] for t in tasks if t["resolution"]["samples_needed"]]
        assert needed and int(asked.group(1)) == max([2] + needed)  # the number gate.json names, read from it
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


def _archive(tmp_path: Path, baseline_run: Path, change) -> str:
    """A baselines archive (the workflow's EVALGATE_BASELINE_ARCHIVE) holding ``baseline_run`` recorded, then
    changed by ``change(folder)``; its file:// URL."""
    import tarfile

    from evalgate.run.baselines import record

    root = tmp_path / "archived"
    for path in record(baseline_run, root):
        change(Path(path))
    archive = tmp_path / "baselines.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for item in root.iterdir():
            tar.add(item, arcname=item.name)
    return archive.as_uri()


def _another_model(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["model"]["fingerprint"] = "0123456789abcdef"
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize("change", [_another_model, lambda folder: None], ids=["another-model", "no-aa"])
def test_a_fetched_baseline_of_another_model_or_without_aa_is_recorded_again(change, stored, cli_env, tmp_path):
    """A W4A8 baseline for both tasks is not enough: calibrate runs unless it is this model's, with an A/A."""
    url = _archive(tmp_path, stored["PASS"][0], change)
    job, calls, _ = _night(tmp_path, stored["PASS"], cli_env, variables={"EVALGATE_BASELINE_ARCHIVE": url})
    assert [c[:2] for c in calls] == [["baseline", "find"], ["calibrate", "--model"], ["gate", "--model"]], calls
    assert job.conclusion == "success", job.logs
    assert json.loads(job.uploaded["gate-report/gate.json"])["verdict"] == "PASS"


def test_the_job_reads_no_folder_but_the_model_and_writes_only_folders_it_makes():
    """On a plain runner nothing but $MODEL_DIR exists: every other folder the job names is one a step makes
    (or lies inside one), never an input that may be missing (an EVALGATE_DATA_DIR nobody made is exit 2)."""
    workflow = yaml.safe_load(REPO.joinpath(".github/workflows/nightly-gate.yml").read_text())
    (job,) = workflow["jobs"].values()
    scripts = "\n".join(step.get("run", "") for step in job["steps"])
    made = [job["env"][name] for name in re.findall(r'mkdir -p ((?:"\$\w+" ?)+)', scripts)[0].replace('"', "")
            .replace("$", "").split()]
    for name, value in job["env"].items():
        if name == "MODEL_DIR" or not str(value).startswith("/"):
            continue
        assert any(str(value) == m or str(value).startswith(m + "/") for m in made), (name, value)
