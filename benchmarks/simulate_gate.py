"""Simulate the whole release gate with evalgate's own decision rule: how often it PASSes, is INCONCLUSIVE or
FAILs a kernel as good as the baseline (Δ = 0), one half the margin worse (Δ = −M/2) and one the margin worse
(Δ = −M), greedy (one look) and sequential (rounds of coupled samples per item), with noise on the validity
flags — one table, every verdict cross-checked against ``decide_task`` / ``decide_overall``.

The gate (docs/gate.md#the-decision-rule): per task PASS when shown within M (k = 1: the exact unconditional
test of Tango's statistic; k > 1: the score interval), FAIL when shown worse than M (Holm across the tasks
of the look at α_acc) or a validity rate shown risen (exact McNemar on the discordant flags at α_validity/J),
else INCONCLUSIVE. Look j of a gate is decided at α·2^-(j+1) (``Thresholds.at_look``). Sequential: look 0 is
greedy; while a task is undecided the next look adds k coupled samples per item to the undecided tasks
(``evalgate.pipeline.next_samples``: k = 4, then 8, up to ``--max-samples``).

Worlds (items are heterogeneous; the same items at every look):

- greedy: item i flips between the two kernels with probability π_i ~ Beta(0.3, 0.3·(1/ψ − 1)) (mean ψ); a flip
  is a loss or a gain with probability ½; a drop D adds one-directional losses: P(loss) = π_i/2 − D.
- k coupled samples (the rounds): item i passes a sample with probability p_i ~ Beta(0.5, 0.088) (mean 0.85);
  sample s of both kernels shares its random key, and the kernel moves it with probability φ_i ~ Beta(1,
  1/φ̄ − 1) (φ̄ = 0.5), redrawn at the candidate's pass rate q_i; Δ = 0 has per-item shifts that cancel
  (τ = 0.25), a drop D scales q so that the mean difference is D. "independent": φ̄ = 1 (no coupling:
  per-sample flip rate 9.4%).
- validity flags: per check (invalid, truncation) and look, each item is newly flagged with probability r/2
  and loses its flag with probability r/2 (symmetric noise r, no real change); k > 1 looks flag whole items.

Policies: the default (thresholds.yaml: GSM8K n = 1319, M = 1.5 pp; HumanEval n = 164, M = 5 pp) and the
canary's (evalgate/canary/thresholds-canary.yaml: GSM8K n = 200, M = 3 pp; HumanEval n = 164, M = 5 pp).
Columns: Δ = 0 and Δ = −M/2 on both tasks; Δ = −M on one task, the other as good as the baseline (PASS needs
every task, so this is the worst case for a false PASS), the worse of the two tasks shown. "k̄": the mean
samples per item each kernel generates over the looks taken (both tasks' items together).

Run:  python benchmarks/simulate_gate.py [--reps 2000] [--seed 12345] [--check 6] [--max-samples 8]
      (about 9 minutes on 2 busy cores at the defaults); ``--mde``: only the greedy MDE table
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import binom, norm

from evalgate.canary import THRESHOLDS as CANARY_THRESHOLDS
from evalgate.gate.policy import Thresholds, load_thresholds
from evalgate.gate.rule import TaskData, TaskRule, decide_overall, decide_task, gate_levels
from evalgate.pipeline import next_samples
from evalgate.stats.exact_ni import _tails, critical_value
from evalgate.stats.margin import mde_binary
from evalgate.stats.paired import Counts, tango_z
from evalgate.stats.scores import score_z

CHUNK = 500


def hist_rows(steps: np.ndarray, m: int) -> np.ndarray:
    """Per row, how many items fall in each of the m lattice cells (steps are cell indices)."""
    rows = steps.shape[0]
    flat = steps + m * np.arange(rows)[:, None]
    return np.bincount(flat.ravel(), minlength=rows * m).reshape(rows, m).astype(float)


@dataclass
class Greedy:
    n: int
    psi: float

    def __post_init__(self):
        rng = np.random.default_rng(int(self.psi * 1e6) + self.n)
        self.pi = rng.beta(0.3, 0.3 * (1 / self.psi - 1), size=self.n)

    def draw(self, drop: float, reps: int, rng, keep: int = 0):
        """Histograms (reps, 3) over D ∈ {−1, 0, 1}; ``keep``: the first rows' per-item (base, cand) too."""
        out, kept = np.zeros((reps, 3)), []
        for start in range(0, reps, CHUNK):
            r = min(CHUNK, reps - start)
            u = rng.random((r, self.n))
            loss = self.pi / 2 - drop
            lost, gained = u < loss, (u >= loss) & (u < loss + self.pi / 2)
            b, c = lost.sum(axis=1), gained.sum(axis=1)
            out[start:start + r] = np.column_stack([b, self.n - b - c, c])
        return out, kept


