"""Stopping a gate early once its FAIL is certain (docs/gate.md#stopping-early).

The argument: the gate's rule is monotone in each item's outcome, so when the best completion (every item
not run right, valid, not truncated) FAILs, every completion FAILs. Checked here piece by piece over full
grids (the exact McNemar p, the Tango and Newcombe lower bounds, the rate checks, Holm), then end to end by
brute force on small runs (every completion enumerated), then the runner (the stream stops, the stored run
resumes to completion) and the reports of a stopped-early gate.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from evalgate.gate.early_stop import EarlyStop, best_completion_verdict
from evalgate.gate.stopped import headline
from evalgate.gate.policy import load_thresholds
from evalgate.run.store import Run
from evalgate.stats.multiplicity import adjusted_pvalues
from evalgate.stats.paired import mcnemar_exact_one_sided, newcombe_interval, tango_lower_bound
from evalgate.types import AdapterBase

CANARY_N = (164, 200)  # the canary's HumanEval and GSM8K item counts


# ------------------------------------------------------------------------------------------ monotonicity


def test_exact_mcnemar_p_is_monotone_in_losses_and_gains():
    # p = P(X ≥ b | b + c): one more loss can only lower it, one more gain only raise it (every b + c ≤ 201)
    n = 201
    p = np.full((n + 1, n + 1), np.nan)
    for b in range(n + 1):
        for c in range(n + 1 - b):
            p[b, c] = mcnemar_exact_one_sided(b, c)
    assert np.nanmax(p[1:, :] - p[:-1, :]) <= 0.0  # more losses: p never rises
    assert np.nanmin(p[:, 1:] - p[:, :-1]) >= 0.0  # more gains: p never falls


@pytest.mark.parametrize("alpha", [0.05, 0.025])
def test_tango_lower_bound_is_monotone_over_every_table_up_to_200_items(alpha):
    # L(b, c; n) for every n ≤ 200 (the canary's 164 and 200 among them) and every b + c ≤ n: exactly,
    # without tolerance, non-increasing in b and non-decreasing in c
    for n in range(1, 201):
        b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        inside = b + c <= n
        low = np.full(b.shape, np.nan)
        low[inside] = tango_lower_bound(b[inside], c[inside], n, alpha)
        assert not np.nanmax(low[1:, :] - low[:-1, :]) > 0.0, n
        assert not np.nanmin(low[:, 1:] - low[:, :-1]) < 0.0, n


def _newcombe_lower(a, b, c, d, alpha):
    """newcombe_interval(a, b, c, d, alpha)[0], vectorised (the same formula, checked against it below)."""
    a, b, c, d = (np.asarray(x, dtype=float) for x in (a, b, c, d))
    n = a + b + c + d
    z = norm.ppf(1 - alpha / 2)

    def wilson(x):
        p = x / n
        centre = (x + z * z / 2) / (n + z * z)
        half = z * np.sqrt(np.maximum(n * p * (1 - p), 0.0) + z * z / 4) / (n + z * z)
        return np.maximum(0.0, centre - half), np.minimum(1.0, centre + half)

    p1, p2 = (a + c) / n, (a + b) / n
    l1, _ = wilson(a + c)
    _, u2 = wilson(a + b)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    big_b = a * d - b * c
    big_c = np.where(big_b > n / 2, big_b - n / 2, np.where(big_b >= 0, 0.0, big_b))
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.where(margins > 0, big_c / np.sqrt(np.where(margins > 0, margins, 1.0)), 0.0)
    lower = (p1 - p2) - np.sqrt(np.maximum((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    return np.maximum(-1.0, lower)


def _tables(n):
    a, b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), np.arange(n + 1), indexing="ij")
    keep = a + b + c <= n
    return a[keep], b[keep], c[keep], n - (a + b + c)[keep]


def test_the_vectorised_newcombe_is_the_gates():
    rnd = random.Random(0)
    for _ in range(300):
        n = rnd.choice([5, 40, 164, 200])
        cuts = sorted(rnd.randint(0, n) for _ in range(3))
        a, b, c, d = cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], n - cuts[2]
        for alpha in (0.1, 0.05):
            assert _newcombe_lower(a, b, c, d, alpha) == pytest.approx(newcombe_interval(a, b, c, d, alpha)[0], abs=1e-12)


@pytest.mark.parametrize("n", [*range(1, 41), *CANARY_N])
def test_newcombe_lower_bound_is_monotone_in_each_items_outcome(n):
    # Newcombe depends on all four cells: an item not run moves b -> a (a loss becomes right) or d -> c (a
    # miss becomes a gain) when its outcome improves; the gated bound (the two-sided 1 - 2α interval's lower
    # end, α = 0.05) must never fall. Every table of n items.
    a, b, c, d = _tables(n)
    for alpha in (0.1, 0.05):
        low = _newcombe_lower(a, b, c, d, alpha)
        has_b, has_d = b > 0, d > 0
        assert (_newcombe_lower(a[has_b] + 1, b[has_b] - 1, c[has_b], d[has_b], alpha) >= low[has_b] - 1e-12).all()
        assert (_newcombe_lower(a[has_d], b[has_d], c[has_d] + 1, d[has_d] - 1, alpha) >= low[has_d] - 1e-12).all()
    if n <= 12:  # and with the gate's own function on the small ones, exactly
        for a_, b_, c_, d_ in zip(a, b, c, d):
            low = newcombe_interval(a_, b_, c_, d_, 0.1)[0]
            if b_:
                assert newcombe_interval(a_ + 1, b_ - 1, c_, d_, 0.1)[0] >= low
            if d_:
                assert newcombe_interval(a_, b_, c_ + 1, d_ - 1, 0.1)[0] >= low


def test_rate_checks_fail_more_as_the_candidate_flags_more_items():
    from evalgate.gate.rule import _rate_check

    rnd = random.Random(1)
    for _ in range(400):
        n = rnd.choice([8, 40, 164, 200])
        base = [rnd.random() < 0.05 for _ in range(n)]
        cand = [rnd.random() < rnd.choice([0.0, 0.03, 0.1]) for _ in range(n)]
        alpha, limit, floor = rnd.choice([0.0025, 0.01, 0.05]), rnd.choice([0.0, 0.01, 0.05]), rnd.choice([0, 1, 4])
        before = _rate_check("invalid", base, cand, alpha, limit, floor)
        unflagged = [i for i, f in enumerate(cand) if not f]
        if not unflagged:
            continue
        worse = list(cand)
        worse[rnd.choice(unflagged)] = True  # one more item flagged by the candidate
        after = _rate_check("invalid", base, worse, alpha, limit, floor)
        assert after.p <= before.p
        assert after.failed or not before.failed


@pytest.mark.parametrize("rule", ["holm", "bonferroni", "none"])
def test_multiplicity_rules_are_monotone_in_the_raw_p_values(rule):
    grid = np.concatenate([np.linspace(0, 0.1, 41), [0.2, 0.5, 1.0]])
    for k in (2, 3):
        for ps in itertools.product(grid, repeat=k):
            names = [f"t{i}" for i in range(k)]
            rejected, adjusted = adjusted_pvalues(dict(zip(names, ps)), 0.04, rule)
            if k == 3 and sum(ps) % 3:  # the 3-task lattice: a sample of it is enough
                continue
            for i in range(k):
                for smaller in grid[grid < ps[i]][-2:]:  # one coordinate lowered
                    qs = list(ps)
                    qs[i] = smaller
                    rej2, adj2 = adjusted_pvalues(dict(zip(names, qs)), 0.04, rule)
                    assert all(adj2[t] <= adjusted[t] for t in names)
                    assert all(rej2[t] or not rejected[t] for t in names)


# ------------------------------------------------------------------------------------------ brute force

POLICY = """
alpha: {alpha}
alpha_split: {split}
alpha_validity: {validity}
inconclusive: {inconclusive}
multiple_comparisons: {mc}
ci_method: {ci}
tasks:
  gsm8k:
    profile: gsm8k-lmeval-v3
    metric: exact_match,strict-match
    margin_pp: {margin}
    max_invalid_rise_pp: 1.0
    max_truncation_rise_pp: 1.0
    min_rise_items: {floor}
  humaneval:
    profile: humaneval-completion-codex
    metric: pass@1
    margin_pp: {margin}
    max_invalid_rise_pp: 1.0
    max_truncation_rise_pp: 1.0
    min_rise_items: {floor}
