"""Two stored runs, paired item by item: comparability first (fail closed), then counts and flips.

``compare(baseline, candidate)`` works on stored runs only — no model — so any two runs can be compared
again later. The gate (``evalgate.gate.decide``) turns a Comparison into a verdict with the policy in
thresholds.yaml; notebooks use ``Comparison.summary``, ``Comparison.flips(task)`` and
``Comparison.show(task, doc_id)`` directly (statistics are computed on first use with the default policy
when no gate has decided). HTML rendering lives in ``evalgate.report.html``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from evalgate.errors import NotComparable, UserError
from evalgate.run.store import Run, load_run
from evalgate.tasks import get_task

# Run-level keys that must match for two runs to be comparable; the kernel is what may differ (§1).
MODEL_KEYS = ("fingerprint", "config_sha256", "safetensors_headers_sha256", "tokenizer_sha256")
SERVING_KEYS = ("adapter", "dtype")


def _as_run(run) -> Run:
    return run if isinstance(run, Run) else load_run(run)


def default_metric(task_name: str) -> str:
    return get_task(task_name).gate_metric


def is_invalid(task_name: str, record: dict, metric: str) -> bool:
    """An answer the scorer could not use: GSM8K ``[invalid]``, HumanEval no code or a syntax error."""
    task = get_task(task_name)
    check = getattr(task, "is_invalid", None)
    if check is not None:
        return bool(check(record, metric))
    return record.get("failure_class") in ("no_code", "failed:syntax")


def is_truncated(record: dict) -> bool:
    return record.get("finish_reason") == "length"


def comparability_problems(base: Run, cand: Run, tasks: list[str]) -> list[str]:
    """Everything that makes the two runs incomparable; empty when they may be compared."""
    problems: list[str] = []
    bm, cm = base.manifest, cand.manifest
    if bm.get("aggregate_only"):
        return problems  # checked by the gate against the policy (require_paired)
    for key in MODEL_KEYS:
        if bm.get("model", {}).get(key) != cm.get("model", {}).get(key):
            problems.append(f"model {key} differs ({_short(bm.get('model', {}).get(key))} vs {_short(cm.get('model', {}).get(key))})")
    for key in SERVING_KEYS:
        b, c = bm.get("model", {}).get(key), cm.get("model", {}).get(key)
        if b != c:
            problems.append(f"serving {key} differs ({b} vs {c})")
    for task in tasks:
        bt, ct = bm.get("tasks", {}).get(task), cm.get("tasks", {}).get(task)
        if bt is None or ct is None:
            problems.append(f"task {task} is missing from the {'baseline' if bt is None else 'candidate'}")
            continue
        for key in ("profile_id", "name"):
            if bt.get(key) != ct.get(key):
                problems.append(f"{task} profile {key} differs ({_short(bt.get(key))} vs {_short(ct.get(key))})")
        if bt.get("dataset_sha256") != ct.get("dataset_sha256"):
            problems.append(f"{task} dataset sha256 differs")
        if bt.get("decoding") != ct.get("decoding"):
            problems.append(f"{task} decoding settings differ ({bt.get('decoding')} vs {ct.get('decoding')})")
        for label, run in (("baseline", base), ("candidate", cand)):
            expected = run.manifest["tasks"][task].get("n_items")
            got = {r["doc_id"] for r in run.records.get(task, [])}
            if expected is not None and len(got) != expected:
                problems.append(f"{task}: the {label} has {len(got)} of {expected} items (crashed or unfinished run)")
        b_ids = {r["doc_id"] for r in base.records.get(task, [])}
        c_ids = {r["doc_id"] for r in cand.records.get(task, [])}
        if b_ids != c_ids:
            problems.append(f"{task}: item ids differ ({len(b_ids - c_ids)} only in baseline, {len(c_ids - b_ids)} only in candidate)")
    return problems


def _short(value) -> str:
    text = str(value)
    return text[:12] + "…" if len(text) > 13 else text


@dataclass
class TaskPairs:
    """One task's items, paired by doc_id in a stable order."""

    task: str
    metric: str
    doc_ids: list
    base: list[dict]
    cand: list[dict]

    def scores(self, side: str) -> list[float]:
        return [float(r.get(self.metric, 0.0)) for r in (self.base if side == "base" else self.cand)]

    def correct(self, side: str) -> list[bool]:
        return [s >= 1.0 for s in self.scores(side)]

    def invalid(self, side: str) -> list[bool]:
        return [is_invalid(self.task, r, self.metric) for r in (self.base if side == "base" else self.cand)]

    def truncated(self, side: str) -> list[bool]:
        return [is_truncated(r) for r in (self.base if side == "base" else self.cand)]

    def tokens(self, side: str) -> list[float]:
        return [float(r.get("n_tokens", 0)) for r in (self.base if side == "base" else self.cand)]


