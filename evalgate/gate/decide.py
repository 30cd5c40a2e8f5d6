"""The gate: a Pairing plus the policy (thresholds.yaml) and the baseline's A/A record -> a Verdict.

Validity first, failing closed (docs/gate.md#the-decision-rule): comparable runs, every item on both
sides with the same k samples, the HumanEval executor self-test passed, an A/A calibration on record that did
not fail. Then the rule of ``evalgate.gate.rule`` per task, Holm across tasks: PASS only if every task
passes, FAIL if any fails, else INCONCLUSIVE (exit 3). Nothing
passed in is changed: the verdict carries its own pairing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from evalgate.errors import NotComparable, UserError
from evalgate.gate.compare import Pairing, compare, serving_difference
from evalgate.gate.policy import Thresholds
from evalgate.gate.rule import GateRule, TaskData, TaskRule, decide_overall, decide_task
from evalgate.gate.verdict import EXIT_CODES, Verdict
from evalgate.run.baselines import StoredBaseline
from evalgate.run.store import Run
from evalgate.stats.margin import pooled_psi
from evalgate.stats.unpaired import unpaired_two_proportion
from evalgate.tasks import comparison_notes

CONFORMANCE_UNCHECKED = ("kernel conformance not checked: the candidate's kernel ran outside evalgate (a server) or "
                         "its run predates the check; decided on accuracy alone")
UNPAIRED_NOTE = "aggregate-only baseline: pairing ignored, much weaker than the paired McNemar/Tango gate"


def _validity_problems(pairing: Pairing, thresholds: Thresholds, aa: dict, require_aa: bool) -> list[str]:
    problems: list[str] = []
    for task in pairing.pairs:
        policy = thresholds.task(task)
        profile_name = pairing.candidate.meta.tasks[task].name
        if profile_name != policy.profile:
            problems.append(f"thresholds give {task} profile {policy.profile!r} but the runs used {profile_name!r}; "
                            f"pass --thresholds with a section for that profile")
            continue
        for side, run in (("baseline", pairing.baseline), ("candidate", pairing.candidate)):
            prep = run.meta.tasks[task].prepare
            if prep is not None and prep.ok is False:
                problems.append(f"{task}: the {side}'s executor self-test failed")
        if not pairing.pairs[task].doc_ids:
            problems.append(f"{task}: the runs have no items for this task; run it with items (check --limit)")
        task_aa = aa.get(task)
        if task_aa is None and require_aa and policy.min_aa_runs > 0:
            problems.append(f"{task}: no A/A calibration on record for the baseline; run `evalgate calibrate` "
                            f"(or pass --allow-uncalibrated to decide without it)")
        elif task_aa is not None and task_aa.get("verdict") not in (None, "PASS", "INCONCLUSIVE"):
            problems.append(f"{task}: the baseline's own A/A pair failed the gate ({task_aa.get('verdict')}): "
                            "the stack is not reproducible, or the baseline kernel degrades against itself")
        elif task_aa is not None:
            problems += _aa_record_problems(task, task_aa, policy.min_aa_runs if require_aa else 0)
    return problems


def aa_runs(entry: dict) -> list[tuple[Any, Any]]:
    """The A/A runs a task's record holds, each (ψ₀, n) as stored (unchecked: ``_aa_record_problems`` checks
    them): its ``runs`` when calibrate pooled several, else one."""
    runs = entry.get("runs")
    if isinstance(runs, list) and runs:
        return [(r.get("psi0"), r.get("n")) for r in runs if isinstance(r, dict)]
    return [(entry.get("psi0"), entry.get("n"))]


def _aa_record_problems(task: str, entry: dict, min_runs: int) -> list[str]:
    """A/A values that cannot be (a flip rate outside [0, 1], no items) and too few A/A runs (min_aa_runs)."""
    out = []
    for psi0, n in aa_runs(entry):
        if psi0 is not None and not (isinstance(psi0, (int, float)) and 0.0 <= psi0 <= 1.0):
            out.append(f"{task}: the baseline's A/A record is corrupt (psi0 = {psi0!r}, not a flip rate in [0, 1]); "
                       "re-run `evalgate calibrate`")
        if n is not None and not (isinstance(n, int) and n > 0):
            out.append(f"{task}: the baseline's A/A record is corrupt (n = {n!r}, not a positive item count); "
                       "re-run `evalgate calibrate`")
    count = len(aa_runs(entry))
    if count < min_runs:
        out.append(f"{task}: the policy asks for {min_runs} A/A runs (tasks.{task}.min_aa_runs) and the baseline has "
                   f"{count}; run `evalgate calibrate` again to add one (each run is pooled), or pass "
                   "--allow-uncalibrated")
    return out


def decide(pairing: Pairing, thresholds: Thresholds, aa: dict | None = None, require_aa: bool = True) -> Verdict:
    """Per-task paired decisions, then the overall verdict. Raises NotComparable on a validity failure."""
    aa = aa or {}
    problems = _validity_problems(pairing, thresholds, aa, require_aa)
    if problems:
        raise NotComparable("cannot decide: " + "; ".join(problems))
    scored = pairing.with_metrics({t: thresholds.task(t).metric for t in pairing.pairs})
    problems = [p for pairs in scored.pairs.values() for p in pairs.problems()]
    if problems:
        raise NotComparable("cannot decide: " + "; ".join(problems))
    if aa:
        scored = replace(scored, aa_flips={t: a["flips"] for t, a in aa.items()})
    decisions = []
    for task, pairs in scored.pairs.items():
        task_aa = _pooled(aa.get(task) or {})
        # per-item scores are means over k samples (docs/gate.md#k-samples); k = 1: binary, McNemar and Tango
        data = TaskData(
            task, pairs.scores("base"), pairs.scores("cand"), n_samples=pairs.n_samples("base"),
            base_samples=pairs.sample_scores("base"), cand_samples=pairs.sample_scores("cand"),
            base_invalid=pairs.invalid("base"), cand_invalid=pairs.invalid("cand"),
            base_truncated=pairs.truncated("base"), cand_truncated=pairs.truncated("cand"),
            # on the items the candidate ran (a stopped-early candidate may have run none of a task's)
            base_tokens=pairs.tokens("base") if any(pairs.observed()) else None,
            cand_tokens=pairs.tokens("cand") if any(pairs.observed()) else None,
            aa_psi0=task_aa.get("psi0"), aa_n=task_aa.get("n"),
            # a stopped-early task: the noise warning looks at the items run, not the best completion's gains
            items_run=pairs.observed() if pairs.imputed else None,
        )
        decisions.append(decide_task(data, TaskRule.from_policy(thresholds, task)))
    overall = decide_overall(decisions, GateRule.from_policy(thresholds))
    notes = [] if aa else ["decided without an A/A calibration (--allow-uncalibrated)"]
    aa_out = {t: {**a, **_aa_bound(overall.tasks.get(t))} for t, a in aa.items()}
    return Verdict(overall.verdict, overall.exit_code, overall, scored, thresholds, aa=aa_out, notes=notes)


def _pooled(entry: dict) -> dict:
    """A task's A/A record with ψ₀ and n pooled over its runs (``pooled_psi``: flips and items summed)."""
    runs = aa_runs(entry)
    if len(runs) < 2 or any(psi is None or n is None for psi, n in runs):
        return entry
    psi0, n = pooled_psi(runs)
    return {**entry, "psi0": psi0, "n": n}