"""

POLICIES = [
    dict(alpha=0.45, split="true", validity=0.05, inconclusive="true", mc="holm", ci="tango", margin=10.0, floor=1),
    dict(alpha=0.2, split="false", validity=0.01, inconclusive="false", mc="bonferroni", ci="tango", margin=30.0,
         floor=1),
    dict(alpha=0.45, split="true", validity=0.1, inconclusive="true", mc="none", ci="tango", margin=5.0, floor=2),
]


def _record(task: str, i: int, right: bool, invalid: bool, truncated: bool) -> dict:
    common = {"finish_reason": "length" if truncated else "stop", "n_tokens": 7 + i}
    if task == "gsm8k":
        return {"doc_id": i, "exact_match,strict-match": float(right), "invalid,strict-match": invalid, **common}
    failure = "passed" if right else ("failed:syntax" if invalid else "failed:assertion")
    return {"doc_id": f"HumanEval/{i}", "pass@1": float(right), "failure_class": failure, **common}


def _run(kind: str, outcomes: dict, status: str = "complete") -> Run:
    from synthetic_runs import manifest

    m = manifest(kind, kind, len(outcomes["gsm8k"]), len(outcomes["humaneval"]))
    m["status"] = status
    records = {t: [_record(t, i, *o) for i, o in enumerate(items) if o is not None] for t, items in outcomes.items()}
    return Run(path=Path(kind), manifest=m, records=records)


def _decide_complete(base: Run, outcomes: dict, policy):
    from evalgate.gate.compare import compare
    from evalgate.gate.decide import decide

    cand = _run("cand", outcomes)
    pairing = compare(base, cand, metrics={t: policy.task(t).metric for t in outcomes}, aa_flips={})
    return decide(pairing, policy, require_aa=False).decision.verdict


@pytest.mark.parametrize("which", range(len(POLICIES)))
def test_certain_means_every_completion_fails_and_uncertain_means_one_does_not(which, tmp_path):
    """Small runs (7 GSM8K + 5 HumanEval items), random baselines and candidates with 1 or 2 items not run:
    whenever the best completion FAILs, each of the 8 or 64 completions (right or wrong × invalid or not ×
    truncated or not, per item) FAILs through the gate's own compare + decide; when it does not, the best
    completion is itself a completion that does not FAIL. About 300 decisions per policy."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(**POLICIES[which]))
    policy = load_thresholds(str(path))
    rnd = random.Random(which)
    sizes = {"gsm8k": 7, "humaneval": 5}
    want = {1: 8, 2: 3}  # certain scenarios to enumerate, by the number of items not run
    uncertain = 0
    for scenario in range(400):
        if not any(want.values()) and uncertain >= 3:
            break
        base_out = {t: [(rnd.random() < 0.7, rnd.random() < 0.1, rnd.random() < 0.1) for _ in range(n)]
                    for t, n in sizes.items()}
        base = _run("base", base_out)
        bad = rnd.choice([0.0, 0.2, 0.5, 0.8])  # how broken this candidate is
        cand_out = {t: [(rnd.random() > bad, rnd.random() < bad / 2, rnd.random() < bad / 3) for _ in range(n)]
                    for t, n in sizes.items()}
        u = rnd.choice([k for k, left in want.items() if left] or [1])
        unrun = rnd.sample([(t, i) for t, n in sizes.items() for i in range(n)], u)
        partial = {t: list(v) for t, v in cand_out.items()}
        for t, i in unrun:
            partial[t][i] = None
        verdict = best_completion_verdict(base, _run("cand", partial, "running"), policy, require_aa=False)
        if verdict.decision.verdict != "FAIL":
            if uncertain < 3:  # the best completion, run for real, is a completion that does not FAIL
                best = {t: list(v) for t, v in partial.items()}
                for t, i in unrun:
                    best[t][i] = (True, False, False)
                assert _decide_complete(base, best, policy) == verdict.decision.verdict
            uncertain += 1
            continue
        if not want.get(u):
            continue
        want[u] -= 1
        for outcome in itertools.product(itertools.product([False, True], repeat=3), repeat=u):
            full = {t: list(v) for t, v in partial.items()}
            for (t, i), o in zip(unrun, outcome):
                full[t][i] = o
            assert _decide_complete(base, full, policy) == "FAIL", (scenario, unrun, outcome)
    assert not any(want.values()) and uncertain >= 3  # both branches exercised


