"""Simulate the release gate with evalgate's own decision rule: how often it FAILs a candidate as good as the
baseline, PASSes one worse than the margin, and is INCONCLUSIVE — greedy and with k coupled samples per item.

Tasks (drawn together, so Holm across the two tasks and the whole-gate α budget apply as in the gate):

- GSM8K, n = 1319, greedy (k = 1), M = 1.5 pp; baseline accuracy 0.90.
- HumanEval, n = 164, M = 5 pp: greedy, or k coupled samples per item at temperature T > 0.

Flip structure (docs/gate.md#k-samples). Items are heterogeneous, and the A/A flip rate ψ₀ is estimated from a
simulated A/A run of the same items, never given:

- greedy: item i flips between two kernels with its own probability π_i ~ Beta(0.3, 0.3·(1/ψ − 1)) (mean ψ:
  most items never flip, near-ties flip often); a flip is a loss or a gain with probability ½ each. A true drop
  D adds one-directional losses, P(loss) = π_i/2 + D. The A/A run flips item i with the same π_i.
- k coupled samples: item i passes a sample with probability p_i ~ Beta(0.5, 0.088) (mean 0.85, most items
  near 0 or 1); sample s of the two kernels shares its random keys, so the candidate's sample is the
  baseline's unless the kernel's perturbation moves the sampled path, which happens with probability φ_i ~
  Beta(1, 1/φ̄ − 1) (mean φ̄, heterogeneous); a moved sample is redrawn at the candidate's pass rate q_i.
  "As good as the baseline": q_i = p_i + ε_i with per-item shifts ε_i of either sign that cancel on average
  (τ = 0.25: the kernel helps some items and hurts others — what averaging samples cannot remove).
  A drop D: q_i = (p_i + ε_i)(1 − r), r set so that the mean per-item difference is D.
  φ̄ = 1 is independent sampling (no coupling); the uncoupled per-sample flip rate here is E[2p(1−p)] = 9.4%.
- ``--from-runs BASE CAND`` (or ``--runs``): the per-item structure of two stored runs (e.g. the canary's
  w4a8 baseline and a candidate made with ``evalgate run``). Greedy runs: items are resampled, a resampled
  item flips with its observed flip indicator, random signs for Δ = 0, extra losses for a drop. Sampled runs
  (k paired samples per item, ``evalgate run --samples K --temperature T``): each item's pass rate p_i and
  how often the kernel moves one of its samples, φ_i = (observed per-sample flip rate) / 2p_i(1 − p_i), feed
  the coupled model above at every k of the table. Either way ψ₀ comes from a simulated A/A run of the same
  structure (greedy: each item flips with its observed indicator; sampled: the same keys and batch-invariant
  numerics reproduce every sample, ψ̂₀ = 0), never from the runs' own ψ.
- ``--canary``: the measured structure of the canary's packed W4A4 kernel against the canary's packaged W4A8
  baseline, both tasks (one command: it runs ``evalgate run --kernel w4a4_packed`` into
  ``results/runs/simulate-canary-w4a4_packed`` first when that run is missing or incomplete, a few minutes).
- ``--cost N``: time the in-process canary generating N HumanEval items at k = 1, 4, 8, 16 (tokens capped by
  ``--cost-tokens``): the generation cost per k of the table.

Rules compared: ours (the policy in thresholds.yaml: evalgate.gate.rule, vectorised here and cross-checked
verdict by verdict against decide_task/decide_overall on a sample of replicates; the mismatch count must be
0); "separate": ours plus a FAIL whenever the degradation test rejects, also within the margin (item 4 of
issue 14); "before": the rule before issue 14 (McNemar FAIL, NI at max(M, A/A floor of the plug-in ψ̂₀),
two outcomes); "original" (docs/gate.md#the-original-rule); flat rules like vLLM's (rtol 0.05, 0.08).

Run:  python benchmarks/simulate_gate.py [--reps 5000] [--seed 12345] [--from-runs BASE CAND | --canary] [--cost N]
      (~2.5 min on 2 cores without --cost)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta, binom, norm

from evalgate.gate.policy import load_thresholds
from evalgate.gate.rule import TaskData, TaskRule, decide_overall, decide_task, gate_levels
from evalgate.stats.margin import aa_margin_floor, mde_binary
from evalgate.stats.paired import Counts, tango_lower_bound
from evalgate.stats.scores import score_lower_bound, score_z, signflip_from_histogram

POLICY = load_thresholds()
ALPHA = POLICY.alpha
Z = norm.ppf(1 - ALPHA)
N_GSM8K, N_HUMANEVAL = 1319, 164
M_GSM8K, M_HUMANEVAL = POLICY.task("gsm8k").margin, POLICY.task("humaneval").margin
CHUNK = 2000


# ------------------------------------------------------------------------------------------- worlds


def hist_rows(steps: np.ndarray, m: int) -> np.ndarray:
    """Per row, how many items fall in each of the m lattice cells (steps are cell indices)."""
    rows = steps.shape[0]
    flat = steps + m * np.arange(rows)[:, None]
    return np.bincount(flat.ravel(), minlength=rows * m).reshape(rows, m).astype(float)


@dataclass
class Greedy:
    """Binary items (k = 1) with heterogeneous flip probabilities."""

    n: int
    psi: float
    accuracy: float = 0.90
    k: int = 1

    def __post_init__(self):
        rng = np.random.default_rng(int(self.psi * 1e6) + self.n)
        a = 0.3
        self.pi = rng.beta(a, a * (1 / self.psi - 1), size=self.n)

    def describe(self) -> str:
        return f"greedy, ψ = {100 * self.psi:g}%"

    def draw(self, drop: float, reps: int, rng) -> np.ndarray:
        """Histograms (reps, 3) over D ∈ {−1, 0, 1}."""
        out = np.zeros((reps, 3))
        for start in range(0, reps, CHUNK):
            r = min(CHUNK, reps - start)
            u = rng.random((r, self.n))
            loss = self.pi / 2 - drop  # drop < 0: extra one-directional losses
            lost = u < loss
            gained = (u >= loss) & (u < loss + self.pi / 2)
            b, c = lost.sum(axis=1), gained.sum(axis=1)
            out[start:start + r] = np.column_stack([b, self.n - b - c, c])
        return out

    def draw_aa(self, reps: int, rng) -> np.ndarray:
        """ψ̂₀ of one simulated A/A run per replicate."""
        return rng.binomial(1, np.broadcast_to(self.pi, (reps, self.n))).mean(axis=1)


@dataclass
class Coupled:
    """k coupled samples per item at T > 0 (see the module docstring)."""

    n: int
    k: int
    phi_mean: float
    tau: float = 0.25

    def __post_init__(self):
        rng = np.random.default_rng(int(100 * self.phi_mean))  # the same items for every k
        self.p = rng.beta(0.5, 0.088, size=self.n)
        self.phi = (np.ones(self.n) if self.phi_mean >= 1 else
                    rng.beta(1.0, 1.0 / self.phi_mean - 1.0, size=self.n))
        self._shifts(rng)

    label: str = ""

    @classmethod
    def from_structure(cls, k: int, p: np.ndarray, phi: np.ndarray, label: str, n: int = N_HUMANEVAL,
                       tau: float = 0.25) -> "Coupled":
        """The coupled model with per-item pass rates and move probabilities measured on real runs; the
        measured items are resampled (pairs (p_i, φ_i) kept together) to ``n`` items when their count differs."""
        rng = np.random.default_rng(len(p))
        idx = np.arange(len(p)) if len(p) == n else rng.integers(0, len(p), size=n)
        world = cls.__new__(cls)
        world.n, world.k, world.tau, world.label = n, k, tau, label
        world.p, world.phi = np.asarray(p, float)[idx], np.asarray(phi, float)[idx]
        world.phi_mean = float(np.mean(world.phi))
        world._shifts(rng)
        return world

    def _shifts(self, rng) -> None:
        signs = rng.choice((-1.0, 1.0), size=self.n)
        eps = self.tau * 4 * self.p * (1 - self.p) * signs
        w = self.phi * eps  # make the shifts cancel exactly on average: Δ = 0
        pos, neg = w[w > 0].sum(), -w[w < 0].sum()
        if pos > 0 and neg > 0:
            eps = np.where(eps > 0, eps * min(1.0, neg / pos), eps * min(1.0, pos / neg))
        self.q0 = np.clip(self.p + eps, 0.0, 1.0)
        self.psi_sample = float(np.mean(self.phi * (self.p * (1 - self.q0) + self.q0 * (1 - self.p))))

    def describe(self) -> str:
        coupling = ("independent samples" if self.phi_mean >= 1 else
                    f"{self.label}, φ̄ = {self.phi_mean:.3g}" if self.label else f"coupled, φ̄ = {self.phi_mean:g}")
        return f"k = {self.k}, {coupling} (per-sample flip rate {100 * self.psi_sample:.1f}%)"

    def q(self, drop: float) -> np.ndarray:
        if drop == 0:
            return self.q0
        r = -drop / float(np.mean(self.phi * self.q0))
        return self.q0 * (1 - r)

    def draw(self, drop: float, reps: int, rng, keep: int = 0):
        """Histograms (reps, 2k + 1) over D ∈ {−1, …, 1} in steps of 1/k; with ``keep``, also the first
        ``keep`` replicates' per-item scores (base, cand) for the cross-check."""
        q = self.q(drop)
        out = np.zeros((reps, 2 * self.k + 1))
        kept = []
        for start in range(0, reps, CHUNK // 4):
            r = min(CHUNK // 4, reps - start)
            shape = (r, self.n, self.k)
            base = rng.random(shape) < self.p[None, :, None]
            moved = rng.random(shape) < self.phi[None, :, None]
            cand = np.where(moved, rng.random(shape) < q[None, :, None], base)
            steps = cand.sum(axis=2) - base.sum(axis=2) + self.k
            out[start:start + r] = hist_rows(steps, 2 * self.k + 1)
            if len(kept) < keep:
                kept += [(base[i].mean(axis=1), cand[i].mean(axis=1)) for i in range(min(keep - len(kept), r))]
        return (out, kept) if keep else out

    def draw_aa(self, reps: int, rng) -> np.ndarray:
        """ψ̂₀ = mean(D²) of one simulated A/A run: the same kernel, the same keys (batch-invariant
        generation reproduces every sample, so ψ̂₀ = 0)."""
        return np.zeros(reps)


@dataclass
class FromRuns:
    """The per-item structure of two stored runs, resampled (``--runs``)."""

    n: int
    k: int
    base: np.ndarray
    diffs: np.ndarray
    label: str

    def describe(self) -> str:
        return f"from runs {self.label} (k = {self.k}, ψ = {100 * float(np.mean(self.diffs ** 2)):.2f}%)"

    def draw(self, drop: float, reps: int, rng) -> np.ndarray:
        out = np.zeros((reps, 2 * self.k + 1))
        for start in range(0, reps, CHUNK):
            r = min(CHUNK, reps - start)
            idx = rng.integers(0, self.n, size=(r, self.n))
            steps = np.rint(np.abs(self.diffs[idx]) * self.k) * rng.choice((-1, 1), size=(r, self.n))
            if drop:
                passes = np.rint((self.base[idx] + self.diffs[idx]) * self.k).astype(int)
                rate = min(1.0, -drop / max(float(np.mean(self.base + self.diffs)), 1e-9))
                steps = steps - rng.binomial(np.maximum(passes, 0), rate)
            steps = np.clip(steps, -self.k, self.k).astype(int) + self.k
            out[start:start + r] = hist_rows(steps, 2 * self.k + 1)
        return out

    def draw_aa(self, reps: int, rng) -> np.ndarray:
        """ψ̂₀ of one simulated A/A run of the same structure: n items resampled, each flipping with its
        observed flip indicator |D_i| (a per-item flip probability); estimated, never the runs' own ψ."""
        out = np.empty(reps)
        flip = np.abs(self.diffs)
        for start in range(0, reps, CHUNK):
            r = min(CHUNK, reps - start)
            idx = rng.integers(0, self.n, size=(r, self.n))
            out[start:start + r] = (rng.random((r, self.n)) < flip[idx]).mean(axis=1)
        return out


def load_runs(base_path: str, cand_path: str, task: str | None = None):
    """The structure of two stored runs for ``task`` (HumanEval when both have it, else their first task):
    ``FromRuns`` for greedy runs; for sampled runs the measured p_i and φ_i (``sampled_structure``)."""
    from evalgate.gate.compare import compare

    pairing = compare(base_path, cand_path, tasks=[task] if task else None)
    task = task or ("humaneval" if "humaneval" in pairing.pairs else pairing.tasks[0])
    pairs = pairing.pairs[task]
    base, cand = np.array(pairs.scores("base")), np.array(pairs.scores("cand"))
    label = f"measured: {Path(base_path).name} vs {Path(cand_path).name} ({task})"
    if pairs.k == 1:
        return task, FromRuns(len(base), 1, base, cand - base, label)
    return task, sampled_structure(pairs, label)


CANARY_RUN = Path("results/runs/simulate-canary-w4a4_packed")


def canary_structures(run_dir: Path = CANARY_RUN):
    """(task, structure) for both canary tasks: the packaged W4A8 baseline against a w4a4_packed run (made
    here when missing: canonical numerics make it the same run on any machine)."""
    import json
    import subprocess
    import sys

    from evalgate.canary import BASELINES, PROFILES

    manifest = run_dir / "manifest.json"
    tasks = json.loads(manifest.read_text()).get("tasks", {}) if manifest.is_file() else {}
    if not all(tasks.get(t, {}).get("complete") for t in PROFILES):
        print(f"running the canary with w4a4_packed into {run_dir} (a few minutes) ...", flush=True)
        resume = ["--resume"] if manifest.is_file() else []
        subprocess.run([sys.executable, "-m", "evalgate", "run", "--kernel", "w4a4_packed", "--tasks",
                        ",".join(PROFILES), "--out", str(run_dir), *resume], check=True)
    for task, profile in PROFILES.items():
        base = next(BASELINES.glob(f"*/{profile}-*/w4a8"))
        yield load_runs(str(base), str(run_dir), task)


def sampled_structure(pairs, label: str):
    """Per item: the baseline pass rate p_i and φ_i, the probability that the kernel moves a sample, from the
    observed per-sample flip rate f_i = φ_i·(p_i(1 − q_i) + q_i(1 − p_i)) with q_i ≈ p_i."""
    base = np.array(pairs.sample_scores("base"), dtype=float)
    cand = np.array(pairs.sample_scores("cand"), dtype=float)
    p = base.mean(axis=1)
    flips = np.abs(cand - base).mean(axis=1)
    print(f"measured structure, {label}: {len(p)} items × k = {base.shape[1]}, mean pass rate {p.mean():.3f}, "
          f"per-sample flip rate {flips.mean():.3f}, items with a moved sample {np.mean(flips > 0):.2f}")
    spread = 2 * p * (1 - p)
    phi = np.where(spread > 0, np.clip(flips / np.maximum(spread, 1e-12), 0.0, 1.0), flips)
    return p, phi, label


# ------------------------------------------------------------------------------------------- the rule, vectorised


def support_of(k: int) -> np.ndarray:
    return np.arange(-k, k + 1) / k


def degradation_p(hist: np.ndarray, k: int) -> np.ndarray:
    """The exact one-sided degradation p per replicate: McNemar (k = 1), the sign-flip test (k > 1)."""
    if k == 1:
        b, c = hist[:, 0], hist[:, 2]
        return np.where(b + c > 0, binom.sf(b - 1, b + c, 0.5), 1.0)
    return np.array([signflip_from_histogram(h, k).p_lower for h in hist])


def non_inferior(hist: np.ndarray, k: int, margin: float) -> np.ndarray:
    """L > −M per replicate, as "Z(−M) > z" (Tango's Z when k = 1)."""
    if k == 1:
        b, c, n = hist[:, 0], hist[:, 2], int(hist[0].sum())
        return tango_lower_bound(b, c, n, ALPHA) > -margin
    return score_z(support_of(k), hist, -margin) > Z


def mean_delta(hist: np.ndarray, k: int) -> np.ndarray:
    return (hist * support_of(k)).sum(axis=1) / hist.sum(axis=1)


def holm_two(p1: np.ndarray, p2: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm with K = 2, vectorised: the smaller p needs ≤ α/2, then the larger ≤ α."""
    first = np.minimum(p1, p2) <= alpha / 2
    return (first & (p1 <= np.where(p1 <= p2, alpha / 2, alpha)),
            first & (p2 <= np.where(p2 < p1, alpha / 2, alpha)))


def draw_rates(n: int, reps: int, rng, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Validity indicators (invalid, truncated) with symmetric flip noise: (new, gone) counts each."""
    flips = rng.multinomial(n, [noise / 2, noise / 2, 1 - noise], size=(2, reps))
    return flips[..., 0], flips[..., 1]


def rate_fails(new, gone, n, alpha_check, limit, min_items) -> np.ndarray:
    p = np.where(new + gone > 0, binom.sf(new - 1, new + gone, 0.5), 1.0)
    return ((p <= alpha_check) | ((new - gone) > max(limit * n, min_items) + 1e-9)).any(axis=0)


@dataclass
class Outcome:
    """Per replicate, one task's verdict under each rule (booleans)."""

    ours_pass: np.ndarray
    ours_fail: np.ndarray
    separate_fail: np.ndarray
    before_fail: np.ndarray
    original_fail: np.ndarray
    flat: dict
    psi0: np.ndarray
    psi0_upper: np.ndarray

    @property
    def ours_inconclusive(self):
        return ~self.ours_pass & ~self.ours_fail


def simulate(worlds: dict, drops: dict, reps: int, rng, keep: int = 0):
    """Both tasks at once: per task an Outcome; with ``keep``, replicates for the cross-check."""
    alpha_acc, alpha_rate = gate_levels(ALPHA, POLICY.alpha_split, POLICY.alpha_validity, 2, 4)
    hists, kept = {}, {}
    for task, world in worlds.items():
        if keep and isinstance(world, Coupled):
            hists[task], kept[task] = world.draw(drops.get(task, 0.0), reps, rng, keep=keep)
        else:
            hists[task] = world.draw(drops.get(task, 0.0), reps, rng)
    pvals = {t: degradation_p(hists[t], w.k) for t, w in worlds.items()}
    names = list(worlds)
    degraded = dict(zip(names, holm_two(pvals[names[0]], pvals[names[1]], alpha_acc)))
    spec_degraded = dict(zip(names, holm_two(pvals[names[0]], pvals[names[1]], ALPHA)))
    out, rates = {}, {}
    for task, world in worlds.items():
        policy = POLICY.task(task)
        hist, n, k = hists[task], world.n, world.k
        ni = non_inferior(hist, k, policy.margin)
        new, gone = draw_rates(n, reps, rng, 0.005 if task == "gsm8k" else 0.01)
        rates[task] = (new, gone)
        rate = rate_fails(new, gone, n, alpha_rate, policy.max_invalid_rise, policy.min_rise_items)
        psi0 = world.draw_aa(reps, rng)
        x = np.minimum(psi0 * n, n - 1e-9)  # psi_upper_bound, vectorised: Clopper–Pearson on x "flips"
        upper = beta.ppf(1 - ALPHA, x + 1, n - x)
        # the rule before issue 14: NI at max(M, floor(plug-in ψ̂₀)), McNemar FAIL, two outcomes
        floors = {x: aa_margin_floor(x, n, ALPHA, alpha_acc / 2) for x in np.unique(np.round(psi0, 6))}
        m_before = np.maximum(policy.margin, np.array([floors[x] for x in np.round(psi0, 6)]))
        if k == 1:
            lower = tango_lower_bound(hist[:, 0], hist[:, 2], n, ALPHA)
            before_ni = lower > -m_before
        else:
            before_ni = score_z(support_of(k), hist, -m_before) > Z
        delta = mean_delta(hist, k)
        base_rate = world.accuracy if isinstance(world, Greedy) else float(np.mean(getattr(world, "p", 0.85)))
        out[task] = Outcome(
            ours_pass=ni & ~rate,
            ours_fail=(~ni & degraded[task]) | rate,
            separate_fail=degraded[task] | rate,
            before_fail=degraded[task] | ~before_ni | rate,
            original_fail=spec_degraded[task] | ~ni | rate_fails(new, gone, n, ALPHA, policy.max_invalid_rise, 0),
            flat={r: base_rate + delta < base_rate * (1 - r) for r in (0.05, 0.08)},
            psi0=psi0, psi0_upper=upper)
    return out, hists, kept, rates


def cross_check(worlds, hists, kept, rates, outcome, samples: int) -> int:
    """Re-decide the first ``samples`` replicates with decide_task/decide_overall; count verdict mismatches."""
    mismatches = 0
    for i in range(samples):
        decisions = []
        for task, world in worlds.items():
            new, gone = (x[:, i] for x in rates[task])
            flags = []
            for j in range(2):
                base_flags = np.zeros(world.n, bool)
                base_flags[:gone[j]] = True
                cand_flags = np.zeros(world.n, bool)
                cand_flags[gone[j]:gone[j] + new[j]] = True
                flags.append((base_flags, cand_flags))
            common = dict(base_invalid=flags[0][0], cand_invalid=flags[0][1], base_truncated=flags[1][0],
                          cand_truncated=flags[1][1])
            rule = TaskRule.from_policy(POLICY, task)
            if world.k == 1:
                h = hists[task][i].astype(int)
                decisions.append(decide_task(TaskData.from_counts(task, Counts(h[1], h[0], h[2], 0, world.n), **common),
                                             rule))
            elif task in kept and i < len(kept[task]):
                base, cand = kept[task][i]
                decisions.append(decide_task(TaskData(task, base, cand, n_samples=world.k, **common), rule))
            else:
                return mismatches
        overall = decide_overall(decisions, alpha=ALPHA, multiple_comparisons=POLICY.multiple_comparisons)
        for task in worlds:
            o, dec = outcome[task], overall.tasks[task]
            expected = "PASS" if o.ours_pass[i] else ("FAIL" if o.ours_fail[i] else "INCONCLUSIVE")
            mismatches += dec.verdict != expected
    return mismatches


# ------------------------------------------------------------------------------------------- printing


def pct(x) -> str:
    return f"{100 * np.mean(x):5.1f}%"


def mde_of(world, reps: int, rng) -> float:
    """The MDE (80% power) the gate would print: the median over replicates at Δ = 0."""
    hist = world.draw(0.0, 200, rng)
    if world.k == 1:
        return float(np.median([mde_binary(round((h[0] + h[2]) / world.n, 9), world.n) for h in hist]))
    k = world.k
    sym = (hist + hist[:, ::-1]) / 2  # the symmetrised structure: each |D| half +, half −
    support = support_of(k)
    psi = (hist * support ** 2).sum(axis=1) / world.n
    lower = score_lower_bound(support, sym, ALPHA)
    return float(np.median(-lower + norm.ppf(0.8) * np.sqrt(psi / world.n)))


K_TABLE = (1, 4, 8, 16)  # samples per item in the target table


def generation_cost(items: int, tokens: int) -> None:
    """Wall time of the in-process canary (w4a8, canonical numerics) generating ``items`` HumanEval canary
    prompts at k = 1, 4, 8, 16 samples each (T = 0.8, one batch per item: its k samples), ``tokens`` new
    tokens at most."""
    from evalgate.canary import HUMANEVAL_PROFILE, canary_path
    from evalgate.model_adapters.generation import decode
    from evalgate.model_adapters.hf import load_model
    from evalgate.model_adapters.sampling import SampleKey, sample_seed
    from evalgate.tasks.humaneval import task as humaneval

    model, tok = load_model(canary_path(), "w4a8")
    loaded, resolved = humaneval.TASK.load(humaneval.PROFILES[HUMANEVAL_PROFILE], None, items)
    requests = humaneval.TASK.requests(loaded, resolved)
    print(f"generation cost on the canary (CPU, {torch_threads()} threads): {items} HumanEval item(s), ≤ {tokens} "
          "new tokens, one batch of k rows per item")
    base = None
    for k in K_TABLE:
        t0 = time.perf_counter()
        generated = 0
        for r in requests:
            keys = [SampleKey(sample_seed(0, r.doc_id, j), 0.8) for j in range(k)]
            out = decode(model, tok, [r.prompt] * k, [r.stop] * k, [tokens] * k, keys=keys)
            generated += sum(len(g.token_ids) for g in out)
        wall = time.perf_counter() - t0
        base = base or wall
        print(f"  k = {k:2d}: {wall:7.1f} s ({wall / items:6.1f} s per item, {generated} tokens, "
              f"{wall / base:4.1f}× k = 1)")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--check", type=int, default=40, help="replicates per row re-decided with decide_overall")
    parser.add_argument("--from-runs", "--runs", dest="runs", nargs=2, metavar=("BASE", "CAND"),
                        help="also take the per-item structure from two stored runs (HumanEval if they have it)")
    parser.add_argument("--canary", action="store_true",
                        help="also the measured structure of the canary's w4a4_packed against its packaged W4A8 baseline")
    parser.add_argument("--cost", type=int, default=0, metavar="N", help="time N canary HumanEval items at each k")
    parser.add_argument("--cost-tokens", type=int, default=32, help="token limit of the --cost generations")
    args = parser.parse_args()
    if args.cost:
        generation_cost(args.cost, args.cost_tokens)
    if POLICY.multiple_comparisons != "holm" or POLICY.ci_method != "tango":
        raise SystemExit("the vectorised twin implements holm + tango only; adjust it for this policy")
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    reps = args.reps
    alpha_acc, alpha_rate = gate_levels(ALPHA, POLICY.alpha_split, POLICY.alpha_validity, 2, 4)
    print(f"evalgate gate simulation: {reps} replicates per row, seed {args.seed}; policy {POLICY.path} "
          f"(sha256 {POLICY.sha256[:12]})")
    print(f"  α = {ALPHA}: PASS needs L > −M at the requested M on every task; FAIL needs the degradation test "
          f"(Holm over 2 tasks at α_acc = {alpha_acc:g}) or a rate check (4 at {alpha_rate:g}); else INCONCLUSIVE")
    mismatches = 0

    def row(task, world, drop, other, label, check=0):
        nonlocal mismatches
        worlds = {"gsm8k": other, task: world} if task == "humaneval" else {task: world, "humaneval": other}
        count = reps if world.k == 1 else max(reps // 2, 1000)  # k samples: half the replicates, bounded time
        out, hists, kept, rates = simulate(worlds, {task: drop}, count, rng, keep=check)
        if check:
            mismatches += cross_check(worlds, hists, kept, rates, out, check)
        return out[task], out

    quiet_gsm = Greedy(N_GSM8K, 0.02)
    quiet_he = Greedy(N_HUMANEVAL, 0.04)

    print("\nA. THE TARGETS (issue 14). Δ = 0: a candidate as good as the baseline; Δ = −M': worse than the margin.")
    print("   ψ₀ from one simulated A/A run. PASS / INCONCLUSIVE / FAIL of that task; target: FAIL(0) ≤ 5%, PASS(−M') ≤ 5%.")
    print(f"{'task':10} {'setting':52} {'MDE':>7} {'PASS':>6} {'INC':>6} {'FAIL':>6} │ {'Δ':>6} {'PASS':>6} {'INC':>6} "
          f"{'FAIL':>6} {'met':>4}")
    targets = [("gsm8k", Greedy(N_GSM8K, 0.04), -0.02, quiet_he)]
    he_worlds = [Greedy(N_HUMANEVAL, 0.085)] + [Coupled(N_HUMANEVAL, k, 0.5) for k in K_TABLE]
    measured_runs = [load_runs(*args.runs)] if args.runs else []
    if args.canary:
        measured_runs += list(canary_structures())
    for task, measured in measured_runs:  # the measured structure: greedy as it is, sampled at every k of the table
        if isinstance(measured, FromRuns):  # greedy: that task's own target
            (he_worlds.append(measured) if task == "humaneval" else targets.append((task, measured, -0.02, quiet_he)))
        else:  # sampled: the coupled HumanEval target (n = 164, M = 5 pp) with the measured p_i, φ_i
            he_worlds += [Coupled.from_structure(k, *measured) for k in K_TABLE]
    targets += [("humaneval", w, -0.05, quiet_gsm) for w in he_worlds]
    for task, world, drop, other in targets:
        null, _ = row(task, world, 0.0, other, "null", check=args.check if world.k <= 4 else 0)
        bad, _ = row(task, world, drop, other, "bad", check=args.check // 2 if world.k <= 4 else 0)
        met = np.mean(null.ours_fail) <= 0.05 and np.mean(bad.ours_pass) <= 0.05
        print(f"{task:10} {world.describe():52} {100 * mde_of(world, reps, rng):5.2f}pp {pct(null.ours_pass)} "
              f"{pct(null.ours_inconclusive)} {pct(null.ours_fail)} │ {100 * drop:+4.0f}pp {pct(bad.ours_pass)} "
              f"{pct(bad.ours_inconclusive)} {pct(bad.ours_fail)} {'yes' if met else 'NO':>4}")

    print("\nB. HumanEval, k coupled samples per item: what k buys (Δ = 0 / Δ = −5 pp), and its generation cost")
    print(f"{'coupling':24} {'k':>3} {'cost':>5} {'MDE':>7} {'PASS(0)':>8} {'FAIL(0)':>8} {'PASS(−5)':>9} {'FAIL(−5)':>9}")
    for phi in (0.25, 0.5, 1.0):
        for k in (1, 4, 8, 16):
            world = Coupled(N_HUMANEVAL, k, phi)
            null, _ = row("humaneval", world, 0.0, quiet_gsm, "null")
            bad, _ = row("humaneval", world, -0.05, quiet_gsm, "bad")
            label = "independent" if phi >= 1 else f"φ̄ = {phi:g}"
            print(f"{label:24} {k:3d} {k:4d}× {100 * mde_of(world, reps, rng):5.2f}pp {pct(null.ours_pass):>8} "
                  f"{pct(null.ours_fail):>8} {pct(bad.ours_pass):>9} {pct(bad.ours_fail):>9}")

    print("\nC. Whole gate, Δ = 0 on both tasks (GSM8K greedy ψ, HumanEval greedy ψ): FAIL rate by rule")
    print("   ours | separate = also FAIL on a significant loss within M | before = the rule before issue 14 with")
    print("   ψ₀ from one A/A run | original | flat rtol 0.05 / 0.08 (vLLM); and ours' PASS and INCONCLUSIVE")
    print(f"{'ψ':>4} {'ours':>6} {'separ.':>7} {'before':>7} {'orig.':>6} {'rtol5':>6} {'rtol8':>6} │ {'PASS':>6} {'INC':>6}")
    for psi in (0.01, 0.02, 0.04, 0.06):
        worlds = {"gsm8k": Greedy(N_GSM8K, psi), "humaneval": Greedy(N_HUMANEVAL, psi)}
        out, hists, kept, rates = simulate(worlds, {}, reps, rng)
        mismatches += cross_check(worlds, hists, kept, rates, out, args.check)
        g, h = out["gsm8k"], out["humaneval"]
        print(f"{100 * psi:3g}% {pct(g.ours_fail | h.ours_fail)} {pct(g.separate_fail | h.separate_fail):>7} "
              f"{pct(g.before_fail | h.before_fail):>7} {pct(g.original_fail | h.original_fail)} "
              f"{pct(g.flat[0.05] | h.flat[0.05])} {pct(g.flat[0.08] | h.flat[0.08])} │ "
              f"{pct(g.ours_pass & h.ours_pass)} {pct(~(g.ours_fail | h.ours_fail) & ~(g.ours_pass & h.ours_pass))}")

    print("\nD. The A/A flip rate ψ₀ from one A/A run of n items: how often it covers the true ψ, and what the")
    print("   plug-in did to the rule before issue 14 (that task's FAIL at Δ = 0 / PASS at Δ = −M', M' = 2 pp, 5 pp)")
    print(f"{'task':10} {'ψ':>5} {'ψ̂₀ ≥ ψ':>8} {'ψ₀ᵁ ≥ ψ':>8} │ {'before: FAIL(0)':>16} {'PASS(−M′)':>10} │ "
          f"{'ours: FAIL(0)':>14} {'PASS(−M′)':>10}")
    for task, n, drop, other in (("gsm8k", N_GSM8K, -0.02, quiet_he), ("humaneval", N_HUMANEVAL, -0.05, quiet_gsm)):
        for psi in (0.02, 0.04, 0.06):
            world = Greedy(n, psi)
            null, _ = row(task, world, 0.0, other, "null")
            bad, _ = row(task, world, drop, other, "bad")
            truth = float(world.pi.mean())  # this world's flip rate (its items' mean, ≈ ψ)
            print(f"{task:10} {100 * psi:4g}% {pct(null.psi0 >= truth):>8} {pct(null.psi0_upper >= truth):>8} │ "
                  f"{pct(null.before_fail):>16} {pct(~bad.before_fail):>10} │ {pct(null.ours_fail):>14} "
                  f"{pct(bad.ours_pass):>10}")

    print(f"\ncross-check against decide_task/decide_overall (verdicts): {mismatches} mismatches")
    print(f"elapsed {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