def pair_task(base: Run, cand: Run, task: str, metric: str | None = None) -> TaskPairs:
    metric = metric or default_metric(task)
    b = {r["doc_id"]: r for r in base.records[task]}
    c = {r["doc_id"]: r for r in cand.records[task]}
    ids = sorted(b, key=lambda x: (str(type(x)), x))
    for side, records in (("baseline", b), ("candidate", c)):
        missing = [i for i in ids if i in records and metric not in records[i]]
        if missing:
            raise UserError(f"{task}: the {side} records have no metric {metric!r} (item {missing[0]}); check thresholds.yaml's metric")
    return TaskPairs(task, metric, ids, [b[i] for i in ids], [c[i] for i in ids])


@dataclass
class Comparison:
    """Two runs paired by item. ``summary`` and ``flips(task)`` are pandas DataFrames."""

    baseline: Run
    candidate: Run
    pairs: dict[str, TaskPairs]
    aa_flips: dict[str, set] = field(default_factory=dict)  # items that flip between two baseline runs
    decision: object = None  # evalgate.stats.paired.OverallDecision once the gate has decided
    thresholds: object = None  # policy for statistics computed on demand: a path, a Thresholds, None = default
    notes: list[str] = field(default_factory=list)  # how on-demand statistics were decided
    stats_problem: str | None = None  # why on-demand statistics could not be decided (not retried)

    def ensure_decision(self):
        """The per-task statistics; decided here (lazily, default policy, A/A if on record) if no gate did."""
        if self.decision is None and self.stats_problem is None:
            from evalgate.api import decide_on_demand

            decide_on_demand(self)
        return self.decision

    @property
    def tasks(self) -> list[str]:
        return list(self.pairs)

    @property
    def summary(self):
        """One row per task: task, n, baseline, candidate, delta, ci_low, ci_high, b, c, p, verdict, ..."""
        import pandas as pd

        self.ensure_decision()
        rows = []
        for task, p in self.pairs.items():
            base, cand = p.correct("base"), p.correct("cand")
            b = sum(x and not y for x, y in zip(base, cand))
            c = sum(y and not x for x, y in zip(base, cand))
            row = {"task": task, "n": len(base), "baseline": sum(p.scores("base")) / len(base),
                   "candidate": sum(p.scores("cand")) / len(cand), "b": b, "c": c}
            row["delta"] = row["candidate"] - row["baseline"]
            dec = self.decision.tasks.get(task) if self.decision is not None else None
            if dec is not None:
                row.update(ci_low=dec.tango_ci[0], ci_high=dec.tango_ci[1], lower_bound=dec.gate_lower,
                           p=dec.p_degradation, p_adjusted=dec.p_degradation_adjusted, margin=dec.margin,
                           verdict=dec.verdict)
            rows.append(row)
        return pd.DataFrame(rows, columns=SUMMARY_COLUMNS + [k for k in rows[0] if k not in SUMMARY_COLUMNS] if rows
                            else SUMMARY_COLUMNS)

    def flips(self, task: str | None = None, direction: str | None = None, failure_class: str | None = None):
        """Items whose score differs: ``direction`` "lost" (baseline right, candidate wrong) or "gained".

        ``failure_class`` keeps items where either side failed that way (HumanEval, e.g. "failed:syntax").
        Without ``task``: every task's flips, with a ``task`` column first.
        """
        import pandas as pd

        if task is None:
            frames = [self.flips(t, direction, failure_class).assign(task=t) for t in self.pairs]
            columns = ["task"] + FLIP_COLUMNS
            return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)
        if task not in self.pairs:
            raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(self.pairs)}")
        if direction not in (None, "lost", "gained"):
            raise UserError(f"direction must be 'lost' or 'gained', not {direction!r}")
        p = self.pairs[task]
        rows = []
        for doc_id, br, cr, bs, cs in zip(p.doc_ids, p.base, p.cand, p.scores("base"), p.scores("cand")):
            if bs == cs:
                continue
            row = {"doc_id": doc_id, "direction": "lost" if bs > cs else "gained",
                   "question": br.get("question") or br.get("task_id"), "gold": br.get("target"),
                   "base_extracted": _extracted(br), "cand_extracted": _extracted(cr),
                   "base_correct": bs, "cand_correct": cs,
                   "base_finish_reason": br.get("finish_reason"), "cand_finish_reason": cr.get("finish_reason"),
                   "base_failure_class": br.get("failure_class"), "cand_failure_class": cr.get("failure_class"),
                   "flips_in_aa": doc_id in self.aa_flips.get(task, set()),
                   "base_response": br.get("resps"), "cand_response": cr.get("resps")}
            rows.append(row)
        df = pd.DataFrame(rows, columns=FLIP_COLUMNS)
        if direction:
            df = df[df["direction"] == direction]
        if failure_class:
            df = df[(df["base_failure_class"] == failure_class) | (df["cand_failure_class"] == failure_class)]
        order = {"lost": 0, "gained": 1}
        return df.sort_values(["direction", "doc_id"], key=lambda s: s.map(order) if s.name == "direction" else s,
                              kind="stable").reset_index(drop=True)


    def changed(self, task: str):
        """Items whose completion text differs, flipped or not (kernel drift shows here before scores move)."""
        import pandas as pd

        if task not in self.pairs:
            raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(self.pairs)}")
        p = self.pairs[task]
        rows = [{"doc_id": d, "flipped": bs != cs, "base_extracted": _extracted(b), "cand_extracted": _extracted(c),
                 "base_response": b.get("resps"), "cand_response": c.get("resps")}
                for d, b, c, bs, cs in zip(p.doc_ids, p.base, p.cand, p.scores("base"), p.scores("cand"))
                if b.get("resps") != c.get("resps")]
        return pd.DataFrame(rows, columns=["doc_id", "flipped", "base_extracted", "cand_extracted", "base_response",
                                           "cand_response"])

    def show(self, task: str, doc_id):
        """One item side by side: question, gold, both completions diffed, answers highlighted (HTML in Jupyter)."""
        from evalgate.report.html import ItemView

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
        from evalgate.report.html import comparison_html

        return comparison_html(self)

    def __repr__(self) -> str:
        counts = ", ".join(f"{t}: {len(p.doc_ids)} items" for t, p in self.pairs.items())
        return (f"Comparison(baseline={str(self.baseline.path)!r} [{self.baseline.kernel}], "
                f"candidate={str(self.candidate.path)!r} [{self.candidate.kernel}], {counts})")


