"""Stopping a gate's candidate run early once its FAIL is certain (docs/gate.md#stopping-early).

While the candidate runs, after each batch of scored items, ``EarlyStop`` decides the gate on the **best
completion** of what is stored: every item not yet run counted right (score 1), valid and not truncated. The
decision is the gate's own (``compare`` + ``decide``: the same policy, A/A record, Holm across every task).
The rule is monotone in each item's outcome — a lost item, a gained item turned wrong, a new invalid answer
or truncation can only move every statistic towards FAIL (the exact McNemar p, the rate checks, Holm's
adjusted p, the Tango and Newcombe lower bounds; tests/test_early_stop.py checks each over a full grid) — so
when the best completion FAILs, every completion does: the FAIL holds whatever the remaining items give.
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
import json
from pathlib import Path

from evalgate.errors import NotComparable, UserError
from evalgate.gate.policy import Thresholds, load_thresholds


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def best_completion_verdict(baseline, candidate, policy: Thresholds, aa: dict | None = None, require_aa: bool = True):
    """The gate's verdict on the best completion of ``candidate`` (a ``Run`` holding the items scored so far):
    the candidate taken as stopped early, its missing items right, valid and not truncated, decided by
    ``compare`` and ``decide`` exactly as the gate decides a complete run (conformance aside). Raises
    NotComparable / UserError / ValueError as they do."""
    from evalgate.gate.compare import compare
    from evalgate.gate.decide import decide
    from evalgate.run.store import Run

    partial = Run(path=candidate.path, manifest={**candidate.manifest, "status": "stopped_early"},
                  records=candidate.records)
    tasks = list(partial.manifest["tasks"])
    pairing = compare(baseline, partial, tasks=tasks, metrics={t: policy.task(t).metric for t in tasks}, aa_flips={})
    return decide(pairing, policy, aa=aa or {}, require_aa=require_aa)


class EarlyStop:
    """The gate's ``stop_when`` hook for ``evalgate.run.runner.execute``: called with the run folder and its
    manifest before generating and after items are scored and stored; returns the early-stop record when the
    gate's verdict is FAIL for every outcome of the items not yet run (a failed kernel conformance, or the
    best completion's FAIL), else None. Never raises for a comparison it cannot
    make (the complete run's gate reports that)."""

    def __init__(self, baselines, thresholds: Thresholds | str | Path | None = None,
                 allow_uncalibrated: bool = False, on_conformance: bool = True):
        from evalgate.run.baselines import aa_for_baseline, assemble

        self.dirs = [Path(b) for b in (baselines if isinstance(baselines, (list, tuple)) else [baselines])]
        self.policy = thresholds if isinstance(thresholds, Thresholds) else load_thresholds(thresholds)
        self.base = assemble(self.dirs)
        self.aa = aa_for_baseline(self.dirs)
        self.require_aa = not allow_uncalibrated
        # False: only the accuracy FAIL stops (selfcheck, which measures what the canary's accuracy catches)
        self.on_conformance = on_conformance
        self.checks = 0  # decisions made on a best completion
        self._seen = -1
        self._out: Path | None = None
        self._files: dict[str, tuple[int, list]] = {}  # task -> (bytes read, records) of the run watched
        self._below_best: frozenset | None = None  # items run below their best outcome, at the last decision

    def _read(self, out: Path, task: str) -> list[dict]:
        """The task's stored records, reading only what was appended since the last look."""
        path = out / f"{task}.jsonl"
        offset, records = self._files.get(task, (0, []))
        size = path.stat().st_size if path.exists() else 0
        if size < offset:  # rewritten (not during a run): read it again
            offset, records = 0, []
        if size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # still being written
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                offset += len(line)
        self._files[task] = (offset, records)
        return list(records)

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

    def why_not(self, manifest: dict) -> str | None:
        """Why this run cannot be stopped early (None: it can)."""
        if self.base.manifest.get("aggregate_only"):
            return "an aggregate-only baseline"
        k = (manifest.get("spec") or {}).get("samples") or 1
        if k > 1:
            return f"k = {k} samples per item (stopping early is proven for k = 1 only)"
        return None

    def __call__(self, out: Path, manifest: dict) -> dict | None:
        from evalgate.run.store import Run

        if self.why_not(manifest):
            return None
        out = Path(out)
        if out != self._out:
            self._out, self._files, self._below_best, self._seen = out, {}, None, -1
        totals = {t: int(s["n_items"]) for t, s in manifest["tasks"].items()}
        try:
            records = {t: self._read(out, t) for t in totals}
            run = {t: len({r["doc_id"] for r in records[t]}) for t in totals}
            below = self._below_best_items(records)
        except (OSError, KeyError, TypeError, ValueError):
            return None
        if all(run[t] >= totals[t] for t in totals):
            return None  # nothing left to save
        conformance = (manifest.get("kernel") or {}).get("conformance") or {}
        if self.on_conformance and conformance.get("ok", True) is False:  # decided before any item: the kernel is not what it declares
            return {"reason": f"FAIL certain before generating: kernel conformance FAIL ({conformance.get('summary', '')})",
                    "items_run": sum(run.values()), "items_total": sum(totals.values()), "at": _now(),
                    "tasks": {t: {"items_run": run[t], "items_total": totals[t]} for t in totals}}
        if sum(run.values()) == self._seen:
            return None  # nothing new since the last look
        self._seen = sum(run.values())
        if below == self._below_best:
            return None  # every item since the last decision ran as its best completion: the same verdict
        tasks = list(totals)
        try:
            verdict = best_completion_verdict(self.base, Run(path=out, manifest=manifest, records=records),
                                              self.policy, self.aa, self.require_aa)
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