def _aa_bound(dec) -> dict:
    """What the verdict adds to a task's A/A record: ψ₀'s one-sided upper bound and the MDE at it."""
    if dec is None or dec.resolution.aa_psi0_upper is None:
        return {}
    return {"psi0_upper": dec.resolution.aa_psi0_upper, "mde_at_psi0_upper": dec.resolution.aa_mde}


def decide_unpaired(baseline: Run, candidate: Run, thresholds: Thresholds) -> Verdict:
    """Against an aggregate-only baseline: the weaker unpaired test, only where the policy allows it."""
    results, verdict = {}, "PASS"
    for task, summary in baseline.meta.tasks.items():
        policy = thresholds.task(task)
        if policy.require_paired:
            raise NotComparable(f"{task}: the baseline {baseline.path} is aggregate-only (score {summary.score}, "
                                f"n = {summary.n_items}, no per-item records) but thresholds require a paired test "
                                f"(tasks.{task}.require_paired); record a per-item W4A8 baseline")
        if task not in candidate.records:
            raise NotComparable(f"the candidate has no task {task}")
        scores = [float(r.get(policy.metric, 0.0)) for r in candidate.records[task]]
        if summary.score is None:
            raise NotComparable(f"{task}: the aggregate-only baseline {baseline.path} holds no score")
        res = unpaired_two_proportion(summary.score, summary.n_items, sum(scores) / len(scores),
                                      len(scores), thresholds.alpha, policy.margin)
        results[task] = {**res.to_dict(), "note": UNPAIRED_NOTE}
        if not res.non_inferior or res.p_degradation <= thresholds.alpha:
            verdict = "FAIL"
    notes = ["aggregate-only baseline: unpaired test, much weaker than the paired gate"]
    return Verdict(verdict, 0 if verdict == "PASS" else 1, None, None, thresholds, notes=notes, unpaired=results)


