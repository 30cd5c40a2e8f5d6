"""The gate: a Comparison plus the policy in thresholds.yaml (and the baseline's A/A record) -> a Verdict.

Validity first, failing closed (eval-conventions §4.8 step 1): comparable runs, every item on both sides,
the HumanEval executor self-test passed, an A/A calibration on record that itself passed. Then the paired
statistics of ``evalgate.stats.paired`` per task, Holm across tasks, and PASS only if every task passes.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.stats import paired as stats
from evalgate.run.baselines import read_aa
from evalgate.gate.compare import Comparison, compare
from evalgate.errors import NotComparable
from evalgate.run.store import Run, load_run
from evalgate.gate.policy import Thresholds, load_thresholds


@dataclass
class Verdict:
    verdict: str  # "PASS" | "FAIL"
    exit_code: int
    decision: stats.OverallDecision | None
    comparison: Comparison | None
    thresholds: Thresholds
    aa: dict = field(default_factory=dict)  # task -> A/A summary used (psi0, n, flips)
    notes: list[str] = field(default_factory=list)
    unpaired: dict = field(default_factory=dict)  # task -> UnpairedResult.to_dict() (aggregate-only baselines)

    def to_dict(self) -> dict:
        cmp = self.comparison
        out = {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "notes": self.notes,
            "thresholds": {"path": self.thresholds.path, "sha256": self.thresholds.sha256,
                           "alpha": self.thresholds.alpha, "multiple_comparisons": self.thresholds.multiple_comparisons,
                           "ci_method": self.thresholds.ci_method},
            "aa": {t: {k: v for k, v in a.items() if k != "flips"} | {"flips": sorted(a.get("flips", []), key=str)}
                   for t, a in self.aa.items()},
            "decision": self.decision.to_dict() if self.decision is not None else None,
            "unpaired": self.unpaired,
        }
        if cmp is not None:
            out["baseline"] = _run_identity(cmp.baseline)
            out["candidate"] = _run_identity(cmp.candidate)
            out["flips"] = {t: cmp.flips(t).drop(columns=["base_response", "cand_response"]).to_dict("records")
                            for t in cmp.tasks}
        return out


def _run_identity(run: Run) -> dict:
    m = run.manifest
    return {"path": str(run.path), "kernel": m.get("kernel", {}), "model": m.get("model", {}),
            "tasks": {t: {k: v for k, v in s.items() if k != "settings"} for t, s in m.get("tasks", {}).items()},
            "dg_env": m.get("dg_env", {}), "created": m.get("created"), "aggregate_only": bool(m.get("aggregate_only"))}


def aa_for_baseline(baseline_dirs: list[Path]) -> dict:
    """task -> {"psi0", "n", "flips", "verdict"} from the baselines' A/A records."""
    found = {}
    for d in baseline_dirs:
        aa = read_aa(d)
        if aa:
            for task, entry in aa.get("tasks", {}).items():
                found[task] = {**entry, "flips": set(entry.get("flips", []))}
    return found


def _decide_kwargs() -> set[str]:
    return set(inspect.signature(stats.decide_task).parameters)


def decide(comparison: Comparison, thresholds: Thresholds, aa: dict | None = None,
           require_aa: bool = True, selftest_ok: dict | None = None) -> Verdict:
    """Per-task paired decisions, then the overall verdict. Raises NotComparable on a validity failure."""
    aa = aa or {}
    notes: list[str] = []
    problems: list[str] = []
    accepted = _decide_kwargs()
    decisions = []
    for task, pairs in comparison.pairs.items():
        policy = thresholds.task(task)
        profile_name = comparison.candidate.manifest["tasks"][task].get("name")
        if profile_name != policy.profile:
            problems.append(f"thresholds give {task} profile {policy.profile!r} but the runs used {profile_name!r}; "
                            f"pass --thresholds with a section for that profile")
            continue
        if pairs.metric != policy.metric:
            pairs = type(pairs)(task, policy.metric, pairs.doc_ids, pairs.base, pairs.cand)
            comparison.pairs[task] = pairs
        for side, run in (("baseline", comparison.baseline), ("candidate", comparison.candidate)):
            prep = run.manifest["tasks"][task].get("prepare") or {}
            if prep and prep.get("ok") is False:
                problems.append(f"{task}: the {side}'s executor self-test failed")
        task_aa = aa.get(task)
        if task_aa is None and require_aa and policy.min_aa_runs > 0:
            problems.append(f"{task}: no A/A calibration on record for the baseline; run `evalgate calibrate` "
                            f"(or pass --allow-uncalibrated to decide without it)")
            continue
        if task_aa is not None and task_aa.get("verdict") not in (None, "PASS"):
            problems.append(f"{task}: the baseline's own A/A pair failed the gate ({task_aa.get('verdict')}): "
                            "the margin is too tight or the stack is not reproducible")
            continue
        kwargs = dict(margin=policy.margin, alpha=thresholds.alpha, ci_method=thresholds.ci_method,
                      base_invalid=pairs.invalid("base"), cand_invalid=pairs.invalid("cand"),
                      base_truncated=pairs.truncated("base"), cand_truncated=pairs.truncated("cand"),
                      max_invalid_rise=policy.max_invalid_rise, max_truncation_rise=policy.max_truncation_rise,
                      base_tokens=pairs.tokens("base"), cand_tokens=pairs.tokens("cand"),
                      token_ratio_band=tuple(thresholds.token_ratio_band))
        if task_aa is not None and "aa_psi0" in accepted:
            kwargs.update(aa_psi0=task_aa["psi0"], aa_n=task_aa["n"])
        extra = getattr(thresholds, "decision_kwargs", None)
        if callable(extra):
            kwargs.update({k: v for k, v in extra(task).items() if k in accepted})
        decisions.append(stats.decide_task(task, pairs.correct("base"), pairs.correct("cand"), **kwargs))
    if problems:
        raise NotComparable("cannot decide: " + "; ".join(problems))
    overall = stats.decide_overall(decisions, alpha=thresholds.alpha,
                                   multiple_comparisons=thresholds.multiple_comparisons)
    comparison.decision = overall
    comparison.aa_flips = {t: a["flips"] for t, a in aa.items()}
    if not aa:
        notes.append("decided without an A/A calibration (--allow-uncalibrated)")
    return Verdict(overall.verdict, overall.exit_code, overall, comparison, thresholds, aa=aa, notes=notes)


