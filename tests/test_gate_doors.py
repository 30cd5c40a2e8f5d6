"""One verdict whichever door asks (issue 45): `gate --candidate`, `report`, `evalgate.decide()` and
`Comparison.verdict` decide a stored pair through one function, with one policy resolver, at the same look."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalgate.cli.main import main as evalgate_cli
from evalgate.gate.policy import load_thresholds
from evalgate.stats.exact_ni import exact_pvalues
from synthetic_runs import write_run

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v1-baselines" / "deepseek_v4-54507fbf4b7a503b"
N = 164
POLICY = """alpha: 0.05
tasks:
  gsm8k: {profile: gsm8k-lmeval-v3, metric: "exact_match,strict-match", margin_pp: 1.5}
  humaneval: {profile: humaneval-completion-codex, metric: pass@1, margin_pp: 5.0}
"""


def _doors(base: list[Path], cand: Path, cwd: Path, thresholds: Path | None) -> dict[str, tuple[str, int, float]]:
    """door -> (verdict, look, each task's α) on the same stored pair."""
    import evalgate

    policy = ["--thresholds", str(thresholds)] if thresholds else []
    bases = [x for b in base for x in ("--baseline", str(b))]
    runner = CliRunner()
    out = {}
    gated = runner.invoke(evalgate_cli, ["gate", "--candidate", str(cand), *bases, *policy, "--allow-uncalibrated",
                                         "--report-dir", str(cwd / "gate")], catch_exceptions=False)
    record = json.loads((cwd / "gate" / "gate.json").read_text())
    out["gate --candidate"] = (record["verdict"], record["sequence"]["looks"][0]["look"],
                               {t: d["rule"]["alpha"] for t, d in record["decision"]["tasks"].items()})
    assert gated.exit_code == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}[record["verdict"]], gated.output
    reported = runner.invoke(evalgate_cli, ["report", *bases, "--candidate", str(cand), *policy, "--allow-uncalibrated",
                                            "--html", str(cwd / "report.html")], catch_exceptions=False)
    assert reported.exit_code == gated.exit_code, reported.output
    for name, verdict in (("evalgate.decide()", evalgate.decide(base, cand, thresholds, allow_uncalibrated=True)),
                          ("Comparison.verdict", evalgate.compare(base, cand, thresholds=thresholds).verdict)):
        out[name] = (verdict.verdict, verdict.sequence["looks"][0]["look"],
                     {t: d.rule.alpha for t, d in verdict.decision.tasks.items()})
    said = re.search(r"verdict: (\w+) .*look (\d+) at α = ([\d.e-]+)\)", reported.output)
    assert said, reported.output
    alphas = {t: float(said[3]) for t in out["gate --candidate"][2]}
    out["report"] = (said[1], int(said[2]) - 1, alphas)
    return out


def test_a_borderline_pair_gets_one_verdict_at_every_door(tmp_path, monkeypatch):
    """4 lost, 1 gained of 164 at M = 5 pp: PASS at α = 5% (p = 0.049), not at look 1's α/2. It used to PASS in
    a notebook and be INCONCLUSIVE in the gate; and $EVALGATE_THRESHOLDS, which the notebook ignored, decides
    at every door."""
    assert 0.025 < exact_pvalues(4, 1, N, 0.05)[0] <= 0.05
    base_right = [i % 10 < 7 for i in range(N)]
    right, wrong = [i for i in range(N) if base_right[i]], [i for i in range(N) if not base_right[i]]
    cand_right = [(ok and i not in right[:4]) or i in wrong[:1] for i, ok in enumerate(base_right)]
    base = write_run(tmp_path / "base", "w4a8", [], base_right, ["failed:assertion"] * N, 0)
    cand = write_run(tmp_path / "cand", "w4a4_packed", [], cand_right, ["failed:assertion"] * N, 1)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVALGATE_THRESHOLDS", str(policy))
    doors = _doors([base], cand, tmp_path, None)
    assert all(v == ("INCONCLUSIVE", 0, {"humaneval": 0.025}) for v in doors.values()), doors


def test_the_stored_fixtures_get_one_verdict_at_every_door(tmp_path, monkeypatch):
    """The stored v1 baselines (both tasks) against their own A/A run: every door, the same verdict and look."""
    root = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, root)  # the looks are recorded with the baseline: never in the repository's copy
    base = sorted(p.parent for p in root.glob("*/w4a8/manifest.json"))
    cand = base[0] / "aa"
    monkeypatch.chdir(tmp_path)
    from evalgate.canary import THRESHOLDS

    doors = _doors(base, cand, tmp_path, Path(THRESHOLDS))
    first = doors["gate --candidate"]
    assert all(v == first for v in doors.values()), doors
    alpha = load_thresholds(THRESHOLDS).alpha
    assert first[1] == 0 and list(first[2].values()) == pytest.approx([alpha / 2] * len(first[2]))