def gate_runs(stored: StoredBaseline, candidate: Run, policy: Thresholds, allow_uncalibrated: bool = False,
              items: str = "all", across_serving: bool = False) -> Verdict:
    """Decide from loaded runs: ``stored`` the baseline (``run.baselines.load_baseline``), ``candidate`` the
    run, ``policy`` the parsed policy (the edges load them: CLI, API). ``items="candidate"``: decide on the
    candidate's items only (a ``--limit`` run against a full baseline), both runs cut to them after an
    item-by-item check (``gate.subset``); the policy's margins stay, the smaller n decides. ``across_serving``:
    compare although the two servers differ in serving identity (shared-expert fusion, routed scaling), which
    the verdict then says."""
    dirs, base_run, cand_run = list(stored.dirs), stored.run, candidate
    subset_notes: list[str] = []
    if items == "candidate" and not base_run.meta.aggregate_only:
        from evalgate.gate.subset import item_lists, restrict

        base_run, cand_run, subset_notes = restrict(base_run, cand_run, item_lists("candidate", base_run, cand_run, None))
    elif items != "all":
        raise UserError(f'items must be "all" or "candidate", not {items!r}')
    if base_run.meta.aggregate_only:
        return with_conformance(replace(decide_unpaired(base_run, cand_run, policy), baseline_dirs=[str(d) for d in dirs]),
                                cand_run)
    tasks = [t for t in cand_run.tasks if t in base_run.meta.tasks]
    missing = [t for t in cand_run.tasks if t not in tasks]
    if missing:
        raise NotComparable(f"the baseline has no {', '.join(missing)}; record a baseline for every task the candidate ran")
    pairing = compare(base_run, cand_run, tasks=tasks, metrics={t: policy.task(t).metric for t in tasks},
                      aa_flips={t: a["flips"] for t, a in stored.aa.items()}, across_serving=across_serving)
    differs = serving_difference(base_run, cand_run) if across_serving else None
    if differs:
        subset_notes.append(f"compared across a serving difference, as asked (--across-serving): {differs}; the "
                            "verdict covers the kernel and that difference together")
    verdict = decide(pairing, policy, aa=stored.aa, require_aa=not allow_uncalibrated)
    # what the tasks note about the two runs (HumanEval: programs run under different Python minors), in gate.json
    notes = [*subset_notes, *verdict.notes, *comparison_notes(base_run.meta, cand_run.meta, tasks)]
    verdict = replace(verdict, baseline_dirs=[str(d) for d in dirs], notes=notes)
    if pairing.stopped_early:  # decided on its best completion: certain FAIL, or no verdict at all
        from evalgate.gate.stopped import check_stopped_verdict, summary

        conformance, stop = cand_run.meta.kernel.conformance, cand_run.meta.early_stop
        check_stopped_verdict(verdict, cand_run.path, conformance.to_dict() if conformance is not None else None)
        verdict = replace(verdict, early_stop=summary(verdict.comparison, stop.to_dict() if stop is not None else None))
    return with_conformance(verdict, cand_run)


def with_conformance(verdict: Verdict, candidate: Run) -> Verdict:
    """The candidate kernel's conformance (docs/gate.md#kernel-conformance), recorded in its run, joins the
    verdict: a kernel that does not compute the numerics it declares FAILs, whatever its accuracy. A run
    without the record (a server's kernel is out of reach) is decided on accuracy alone, with a note. A server
    that reported another kernel than the one named (``model.kernel_check``) gets no verdict; one whose kernel
    could not be verified is said in the notes."""
    served = getattr(candidate.meta.model, "kernel_check", None) or {}  # a server adapter's own field (open)
    if served.get("status") == "contradicted":
        raise NotComparable(f"cannot decide: the candidate's server contradicts its kernel ({served.get('why')})")
    if served.get("status") in ("unverified", "unverifiable"):  # "unverifiable": runs stored before the rename
        verdict = replace(verdict, notes=[*verdict.notes, f"server kernel unverified: {served.get('why')}"])
    elif served.get("status") == "verified" and served.get("rests_on"):  # the fields the label rests on
        fields = ", ".join(f"{k}={v!r}" for k, v in served["rests_on"].items())
        verdict = replace(verdict, notes=[*verdict.notes, f"server kernel verified from {fields}"])
    conformance = candidate.meta.kernel.conformance
    if conformance is None:
        return replace(verdict, notes=[*verdict.notes, CONFORMANCE_UNCHECKED])
    if conformance.ok:
        return replace(verdict, conformance=conformance.to_dict())
    return replace(verdict, verdict="FAIL", exit_code=EXIT_CODES["FAIL"], conformance=conformance.to_dict())