# ------------------------------------------------------------------------------------------ the runner


class StreamingAdapter(AdapterBase):
    """Answers every GSM8K item wrong, one item per yield; says whether its stream was closed."""

    from types import SimpleNamespace as _NS

    kernel = _NS(name="faulty/x", version="fake 1.0", id="faulty/x@fake 1.0", description="fake",
                 recipe={}, faulty=True)
    serving = "stream"

    def __init__(self):
        self.closed = False
        self.yielded = 0

    def info(self) -> dict:
        return {"adapter": "fake", "fingerprint": "0123456789abcdef", "dtype": "bfloat16", "model_type": "fake"}

    def generate_stream(self, requests, batch_size=None):
        from evalgate.types import Generation

        import time

        try:
            for i in range(len(requests)):
                time.sleep(0.05)  # decoding takes time: the scorer's check runs while the next item decodes
                self.yielded += 1
                yield [(i, Generation(text=" 1 + 1 = 3\n#### 3", finish_reason="stop", n_prompt_tokens=4, n_tokens=5))]
        finally:
            self.closed = True


def quiet():
    from evalgate.run.progress import Progress

    return Progress(enabled=False, stream=open(os.devnull, "w"))


class stop_after:
    """An observer that stops the run once ``count`` items are stored (what EarlyStop returns, without a
    gate), counting only what the runner tells it."""

    def __init__(self, count: int):
        self.count, self.stored, self.seen, self.run = count, 0, [], None

    def started(self, run) -> None:
        self.stored = sum(len(r) for r in run.records.values())

    def scored(self, task, records) -> None:
        self.stored += len(records)

    def should_stop(self):
        self.seen.append(self.stored)
        if self.stored < self.count:
            return None
        return {"reason": "test", "items_run": self.stored, "items_total": 0, "tasks": {}}

    def finished(self, run) -> None:
        self.run = run


