"""Simulate the release gate on synthetic paired runs: false-fail rate at Δ = 0, power against drops and
against broken kernels, for the rule shipped in thresholds.yaml next to the original rule (docs/gate.md#the-original-rule) and flat rules.

Tasks: GSM8K (n = 1319, baseline accuracy 0.90, M = 1.5 pp) and HumanEval (n = 164, 0.85, M = 5 pp), drawn
together so Holm across the two tasks and the whole-gate α budget are applied as the gate applies them.
Rules compared:

- ours: the policy in thresholds.yaml (alpha_split, alpha_validity, margin_floor, min_rise_items), i.e.
  evalgate.stats.paired.decide_task + decide_overall, vectorised here and cross-checked verdict by verdict against
  the real functions on a sample of replicates (the count of mismatches is printed; it must be 0);
- spec: the original rule (docs/gate.md#the-original-rule) (every test at α, requested M, raw 1 pp rate limit);
- flat rules like vLLM's lm-eval CI: FAIL if measured < baseline·(1 − rtol), rtol = 0.05 (old) and 0.08.

Model. Noise flips are symmetric: P(b) = P(c) = ψ/2 per item. A drop D adds one-directional flips,
P(b) = ψ/2 + D. The gate is given the A/A flip rate ψ₀ = ψ (one block: ψ₀ = ψ/2, an A/A run that
underestimates the noise). The invalid and truncation indicators get their own symmetric flip noise
(GSM8K 0.5%, HumanEval 1% of items per run pair) on a base rate of 1% / 2%. A broken kernel that raises the
invalid rate by R adds P(new invalid) = R; those items were right with the baseline's accuracy, so the
accuracy also drops by R·accuracy.

Run:  python benchmarks/simulate_gate.py [--reps 20000] [--seed 12345]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from evalgate.gate.rule import decide_overall, decide_task, gate_levels
from evalgate.stats.margin import aa_margin_floor
from evalgate.stats.paired import Counts, tango_lower_bound
from evalgate.gate.policy import load_thresholds

FLIP_RATES = (0.01, 0.02, 0.04, 0.06)
FLAT_RTOLS = (0.05, 0.08)
POLICY = load_thresholds()
ALPHA = POLICY.alpha


@dataclass(frozen=True)
class Task:
    name: str
    n: int
    accuracy: float  # baseline accuracy
    margin: float  # requested NI margin M (fraction), from thresholds.yaml
    drop: float  # accuracy drop the power table asks about
    rate_base: float  # baseline invalid (and truncation) rate
    rate_noise: float  # per-item flip rate of each indicator between runs
    limit: float  # max_invalid_rise = max_truncation_rise (fraction)
    min_items: int  # min_rise_items


def make_task(name, n, accuracy, drop, rate_base, rate_noise) -> Task:
    policy = POLICY.task(name)
    assert policy.max_invalid_rise == policy.max_truncation_rise, "the twin assumes one limit per task"
    return Task(name, n, accuracy, policy.margin, drop, rate_base, rate_noise, policy.max_invalid_rise,
                policy.min_rise_items)


TASKS = (
    make_task("gsm8k", 1319, 0.90, 0.015, rate_base=0.01, rate_noise=0.005),
    make_task("humaneval", 164, 0.85, 0.05, rate_base=0.02, rate_noise=0.01),
)


# ------------------------------------------------------------------------------------------- drawing


def draw_tables(task: Task, psi: float, drop: float, reps: int, rng) -> np.ndarray:
    """(reps, 4) counts a, b, c, d of paired runs with noise flip rate ψ and a true drop."""
    p_b, p_c = psi / 2 + drop, psi / 2
    p_a = task.accuracy - p_b  # baseline right = a + b
    return rng.multinomial(task.n, [p_a, p_b, p_c, 1 - p_a - p_b - p_c], size=reps)


def draw_indicator(task: Task, reps: int, rng, rise: float = 0.0, noise: float | None = None) -> np.ndarray:
    """(reps, 3): items newly flagged, items no longer flagged, baseline flagged count."""
    noise = task.rate_noise if noise is None else noise
    flips = rng.multinomial(task.n, [noise / 2 + rise, noise / 2, 1 - noise - rise], size=reps)
    base_flagged = np.maximum(rng.binomial(task.n, task.rate_base, size=reps), flips[:, 1])
    return np.column_stack([flips[:, 0], flips[:, 1], base_flagged])


# ------------------------------------------------------------------------------- the rules, vectorised


def mcnemar_p(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Vectorised exact one-sided McNemar P(X ≥ b | b + c); 1 where b + c = 0."""
    return np.where(b + c > 0, binom.sf(b - 1, b + c, 0.5), 1.0)


