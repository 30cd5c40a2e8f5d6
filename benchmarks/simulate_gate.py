"""Simulate the release gate through its real decision path: how often it PASSes, is INCONCLUSIVE or FAILs
kernels of known quality, how many samples per item it spends on each side, and what reruns can buy.

Every replicate runs ``evalgate.pipeline.gate`` on a plan — the greedy look, the rounds of coupled samples
per item (``next_samples``; the baseline sampled in the same round, with the baseline's recorded seed), each
look allocated and recorded by ``evalgate.gate.sequence`` in a baseline folder, decided by ``gate_runs``
(``compare``, ``decide``, ``decide_task`` / ``decide_overall``). Only the runner is replaced: instead of a model,
each run's records are drawn from a world below, keyed the way evalgate keys samples (item, sample index,
seed), so a round reuses the earlier samples' keys and a rerun of a reproducible candidate reproduces them.

Worlds (default policy, thresholds.yaml: GSM8K n = 1319, M = 1.5 pp; HumanEval n = 164, M = 5 pp):

- item i passes a sample of the baseline with probability p_i ~ Beta(0.5, 0.088) (mean 0.85); sample j of
  item i has a uniform key U_ij shared by both kernels (greedy is its own key);
- the candidate passes with probability q_i. Its moves (ψ: the greedy flip rate of a healthy kernel):
  *independent* — each sample is redrawn from its own key with probability φ (φ tuned so the greedy flip rate
  is ψ; the same φ in every round, so a round's flip rate follows ψ); *item-persistent* — half the items
  move on every sample together: q_i = p_i ± τ (random sign, cancelling; τ tuned to ψ), keys coupled;
- a loss Δ: *diffuse* (q_i = p_i·(1 − Δ/p̄)) or *concentrated* (items lose every sample: q_i = 0 on Δ·n/p̄ items);
- *invalid losses*: a sample lost to the baseline is an invalid answer with the chance that makes the
  expected invalid-rate rise the net loss Δ (the lost answers the net loss is made of), or the policy's
  1 pp limit where Δ is larger ("up to the limit"; HumanEval's M/2 = 2.5 pp is over it: a rise the policy
  does not accept, shown in its own row);
- *reproducible*: a rerun redraws nothing (in-process canonical numerics); otherwise (a server that is not
  bit-reproducible) each attempt redraws the candidate's independent moves.

Columns: PASS / INCONCLUSIVE / FAIL %, the mean samples per item each side generated (greedy + every round:
``k cand``, ``k base``, both tasks' items together) and the looks taken. The rerun table: a kernel exactly M
worse on HumanEval (GSM8K as good as the baseline), attempts until the first PASS: reproducible (every reset
gives the same verdict), not reproducible with its looks recorded with the baseline, and not reproducible with
the record lost before every attempt (a re-recorded baseline: what the guarantee does not cover).

Run:  python benchmarks/simulate_gate.py [--reps 400] [--attempts 20] [--workers N] [--seed 45]
      (404 s on 16 cores at --reps 250 --rerun-reps 100); ``--mde``: only the greedy MDE table
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

TASKS = {"gsm8k": (1319, "exact_match,strict-match", "gsm8k-lmeval-v3"),
         "humaneval": (164, "pass@1", "humaneval-completion-codex")}
MARGIN = {"gsm8k": 0.015, "humaneval": 0.05}
GREEDY = -1  # the greedy sample's key index


@dataclass(frozen=True)
class World:
    name: str
    psi: float = 0.06
    drop: tuple = ()  # ((task, Δ as a positive loss), ...)
    moves: str = "independent"  # or "persistent"
    loss: str = "diffuse"  # or "concentrated"
    invalid_losses: bool = False
    invalid_cap: float = 1.0  # the largest expected invalid-rate rise (the policy's limit: 0.01)
    reproducible: bool = True


class Task:
    """One task's items in one world: p, q, the persistent movers and the tuned move rate φ."""

    def __init__(self, task: str, world: World, seed: int):
        self.task, self.world = task, world
        n = TASKS[task][0]
        rng = np.random.default_rng([seed, zlib(task)])
        self.p = rng.beta(0.5, 0.088, size=n)
        drop = dict(world.drop).get(task, 0.0)
        q = self.p.copy()
        self.phi = 0.0
        if world.moves == "persistent":  # movers trade pass rates with each other: the mean stays, items move
            movers = rng.permutation(n)[: n // 2]
            other = self.p[rng.permutation(movers)]
            lam = _tune(lambda x: float(np.sum(np.abs(x * (other - self.p[movers])))) / n, world.psi)
            q[movers] = (1 - lam) * self.p[movers] + lam * other
        else:
            self.phi = min(1.0, world.psi / float(np.mean(2 * self.p * (1 - self.p))))
        if drop:
            if world.loss == "diffuse":
                q = q * (1 - drop / q.mean())
            else:
                lose = rng.permutation(n)[: int(round(drop * n / q.mean()))]
                q[lose] = 0.0
        self.q = q
        # P(a sample lost): coupled keys lose where q < U < p; a redrawn sample loses w.p. p(1 − q)
        coupled, moved = np.clip(self.p - self.q, 0, None), self.p * (1 - self.q)
        p_lost = float(np.mean((1 - self.phi) * coupled + self.phi * moved))
        rise = min(drop, world.invalid_cap)
        self.invalid_share = min(1.0, rise / p_lost) if world.invalid_losses and drop and p_lost > 0 else 0.0

    def outcomes(self, kernel: str, k: int, seed: int, attempt: int) -> tuple[np.ndarray, np.ndarray]:
        """(right, invalid), shape (n, k): samples 0..k-1 (k = 1 greedy: the greedy key)."""
        n = self.p.size
        idx = [GREEDY] if k == 1 else list(range(k))
        right = np.empty((n, len(idx)), bool)
        invalid = np.zeros((n, len(idx)), bool)
        for col, j in enumerate(idx):
            u = np.random.default_rng([seed, zlib(self.task), j + 1]).random(n)  # the sample's key
            base = u < self.p
            if kernel == "base":
                right[:, col] = base
                continue
            noise = 0 if self.world.reproducible else attempt
            r = np.random.default_rng([seed, zlib(self.task), j + 1, 7, noise])
            moved, v = r.random(n) < self.phi, r.random(n)
            cand = np.where(moved, v < self.q, u < self.q)
            right[:, col] = cand
            lost = base & ~cand
            invalid[:, col] = lost & (r.random(n) < self.invalid_share)
        return right, invalid


def zlib(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def _tune(f, target: float) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


# ----------------------------------------------------------------------------------------------------------
# Runs in the run store's format, drawn from a world (the runner's stand-in)
# ----------------------------------------------------------------------------------------------------------


def _record(task: str, i: int, right: np.ndarray, invalid: np.ndarray, seeds: list[int]) -> dict:
    metric = TASKS[task][1]

    def one(ok, bad):
        r = {metric: 1.0 if ok else 0.0, "finish_reason": "stop", "n_tokens": 100}
        if task == "gsm8k":
            r["invalid,strict-match"] = bool(bad)
        else:
            r["failure_class"] = "passed" if ok else ("failed:syntax" if bad else "failed:assertion")
        return r

    if right.size == 1:
        return {"doc_id": i, **one(right[0], invalid[0])}
    samples = [{**one(ok, bad), "seed": s} for ok, bad, s in zip(right, invalid, seeds)]
    return {"doc_id": i, **one(right.mean() >= 0.5, False), metric: float(right.mean()), "n_samples": right.size,
            "samples": samples, "invalid,strict-match": False, "failure_class": "passed"}


def make_run(tasks: dict[str, Task], kernel: str, spec, out: Path, attempt: int):
    from evalgate.run.store import Run

    k, seed = spec.samples, spec.seed
    manifest = {"run_id": out.name, "status": "complete", "spec": {"seed": seed, "samples": k},
                "model": {"fingerprint": "simulated", "adapter": "hf",
                          "numerics": "canonical-v1" if next(iter(tasks.values())).world.reproducible else "native"},
                "kernel": {"name": kernel, "id": f"{kernel}@sim", "version": "sim"}, "tasks": {}}
    records = {}
    for t in spec.tasks:
        right, invalid = tasks[t].outcomes("base" if kernel == "w4a8" else "cand", k, seed, attempt)
        decoding = {"do_sample": k > 1, "n": k, "temperature": spec.temperature, "seed": seed if k > 1 else None}
        manifest["tasks"][t] = {"name": TASKS[t][2], "profile_id": f"{t}-k{k}", "n_items": right.shape[0],
                                "decoding": decoding, "dataset_sha256": {t: "sim"}, "complete": True,
                                **({"prepare": {"ok": True}} if t == "humaneval" else {})}
        records[t] = [_record(t, i, right[i], invalid[i], list(range(k))) for i in range(right.shape[0])]
    return Run(path=out, manifest=manifest, records=records)


# ----------------------------------------------------------------------------------------------------------
# One gate through the real pipeline
# ----------------------------------------------------------------------------------------------------------

STATE: dict = {}


def _patch_pipeline() -> None:
    import evalgate.pipeline as pipeline

    def run_or_resume(spec, out, adapter=None, observer=None, tasks=None, expected_tokens=None, options=None):
        STATE["generated"].append((spec.kernel, spec.samples, tuple(spec.tasks)))
        return make_run(STATE["tasks"], spec.kernel, spec, Path(out), STATE["attempt"])

    stub = lambda spec: {t: SimpleNamespace(profile_id=f"{t}-k{spec.samples}") for t in spec.tasks}  # noqa: E731
    pipeline.run_or_resume = run_or_resume
    pipeline.load_tasks = stub
    pipeline.with_sampling = lambda loaded, spec: SimpleNamespace(profile_id=f"{loaded.profile_id}-k{spec.samples}")


def one_gate(world: World, seed: int, attempt: int, home: Path, max_samples: int = 8):
    """The gate's verdict on one attempt, the samples per item each side generated, and the looks taken."""
    from evalgate.gate.policy import load_thresholds
    from evalgate.pipeline import gate
    from evalgate.plan import GatePlan
    from evalgate.run.baselines import StoredBaseline
    from evalgate.run.spec import RunSpec

    if STATE.get("world") != (world, seed):
        STATE.update(world=(world, seed), tasks={t: Task(t, world, seed) for t in TASKS})
    STATE.update(attempt=attempt, generated=[])
    spec = RunSpec(model="sim", kernel="cand", tasks=list(TASKS))
    home.mkdir(parents=True, exist_ok=True)
    base = make_run(STATE["tasks"], "w4a8", spec, home, 0)
    STATE["generated"].clear()
    plan = GatePlan(policy=load_thresholds(), baseline=StoredBaseline((home,), base, {}), report_dir=home / "rep",
                    allow_uncalibrated=True, spec=spec, tasks={t: SimpleNamespace(profile_id=f"{t}-k1") for t in TASKS},
                    out=home / f"gate-{attempt}", early_stop=False, max_samples=max_samples,
                    baselines_root=home / "none")
    try:
        verdict = gate(plan)
    except Exception as exc:  # a look refused past the last one: no verdict
        if "a further look is refused" not in str(exc):
            raise
        return "REFUSED", 0.0, 0.0, 0
    n_all = sum(TASKS[t][0] for t in TASKS)
    spent = {"cand": float(n_all), "base": float(n_all)}  # the greedy look; the baseline's is stored
    for kernel, k, tasks in STATE["generated"]:
        spent["base" if kernel == "w4a8" else "cand"] += k * sum(TASKS[t][0] for t in tasks)
    spent["cand"] -= n_all  # the greedy candidate run is in STATE["generated"] too
    return verdict.verdict, spent["cand"] / n_all, spent["base"] / n_all, len(verdict.sequence["looks"])


def replicate(args) -> tuple:
    world, seed, attempts, mode = args
    with tempfile.TemporaryDirectory() as tmp:
        first_pass = None
        out = None
        for a in range(attempts):
            home = Path(tmp) / (f"baseline-{a}" if mode == "lost" else "baseline")
            out = one_gate(world, seed, a, home)
            if out[0] == "PASS" and first_pass is None:
                first_pass = a
                break
        return (out if attempts == 1 else first_pass)


def run_table(worlds, reps, seed, workers, attempts=1, mode="kept"):
    from multiprocessing import get_context

    jobs = [(w, seed + r, attempts, mode) for w in worlds for r in range(reps)]
    with get_context("fork").Pool(workers, initializer=_patch_pipeline) as pool:
        results = pool.map(replicate, jobs, chunksize=max(1, len(jobs) // (workers * 8)))
    return {w: results[i * reps:(i + 1) * reps] for i, w in enumerate(worlds)}


def print_mde_table() -> None:
    """The exact greedy MDE (80% power) at the first look's α (α/2) and the policy's margins: what a verdict
    prints for a candidate as good as the baseline at flip rate ψ (docs/gate.md#resolution)."""
    from evalgate.gate.policy import load_thresholds
    from evalgate.stats.exact_ni import critical_value
    from evalgate.stats.margin import mde_binary

    policy = load_thresholds().at_look(0)
    print(f"greedy MDE at 80% power, first look (α = {policy.alpha:g}, exact critical value at the policy's M)")
    print(f"{'ψ':>5} {'GSM8K flips':>12} {'GSM8K MDE':>10} {'HumanEval flips':>16} {'HumanEval MDE':>14}")
    for psi in (0.01, 0.02, 0.04, 0.06, 0.085, 0.10):
        row = []
        for task, (n, _, _) in TASKS.items():
            margin = policy.task(task).margin
            row.append((psi * n, mde_binary(psi, n, policy.alpha, 0.8, critical_value(n, margin, policy.alpha))))
        print(f"{100 * psi:4g}% {row[0][0]:12.1f} {100 * row[0][1]:8.2f}pp {row[1][0]:16.1f} {100 * row[1][1]:12.2f}pp")


def pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--attempts", type=int, default=20)
    ap.add_argument("--rerun-reps", type=int, default=None, help="replicates of the rerun table (default --reps)")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--mde", action="store_true", help="only print the greedy MDE table (docs/gate.md#resolution)")
    args = ap.parse_args()
    if args.mde:
        print_mde_table()
        return
    t0 = time.time()
    half = {t: MARGIN[t] / 2 for t in TASKS}
    worlds = [
        World("healthy, ψ 6%, independent moves"),
        World("healthy, ψ 6%, item-persistent moves on half the items", moves="persistent"),
        World("Δ = −M/2 both tasks, diffuse", drop=tuple(half.items())),
        World("Δ = −M/2 both tasks, concentrated", drop=tuple(half.items()), loss="concentrated"),
        World("Δ = −M/2 GSM8K, every net lost answer invalid", drop=(("gsm8k", half["gsm8k"]),),
              invalid_losses=True),
        World("Δ = −M/2 both, net lost answers invalid up to the limit", drop=tuple(half.items()),
              invalid_losses=True, invalid_cap=0.01),
        World("Δ = −M/2 both, item-persistent, invalid up to the limit", drop=tuple(half.items()),
              moves="persistent", invalid_losses=True, invalid_cap=0.01),
        World("Δ = −M/2 both, all net lost invalid (HumanEval +2.5 pp)", drop=tuple(half.items()),
              invalid_losses=True),
        World("Δ = −M HumanEval, diffuse", drop=(("humaneval", MARGIN["humaneval"]),)),
        World("Δ = −M GSM8K, concentrated", drop=(("gsm8k", MARGIN["gsm8k"]),), loss="concentrated"),
    ]
    table = run_table(worlds, args.reps, args.seed, args.workers)
    print(f"default policy (thresholds.yaml), rounds to k = 8, {args.reps} replicates each, seed {args.seed}\n")
    print(f"{'world':58} {'PASS':>7} {'INCONC':>7} {'FAIL':>7} {'k cand':>7} {'k base':>7} {'looks':>6}")
    for w, rows in table.items():
        v = [r[0] for r in rows]
        print(f"{w.name:58} {pct(v.count('PASS') / len(v)):>7} {pct(v.count('INCONCLUSIVE') / len(v)):>7} "
              f"{pct(v.count('FAIL') / len(v)):>7} {np.mean([r[1] for r in rows]):7.2f} "
              f"{np.mean([r[2] for r in rows]):7.2f} {np.mean([r[3] for r in rows]):6.2f}", flush=True)
    bad = World("Δ = −M HumanEval", drop=(("humaneval", MARGIN["humaneval"]),))
    reps = args.rerun_reps or args.reps
    print(f"\nreruns of a kernel exactly M worse on HumanEval until the first PASS ({reps} replicates, "
          f"up to {args.attempts} attempts)\n")
    print(f"{'how it is rerun':70} {'≤5':>7} {'≤10':>7} {'≤20':>7}")
    for label, world, mode in (
            ("reproducible (in-process): any reset, same data, same verdict", bad, "kept"),
            ("not reproducible (server), looks recorded with the baseline", replace(bad, reproducible=False), "kept"),
            ("not reproducible, the baseline's record lost before every attempt", replace(bad, reproducible=False),
             "lost")):
        firsts = run_table([world], reps, args.seed + 10_000, args.workers, args.attempts, mode)[world]
        within = [np.mean([f is not None and f < a for f in firsts]) for a in (5, 10, 20)]
        print(f"{label:70} " + " ".join(f"{pct(x):>7}" for x in within), flush=True)
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