def watch(policy, base, **kwargs) -> EarlyStop:
    """The gate's EarlyStop over a stored baseline folder and a policy file, as the gate plan loads them."""
    from evalgate.gate.policy import load_thresholds
    from evalgate.run.baselines import load_baseline

    return EarlyStop(load_baseline([base]), load_thresholds(policy), **kwargs)


def ask(hook: EarlyStop, cand_dir, run):
    """What the runner does with a run's stored records: hand them over at the start, then ask."""
    from evalgate.run.store import Run

    hook.started(Run(path=Path(cand_dir), manifest=run.manifest, records=run.records))
    return hook.should_stop()


def test_the_stream_stops_and_the_stored_run_resumes_to_completion(tmp_path, data_dir):
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    spec = RunSpec(model="fake", kernel="faulty/x", tasks=["gsm8k"], limit=30, batch_size=1, data_dir=str(data_dir))
    adapter = StreamingAdapter()
    out = execute(spec, tmp_path / "run", adapter=adapter, progress=quiet(), observer=stop_after(4))
    assert adapter.closed and adapter.yielded < 30
    run = load_run(out)
    info = run.manifest["early_stop"]
    assert run.manifest["status"] == "stopped_early" and run.meta.status == "stopped_early"
    stored = len(run.records["gsm8k"])
    assert 4 <= stored < 30 and info["items_run"] == stored and info["tasks"]["gsm8k"] == {"items_run": stored,
                                                                                            "items_total": 30}
    assert info["reason"] == "test" and info["items_total"] == 30 and run.manifest["tasks"]["gsm8k"]["complete"] is False
    ids = [r["doc_id"] for r in run.records["gsm8k"]]
    assert ids == sorted(ids) == list(range(stored))  # everything that finished was scored and stored, in order

    # never a baseline
    from evalgate.errors import UserError
    from evalgate.run.baselines import record

    with pytest.raises(UserError, match="stopped early after"):
        record(out, tmp_path / "baselines")

    # resumed without the hook: completes, and the stop becomes history
    again = StreamingAdapter()
    execute(spec, out, resume=True, adapter=again, progress=quiet())
    run = load_run(out)
    assert run.manifest["status"] == "complete" and "early_stop" not in run.manifest
    assert [h["items_run"] for h in run.manifest["early_stop_history"]] == [stored]
    assert [r["doc_id"] for r in run.records["gsm8k"]] == list(range(30)) and again.yielded == 30 - stored
    assert record(out, tmp_path / "baselines")  # complete now: a baseline may be recorded from it