SUMMARY_COLUMNS = ["task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high", "b", "c", "p", "verdict"]

FLIP_COLUMNS = ["doc_id", "direction", "question", "gold", "base_extracted", "cand_extracted", "base_correct",
                "cand_correct", "base_finish_reason", "cand_finish_reason", "base_failure_class",
                "cand_failure_class", "flips_in_aa", "base_response", "cand_response"]


def _extracted(record: dict):
    ex = record.get("extracted")
    if isinstance(ex, dict):
        return ex.get("strict-match", next(iter(ex.values()), None))
    return ex if ex is not None else record.get("failure_class")


def compare(baseline, candidate, tasks: list[str] | None = None, metrics: dict[str, str] | None = None,
            aa_flips: dict[str, set] | None = None, thresholds=None) -> Comparison:
    """Pair two stored runs (paths or ``Run``s). Refuses (``NotComparable``) when they must not be compared.

    ``thresholds`` (a policy file or ``Thresholds``; default: the packaged policy) is used when ``summary``
    needs statistics that no gate has decided yet.
    """
    base, cand = _as_run(baseline), _as_run(candidate)
    if base.manifest.get("aggregate_only"):
        raise NotComparable(f"{base.path} is an aggregate-only baseline (a published score, no per-item records); "
                            "it can only be gated with an unpaired test (see `evalgate gate`)")
    tasks = tasks or [t for t in cand.tasks if t in cand.records]
    problems = comparability_problems(base, cand, tasks)
    if problems:
        raise NotComparable("runs are not comparable: " + "; ".join(problems))
    metrics = metrics or {}
    pairs = {t: pair_task(base, cand, t, metrics.get(t)) for t in tasks}
    if aa_flips is None:  # the baseline's A/A record, so flips() can say which items are noise
        from evalgate.api import aa_records

        aa_flips = {t: a["flips"] for t, a in aa_records(base).items()}
    return Comparison(base, cand, pairs, aa_flips=aa_flips or {}, thresholds=thresholds)