def holm_two(p1: np.ndarray, p2: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm with K = 2, vectorised: the smaller p needs ≤ α/2, then the larger ≤ α."""
    first = np.minimum(p1, p2) <= alpha / 2
    return (first & (p1 <= np.where(p1 <= p2, alpha / 2, alpha)),
            first & (p2 <= np.where(p2 < p1, alpha / 2, alpha)))


def rate_fails(ind: np.ndarray, task: Task, alpha_check: float, min_items: int) -> np.ndarray:
    new, gone = ind[:, 0], ind[:, 1]
    limit_items = max(task.limit * task.n, float(min_items))
    return (mcnemar_p(new, gone) <= alpha_check) | ((new - gone) > limit_items + 1e-9)


def effective_margin(task: Task, aa_psi0: float, alpha_acc: float, floor_on: bool) -> float:
    if not floor_on:
        return task.margin
    return max(task.margin, aa_margin_floor(aa_psi0, task.n, ALPHA, alpha_acc / len(TASKS)))


def simulate(psi: float, reps: int, rng, drops=None, rises=None, aa_scale: float = 1.0) -> dict:
    """Draw both tasks at flip rate ψ, apply every rule, return per-task fail indicators.

    drops: task → accuracy drop; rises: task → invalid-rate rise; the gate gets ψ₀ = aa_scale·ψ.
    """
    drops, rises = drops or {}, rises or {}
    tables = {t.name: draw_tables(t, psi, drops.get(t.name, 0.0), reps, rng) for t in TASKS}
    invalid = {t.name: draw_indicator(t, reps, rng, rises.get(t.name, 0.0)) for t in TASKS}
    truncated = {t.name: draw_indicator(t, reps, rng) for t in TASKS}
    n_rate_checks = 2 * len(TASKS)
    alpha_acc, alpha_rate = gate_levels(ALPHA, POLICY.alpha_split, POLICY.alpha_validity, len(TASKS),
                                        n_rate_checks)
    pvals = [mcnemar_p(tables[t.name][:, 1], tables[t.name][:, 2]) for t in TASKS]
    holm_ours = holm_two(*pvals, alpha_acc)
    holm_spec = holm_two(*pvals, ALPHA)
    out = {"tables": tables, "invalid": invalid, "truncated": truncated, "aa_psi0": aa_scale * psi}
    for i, t in enumerate(TASKS):
        a, b, c, _ = tables[t.name].T
        lower = tango_lower_bound(b, c, t.n, ALPHA)
        m_eff = effective_margin(t, aa_scale * psi, alpha_acc, POLICY.margin_floor)
        rates = (rate_fails(invalid[t.name], t, alpha_rate, t.min_items)
                 | rate_fails(truncated[t.name], t, alpha_rate, t.min_items))
        spec_rates = (rate_fails(invalid[t.name], t, ALPHA, 0) | rate_fails(truncated[t.name], t, ALPHA, 0))
        ni = lower <= -m_eff
        base_score, cand_score = (a + b) / t.n, (a + c) / t.n
        out[t.name] = {
            "m_eff": m_eff,
            "mcnemar": holm_ours[i],
            "ni": ni,
            "rates": rates,
            "accuracy": holm_ours[i] | ni,
            "ours": holm_ours[i] | ni | rates,
            "spec": holm_spec[i] | (lower <= -t.margin) | spec_rates,
            **{f"flat_{r}": cand_score < base_score * (1 - r) for r in FLAT_RTOLS},
        }
    return out


# ------------------------------------------------------------------- cross-check with the real functions


def indicator_vectors(n: int, new: int, gone: int, base_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-item flags with the drawn counts: the baseline flags items [0, base_count); the candidate drops
    `gone` of them and adds `new` among the rest."""
    base = np.zeros(n, dtype=bool)
    base[:base_count] = True
    cand = base.copy()
    cand[:gone] = False
    cand[base_count:base_count + new] = True
    return base, cand


def cross_check(sim: dict, samples: int) -> int:
    """Re-decide the first `samples` replicates with decide_task/decide_overall; count mismatching verdicts."""
    mismatches = 0
    for i in range(samples):
        decisions = []
        for t in TASKS:
            a, b, c, d = (int(x) for x in sim["tables"][t.name][i])
            inv = indicator_vectors(t.n, *(int(x) for x in sim["invalid"][t.name][i]))
            trunc = indicator_vectors(t.n, *(int(x) for x in sim["truncated"][t.name][i]))
            policy = POLICY.task(t.name)
            decisions.append(decide_task(
                t.name, counts=Counts(a, b, c, d, t.n), margin=policy.margin, alpha=ALPHA,
                ci_method=POLICY.ci_method, base_invalid=inv[0], cand_invalid=inv[1],
                base_truncated=trunc[0], cand_truncated=trunc[1], max_invalid_rise=policy.max_invalid_rise,
                max_truncation_rise=policy.max_truncation_rise, aa_psi0=sim["aa_psi0"], aa_n=t.n,
                **POLICY.decision_kwargs(t.name)))
        overall = decide_overall(decisions, alpha=ALPHA, multiple_comparisons=POLICY.multiple_comparisons)
        for t in TASKS:
            dec = overall.tasks[t.name]
            mismatches += (dec.verdict == "FAIL") != bool(sim[t.name]["ours"][i])
            mismatches += (dec.spec_verdict == "FAIL") != bool(sim[t.name]["spec"][i])
    return mismatches


# ------------------------------------------------------------------------------------------- printing


def pct(x: np.ndarray) -> str:
    return f"{100 * np.mean(x):5.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--check", type=int, default=100, help="replicates per row re-decided with decide_overall")
    args = parser.parse_args()
    if POLICY.multiple_comparisons != "holm" or POLICY.ci_method != "tango":
        raise SystemExit("the vectorised twin implements holm + tango only; adjust it for this policy")
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    n_checks = 2 * len(TASKS)
    alpha_acc, alpha_rate = gate_levels(ALPHA, POLICY.alpha_split, POLICY.alpha_validity, len(TASKS), n_checks)
    print(f"evalgate gate simulation: {args.reps} replicates per row, seed {args.seed}; policy {POLICY.path} "
          f"(sha256 {POLICY.sha256[:12]})")
    print(f"  α = {ALPHA} for the whole gate: accuracy α_acc = {alpha_acc:g} (McNemar, Holm over {len(TASKS)} "
          f"tasks), {n_checks} rate checks at {alpha_rate:g} each; margin floor "
          f"{'on' if POLICY.margin_floor else 'off'} (exact, share α_acc/K = {alpha_acc / len(TASKS):g} per task)")
    for t in TASKS:
        print(f"  {t.name}: n = {t.n}, accuracy {t.accuracy}, M = {100 * t.margin:g} pp, rate limit "
              f"max({100 * t.limit:g} pp·n, {t.min_items}) = {max(t.limit * t.n, t.min_items):.2f} items; "
              f"invalid/truncation base {100 * t.rate_base:g}%, indicator flip rate {100 * t.rate_noise:g}%")
    mismatches = 0

    print(f"\nA. Candidate as good as the baseline (Δ = 0), A/A ψ₀ = ψ: FALSE-FAIL rate, target ≤ α = {ALPHA:g}")
    print("   M_eff = max(M, A/A floor); McN = McNemar-Holm at α_acc; NI = Tango L ≤ −M_eff; rates = invalid or")
    print("   truncation gate; ours = the shipped rule; spec = the original rule (docs/gate.md#the-original-rule); rtol = flat rules.")
    print(f"{'task':10} {'ψ':>4} {'M_eff':>7} {'McN':>6} {'NI':>6} {'rates':>6} {'ours':>6} {'spec':>6} "
          f"{'rtol5':>6} {'rtol8':>6}")
    whole = []
    for psi in FLIP_RATES:
        sim = simulate(psi, args.reps, rng)
        mismatches += cross_check(sim, args.check)
        for t in TASKS:
            r = sim[t.name]
            print(f"{t.name:10} {100 * psi:3g}% {100 * r['m_eff']:5.2f}pp {pct(r['mcnemar'])} {pct(r['ni'])} "
                  f"{pct(r['rates'])} {pct(r['ours'])} {pct(r['spec'])} {pct(r['flat_0.05'])} "
                  f"{pct(r['flat_0.08'])}")
        whole.append((psi, sim))
    print("\n   Whole gate (FAIL if either task fails), Δ = 0 on both tasks:")
    print(f"   {'ψ':>4} {'ours: accuracy':>15} {'ours: full':>11} {'spec docs/gate.md#the-original-rule':>10} {'rtol5':>6} {'rtol8':>6}")
    for psi, sim in whole:
        g, h = sim["gsm8k"], sim["humaneval"]
        print(f"   {100 * psi:3g}% {pct(g['accuracy'] | h['accuracy']):>15} {pct(g['ours'] | h['ours']):>11} "
              f"{pct(g['spec'] | h['spec']):>10} {pct(g['flat_0.05'] | h['flat_0.05']):>6} "
              f"{pct(g['flat_0.08'] | h['flat_0.08']):>6}")
    print("\n   A/A underestimates the noise by half (ψ₀ = ψ/2), Δ = 0, whole gate:")
    print(f"   {'ψ':>4} {'ψ₀':>5} {'M_eff gsm8k':>12} {'M_eff he':>9} {'ours: full':>11}")
    for psi in (0.04, 0.06):
        sim = simulate(psi, args.reps, rng, aa_scale=0.5)
        mismatches += cross_check(sim, args.check // 2)
        g, h = sim["gsm8k"], sim["humaneval"]
        print(f"   {100 * psi:3g}% {50 * psi:4g}% {100 * g['m_eff']:10.2f}pp {100 * h['m_eff']:7.2f}pp "
              f"{pct(g['ours'] | h['ours']):>11}")

    print("\nB. POWER: the candidate drops by M on one task (GSM8K −1.5 pp at n = 1319, HumanEval −5 pp at")
    print("   n = 164), the other task unchanged, A/A ψ₀ = ψ. Chance that that task FAILS (gate: FAIL at all).")
    print(f"{'task':10} {'ψ':>4} {'drop':>6} {'M_eff':>7} {'McN':>6} {'NI':>6} {'ours':>6} {'gate':>6} "
          f"{'spec':>6} {'rtol5':>6} {'rtol8':>6}")
    for psi in FLIP_RATES:
        for t in TASKS:
            sim = simulate(psi, args.reps, rng, drops={t.name: t.drop})
            mismatches += cross_check(sim, args.check // 4)
            r = sim[t.name]
            gate = sim["gsm8k"]["ours"] | sim["humaneval"]["ours"]
            print(f"{t.name:10} {100 * psi:3g}% {100 * t.drop:4.1f}pp {100 * r['m_eff']:5.2f}pp "
                  f"{pct(r['mcnemar'])} {pct(r['ni'])} {pct(r['ours'])} {pct(gate)} {pct(r['spec'])} "
                  f"{pct(r['flat_0.05'])} {pct(r['flat_0.08'])}")

    print("\nC. BROKEN KERNEL: the invalid rate rises by R on one task (accuracy drops by R·accuracy), ψ = 2%,")
    print("   A/A ψ₀ = ψ. Chance that that task FAILS: by the rate gates alone, and by the whole rule.")
    print(f"{'task':10} {'R':>5} {'rates':>6} {'ours':>6} {'spec':>6} {'rtol5':>6} {'rtol8':>6}")
    for rise in (0.03, 0.10):
        for t in TASKS:
            sim = simulate(0.02, args.reps, rng, drops={t.name: rise * t.accuracy}, rises={t.name: rise})
            mismatches += cross_check(sim, args.check // 4)
            r = sim[t.name]
            print(f"{t.name:10} {100 * rise:3g}pp {pct(r['rates'])} {pct(r['ours'])} {pct(r['spec'])} "
                  f"{pct(r['flat_0.05'])} {pct(r['flat_0.08'])}")

    print("\nD. Rate gates alone at Δ = 0 (invalid OR truncation, no true rise) by indicator flip rate:")
    print("   false-fail of one task, ours / spec docs/gate.md#the-original-rule.")
    noises = (0.0025, 0.005, 0.01, 0.02)
    print(f"{'task':10} " + " ".join(f"{f'flip {100 * x:g}%':>14}" for x in noises))
    for t in TASKS:
        cells = []
        for noise in noises:
            inv, trunc = draw_indicator(t, args.reps, rng, noise=noise), draw_indicator(t, args.reps, rng, noise=noise)
            ours = rate_fails(inv, t, alpha_rate, t.min_items) | rate_fails(trunc, t, alpha_rate, t.min_items)
            spec = rate_fails(inv, t, ALPHA, 0) | rate_fails(trunc, t, ALPHA, 0)
            cells.append(f"{pct(ours)} / {pct(spec)}")
        print(f"{t.name:10} " + " ".join(f"{c:>14}" for c in cells))

    print(f"\ncross-check against decide_task/decide_overall (ours and spec verdicts): {mismatches} mismatches")
    print(f"elapsed {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