def test_a_hook_that_is_satisfied_by_the_stored_items_generates_nothing_on_resume(tmp_path, data_dir):
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    spec = RunSpec(model="fake", kernel="faulty/x", tasks=["gsm8k"], limit=12, batch_size=1, data_dir=str(data_dir))
    out = execute(spec, tmp_path / "run", adapter=StreamingAdapter(), progress=quiet(), observer=stop_after(3))
    before = load_run(out).manifest["early_stop"]["items_run"]
    adapter = StreamingAdapter()
    execute(spec, out, resume=True, adapter=adapter, progress=quiet(), observer=stop_after(3))
    run = load_run(out)
    assert adapter.yielded == 0 and run.manifest["status"] == "stopped_early"
    assert len(run.records["gsm8k"]) == before and "early_stop_history" not in run.manifest


def test_batch_by_batch_and_server_dispatch_stop_too(tmp_path, data_dir, monkeypatch):
    from evalgate.run import runner
    from evalgate.run.runner import _dispatch_continuously, execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run
    from evalgate.types import Generation

    class Batches(StreamingAdapter):
        serving = "batches"

        def __init__(self):
            super().__init__()
            self.batches = []

        def generate(self, requests):
            self.batches.append(len(requests))
            return [Generation(text=" #### 3", finish_reason="stop") for _ in requests]

    adapter = Batches()
    spec = RunSpec(model="fake", kernel="faulty/x", tasks=["gsm8k"], limit=20, batch_size=3, data_dir=str(data_dir))
    out = execute(spec, tmp_path / "run", adapter=adapter, progress=quiet(), observer=stop_after(5))
    assert adapter.batches == [3, 3] and load_run(out).manifest["status"] == "stopped_early"

    class Pool:  # a server's continuous dispatch: yields chunks, close() hands back what finished
        def __init__(self, requests):
            self.requests, self.closed = list(requests), False

        def __iter__(self):
            for r in self.requests:
                yield [(r, Generation(text="x", finish_reason="stop"))]

        def close(self):
            self.closed = True
            return []

        def stats(self):
            return {"mean_in_flight_until_tail": 1.0}

    pools = []

    def dispatch(requests):
        pools.append(Pool(requests))
        return pools[-1]

    stored = []
    asked = iter([False, False, True])
    monkeypatch.setattr(runner, "WRITE_EVERY_S", 0.0)  # store (and ask) after every chunk
    _dispatch_continuously(dispatch, list(range(10)), lambda reqs, gens: stored.extend(reqs), {"score_s": 0.0,
                           "generate_s": 0.0}, should_stop=lambda: next(asked))
    assert pools[0].closed and stored == [0, 1, 2]


