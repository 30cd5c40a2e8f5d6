"""The notebook surface: ``load_run``, ``compare`` and ``decide`` on stored runs (no model needed).

``compare(baseline, candidate)`` returns a ``Comparison``: the two runs paired item by item, with
``summary`` (scores, Δ, CI, b/c, p, verdict per task), ``flips(task)``, ``changed(task)``, ``show(task,
doc_id)`` and an HTML summary in Jupyter. Its statistics are the gate's rule, decided on first use with the
policy given (default: the canary's policy for canary runs, else the packaged one), the baseline's A/A
record when it has one, and no refusal for a missing calibration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.canary import policy_for
from evalgate.errors import UserError
from evalgate.gate.compare import Pairing
from evalgate.gate.compare import compare as pair_runs
from evalgate.gate.decide import decide as decide_pairing
from evalgate.gate.decide import gate_runs
from evalgate.gate.policy import Thresholds, load_thresholds
from evalgate.gate.verdict import OverallDecision, Verdict
from evalgate.report.html import ItemView, comparison_html
from evalgate.records import load_verdict
from evalgate.run.baselines import aa_for_baseline, assemble
from evalgate.run.store import Run, load_run

SUMMARY_COLUMNS = ["task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high", "b", "c", "p", "verdict"]


def _policy(thresholds, run: Run) -> Thresholds:
    if isinstance(thresholds, Thresholds):
        return thresholds
    return load_thresholds(thresholds or policy_for(run))


def _for_profiles_used(pairing: Pairing, policy: Thresholds, notes: list[str]) -> Thresholds:
    """The policy with each task's profile set to the one the runs used (a notebook may look at any profile)."""
    tasks = dict(policy.tasks)
    for task in pairing.pairs:
        used = pairing.candidate.manifest["tasks"][task].get("name")
        if task in tasks and tasks[task].profile != used:
            notes.append(f"{task}: the policy is written for profile {tasks[task].profile!r}; "
                         f"its margin is applied to {used!r}")
            tasks[task] = dataclasses.replace(tasks[task], profile=used)
    return dataclasses.replace(policy, tasks=tasks)


@dataclass(repr=False)  # the Pairing's short repr
class Comparison(Pairing):
    """A ``Pairing`` with statistics for notebooks: ``summary``, ``show``, and an HTML summary."""

    thresholds: object = None  # a policy file, a ``Thresholds``, or None for the default
    notes: list[str] = field(default_factory=list)  # how the statistics were decided
    stats_problem: str | None = None  # why statistics could not be decided (not retried)
    _verdict: Verdict | None = field(default=None, repr=False)

    @property
    def verdict(self) -> Verdict | None:
        """The gate's verdict on this pair (decided once, on first use); None when it cannot be decided."""
        if self._verdict is None and self.stats_problem is None:
            try:
                aa = aa_for_baseline([self.baseline.path])
            except (OSError, ValueError):  # an unreadable aa.json must not stop anyone looking at flips
                aa = {}
            try:
                policy = _for_profiles_used(self, _policy(self.thresholds, self.candidate), self.notes)
                self._verdict = decide_pairing(self, policy, aa=aa, require_aa=False)
            except UserError as exc:  # NotComparable included: the numbers would not be a valid gate
                self.stats_problem = f"no statistics: {exc}"
                self.notes.append(self.stats_problem)
                return None
            self.notes.extend(self._verdict.notes)
        return self._verdict

    @property
    def decision(self) -> OverallDecision | None:
        verdict = self.verdict
        return verdict.decision if verdict is not None else None

    def ensure_decision(self) -> OverallDecision | None:
        return self.decision

    @property
    def aa(self) -> dict:
        verdict = self.verdict
        return verdict.aa if verdict is not None else {}

    @property
    def summary(self):
        """One row per task: task, n, baseline, candidate, delta, ci_low, ci_high, b, c, p, verdict, ..."""
        import pandas as pd

        decision = self.decision
        rows = []
        for task, p in self.pairs.items():
            base, cand = p.correct("base"), p.correct("cand")
            row = {"task": task, "n": len(base), "baseline": sum(p.scores("base")) / len(base),
                   "candidate": sum(p.scores("cand")) / len(cand),
                   "b": sum(x and not y for x, y in zip(base, cand)), "c": sum(y and not x for x, y in zip(base, cand))}
            row["delta"] = row["candidate"] - row["baseline"]
            dec = decision.tasks.get(task) if decision is not None else None
            if dec is not None:
                row.update(ci_low=dec.tango_ci[0], ci_high=dec.tango_ci[1], lower_bound=dec.gate_lower,
                           p=dec.p_degradation, p_adjusted=dec.p_degradation_adjusted, margin=dec.margin,
                           verdict=dec.verdict)
            rows.append(row)
        columns = SUMMARY_COLUMNS + [k for k in rows[0] if k not in SUMMARY_COLUMNS] if rows else SUMMARY_COLUMNS
        return pd.DataFrame(rows, columns=columns)

    def show(self, task: str, doc_id) -> ItemView:
        """One item side by side: question, gold, both completions diffed, answers highlighted (HTML in Jupyter)."""
        if task not in self.pairs:
            raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(self.pairs)}")
        p = self.pairs[task]
        index = {str(d): i for i, d in enumerate(p.doc_ids)}
        i = index.get(str(doc_id))
        if i is None:
            raise UserError(f"{task} has no item {doc_id!r}; ids run from {p.doc_ids[0]!r} to {p.doc_ids[-1]!r}")
        return ItemView(task, p.doc_ids[i], p.base[i], p.cand[i], p.metric,
                        flips_in_aa=p.doc_ids[i] in self.aa_flips.get(task, set()))

    def _repr_html_(self) -> str:
        return comparison_html(self)


