"""Two stored runs, paired item by item: comparability first (fail closed), then counts and flips.

``compare(baseline, candidate)`` works on stored runs only — no model — so any two runs can be compared
again later. It returns a ``Pairing``: the items of each task side by side, with the flip tables. Deciding
PASS/FAIL is ``evalgate.gate.decide``'s job; the notebook object with statistics and HTML is
``evalgate.api.Comparison``. Nothing here mutates a pairing once built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evalgate.errors import NotComparable, UserError
from evalgate.records import RunManifest
from evalgate.run.baselines import aa_for_baseline
from evalgate.run.store import Run
from evalgate.tasks import get_task

# Run-level keys that must match for two runs to be comparable; the kernel is what may differ (docs/scoring.md#comparability).
MODEL_KEYS = ("fingerprint", "config_sha256", "safetensors_headers_sha256", "tokenizer_sha256")
# serving_identity: how a server computes around the kernel (shared-expert fusion, routed-scaling placement)
SERVING_KEYS = ("adapter", "dtype", "serving_identity")
LEGACY = "fp32 in BLAS order (before canonical-v1)"  # what a run recorded before the scheme was named used
OWN = "the kernel's own"  # not an evalgate emulation (the BF16 reference, a real kernel): nothing to match


def numerics_of(manifest: RunManifest) -> tuple[str, str]:
    """(forward-pass numerics, kernel accumulation) a run was made with (docs/kernels.md#accumulation).
    In-process runs recorded before canonical-v1 carry neither; a server run has no forward-pass numerics
    of evalgate's and says "server". The accumulation scheme is a property of evalgate's emulated recipes
    (those with a ``group_size``); another kernel accumulates its own way, which is what a gate compares."""
    model, recipe = manifest.model, manifest.kernel.recipe or {}
    forward = getattr(model, "numerics", None) or ("server" if model.adapter not in (None, "hf") else LEGACY)
    if "group_size" not in recipe:
        return forward, OWN
    return forward, recipe.get("accumulation") or LEGACY


def default_metric(task_name: str) -> str:
    return get_task(task_name).gate_metric


def is_invalid(task_name: str, record: dict, metric: str) -> bool:
    """An answer the scorer could not use: GSM8K ``[invalid]``, HumanEval no code or a syntax error."""
    return bool(get_task(task_name).is_invalid(record, metric))


def is_truncated(record: dict) -> bool:
    return record.get("finish_reason") == "length"


def serving_difference(base: Run, cand: Run) -> str | None:
    """How the two runs' servers compute around the kernel differently (shared-expert fusion, routed-scaling
    placement), or None when they do not."""
    b, c = getattr(base.meta.model, "serving_identity", None), getattr(cand.meta.model, "serving_identity", None)
    return None if b == c else f"serving identity differs ({b} vs {c})"


def comparability_problems(base: Run, cand: Run, tasks: list[str], across_serving: bool = False) -> list[str]:
    """Everything that makes the two runs incomparable; empty when they may be compared. ``across_serving``:
    the user asked to compare across a difference in serving identity (said in the verdict instead)."""
    problems: list[str] = []
    bm, cm = base.meta, cand.meta
    if bm.aggregate_only:
        return problems  # checked by the gate against the policy (require_paired)
    for key in MODEL_KEYS:  # the model's fields, typed or the adapter's own (open)
        if getattr(bm.model, key, None) != getattr(cm.model, key, None):
            problems.append(f"model {key} differs ({_short(getattr(bm.model, key, None))} vs "
                            f"{_short(getattr(cm.model, key, None))})")
    for key in SERVING_KEYS:
        b, c = getattr(bm.model, key, None), getattr(cm.model, key, None)
        if key == "serving_identity" and b != c:
            if not across_serving:
                problems.append(f"serving identity differs ({b} vs {c}): the servers compute around the kernel "
                                "differently; to compare across that, pass --across-serving (across_serving=True)")
            continue
        if b != c:
            problems.append(f"serving {key} differs ({b} vs {c})")
    (bf, ba), (cf, ca) = numerics_of(bm), numerics_of(cm)
    if bf != cf:
        problems.append(f"forward-pass numerics differ ({bf} vs {cf}): re-record the baseline with this evalgate")
    if ba != ca and "server" not in (bf, cf) and OWN not in (ba, ca):
        problems.append(f"kernel accumulation differs ({ba} vs {ca}): re-record the baseline with this evalgate")
    if stopped_early(base):
        problems.append(f"the baseline {base.path} is a run the gate stopped early ({_stopped_text(bm)}); a "
                        "baseline needs every item: complete it with `evalgate run --resume --out "
                        f"{base.path}` first")
        return problems
    partial = stopped_early(cand)  # its missing items are decided on their best completion
    for task in tasks:
        bt, ct = bm.tasks.get(task), cm.tasks.get(task)
        if bt is None or ct is None:
            problems.append(f"task {task} is missing from the {'baseline' if bt is None else 'candidate'}")
            continue
        bd, cd = bt.decoding or {}, ct.decoding or {}
        if bd != cd:
            # the profile id covers the decoding: name the settings a user passes, not two hashes
            problems.append(f"{task} sampling settings differ ({_sampling(bd)} vs {_sampling(cd)}); runs with "
                            "different --samples/--temperature/--seed are not comparable")
        else:
            for key in ("profile_id", "name"):
                if getattr(bt, key) != getattr(ct, key):
                    problems.append(f"{task} profile {key} differs ({_short(getattr(bt, key))} vs {_short(getattr(ct, key))})")
        if bt.dataset_sha256 != ct.dataset_sha256:
            problems.append(f"{task} dataset sha256 differs")
        for label, run in (("baseline", base), ("candidate", cand)):
            if label == "candidate" and partial:
                continue
            expected = run.meta.tasks[task].n_items
            got = {r["doc_id"] for r in run.records.get(task, [])}
            if len(got) != expected:
                problems.append(f"{task}: the {label} has {len(got)} of {expected} items (crashed or unfinished run)")
        b_ids = {r["doc_id"] for r in base.records.get(task, [])}
        c_ids = {r["doc_id"] for r in cand.records.get(task, [])}
        if partial and c_ids <= b_ids:
            continue
        if b_ids != c_ids:
            problems.append(f"{task}: item ids differ ({len(b_ids - c_ids)} only in baseline, {len(c_ids - b_ids)} only in candidate)")
    return problems


def stopped_early(run: Run) -> bool:
    """Whether the gate stopped this run early (docs/gate.md#stopping-early): its missing items are decided on
    their best completion, and it can never be a baseline."""
    return run.meta.status == "stopped_early"


def _stopped_text(manifest: RunManifest) -> str:
    info = manifest.early_stop
    if info is not None:
        return f"{info.items_run} of {info.items_total} items run"
    return "not every item run"


def best_completion_record(base_record: dict, metric: str) -> dict:
    """What the best completion puts in place of an item the candidate did not run: right, valid, not truncated
    (the per-item values ``TaskPairs`` reads for an imputed item; docs/gate.md#stopping-early)."""
    return {"doc_id": base_record["doc_id"], metric: 1.0, "n_samples": n_samples_of(base_record),
            "finish_reason": "stop", "best_completion": True}


def _sampling(decoding: dict) -> str:
    if not decoding.get("temperature"):
        return f"greedy, k = {decoding.get('n', 1)}"
    return f"k = {decoding.get('n', 1)}, T = {decoding.get('temperature')}, seed {decoding.get('seed')}"


def _short(value) -> str:
    text = str(value)
    return text[:12] + "…" if len(text) > 13 else text


def n_samples_of(record: dict) -> int:
    """k, the samples an item's score averages (docs/gate.md#k-samples): ``n_samples``; else the length of
    ``samples``; else HumanEval's ``n`` (with ``c``, the pass@k convention); else 1 (greedy, older runs)."""
    if "n_samples" in record:
        return int(record["n_samples"])
    if isinstance(record.get("samples"), list) and record["samples"]:
        return len(record["samples"])
    if isinstance(record.get("n"), int) and "c" in record:
        return int(record["n"])
    return 1


def sample_score(sample: dict, metric: str) -> float:
    """One sample's score: its own value of the gated metric, else HumanEval's ``passed``."""
    if metric in sample:
        return float(sample[metric])
    return float(bool(sample.get("passed", False)))


@dataclass
class TaskPairs:
    """One task's items, paired by doc_id in a stable order.

    An item's score is the gated metric of its record: with k samples per item, the mean over them
    (docs/gate.md#k-samples); its flags (invalid, truncated) are then the fraction of its samples flagged.
    """

    task: str
    metric: str
    doc_ids: list
    base: list[dict]
    cand: list[dict]
    # items a stopped-early candidate did not run, in their best completion: right (score 1), valid and not
    # truncated, whatever the metric (docs/gate.md#stopping-early); never a flip, never in the token means
    imputed: frozenset = field(default_factory=frozenset)

    def _records(self, side: str) -> list[dict]:
        return self.base if side == "base" else self.cand

    def _imputed(self, side: str) -> list[bool]:
        return [side == "cand" and d in self.imputed for d in self.doc_ids]

    def scores(self, side: str) -> list[float]:
        return [1.0 if best else float(r.get(self.metric, 0.0))
                for r, best in zip(self._records(side), self._imputed(side))]

    def observed(self) -> list[bool]:
        """Per item, whether the candidate ran it (False: its best completion stands in)."""
        return [d not in self.imputed for d in self.doc_ids]

    def observed_counts(self) -> dict:
        """On the items the candidate ran: n, lost b, gained c and both mean scores (k = 1: the paired table)."""
        base, cand = self.scores("base"), self.scores("cand")
        rows = [(x, y) for x, y, seen in zip(base, cand, self.observed()) if seen]
        n = len(rows)
        return {"items_run": n, "items_total": len(self.doc_ids), "b": sum(x > y for x, y in rows),
                "c": sum(y > x for x, y in rows), "baseline": sum(x for x, _ in rows) / n if n else None,
                "candidate": sum(y for _, y in rows) / n if n else None}

    def correct(self, side: str) -> list[bool]:
        return [s >= 1.0 for s in self.scores(side)]

    def n_samples(self, side: str = "base") -> list[int]:
        return [n_samples_of(r) for r in self._records(side)]

    @property
    def k(self) -> int:
        """Samples per item (the largest, if items differ)."""
        return max(self.n_samples("base"), default=1)

    def sample_scores(self, side: str) -> list[list[float]] | None:
        """Per item, its k sample scores in sample order (seed order: the same seeds on both sides); None
        when the records do not carry them."""
        out = []
        for r in self._records(side):
            samples = r.get("samples")
            if not isinstance(samples, list) or len(samples) != n_samples_of(r):
                return None
            out.append([sample_score(s, self.metric) for s in samples])
        return out

    def _per_sample(self, side: str, flag) -> list[float]:
        out = []
        for r, best in zip(self._records(side), self._imputed(side)):
            if best:  # the best completion: neither invalid nor truncated
                out.append(0.0)
                continue
            samples = r.get("samples")
            if n_samples_of(r) > 1 and isinstance(samples, list) and samples:
                out.append(sum(bool(flag(s)) for s in samples) / len(samples))
            else:
                out.append(float(bool(flag(r))))
        return out

    def invalid(self, side: str) -> list[float]:
        """Per item 1/0 (k = 1), or the fraction of its samples the scorer could not use."""
        values = self._per_sample(side, lambda r: is_invalid(self.task, r, self.metric))
        return [bool(v) for v in values] if self.k == 1 else values

    def truncated(self, side: str) -> list[float]:
        """Per item 1/0 (k = 1), or the fraction of its samples cut off at the token limit."""
        values = self._per_sample(side, is_truncated)
        return [bool(v) for v in values] if self.k == 1 else values

    def problems(self) -> list[str]:
        """What makes the per-item scores unusable: k differing between the runs, scores outside [0, 1] or
        not a mean over the item's k samples."""
        out = []
        kb, kc = self.n_samples("base"), self.n_samples("cand")
        differ = [d for d, x, y in zip(self.doc_ids, kb, kc) if x != y]
        if differ:
            out.append(f"{self.task}: {len(differ)} item(s) have different sample counts k in the two runs (first: "
                       f"{differ[0]!r}, {kb[self.doc_ids.index(differ[0])]} vs {kc[self.doc_ids.index(differ[0])]}); "
                       "runs with different k are not comparable")
        for side, ks in (("baseline", kb), ("candidate", kc)):
            for doc_id, score, k in zip(self.doc_ids, self.scores("base" if side == "baseline" else "cand"), ks):
                if k < 1 or not 0.0 <= score <= 1.0 or abs(score * k - round(score * k)) > 1e-6:
                    out.append(f"{self.task}: the {side}'s item {doc_id!r} has {self.metric} = {score!r}, not a mean "
                               f"over its k = {k} sample(s) in [0, 1]")
                    break
        return out

    def tokens(self, side: str) -> list[float]:
        """Generated tokens per item, on the items the candidate ran (both sides: the token ratio compares
        like with like when a run stopped early)."""
        return [float(r.get("n_tokens", 0)) for r, seen in zip(self._records(side), self.observed()) if seen]


def pair_task(base: Run, cand: Run, task: str, metric: str | None = None) -> TaskPairs:
    """One task's items paired by id. A candidate the gate stopped early has its missing items filled in with
    their best completion (``best_completion_record``; ``TaskPairs.imputed``)."""
    metric = metric or default_metric(task)
    b = {r["doc_id"]: r for r in base.records[task]}
    c = {r["doc_id"]: r for r in cand.records.get(task, [])}
    ids = sorted(b, key=lambda x: (str(type(x)), x))
    for side, records in (("baseline", b), ("candidate", c)):
        missing = [i for i in ids if i in records and metric not in records[i]]
        if missing:
            raise UserError(f"{task}: the {side} records have no metric {metric!r} (item {missing[0]}); check thresholds.yaml's metric")
    imputed = frozenset(i for i in ids if i not in c) if stopped_early(cand) else frozenset()
    for i in imputed:
        c[i] = best_completion_record(b[i], metric)
    pairs = TaskPairs(task, metric, ids, [b[i] for i in ids], [c[i] for i in ids], imputed)
    problems = pairs.problems()
    if problems:
        raise NotComparable("runs are not comparable: " + "; ".join(problems))
    return pairs


@dataclass
class Pairing:
    """Two runs paired by item. ``flips(task)`` and ``changed(task)`` are pandas DataFrames. Never mutated:
    a pairing scored differently is a new one (``with_metrics``)."""

    baseline: Run
    candidate: Run
    pairs: dict[str, TaskPairs]
    aa_flips: dict[str, set] = field(default_factory=dict)  # items that flip between two baseline runs

    def with_metrics(self, metrics: dict[str, str]) -> "Pairing":
        """The same pairing scored on other record fields (e.g. the policy's metric); a new object."""
        pairs = {t: (TaskPairs(t, metrics[t], p.doc_ids, p.base, p.cand, p.imputed)
                     if metrics.get(t, p.metric) != p.metric else p)
                 for t, p in self.pairs.items()}
        return Pairing(self.baseline, self.candidate, pairs, self.aa_flips)

    @property
    def tasks(self) -> list[str]:
        return list(self.pairs)

    @property
    def stopped_early(self) -> bool:
        """The candidate stopped early: its missing items stand in their best completion (``TaskPairs.imputed``)."""
        return stopped_early(self.candidate)

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
            if bs == cs or doc_id in p.imputed:  # a flip is observed: never an item the candidate did not run
                continue
            row = {"doc_id": doc_id, "direction": "lost" if bs > cs else "gained",
                   "question": item_question(task, br), "gold": item_gold(task, br),
                   "base_extracted": _extracted(task, br), "cand_extracted": _extracted(task, cr),
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
        rows = [{"doc_id": d, "flipped": bs != cs, "base_extracted": _extracted(task, b), "cand_extracted": _extracted(task, c),
                 "base_response": b.get("resps"), "cand_response": c.get("resps")}
                for d, b, c, bs, cs in zip(p.doc_ids, p.base, p.cand, p.scores("base"), p.scores("cand"))
                if d not in p.imputed and b.get("resps") != c.get("resps")]
        return pd.DataFrame(rows, columns=["doc_id", "flipped", "base_extracted", "cand_extracted", "base_response",
                                           "cand_response"])

    def __repr__(self) -> str:
        counts = ", ".join(f"{t}: {len(p.doc_ids)} items" for t, p in self.pairs.items())
        return (f"{type(self).__name__}(baseline={str(self.baseline.path)!r} [{self.baseline.kernel}], "
                f"candidate={str(self.candidate.path)!r} [{self.candidate.kernel}], {counts})")



FLIP_COLUMNS = ["doc_id", "direction", "question", "gold", "base_extracted", "cand_extracted", "base_correct",
                "cand_correct", "base_finish_reason", "cand_finish_reason", "base_failure_class",
                "cand_failure_class", "flips_in_aa", "base_response", "cand_response"]


def item_question(task: str, record: dict) -> str | None:
    """What a flip row names the item by (the task's ``item_title``: GSM8K's question, HumanEval's id and
    signature line)."""
    return get_task(task).item_title(record)


def item_gold(task: str, record: dict) -> str | None:
    """What the item is checked against (the task's ``item_gold``)."""
    return get_task(task).item_gold(record)


def extracted_answer(task: str, record: dict):
    """The answer the scorer read from a response (the task's ``item_answer``); None when none."""
    return get_task(task).item_answer(record)


def _extracted(task: str, record: dict):
    """What a flip table shows as the answer: the extracted one, else why there is none (HumanEval)."""
    answer = extracted_answer(task, record)
    return answer if answer is not None else record.get("failure_class")


def compare(base: Run, cand: Run, tasks: list[str] | None = None, metrics: dict[str, str] | None = None,
            aa_flips: dict[str, set] | None = None, across_serving: bool = False) -> Pairing:
    """Pair two loaded runs (the API's ``compare`` takes folders). Refuses (``NotComparable``) when they must
    not be compared; ``across_serving``: not for a difference in serving identity alone."""
    if base.meta.aggregate_only:
        raise NotComparable(f"{base.path} is an aggregate-only baseline (a published score, no per-item records); "
                            "it can only be gated with an unpaired test (see `evalgate gate`)")
    tasks = tasks or [t for t in cand.tasks if t in cand.records]
    problems = comparability_problems(base, cand, tasks, across_serving)
    if problems:
        raise NotComparable("runs are not comparable: " + "; ".join(problems))
    metrics = metrics or {}
    pairs = {t: pair_task(base, cand, t, metrics.get(t)) for t in tasks}
    if aa_flips is None:  # the baseline's A/A record, so flips() can say which items are noise
        try:
            aa_flips = {t: a["flips"] for t, a in aa_for_baseline([base.path]).items()}
        except (OSError, ValueError):  # an unreadable aa.json must not stop anyone looking at flips
            aa_flips = {}
    return Pairing(base, cand, pairs, aa_flips=aa_flips)