def test_the_hook_is_asked_before_anything_is_generated(tmp_path, data_dir):
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run
    from evalgate.types import Generation

    class Batches(StreamingAdapter):
        serving = "batches"

        def generate(self, requests):
            self.yielded += len(requests)
            return [Generation(text=" #### 3", finish_reason="stop") for _ in requests]

    for adapter in (StreamingAdapter(), Batches()):  # one stream for every task; task by task
        spec = RunSpec(model="fake", kernel="faulty/x", tasks=["gsm8k"], limit=10, batch_size=2,
                       data_dir=str(data_dir))
        out = execute(spec, tmp_path / type(adapter).__name__, adapter=adapter, progress=quiet(),
                      observer=stop_after(0))
        run = load_run(out)
        assert adapter.yielded == 0 and run.manifest["status"] == "stopped_early"
        assert run.manifest["early_stop"]["items_run"] == 0 and run.records["gsm8k"] == []


# ------------------------------------------------------------------------------------------ the gate


def test_headline_names_items_per_task():
    info = {"items_run": 58, "items_total": 364, "tasks": {"gsm8k": {"items_run": 20, "items_total": 200},
                                                            "humaneval": {"items_run": 38, "items_total": 164}}}
    assert headline(info) == ("stopped early after 58 of 364 items: gsm8k 20/200, humaneval 38/164 — the FAIL "
                              "holds whatever the remaining items give")


