"""Which policy a gate uses, in one function: --thresholds, else $EVALGATE_THRESHOLDS, else the canary's own
(canary runs), else ./thresholds.yaml, else the packaged default; the verdict records which, with its sha256."""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalgate.canary import THRESHOLDS as CANARY_POLICY
from evalgate.errors import UserError
from evalgate.gate.policy import ENV, SOURCES, default_thresholds_path, load_thresholds, resolve_policy

REPO = Path(__file__).resolve().parent.parent
GOOD = (REPO / "thresholds.yaml").read_text(encoding="utf-8")


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """An empty working directory and no $EVALGATE_THRESHOLDS: nothing but the packaged default to find."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv(ENV, raising=False)
    return cwd


def policy_file(path: Path, margin: str) -> Path:
    path.write_text(GOOD.replace("margin_pp: 1.5", f"margin_pp: {margin}"), encoding="utf-8")
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_source_in_its_turn(elsewhere, tmp_path, monkeypatch):
    # nothing given, nothing in the current directory: the packaged default (the top-level file)
    policy = resolve_policy(None)
    assert (policy.source, Path(policy.path)) == ("packaged default", default_thresholds_path())
    assert policy.sha256 == sha(REPO / "thresholds.yaml")
    # ./thresholds.yaml in the current directory beats the packaged default
    local = policy_file(elsewhere / "thresholds.yaml", "2.0")
    policy = resolve_policy(None)
    assert (policy.source, Path(policy.path), policy.sha256) == ("./thresholds.yaml", local, sha(local))
    assert policy.task("gsm8k").margin_pp == 2.0
    # a canary run takes the canary's own policy, even with ./thresholds.yaml present
    policy = resolve_policy(None, canary=True)
    assert (policy.source, Path(policy.path), policy.sha256) == ("canary", CANARY_POLICY, sha(CANARY_POLICY))
    # $EVALGATE_THRESHOLDS beats both
    env_file = policy_file(tmp_path / "env.yaml", "3.0")
    monkeypatch.setenv(ENV, str(env_file))
    for canary in (False, True):
        policy = resolve_policy(None, canary=canary)
        assert (policy.source, Path(policy.path), policy.sha256) == (ENV, env_file, sha(env_file))
    # --thresholds beats everything
    explicit = policy_file(tmp_path / "explicit.yaml", "4.0")
    policy = resolve_policy(str(explicit), canary=True)
    assert (policy.source, Path(policy.path), policy.sha256) == ("--thresholds", explicit, sha(explicit))
    assert policy.task("gsm8k").margin_pp == 4.0
    assert SOURCES == ("--thresholds", ENV, "canary", "./thresholds.yaml", "packaged default")


def test_a_parsed_policy_passes_through(elsewhere):
    policy = resolve_policy(None)
    assert resolve_policy(policy) is policy and load_thresholds(policy) is policy
    # api._for_profiles_used replaces tasks on the frozen dataclass: the rest, source included, is kept
    changed = dataclasses.replace(policy, tasks={})
    assert (changed.source, changed.sha256, changed.tasks) == (policy.source, policy.sha256, {})


def test_direct_loads_say_what_they_are(tmp_path):
    assert load_thresholds().source == "packaged default"
    assert load_thresholds(CANARY_POLICY).source == "canary"
    assert load_thresholds(policy_file(tmp_path / "p.yaml", "2.0")).source == "path given"


def test_a_bad_env_path_is_one_line(elsewhere, monkeypatch):
    monkeypatch.setenv(ENV, "/nonexistent/policy.yaml")
    with pytest.raises(UserError) as info:
        resolve_policy(None)
    message = str(info.value)
    assert message.startswith(f"{ENV}=/nonexistent/policy.yaml: file not found") and "\n" not in message
    assert info.value.exit_code == 2


def test_a_bad_env_path_through_the_command_line(tmp_path, monkeypatch):
    from evalgate.cli.main import main
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", 40, 0)
    res = CliRunner().invoke(main, ["report", "--baseline", str(base), "--candidate", str(cand),
                                    "--html", str(tmp_path / "r.html"), "--allow-uncalibrated"],
                             env={ENV: "/nonexistent"})
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("evalgate: error:")]
    assert errors == [f"evalgate: error: {ENV}=/nonexistent: file not found; expected a thresholds YAML file, "
                      f"or {ENV} unset"]


def test_the_verdict_records_source_path_and_sha(elsewhere, tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.report.outputs import write_outputs
    from synthetic_runs import write_pair

    local = policy_file(elsewhere / "thresholds.yaml", "7.5")
    base, cand = write_pair(tmp_path / "runs", 60, 0)
    verdict = gate_runs(load_baseline(base), load_run(cand), resolve_policy(None), allow_uncalibrated=True)
    record = verdict.to_dict()["thresholds"]
    assert (record["source"], Path(record["path"]), record["sha256"]) == ("./thresholds.yaml", local, sha(local))
    write_outputs(verdict, tmp_path / "gate")
    written = json.loads((tmp_path / "gate" / "gate.json").read_text())["thresholds"]
    assert (written["source"], written["sha256"]) == ("./thresholds.yaml", sha(local))
    from evalgate.records import load_verdict

    assert load_verdict(tmp_path / "gate" / "gate.json").thresholds.sha256 == sha(local)  # gate.json still loads
