"""Stopping a gate's candidate run early once its FAIL is certain (docs/gate.md#stopping-early).

While the candidate runs, after each batch of scored items, ``EarlyStop`` decides the gate on the **best
completion** of what is stored: every item not yet run counted right (score 1), valid and not truncated. The
decision is the gate's own (``compare`` + ``decide``: the same policy, A/A record, Holm across every task).
The rule is monotone in each item's outcome — a lost item, a gained item turned wrong, a new invalid answer
or truncation can only move every statistic towards FAIL (the exact p of "Δ ≥ −M", the rate checks' exact p,
Holm's adjusted p, the Tango bound; tests/test_early_stop.py and tests/test_exact_ni.py check each over a
full grid) — so when the best completion FAILs, every completion does: the FAIL holds whatever the remaining
items give. The gate decides at the α of the look the run will be (evalgate.pipeline.gate), the smallest it
can be, so the FAIL also holds at an earlier look's larger α.
Only FAIL is ever stopped for; PASS and INCONCLUSIVE always run every item.

A kernel that does not compute the numerics it declares (its conformance record, checked when the model is
loaded: docs/gate.md#kernel-conformance) FAILs whatever its items give, so its run stops before generating
anything; ``--no-early-stop`` measures its accuracy in full (``on_conformance=False``: only the accuracy
FAIL stops, as in ``evalgate selfcheck``).

Not curtailed: runs of k > 1 samples per item (the score interval's monotonicity in each sample outcome is
not proven) and aggregate-only baselines.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from evalgate.errors import NotComparable, UserError
from evalgate.gate.policy import Thresholds
from evalgate.records import RunManifest


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def best_completion_verdict(baseline, candidate, policy: Thresholds, aa: dict | None = None, require_aa: bool = True,
                            across_serving: bool = False):
    """The gate's verdict on the best completion of ``candidate`` (a ``Run`` holding the items scored so far):
    the candidate taken as stopped early, its missing items right, valid and not truncated, decided by
    ``compare`` and ``decide`` exactly as the gate decides a complete run (conformance aside). Raises
    NotComparable / UserError / ValueError as they do."""
    from evalgate.gate.compare import compare
    from evalgate.gate.decide import decide
    from evalgate.run.store import Run

    partial = Run(path=candidate.path, manifest=candidate.meta.updated(status="stopped_early"),
                  records=candidate.records)
    tasks = list(partial.meta.tasks)
    pairing = compare(baseline, partial, tasks=tasks, metrics={t: policy.task(t).metric for t in tasks}, aa_flips={},
                      across_serving=across_serving)
    return decide(pairing, policy, aa=aa or {}, require_aa=require_aa)


class EarlyStop:
    """The gate's observer of its candidate run (``evalgate.run.observer.RunObserver``): it keeps the records
    the runner hands it and, asked ``should_stop()`` before generating and after items are scored and
    stored, returns the early-stop record when the gate's verdict is FAIL for every outcome of the items not
    yet run (a failed kernel conformance, or the best completion's FAIL), else None. Never raises for a
    comparison it cannot make (the complete run's gate reports that). Nothing is read from disk: the
    baseline comes loaded, the candidate's records from the runner."""

    def __init__(self, baseline, policy: Thresholds, allow_uncalibrated: bool = False, on_conformance: bool = True,
                 across_serving: bool = False, look_of=None):
        self.baseline = baseline  # evalgate.run.baselines.StoredBaseline
        self.across_serving = across_serving  # the gate compares across a serving difference (GatePlan)
        self.policy = policy
        self._base_policy = policy
        # manifest -> the look the run will take (its candidate is known once the run starts); None: ``policy`` as given
        self.look_of = look_of
        self.require_aa = not allow_uncalibrated
        # False: only the accuracy FAIL stops (selfcheck, which measures what the canary's accuracy catches)
        self.on_conformance = on_conformance
        self.checks = 0  # decisions made on a best completion
        self.run = None  # the finished run (``finished``)
        self._seen = -1
        self._manifest: RunManifest | None = None
        self._path: Path | None = None
        self._records: dict[str, list[dict]] = {}
        self._below_best: frozenset | None = None  # items run below their best outcome, at the last decision

    # ---- RunObserver ----

    def started(self, run) -> None:
        self._path, self._manifest = run.path, run.meta  # the live manifest: the tasks' preparation joins it
        if self.look_of is not None:
            try:
                self.policy = self._base_policy.at_look(self.look_of(run.meta))
            except (UserError, OSError, ValueError):  # no look to take: the gate itself says why, after the run
                self._manifest = None
        self._records = {t: list(run.records.get(t, [])) for t in run.meta.tasks}
        if any(self._records.values()):  # a resumed run: what it holds is decided before anything is generated
            self._seen, self._below_best = -1, None
        else:  # nothing stored: its best completion is every item at its best, decided once one falls short
            self._seen, self._below_best = 0, frozenset()

    def scored(self, task: str, records: list[dict]) -> None:
        self._records.setdefault(task, []).extend(records)

    def finished(self, run) -> None:
        self.run = run

    def _below_best_items(self, records: dict) -> frozenset:
        """The items run whose outcome is worse than the best completion's (wrong, invalid or truncated): when
        they are the same as at the last decision, the best completion is the same, and so is its verdict."""
        from evalgate.gate.compare import is_invalid, is_truncated

        out = set()
        for task, rows in records.items():
            metric = self.policy.task(task).metric
            for r in rows:
                if float(r.get(metric, 0.0)) < 1.0 or is_invalid(task, r, metric) or is_truncated(r):
                    out.add((task, r["doc_id"]))
        return frozenset(out)

    def why_not(self, manifest: RunManifest) -> str | None:
        """Why this run cannot be stopped early (None: it can)."""
        if self.baseline.run.meta.aggregate_only:
            return "an aggregate-only baseline"
        k = getattr(manifest.spec, "samples", None) or 1  # the run's RunSpec (open: an older run's has none)
        if k > 1:
            return f"k = {k} samples per item (stopping early is proven for k = 1 only)"
        return None

    def should_stop(self) -> dict | None:
        from evalgate.run.store import Run

        manifest, path = self._manifest, self._path
        if manifest is None or path is None or self.why_not(manifest):
            return None
        totals = {t: s.n_items for t, s in manifest.tasks.items()}
        try:
            records = {t: list(self._records.get(t, [])) for t in totals}
            run = {t: len({r["doc_id"] for r in records[t]}) for t in totals}
            below = self._below_best_items(records)
        except (KeyError, TypeError, ValueError, UserError):
            return None
        if all(run[t] >= totals[t] for t in totals):
            return None  # nothing left to save
        conformance = manifest.kernel.conformance
        if self.on_conformance and conformance is not None and not conformance.ok:  # decided before any item: the kernel is not what it declares
            return {"reason": f"FAIL certain before generating: kernel conformance FAIL ({conformance.summary})",
                    "items_run": sum(run.values()), "items_total": sum(totals.values()), "at": _now(),
                    "tasks": {t: {"items_run": run[t], "items_total": totals[t]} for t in totals}}
        if sum(run.values()) == self._seen:
            return None  # nothing new since the last look
        self._seen = sum(run.values())
        if below == self._below_best:
            return None  # every item since the last decision ran as its best completion: the same verdict
        tasks = list(totals)
        try:
            candidate = Run(path=path, manifest=manifest, records=records)
            verdict = best_completion_verdict(self.baseline.run, candidate, self.policy, self.baseline.aa,
                                              self.require_aa, self.across_serving)
        except (NotComparable, UserError, ValueError, KeyError):
            return None
        self.checks += 1
        self._below_best = below
        if verdict.decision.verdict != "FAIL":
            return None
        reasons = [r for r in verdict.decision.reasons if not r.split(": ", 1)[-1].startswith("inconclusive")]
        return {"reason": f"FAIL certain once {self._seen} items were stored, on their best completion: "
                          + "; ".join(reasons),
                "items_run": self._seen, "items_total": sum(totals.values()), "at": _now(),
                "tasks": {t: {"items_run": run[t], "items_total": totals[t]} for t in tasks}}