def _write(path: Path, run: Run) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(run.manifest))
    for task, records in run.records.items():
        (path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def stopped_gate(tmp_path):
    """A stored baseline (no A/A), a policy, and a candidate that loses everything it ran (12 of 60 items)."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(alpha=0.05, split="true", validity=0.01, inconclusive="true", mc="holm", ci="tango",
                                  margin=5.0, floor=4))
    rnd = random.Random(3)
    base_out = {"gsm8k": [(rnd.random() < 0.9, False, False) for _ in range(40)],
                "humaneval": [(rnd.random() < 0.9, False, False) for _ in range(20)]}
    base = _write(tmp_path / "base", _run("w4a8", base_out))
    cand_out = {"gsm8k": [(False, True, True) if i < 12 else None for i in range(40)], "humaneval": [None] * 20}
    return base, tmp_path / "cand", cand_out, str(path)


def test_a_stopped_early_candidate_is_decided_on_its_best_completion_with_the_note_everywhere(stopped_gate):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.outputs import write_outputs

    base, cand_dir, cand_out, policy = stopped_gate
    partial = _run("faulty/x", cand_out, "running")
    hook = watch(policy, base, allow_uncalibrated=True)
    _write(cand_dir, partial)
    info = ask(hook, cand_dir, partial)
    assert info is not None and info["tasks"] == {"gsm8k": {"items_run": 12, "items_total": 40},
                                                  "humaneval": {"items_run": 0, "items_total": 20}}
    manifest = {**partial.manifest, "status": "stopped_early", "early_stop": info}
    (cand_dir / "manifest.json").write_text(json.dumps(manifest))

    verdict = gate_runs(load_baseline([base]), load_run(cand_dir), load_thresholds(policy), allow_uncalibrated=True)
    assert verdict.verdict == "FAIL" and verdict.exit_code == 1
    es = verdict.early_stop
    assert (es["items_run"], es["items_total"]) == (12, 60)
    assert es["tasks"]["gsm8k"]["items_run"] == 12 and es["tasks"]["humaneval"]["items_run"] == 0
    flips = verdict.comparison.flips("gsm8k")
    assert set(flips["doc_id"]) <= set(range(12)) and (flips["direction"] == "lost").all()  # observed flips only
    assert es["tasks"]["gsm8k"]["b"] == len(flips)
    assert verdict.comparison.flips("humaneval").empty

    out = write_outputs(verdict, cand_dir / "gate")
    gate = json.loads(out["json"].read_text())
    assert gate["early_stop"]["items_run"] == 12 and gate["early_stop"]["tasks"]["gsm8k"]["items_total"] == 40
    text = headline(es)
    assert text.startswith("stopped early after 12 of 60 items: gsm8k 12/40, humaneval 0/20")
    assert f"FAIL ({text})" in out["markdown"].read_text()
    # humaneval ran none of its items: its row reads "not run" (no best-completion numbers of 0 items)
    assert "12/40" in out["markdown"].read_text() and "not run" in out["markdown"].read_text()
    junit = out["junit"].read_text()
    assert 'name="early_stop"' in junit and "<skipped" in junit  # humaneval: not decided
    html = out["html"].read_text()
    assert "stopped early after 12 of 60 items" in html and "observed on the 12 of 40 items run" in html


def test_the_aa_noise_warning_of_a_stopped_early_task_looks_at_the_items_run(tmp_path):
    # the best completion turns each unrun item the baseline got wrong into a "gain" (6 of the 28 here): over
    # all 40 items ψ exceeds a quiet A/A's bound even when the 12 items run moved nothing
    from evalgate.gate.compare import compare
    from evalgate.gate.decide import decide

    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(alpha=0.05, split="true", validity=0.01, inconclusive="true", mc="holm", ci="tango",
                                  margin=5.0, floor=4))
    policy = load_thresholds(str(path))
    base = _run("w4a8", {"gsm8k": [(i < 34, False, False) for i in range(40)],
                         "humaneval": [(True, False, False)] * 20})
    aa = {t: {"psi0": 0.0, "n": n, "flips": []} for t, n in (("gsm8k", 40), ("humaneval", 20))}
    noise = "moves more items than the baseline's own noise"
    for lost in (0, 2):  # the candidate ran 12 gsm8k items and got `lost` of them wrong
        cand = _run("cand", {"gsm8k": [(i >= lost, False, False) if i < 12 else None for i in range(40)],
                             "humaneval": [(True, False, False)] * 20}, "stopped_early")
        pairing = compare(base, cand, metrics={t: policy.task(t).metric for t in ("gsm8k", "humaneval")}, aa_flips={})
        warnings = [w for w in decide(pairing, policy, aa=aa).decision.tasks["gsm8k"].outcome.warnings if noise in w]
        if lost:
            assert len(warnings) == 1 and "ψ = 16.67% on the 12 items run" in warnings[0]
        else:
            assert warnings == []


def test_a_stopped_early_run_is_never_a_baseline_nor_decided_when_its_fail_no_longer_holds(stopped_gate, tmp_path):
    from evalgate.errors import NotComparable, UserError
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand_dir, cand_out, policy = stopped_gate
    partial = _run("faulty/x", cand_out, "stopped_early")
    partial.manifest["early_stop"] = {"reason": "x", "items_run": 12, "items_total": 60, "tasks": {}}
    _write(cand_dir, partial)
    with pytest.raises(UserError, match="stopped early"):  # as the baseline of a gate
        gate_runs(load_baseline([cand_dir]), load_run(base), load_thresholds(policy), allow_uncalibrated=True)
    lenient = tmp_path / "lenient.yaml"  # a policy under which its best completion passes: no verdict at all
    lenient.write_text(POLICY.format(alpha=0.05, split="true", validity=0.0, inconclusive="true", mc="holm",
                                     ci="tango", margin=90.0, floor=40))
    with pytest.raises(NotComparable, match="--no-early-stop"):
        gate_runs(load_baseline([base]), load_run(cand_dir), load_thresholds(lenient), allow_uncalibrated=True)


@pytest.mark.parametrize("ok", [False, True])
def test_a_kernel_that_fails_its_conformance_check_stops_before_its_first_item(stopped_gate, ok):
    from evalgate.errors import NotComparable
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand_dir, cand_out, policy = stopped_gate
    nothing = _run("faulty/x", {t: [None] * len(v) for t, v in cand_out.items()}, "running")
    nothing.manifest["kernel"]["conformance"] = {
        "kernel": "faulty/x", "reference": "w4a4_packed", "checked": True, "ok": ok, "summary": "test summary",
        "calc_diff": 0.0 if ok else 0.02, "limit": 1e-5}
    _write(cand_dir, nothing)
    info = ask(watch(policy, base, allow_uncalibrated=True), cand_dir, nothing)
    if ok:  # nothing run, and a best completion that passes: go on
        assert info is None
        return
    assert (info["items_run"], info["items_total"]) == (0, 60) and "kernel conformance FAIL (test summary)" in info["reason"]
    # selfcheck's monitor: only a certain accuracy FAIL stops (nothing run yet: not certain)
    assert ask(watch(policy, base, allow_uncalibrated=True, on_conformance=False), cand_dir, nothing) is None
    manifest = {**nothing.manifest, "status": "stopped_early", "early_stop": info}
    (cand_dir / "manifest.json").write_text(json.dumps(manifest))
    verdict = gate_runs(load_baseline([base]), load_run(cand_dir), load_thresholds(policy), allow_uncalibrated=True)
    assert (verdict.verdict, verdict.exit_code) == ("FAIL", 1) and verdict.conformance["ok"] is False
    assert headline(verdict.early_stop) == ("stopped before generating any of its 60 items — the FAIL holds "
                                            "whatever the remaining items give")
    assert {t: d.outcome.verdict for t, d in verdict.decision.tasks.items()} == {"gsm8k": "PASS", "humaneval": "PASS"}  # at best
    manifest["kernel"]["conformance"]["ok"] = True  # a kernel that conforms: nothing run decides nothing
    (cand_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NotComparable, match="complete it first"):
        gate_runs(load_baseline([base]), load_run(cand_dir), load_thresholds(policy), allow_uncalibrated=True)


def test_no_early_stop_for_k_samples(stopped_gate):
    base, _, _, policy = stopped_gate
    from evalgate.run.store import Run

    from evalgate.records import RunManifest

    hook = watch(policy, base, allow_uncalibrated=True)

    def sampled(k):
        return RunManifest.model_validate({"status": "running", "kernel": {"name": "w4a4"}, "model": {}, "tasks": {},
                                           "spec": {"samples": k}})

    assert hook.why_not(sampled(4)) and hook.why_not(sampled(1)) is None
    assert ask(hook, Path("nowhere"), Run(path=Path("nowhere"), manifest=sampled(4))) is None


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_a_real_stream_of_the_tiny_model_stops_and_its_workers_end(tiny_model, tmp_path, data_dir):
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    spec = RunSpec(model=str(tiny_model), kernel="w4a8", tasks=["gsm8k"], limit=24, batch_size=2,
                   data_dir=str(data_dir), max_new_tokens=3)
    out = execute(spec, tmp_path / "run", in_process_adapter(spec), progress=quiet(), observer=stop_after(2))
    run = load_run(out)
    assert run.manifest["status"] == "stopped_early" and 2 <= len(run.records["gsm8k"]) < 24
    assert multiprocessing.active_children() == []  # the decoding workers were terminated
    execute(spec, out, in_process_adapter(spec), resume=True, progress=quiet())
    assert len(load_run(out).records["gsm8k"]) == 24 and load_run(out).manifest["status"] == "complete"


def test_the_monitor_decides_again_only_when_an_item_ran_below_its_best(stopped_gate):
    base, cand_dir, _, policy = stopped_gate
    hook = watch(policy, base, allow_uncalibrated=True)
    outcomes = {"gsm8k": [None] * 40, "humaneval": [None] * 20}
    ask(hook, cand_dir, _run("faulty/x", outcomes, "running"))  # nothing stored yet

    def store(**items):  # as the runner tells it: only the records just stored
        for task, values in items.items():
            for i, o in values:
                outcomes[task][i] = o
            run = _run("faulty/x", outcomes, "running")
            new = {i for i, _ in values}
            hook.scored(task, [r for r in run.records[task] if r["doc_id"] in new])
        return hook.should_stop()

    # a fresh run's best completion is every item at its best: not decided until one falls short
    assert hook.checks == 0
    assert store(gsm8k=[(0, (True, False, False))]) is None and hook.checks == 0
    assert store(gsm8k=[(1, (False, False, False))]) is None and hook.checks == 1  # a loss: decided
    assert store(gsm8k=[(2, (True, False, False)), (3, (True, False, False))]) is None
    assert hook.checks == 1  # both ran as their best completion: the same best completion, not decided again
    assert store(gsm8k=[(4, (False, False, False))]) is None and hook.checks == 2  # a loss: decided again
    info = store(gsm8k=[(i, (False, True, True)) for i in range(5, 16)])
    assert info is not None and info["tasks"]["gsm8k"]["items_run"] == 16 and hook.checks == 3