@dataclass
class Coupled:
    n: int
    phi_mean: float
    tau: float = 0.25

    def __post_init__(self):
        rng = np.random.default_rng(int(100 * self.phi_mean) + self.n)
        self.p = rng.beta(0.5, 0.088, size=self.n)
        self.phi = np.ones(self.n) if self.phi_mean >= 1 else rng.beta(1.0, 1.0 / self.phi_mean - 1.0, size=self.n)
        signs = rng.choice((-1.0, 1.0), size=self.n)
        eps = self.tau * 4 * self.p * (1 - self.p) * signs
        w = self.phi * eps  # the shifts cancel on average: Δ = 0
        pos, neg = w[w > 0].sum(), -w[w < 0].sum()
        if pos > 0 and neg > 0:
            eps = np.where(eps > 0, eps * min(1.0, neg / pos), eps * min(1.0, pos / neg))
        self.q0 = np.clip(self.p + eps, 0.0, 1.0)

    def q(self, drop: float) -> np.ndarray:
        return self.q0 if drop == 0 else self.q0 * (1 + drop / float(np.mean(self.phi * self.q0)))

    def draw(self, drop: float, reps: int, rng, k: int, keep: int = 0):
        """Histograms (reps, 2k + 1) over D ∈ {−1, …, 1} in steps of 1/k, and the first ``keep`` replicates'
        per-item mean scores (base, cand)."""
        q = self.q(drop)
        out, kept = np.zeros((reps, 2 * k + 1)), []
        step = max(1, CHUNK * 164 // (self.n * k))
        for start in range(0, reps, step):
            r = min(step, reps - start)
            shape = (r, self.n, k)
            base = rng.random(shape) < self.p[None, :, None]
            moved = rng.random(shape) < self.phi[None, :, None]
            cand = np.where(moved, rng.random(shape) < q[None, :, None], base)
            out[start:start + r] = hist_rows(cand.sum(axis=2) - base.sum(axis=2) + k, 2 * k + 1)
            while len(kept) < keep and len(kept) < start + r:
                i = len(kept) - start
                kept.append((base[i].mean(axis=1), cand[i].mean(axis=1)))
        return out, kept


# ------------------------------------------------------------------------------------------- the rule, vectorised


def task_tests(hist: np.ndarray, k: int, n: int, margin: float, alpha: float):
    """(PASS at α, p of "Δ ≥ −M") per replicate: the exact test of Tango's Z (k = 1), the score test (k > 1)."""
    if k == 1:
        b, c = hist[:, 0], hist[:, 2]
        z = tango_z(-margin, b, c, n)
        _, p_fail = _tails(n, margin, z)
        return z > critical_value(n, round(margin, 12), alpha), p_fail
    support = np.arange(-k, k + 1) / k
    passed = score_z(support, hist, -margin) > norm.ppf(1 - alpha)
    p_fail = norm.sf(score_z(-support[::-1], hist[:, ::-1], margin))
    return passed, p_fail


def holm(pvals: dict, open_: dict, alpha: float) -> dict:
    """Holm across the tasks open at this look (per replicate: K = how many are open)."""
    names = list(pvals)
    big = {t: np.where(open_[t], pvals[t], np.inf) for t in names}
    count = sum(open_[t].astype(int) for t in names)
    lo = np.minimum(big[names[0]], big[names[1]])
    hi = np.maximum(big[names[0]], big[names[1]])
    first = lo <= alpha / np.maximum(count, 1)
    second = first & (hi <= alpha)
    return {t: open_[t] & ((big[t] == lo) & first | (big[t] == hi) & second) for t in names}


def rate_noise(n: int, reps: int, rng, r: float) -> tuple[np.ndarray, np.ndarray]:
    """(new, gone) flagged items per check (2, reps): symmetric flag noise r per item."""
    counts = rng.multinomial(n, [r / 2, r / 2, 1 - r], size=(2, reps)) if r > 0 else np.zeros((2, reps, 3), int)
    return counts[..., 0], counts[..., 1]


def rate_fails(new, gone, alpha_check):
    p = np.where(new + gone > 0, binom.sf(new - 1, new + gone, 0.5), 1.0)
    return (p <= alpha_check).any(axis=0)


@dataclass
class Scenario:
    """One table cell: a policy, per-task worlds and drops, greedy or sequential, flag noise."""

    policy: Thresholds
    n: dict
    psi: float
    phi: float | None  # None: greedy only (one look)
    drops: dict
    noise: float
    max_samples: int
    greedy: dict = field(init=False)
    coupled: dict = field(init=False)

    def __post_init__(self):
        self.greedy = {t: Greedy(n, self.psi) for t, n in self.n.items()}
        self.coupled = {t: Coupled(n, self.phi) for t, n in self.n.items()} if self.phi else {}


def run(s: Scenario, reps: int, rng, check: int) -> tuple[dict, int]:
    """Verdicts per replicate (PASS / INCONCLUSIVE / FAIL of the whole gate), the mean samples per item and the
    cross-check mismatches."""
    tasks = list(s.n)
    verdict = {t: np.full(reps, "OPEN", dtype=object) for t in tasks}
    samples = {t: np.zeros(reps) for t in tasks}
    mismatches, k, look = 0, 1, 0
    while True:
        open_ = {t: verdict[t] == "OPEN" for t in tasks}
        if not any(o.any() for o in open_.values()):
            break
        policy = s.policy.at_look(look)
        n_open = sum(o.astype(int) for o in open_.values())
        alpha_acc, _ = gate_levels(policy.alpha, policy.alpha_split, policy.alpha_validity, 2, 4)
        passed, p_fail, hists, kept, rates = {}, {}, {}, {}, {}
        for t in tasks:
            world = s.greedy[t] if k == 1 else s.coupled[t]
            args = () if k == 1 else (k,)
            hists[t], kept[t] = world.draw(s.drops.get(t, 0.0), reps, rng, *args, keep=check if k > 1 else 0)
            passed[t], p_fail[t] = task_tests(hists[t], k, s.n[t], policy.task(t).margin, policy.alpha)
            rates[t] = rate_noise(s.n[t], reps, rng, s.noise)
            samples[t] += np.where(open_[t], k, 0)
        inferior = holm(p_fail, open_, alpha_acc)
        for t in tasks:
            # J = 2 rate checks per open task, at α_validity / J each
            alpha_rate = policy.alpha_validity / (2 * np.maximum(n_open, 1))
            rate = rate_fails(*rates[t], alpha_rate)
            v = np.where(inferior[t] | rate, "FAIL", np.where(passed[t], "PASS", "INCONCLUSIVE"))
            new_verdict = np.where(open_[t], v, verdict[t])
            if s.phi:  # sequential: an INCONCLUSIVE stays open for the next round (closed when none is left)
                new_verdict = np.where(open_[t] & (v == "INCONCLUSIVE"), "OPEN", new_verdict)
            verdict[t] = new_verdict
        mismatches += cross_check(s, policy, k, hists, kept, rates, open_, verdict, check)
        stopped = np.zeros(reps, bool)
        for t in tasks:
            stopped |= verdict[t] == "FAIL"
        for t in tasks:  # a FAIL on any task ends the gate; the rest stay as they are
            verdict[t] = np.where(stopped & (verdict[t] == "OPEN"), "INCONCLUSIVE", verdict[t])
        k_next = next_samples(k, [], s.max_samples) if s.phi else None
        if k_next is None:
            for t in tasks:
                verdict[t] = np.where(verdict[t] == "OPEN", "INCONCLUSIVE", verdict[t])
            break
        k, look = k_next, look + 1
    overall = np.where(np.any([verdict[t] == "FAIL" for t in tasks], axis=0), "FAIL",
                       np.where(np.any([verdict[t] == "INCONCLUSIVE" for t in tasks], axis=0), "INCONCLUSIVE", "PASS"))
    total_items = sum(s.n.values())
    kbar = float(np.mean(sum(samples[t] * s.n[t] for t in tasks) / total_items))
    return {"overall": overall, "tasks": verdict, "kbar": kbar}, mismatches


def cross_check(s: Scenario, policy: Thresholds, k: int, hists, kept, rates, open_, verdict, check: int) -> int:
    """Re-decide the first ``check`` replicates of this look with decide_task / decide_overall (the open tasks
    only, at the look's policy); count per-task verdict mismatches."""
    bad = 0
    for i in range(check):
        decisions = []
        for t in s.n:
            if not open_[t][i]:
                continue
            n = s.n[t]
            new, gone = (x[:, i] for x in rates[t])
            flags = {}
            for j, name in enumerate(("invalid", "truncated")):
                base_flags, cand_flags = np.zeros(n, bool), np.zeros(n, bool)
                base_flags[:gone[j]] = True
                cand_flags[gone[j]:gone[j] + new[j]] = True
                flags[f"base_{name}"], flags[f"cand_{name}"] = base_flags, cand_flags
            rule = TaskRule.from_policy(policy, t)
            if k == 1:
                h = hists[t][i].astype(int)
                data = TaskData.from_counts(t, Counts(h[1], h[0], h[2], 0, n), **flags)
            else:
                base, cand = kept[t][i]
                data = TaskData(t, base, cand, n_samples=k, **flags)
            decisions.append(decide_task(data, rule))
        if not decisions:
            continue
        overall = decide_overall(decisions, alpha=policy.alpha, multiple_comparisons=policy.multiple_comparisons)
        for t, dec in overall.tasks.items():
            mine = verdict[t][i]
            mine = "INCONCLUSIVE" if mine == "OPEN" else mine
            bad += dec.verdict != mine
    return bad


def print_mde_table() -> None:
    """The exact greedy MDE (80% power) at the first look's α (α/2) and the policy's margins: what a verdict
    prints for a candidate as good as the baseline at flip rate ψ."""
    policy = load_thresholds().at_look(0)
    print(f"greedy MDE at 80% power, first look (α = {policy.alpha:g}, exact critical value at the policy's M)")
    print(f"{'ψ':>5} {'GSM8K flips':>12} {'GSM8K MDE':>10} {'HumanEval flips':>16} {'HumanEval MDE':>14}")
    for psi in (0.01, 0.02, 0.04, 0.06, 0.085, 0.10):
        row = []
        for task, n in (("gsm8k", 1319), ("humaneval", 164)):
            margin = policy.task(task).margin
            row.append((psi * n, mde_binary(psi, n, policy.alpha, 0.8, critical_value(n, margin, policy.alpha))))
        print(f"{100 * psi:4g}% {row[0][0]:12.1f} {100 * row[0][1]:8.2f}pp {row[1][0]:16.1f} {100 * row[1][1]:12.2f}pp")


def pct(x) -> str:
    return f"{100 * np.mean(x):5.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--check", type=int, default=6, help="replicates per look re-decided with decide_overall")
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--mde", action="store_true", help="only print the greedy MDE table (docs/gate.md#resolution)")
    args = parser.parse_args()
    if args.mde:
        print_mde_table()
        return
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    policies = {"default": load_thresholds(), "canary": load_thresholds(CANARY_THRESHOLDS)}
    for policy in policies.values():
        if policy.multiple_comparisons != "holm" or not policy.alpha_split or not policy.inconclusive:
            raise SystemExit(f"{policy.path}: the vectorised twin implements holm, alpha_split and inconclusive only")
    sizes = {"default": {"gsm8k": 1319, "humaneval": 164}, "canary": {"gsm8k": 200, "humaneval": 164}}
    print(f"evalgate gate simulation: {args.reps} replicates per cell, seed {args.seed}, --max-samples "
          f"{args.max_samples}; look j at α·2^-(j+1); PASS / INCONCLUSIVE / FAIL of the whole gate, %")
    print(f"{'policy':8} {'ψ':>3} {'mode':12} {'r':>3} │ {'Δ = 0: PASS':>11} {'INC':>5} {'FAIL':>5} {'k̄':>5} │ "
          f"{'−M/2: PASS':>10} {'INC':>5} {'FAIL':>5} {'k̄':>5} │ {'−M on one: PASS':>15} {'INC':>5} {'FAIL':>5} {'k̄':>5}")
    mismatches = 0
    modes = (("greedy", None), ("seq coupled", 0.5), ("seq indep.", 1.0))
    for name, policy in policies.items():
        n = sizes[name]
        margins = {t: policy.task(t).margin for t in n}
        for psi in (0.04, 0.06):
            for mode, phi in modes:
                for noise in (0.0, 0.02, 0.04, 0.06):
                    def cell(drops):
                        nonlocal mismatches
                        out, bad = run(Scenario(policy, n, psi, phi, drops, noise, args.max_samples), args.reps, rng,
                                       args.check)
                        mismatches += bad
                        return out
                    null = cell({})
                    text = (f"{name:8} {100 * psi:2.0f}% {mode:12} {100 * noise:2.0f}% │ {pct(null['overall'] == 'PASS'):>11} "
                            f"{pct(null['overall'] == 'INCONCLUSIVE')} {pct(null['overall'] == 'FAIL')} {null['kbar']:5.2f} │")
                    if noise == 0.0:
                        half = cell({t: -m / 2 for t, m in margins.items()})
                        worst = max((cell({t: -margins[t]}) for t in n), key=lambda o: np.mean(o["overall"] == "PASS"))
                        text += (f" {pct(half['overall'] == 'PASS'):>10} {pct(half['overall'] == 'INCONCLUSIVE')} "
                                 f"{pct(half['overall'] == 'FAIL')} {half['kbar']:5.2f} │ "
                                 f"{pct(worst['overall'] == 'PASS'):>15} {pct(worst['overall'] == 'INCONCLUSIVE')} "
                                 f"{pct(worst['overall'] == 'FAIL')} {worst['kbar']:5.2f}")
                    else:
                        text += f" {'(noise rows: Δ = 0 only)':>28}"
                    print(text, flush=True)
    print(f"\ncross-check against decide_task/decide_overall (per task, per look): {mismatches} mismatches")
    print(f"elapsed {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