def _gate_file(path: Path) -> Path | None:
    """``gate.json`` of a gate's report folder, or of a run folder the gate wrote into (``<run>/gate/``)."""
    for candidate in (path / "gate.json", path / "gate" / "gate.json"):
        if candidate.is_file():
            return candidate
    return None


def _sides(baseline, candidate) -> tuple[Run | list[Path], Run | Path]:
    """What ``compare`` was given, as (baseline run or baseline folders, candidate): a gate's output folder
    stands for both sides it decided on."""
    if candidate is None:
        found = _gate_file(Path(baseline)) if not isinstance(baseline, (list, tuple, Run)) else None
        if found is None:
            raise UserError(f"compare needs a baseline and a candidate, or a gate's output folder (with gate.json); "
                            f"{baseline!r} is neither")
        record = load_verdict(found)
        if record.candidate is None:
            raise UserError(f"{found} decided against an aggregate-only baseline: there are no items to pair")
        dirs = record.baseline_dirs or [record.baseline.path]
        return [Path(d) for d in dirs], Path(record.candidate.path)
    if isinstance(baseline, (list, tuple)):
        return [Path(b) for b in baseline], candidate
    return baseline, candidate


def compare(baseline, candidate=None, tasks: list[str] | None = None, metrics: dict[str, str] | None = None,
            aa_flips: dict[str, set] | None = None, thresholds=None) -> Comparison:
    """Pair two stored runs; refuses (``NotComparable``) when they must not be compared.

    ``baseline`` is a run or baseline folder, a ``Run``, or a list of per-task baseline folders (as stored
    by ``evalgate calibrate``); ``compare(gate_dir)`` alone pairs what a gate decided on (its ``gate/``
    folder or the run folder holding it). ``thresholds`` (a policy file or ``Thresholds``) is used when
    ``summary`` needs statistics.
    """
    baseline, candidate = _sides(baseline, candidate)
    if isinstance(baseline, list):
        if aa_flips is None:
            aa_flips = {t: a["flips"] for t, a in aa_for_baseline(baseline).items()}
        baseline = assemble(baseline)
    pairing = pair_runs(baseline, candidate, tasks=tasks, metrics=metrics, aa_flips=aa_flips)
    return Comparison(pairing.baseline, pairing.candidate, pairing.pairs, pairing.aa_flips, thresholds=thresholds)


def decide(baseline, candidate, thresholds=None, allow_uncalibrated: bool = False) -> Verdict:
    """The gate's verdict from stored runs: ``baseline`` a folder or a list of per-task baseline folders."""
    cand = candidate if isinstance(candidate, Run) else load_run(candidate)
    return gate_runs(baseline, cand, _policy(thresholds, cand), allow_uncalibrated)


__all__ = ["Comparison", "Run", "compare", "decide", "load_run"]