def decide_unpaired(baseline: Run, candidate: Run, thresholds: Thresholds) -> Verdict:
    """Against an aggregate-only baseline: the weaker unpaired test, only where the policy allows it."""
    results, verdict = {}, "PASS"
    for task, summary in baseline.manifest["tasks"].items():
        policy = thresholds.task(task)
        if policy.require_paired:
            raise NotComparable(f"{task}: the baseline {baseline.path} is aggregate-only (score {summary['score']}, "
                                f"n = {summary['n_items']}, no per-item records) but thresholds require a paired test "
                                f"(tasks.{task}.require_paired); record a per-item W4A8 baseline")
        if task not in candidate.records:
            raise NotComparable(f"the candidate has no task {task}")
        scores = [float(r.get(policy.metric, 0.0)) for r in candidate.records[task]]
        res = stats.unpaired_two_proportion(summary["score"], summary["n_items"], sum(scores) / len(scores),
                                            len(scores), thresholds.alpha, policy.margin)
        results[task] = res.to_dict()
        if not res.non_inferior or res.p_degradation <= thresholds.alpha:
            verdict = "FAIL"
    notes = ["aggregate-only baseline: unpaired test, much weaker than the paired gate"]
    return Verdict(verdict, 0 if verdict == "PASS" else 1, None, None, thresholds, notes=notes, unpaired=results)


def default_thresholds_for(run: Run) -> str | None:
    """The canary's own policy for runs scored with the canary profiles; otherwise the default file."""
    from evalgate.canary import PROFILES, THRESHOLDS

    names = {t: s.get("name") for t, s in run.manifest.get("tasks", {}).items()}
    if names and all(PROFILES.get(t) == name for t, name in names.items()):
        return str(THRESHOLDS)
    return None


def gate_runs(baseline, candidate, thresholds_path: str | None = None, allow_uncalibrated: bool = False) -> Verdict:
    """Decide from stored runs only. ``baseline`` is a run/baseline folder or a list of baseline folders."""
    dirs = [Path(b) for b in (baseline if isinstance(baseline, (list, tuple)) else [baseline])]
    from evalgate.run.baselines import assemble

    base_run = assemble(dirs)
    cand_run = candidate if isinstance(candidate, Run) else load_run(candidate)
    thresholds = load_thresholds(thresholds_path or default_thresholds_for(cand_run))
    if base_run.manifest.get("aggregate_only"):
        return decide_unpaired(base_run, cand_run, thresholds)
    tasks = [t for t in cand_run.tasks if t in base_run.manifest.get("tasks", {})]
    missing = [t for t in cand_run.tasks if t not in tasks]
    if missing:
        raise NotComparable(f"the baseline has no {', '.join(missing)}; record a baseline for every task the candidate ran")
    aa = aa_for_baseline(dirs)
    comparison = compare(base_run, cand_run, tasks=tasks,
                         metrics={t: thresholds.task(t).metric for t in tasks})
    return decide(comparison, thresholds, aa=aa, require_aa=not allow_uncalibrated)


def write_outputs(verdict: Verdict, out_dir: str | Path) -> dict[str, Path]:
    """gate.json, report.md (also appended to $GITHUB_STEP_SUMMARY), junit.xml."""
    from evalgate.report import text as reports

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "gate.json", "markdown": out / "report.md", "junit": out / "junit.xml"}
    paths["json"].write_text(json.dumps(verdict.to_dict(), indent=2, default=_json_default, ensure_ascii=False) + "\n")
    markdown = reports.markdown(verdict)
    paths["markdown"].write_text(markdown, encoding="utf-8")
    paths["junit"].write_text(reports.junit_xml(verdict), encoding="utf-8")
    html = getattr(reports, "html", None)
    if html is not None:
        paths["html"] = out / "report.html"
        paths["html"].write_text(html(verdict), encoding="utf-8")
    reports.append_step_summary(markdown)
    return paths


def _json_default(obj):
    if isinstance(obj, set):
        return sorted(obj, key=str)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
