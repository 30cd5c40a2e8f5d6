"""Paired statistics for the release gate (eval-conventions §4).

Orientation everywhere: the baseline and the candidate score the same n items, and

    |                 | candidate right | candidate wrong |
    | baseline right  |        a        |        b        |
    | baseline wrong  |        c        |        d        |

so Δ̂ = (c − b)/n is candidate minus baseline (negative = the candidate is worse) and ψ = (b + c)/n is the
flip rate. Intervals are returned as (lower, upper) fractions, not percentage points.

The default decision rule (§4.8) is split in two pure steps:

- ``decide_task`` computes everything for one task and a provisional verdict, treating the task alone
  (its McNemar p-value compared with α, which is what Holm does with K = 1);
- ``decide_overall`` applies Holm (or the configured rule) to the tasks' McNemar p-values, rewrites each
  task's degradation outcome, verdict and reasons, and combines the tasks (overall FAIL if any task fails).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
from scipy.special import gammaln, xlogy
from scipy.stats import binom, norm

# --------------------------------------------------------------------------------------------------------
# Counts
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """The paired 2×2 table (§4.1). b = baseline right & candidate wrong, c = baseline wrong & candidate right."""

    a: int
    b: int
    c: int
    d: int
    n: int

    @property
    def delta(self) -> float:
        """Δ̂ = (c − b)/n, candidate minus baseline."""
        return (self.c - self.b) / self.n if self.n else 0.0

    @property
    def flip_rate(self) -> float:
        """ψ = (b + c)/n."""
        return (self.b + self.c) / self.n if self.n else 0.0

    @property
    def baseline_rate(self) -> float:
        return (self.a + self.b) / self.n if self.n else 0.0

    @property
    def candidate_rate(self) -> float:
        return (self.a + self.c) / self.n if self.n else 0.0


def _as_bool_vector(values: Sequence, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != bool:
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold booleans or 0/1 values (a binary per-item metric)")
        arr = arr.astype(bool)
    return arr


def paired_counts(base: Sequence[bool], cand: Sequence[bool]) -> Counts:
    """Count the paired 2×2 table of two binary per-item vectors in the same item order."""
    base_arr = _as_bool_vector(base, "base")
    cand_arr = _as_bool_vector(cand, "cand")
    if base_arr.shape != cand_arr.shape:
        raise ValueError(f"paired vectors differ in length: base {base_arr.size}, cand {cand_arr.size}")
    a = int(np.sum(base_arr & cand_arr))
    b = int(np.sum(base_arr & ~cand_arr))
    c = int(np.sum(~base_arr & cand_arr))
    d = int(np.sum(~base_arr & ~cand_arr))
    return Counts(a=a, b=b, c=c, d=d, n=int(base_arr.size))


# --------------------------------------------------------------------------------------------------------
# McNemar exact tests (§4.2)
# --------------------------------------------------------------------------------------------------------


def mcnemar_exact_one_sided(b: int, c: int) -> float:
    """Exact one-sided McNemar p-value for H0 "no degradation": P(X ≥ b | m = b + c), X ~ Binomial(m, ½).

    Returns 1 when m = 0. With m ≤ 4 the p-value cannot fall below 0.05.
    References: McNemar (1947), "Note on the sampling error of the difference between correlated proportions
    or percentages", Psychometrika 12:153–157; Dietterich (1998), Neural Computation 10:1895–1923.
    """
    m = b + c
    if m == 0:
        return 1.0
    return float(binom.sf(b - 1, m, 0.5))


def mcnemar_exact_two_sided(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: min(1, 2·P(X ≤ min(b, c))), as statsmodels' ``mcnemar(exact=True)``."""
    m = b + c
    if m == 0:
        return 1.0
    return float(min(1.0, 2.0 * binom.cdf(min(b, c), m, 0.5)))


def mcnemar_mid_p_one_sided(b: int, c: int) -> float:
    """One-sided mid-p McNemar: P(X > b) + ½·P(X = b). Reported only, never gated on (§4.2).

    Reference: Fagerland, Lydersen & Laake (2013), "The McNemar test for binary matched-pairs data:
    mid-p and asymptotic are better than exact conditional", BMC Med Res Methodol 13:91.
    """
    m = b + c
    if m == 0:
        return 1.0
    return float(binom.sf(b, m, 0.5) + 0.5 * binom.pmf(b, m, 0.5))


# --------------------------------------------------------------------------------------------------------
# Confidence intervals for Δ (§4.3)
# --------------------------------------------------------------------------------------------------------

_SIDED = ("two", "lower", "upper")


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def tango_z(delta0, b, c, n):
    """Tango's score statistic Z(Δ₀) for H0: Δ = Δ₀ (decreasing in Δ₀; Z(Δ̂) = 0). Vectorised.

    W = (2n + b − c)·Δ₀ − (b + c);  q̃ = [√(W² + 8n·b·Δ₀(1 − Δ₀)) − W] / (4n), the restricted MLE of
    P(baseline right, candidate wrong);  Z = (c − b − nΔ₀) / √(n·(2q̃ + Δ₀(1 − Δ₀))).
    Reference: Tango (1998), "Equivalence test and confidence interval for the difference in proportions
    for the paired-sample design", Stat. Med. 17:891–908.
    """
    delta0 = np.asarray(delta0, dtype=float)
    b = np.asarray(b, dtype=float)
    c = np.asarray(c, dtype=float)
    w = (2 * n + b - c) * delta0 - (b + c)
    disc = np.maximum(w * w + 8 * n * b * delta0 * (1 - delta0), 0.0)  # ≥ 0 in exact arithmetic
    q = (np.sqrt(disc) - w) / (4 * n)
    var = n * (2 * q + delta0 * (1 - delta0))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (c - b - n * delta0) / np.sqrt(var)
    return np.where(var > 0, z, 0.0)


def _tango_root(b, c, n, target: float, lo, hi, iterations: int = 64):
    """Bisect for Z(Δ₀) = target on [lo, hi], using that Z decreases in Δ₀. Vectorised over b, c."""
    lo = np.array(lo, dtype=float)
    hi = np.array(hi, dtype=float)
    for _ in range(iterations):  # 2^-64 of a unit-wide bracket: below float resolution
        mid = 0.5 * (lo + hi)
        right = tango_z(mid, b, c, n) > target  # still above target: the root lies to the right
        lo = np.where(right, mid, lo)
        hi = np.where(right, hi, mid)
    return 0.5 * (lo + hi)


def _scalar_or_array(x):
    return float(x) if np.ndim(x) == 0 else x


def tango_lower_bound(b, c, n: int, alpha: float = 0.05):
    """One-sided (1 − α) Tango lower bound L for Δ: solves Z(L) = z_{1−α} by bisection on [−1, Δ̂] (§4.3).

    PASS on non-inferiority requires L > −M (§4.4). With b = c = 0, L = −z²/(n + z²).
    ``b`` and ``c`` may be arrays (vectorised; the simulation benchmark uses this).
    Reference: Tango (1998), Stat. Med. 17:891–908.
    """
    _check_alpha(alpha)
    if n <= 0:
        raise ValueError("n must be positive")
    delta_hat = (np.asarray(c, dtype=float) - np.asarray(b, dtype=float)) / n
    z = norm.ppf(1 - alpha)
    return _scalar_or_array(_tango_root(b, c, n, z, np.full_like(delta_hat, -1.0), delta_hat))


def tango_upper_bound(b, c, n: int, alpha: float = 0.05):
    """One-sided (1 − α) Tango upper bound U for Δ: solves Z(U) = −z_{1−α} on [Δ̂, 1]."""
    _check_alpha(alpha)
    if n <= 0:
        raise ValueError("n must be positive")
    delta_hat = (np.asarray(c, dtype=float) - np.asarray(b, dtype=float)) / n
    z = norm.ppf(1 - alpha)
    return _scalar_or_array(_tango_root(b, c, n, -z, delta_hat, np.full_like(delta_hat, 1.0)))


def tango_interval(b: int, c: int, n: int, alpha: float = 0.05, sided: str = "two") -> tuple[float, float]:
    """Tango score interval for Δ = p_candidate − p_baseline, {Δ₀ : |Z(Δ₀)| ≤ z} (§4.3).

    sided="two": the two-sided (1 − α) interval; "lower": (L, 1) with L the one-sided (1 − α) lower bound;
    "upper": (−1, U). Reference: Tango (1998), Stat. Med. 17:891–908.
    """
    if sided not in _SIDED:
        raise ValueError(f"sided must be one of {_SIDED}, got {sided!r}")
    if sided == "lower":
        return tango_lower_bound(b, c, n, alpha), 1.0
    if sided == "upper":
        return -1.0, tango_upper_bound(b, c, n, alpha)
    return tango_lower_bound(b, c, n, alpha / 2), tango_upper_bound(b, c, n, alpha / 2)


def wilson_interval(x: float, n: float, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson score interval for a single proportion x/n (x may be fractional, e.g. a mean score × n).

    Reference: Wilson (1927), "Probable inference, the law of succession, and statistical inference",
    JASA 22:209–212.
    """
    _check_alpha(alpha)
    if n <= 0:
        raise ValueError("n must be positive")
    z = norm.ppf(1 - alpha / 2)
    p = x / n
    centre = (x + z * z / 2) / (n + z * z)
    half = z * math.sqrt(max(n * p * (1 - p), 0.0) + z * z / 4) / (n + z * z)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(a: int, b: int, c: int, d: int, alpha: float = 0.05) -> tuple[float, float]:
    """Newcombe's hybrid score interval for the paired difference Δ (method 10), two-sided (1 − α).

    p₁ = (a + c)/n (candidate), p₂ = (a + b)/n (baseline), with Wilson limits (l₁, u₁), (l₂, u₂); φ̂ is the
    continuity-corrected phi coefficient (0 when any margin is 0).
    Reference: Newcombe (1998), "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Stat. Med. 17:2635–2650.
    """
    _check_alpha(alpha)
    n = a + b + c + d
    if n <= 0:
        raise ValueError("n must be positive")
    p1, p2 = (a + c) / n, (a + b) / n
    l1, u1 = wilson_interval(a + c, n, alpha)
    l2, u2 = wilson_interval(a + b, n, alpha)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if margins > 0:
        big_b = a * d - b * c
        if big_b > n / 2:
            big_c = big_b - n / 2
        elif big_b >= 0:
            big_c = 0.0
        else:
            big_c = big_b
        phi = big_c / math.sqrt(margins)
    delta = p1 - p2
    lower = delta - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    upper = delta + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return max(-1.0, lower), min(1.0, upper)


def wald_interval(b: int, c: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Wald interval Δ̂ ± z·√(ψ − Δ̂²)/√n. Report only: poor at small discordant counts (§4.3)."""
    _check_alpha(alpha)
    delta = (c - b) / n
    se = math.sqrt(max((b + c) / n - delta * delta, 0.0) / n)
    z = norm.ppf(1 - alpha / 2)
    return float(delta - z * se), float(delta + z * se)


@dataclass(frozen=True)
class BootstrapResult:
    delta: float  # mean(cand) − mean(base)
    lower: float
    upper: float
    alpha: float
    sided: str
    n_boot: int
    seed: int


def paired_bootstrap(
    base_scores: Sequence[float],
    cand_scores: Sequence[float],
    n_boot: int = 10_000,
    seed: int = 0,
    alpha: float = 0.05,
    sided: str = "two",
) -> BootstrapResult:
    """Paired percentile bootstrap interval for Δ = mean(cand) − mean(base) (§4.3).

    Resamples item indices with replacement and applies the same indices to both runs, so it works for
    per-item scores in [0, 1] (pass@k with n > 1 samples) and for aggregates across tasks. sided="two"
    gives the (α/2, 1 − α/2) percentiles; "lower" gives (α-percentile, +inf); "upper" (−inf, 1−α).
    Reference: Efron & Tibshirani (1993), An Introduction to the Bootstrap, ch. 13 (percentile interval).
    """
    _check_alpha(alpha)
    if sided not in _SIDED:
        raise ValueError(f"sided must be one of {_SIDED}, got {sided!r}")
    base = np.asarray(base_scores, dtype=float)
    cand = np.asarray(cand_scores, dtype=float)
    if base.shape != cand.shape or base.ndim != 1 or base.size == 0:
        raise ValueError(f"paired score vectors must be 1-D, non-empty and equal length: {base.shape} vs {cand.shape}")
    diff = cand - base  # resampling the paired differences is resampling items for both runs at once
    n = diff.size
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    chunk = max(1, min(n_boot, 4_000_000 // n))  # bound memory (~32 MB of indices per chunk)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    if sided == "two":
        lower, upper = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    elif sided == "lower":
        lower, upper = np.quantile(means, alpha), math.inf
    else:
        lower, upper = -math.inf, np.quantile(means, 1 - alpha)
    return BootstrapResult(float(diff.mean()), float(lower), float(upper), alpha, sided, n_boot, seed)


# --------------------------------------------------------------------------------------------------------
# Several tasks (§4.5), unpaired fallback, power (§4.6)
# --------------------------------------------------------------------------------------------------------


def holm_adjusted(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm step-down adjusted p-values: p̃(j) = max_{i ≤ j} min(1, (K − i + 1)·p(i)).

    Reference: Holm (1979), "A simple sequentially rejective multiple test procedure", Scand. J. Statist.
    6:65–70.
    """
    order = sorted(pvalues, key=lambda name: (pvalues[name], name))
    k = len(order)
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (k - i) * pvalues[name]))
        adjusted[name] = running
    return {name: adjusted[name] for name in pvalues}  # in the caller's order


def holm(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Holm's procedure: sort p ascending, reject H(j) while p(j) ≤ α/(K − j + 1); returns name → rejected."""
    _check_alpha(alpha)
    order = sorted(pvalues, key=lambda name: (pvalues[name], name))
    k = len(order)
    rejected = {name: False for name in pvalues}
    for j, name in enumerate(order):  # j is 0-based, so the divisor is K − j
        if pvalues[name] <= alpha / (k - j):
            rejected[name] = True
        else:
            break  # step-down: stop at the first non-rejection
    return rejected


def bonferroni(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Bonferroni: reject when p ≤ α/K."""
    _check_alpha(alpha)
    k = len(pvalues)
    return {name: p <= alpha / k for name, p in pvalues.items()}


def unadjusted(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """No multiplicity correction: reject when p ≤ α."""
    _check_alpha(alpha)
    return {name: p <= alpha for name, p in pvalues.items()}


MULTIPLE_COMPARISONS = {"holm": holm, "bonferroni": bonferroni, "none": unadjusted}


@dataclass(frozen=True)
class UnpairedResult:
    """Baseline vs candidate from aggregate scores only. WEAKER than the paired tests: ignores pairing."""

    paired: bool
    delta: float  # p2 − p1, candidate minus baseline
    lower_bound: float  # one-sided (1 − α) lower bound for Δ
    ci: tuple[float, float]  # two-sided (1 − α)
    p_degradation: float  # one-sided, H0: candidate not worse
    margin: float
    non_inferior: bool  # lower_bound > −margin
    alpha: float
    method: str
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def _newcombe_independent(p1: float, n1: float, p2: float, n2: float, alpha: float) -> tuple[float, float]:
    """Newcombe's hybrid score interval for p2 − p1 of independent proportions (1998a, method 10)."""
    l1, u1 = wilson_interval(p1 * n1, n1, alpha)
    l2, u2 = wilson_interval(p2 * n2, n2, alpha)
    delta = p2 - p1
    lower = delta - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    upper = delta + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return max(-1.0, lower), min(1.0, upper)


def unpaired_two_proportion(
    p1: float, n1: int, p2: float, n2: int, alpha: float = 0.05, margin: float = 0.0
) -> UnpairedResult:
    """Non-inferiority of a candidate score p2 (n2 items) against an aggregate-only baseline p1 (n1 items).

    WEAKER than the paired gate: with no per-item records the two runs are treated as independent samples,
    so the shared item difficulty is not cancelled and the interval is several times wider (§4.7: ±1.6 pp
    for GSM8K at 0.9 unpaired vs ~±1 pp paired). Use only when the baseline is a published score (§6).

    - lower bound: Newcombe's hybrid score (Wilson) interval for independent proportions, the one-sided
      (1 − α) bound being the lower end of the two-sided (1 − 2α) interval. Newcombe (1998), "Interval
      estimation for the difference between independent proportions: comparison of eleven methods",
      Stat. Med. 17:873–890, method 10.
    - p_degradation: one-sided pooled two-proportion z-test of H0 "candidate not worse". Scores need not be
      whole counts (published figures averaged over repeats often are not).
    """
    _check_alpha(alpha)
    for name, p in (("p1", p1), ("p2", p2)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be a proportion in [0, 1], got {p}")
    if n1 <= 0 or n2 <= 0:
        raise ValueError("n1 and n2 must be positive")
    if margin < 0:
        raise ValueError("margin must be ≥ 0")
    lower, _ = _newcombe_independent(p1, n1, p2, n2, 2 * alpha)
    ci = _newcombe_independent(p1, n1, p2, n2, alpha)
    pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se > 0:
        p_degradation = float(norm.sf((p1 - p2) / se))
    else:
        p_degradation = 1.0 if p2 >= p1 else 0.0
    return UnpairedResult(
        paired=False,
        delta=p2 - p1,
        lower_bound=lower,
        ci=ci,
        p_degradation=p_degradation,
        margin=margin,
        non_inferior=lower > -margin,
        alpha=alpha,
        method="unpaired: Newcombe hybrid score (independent) + pooled z-test",
        note="aggregate-only baseline: pairing ignored, much weaker than the paired McNemar/Tango gate",
    )


def min_detectable_margin(psi0: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest NI margin demonstrable with the given power when Δ = 0: (z_{1−α} + z_power)·√(ψ₀/n) (§4.6).

    With α = 0.05 and power 0.8 the factor is 2.486.
    """
    _check_alpha(alpha)
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    return float((norm.ppf(1 - alpha) + norm.ppf(power)) * math.sqrt(psi0 / n))


# --------------------------------------------------------------------------------------------------------
# Default decision rule (§4.8, with the whole-gate false-fail budget)
# --------------------------------------------------------------------------------------------------------
#
# The gate FAILs if any check of any task fails, so its false-fail rate on a candidate as good as the
# baseline (Δ = 0) is the probability of a UNION of checks. §4.8 as written runs every check at α, which
# the simulation (benchmarks/simulate_gate.py) shows false-fails 24–59% of good kernels. The shipped
# policy spends one budget α on the whole gate instead:
#
# - accuracy share α_acc = α − α_validity: the McNemar degradation tests, Holm across the K tasks at α_acc
#   (their union, "some task degraded", is then ≤ α_acc);
# - the non-inferiority margin is raised, when the A/A flip rate ψ₀ says it is too tight, to
#   M_eff = max(M, floor(ψ₀, n)): the smallest margin at which a candidate exactly as good as the baseline
#   (Δ = 0, flip rate ψ₀) fails this task's accuracy checks (McNemar ∪ NI) with probability ≤ α_acc/K,
#   computed exactly over the trinomial (b, c) distribution (``aa_margin_floor``). Summed over tasks, the
#   accuracy false-fail stays ≤ α_acc. The NI bound keeps level α per task: passing a kernel inferior by
#   M_eff on some task stays ≤ α (intersection–union, Berger 1982);
# - validity share α_validity, split equally (Bonferroni) over every invalid/truncation check of every
#   task; the absolute rise limit gets an item floor, max(limit·n, min_rise_items), so that at n = 164 a
#   1 pp limit is not "2 items", which indicator noise alone exceeds ~20% of the time.
#
# With alpha_split = False, margin_floor = False and min_rise_items = 0 the rule is §4.8 exactly.


def gate_levels(alpha: float, alpha_split: bool, alpha_validity: float, n_tasks: int,
                n_rate_checks: int) -> tuple[float, float]:
    """(α_acc, α per rate check): the levels of the accuracy degradation tests and of each validity check.

    alpha_split=True: accuracy gets α − α_validity (Holm across tasks on top), and each of the
    ``n_rate_checks`` validity checks (all tasks together) gets α_validity / n_rate_checks (Bonferroni).
    alpha_split=False: §4.8 as written, every test at α.
    """
    if not alpha_split:
        return alpha, alpha
    if not 0.0 <= alpha_validity < alpha:
        raise ValueError(f"alpha_validity must be in [0, alpha = {alpha}), got {alpha_validity}")
    return alpha - alpha_validity, alpha_validity / max(n_rate_checks, 1)


@functools.lru_cache(maxsize=512)
def aa_margin_floor(psi0: float, n: int, alpha: float = 0.05, share: float = 0.02) -> float:
    """The smallest NI margin a candidate exactly as good as the baseline can live with, given the A/A noise.

    Under the A/A null (Δ = 0, flip rate ψ₀: P(b) = P(c) = ψ₀/2 per item, a trinomial over the n items)
    this task's accuracy checks fail when the exact McNemar p ≤ ``share`` or the one-sided (1 − α) Tango
    bound L ≤ −M. Returns the smallest M (rounded up to 1e-6) for which that union has probability
    ≤ ``share``, summing the trinomial exactly over every (b, c) with non-negligible mass.
    A closed form M ≥ (z_{1−α} + z_{1−share})·√(ψ₀/n) is too small at these n: Tango's variance is taken
    under H0: Δ = −M, where the flip rate is at least M, and the counts are small and discrete (at ψ₀ = 4%
    it leaves a 9.5% whole-gate false-fail; benchmarks/simulate_gate.py).
    The floor is computed with Tango also when the gate uses Newcombe, whose bound needs a and d as well.
    """
    _check_alpha(alpha)
    _check_alpha(share)
    if not 0.0 <= psi0 <= 1.0:
        raise ValueError(f"psi0 must be a flip rate in [0, 1], got {psi0}")
    if n <= 0:
        raise ValueError("n must be positive")
    half = psi0 / 2
    if half > 0:
        span = binom.ppf(1e-12, n, half), binom.isf(1e-12, n, half)  # each count's range, tails < 1e-12
        counts = np.arange(int(span[0]), int(span[1]) + 1)
    else:
        counts = np.array([0])
    b, c = (x.ravel() for x in np.meshgrid(counts, counts))
    keep = b + c <= n
    b, c = b[keep], c[keep]
    log_pmf = (gammaln(n + 1) - gammaln(b + 1) - gammaln(c + 1) - gammaln(n - b - c + 1)
               + xlogy(b + c, half) + xlogy(n - b - c, 1 - psi0))
    pmf = np.exp(log_pmf)
    mcnemar_fails = np.where(b + c > 0, binom.sf(b - 1, b + c, 0.5), 1.0) <= share
    lower = np.atleast_1d(tango_lower_bound(b, c, n, alpha))
    # NI may additionally fail on the lowest-L cells the McNemar test passes, while the union stays ≤ share
    allowed = share - pmf[mcnemar_fails].sum()
    rest = np.flatnonzero(~mcnemar_fails)
    order = rest[np.argsort(lower[rest], kind="stable")]
    first_kept = int(np.searchsorted(np.cumsum(pmf[order]), allowed, side="right"))
    if first_kept >= order.size:
        return 0.0
    # that cell must pass: L > −M, so M must exceed −L there
    return float(math.floor(-lower[order[first_kept]] * 1e6) / 1e6 + 1e-6)


@dataclass(frozen=True)
class RateCheck:
    """A validity-rate gate (invalid answers or truncations): fails on a significant or too-large rise."""

    name: str  # "invalid" or "truncation"
    base_count: int
    cand_count: int
    n: int
    p: float  # exact one-sided McNemar on the indicator: H0 "the rate did not rise"
    limit: float  # largest allowed absolute rise, as a fraction
    significant: bool  # p ≤ alpha (this check's share of the budget)
    over_limit: bool  # net new flagged items > max(limit·n, min_items)
    alpha: float = 0.05  # level the significance was judged at
    min_items: int = 0  # item floor of the absolute limit
    new_count: int = 0  # items flagged by the candidate only
    gone_count: int = 0  # items flagged by the baseline only
    significant_at_alpha: bool = False  # §4.8 as written: p ≤ α (reported, gated only when alpha_split off)
    over_raw_limit: bool = False  # §4.8 as written: rise > limit·n (reported)

    @property
    def base_rate(self) -> float:
        return self.base_count / self.n

    @property
    def cand_rate(self) -> float:
        return self.cand_count / self.n

    @property
    def rise(self) -> float:
        return (self.cand_count - self.base_count) / self.n

    @property
    def limit_items(self) -> float:
        """The absolute limit in items: max(limit·n, min_items)."""
        return max(self.limit * self.n, float(self.min_items))

    @property
    def failed(self) -> bool:
        return self.significant or self.over_limit


@dataclass(frozen=True)
class TokenCheck:
    """Mean generated tokens, candidate vs baseline; WARN outside the band (MLPerf's 90–110%)."""

    base_mean: float
    cand_mean: float
    band: tuple[float, float]

    @property
    def ratio(self) -> float:
        return self.cand_mean / self.base_mean if self.base_mean > 0 else math.inf

    @property
    def warn(self) -> bool:
        return not (self.band[0] <= self.ratio <= self.band[1])


@dataclass(frozen=True)
class TaskDecision:
    """Everything the §4.8 rule computed for one task, with its verdict and human-readable reasons."""

    task: str
    counts: Counts
    delta: float
    flip_rate: float
    margin: float  # the margin gated on (= margin_effective)
    alpha: float
    ci_method: str  # the interval gated on: "tango" (default) or "newcombe"
    p_degradation: float  # exact one-sided McNemar, unadjusted
    p_degradation_adjusted: float  # after the multiple-comparison rule (= unadjusted for one task)
    p_mid: float  # mid-p, reported only
    p_two_sided: float  # reported only
    tango_ci: tuple[float, float]  # two-sided (1 − α)
    tango_lower: float  # one-sided (1 − α) lower bound
    newcombe_ci: tuple[float, float]  # two-sided (1 − α)
    newcombe_lower: float  # one-sided (1 − α): lower end of the two-sided (1 − 2α) interval
    wald_ci: tuple[float, float]  # report only
    gate_lower: float  # the one-sided lower bound compared with −M (tango_lower unless ci_method says)
    degraded: bool  # McNemar rejected "no degradation" at α_acc (after the multiple-comparison rule)
    non_inferior: bool  # gate_lower > −margin_effective
    invalid: RateCheck | None
    truncation: RateCheck | None
    tokens: TokenCheck | None
    multiple_comparisons: str  # "holm", "bonferroni", "none"; with K tasks
    n_tasks: int
    verdict: str  # "PASS" or "FAIL"
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())
    # the whole-gate budget and the A/A margin floor
    margin_requested: float = 0.0  # M from the policy
    margin_effective: float = 0.0  # max(M, floor) when the floor applies, else M
    margin_raised_because: str | None = None  # why M_eff > M, or None
    margin_floor: float | None = None  # k·√(ψ₀/n), None without A/A data or with the floor off
    margin_floor_k: float | None = None
    aa_psi0: float | None = None
    aa_n: int | None = None
    alpha_split: bool = True
    alpha_validity: float = 0.01
    alpha_accuracy: float = 0.05  # level of the McNemar degradation tests (before Holm)
    min_rise_items: int = 0
    margin_floor_enabled: bool = True
    # §4.8 as written (every test at α, requested M, raw 1 pp limit): reported even when not gated
    spec_degraded: bool = False
    spec_non_inferior: bool = True
    data_warnings: tuple[str, ...] = field(default=())  # warnings from the inputs (flags, tokens, A/A)

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def spec_verdict(self) -> str:
        """The verdict of §4.8 as written on the same data (reported, not gated unless the policy says so)."""
        rates = any(c is not None and (c.significant_at_alpha or c.over_raw_limit)
                    for c in (self.invalid, self.truncation))
        return "FAIL" if self.spec_degraded or not self.spec_non_inferior or rates else "PASS"

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("invalid", "truncation"):
            check = getattr(self, key)
            if check is not None:
                out[key].update(base_rate=check.base_rate, cand_rate=check.cand_rate, rise=check.rise,
                                limit_items=check.limit_items, failed=check.failed)
        if self.tokens is not None:
            out["tokens"].update(ratio=self.tokens.ratio, warn=self.tokens.warn)
        out["spec_verdict"] = self.spec_verdict
        return out


def _pp(x: float) -> str:
    return f"{100 * x:+.2f} pp"


def _rate_check(name: str, base_flags, cand_flags, alpha: float, limit: float, min_items: int) -> RateCheck:
    base_arr = _as_bool_vector(base_flags, f"base_{name}")
    cand_arr = _as_bool_vector(cand_flags, f"cand_{name}")
    # "OK" plays the role of "right": b = baseline OK but candidate flagged, i.e. a new invalid/truncation.
    counts = paired_counts(~base_arr, ~cand_arr)
    base_count, cand_count = int(base_arr.sum()), int(cand_arr.sum())
    p = mcnemar_exact_one_sided(counts.b, counts.c)
    check = RateCheck(name, base_count, cand_count, counts.n, p, limit, p <= alpha, False, alpha=alpha,
                      min_items=min_items, new_count=counts.b, gone_count=counts.c)
    return _judge_rate(check, alpha, alpha)


def _judge_rate(check: RateCheck, alpha_check: float, alpha: float) -> RateCheck:
    rise_items = check.cand_count - check.base_count
    # compare counts, not float rates, so a rise of exactly the limit is not failed by rounding
    return replace(
        check,
        alpha=alpha_check,
        significant=check.p <= alpha_check,
        over_limit=bool(rise_items > check.limit_items + 1e-9),
        significant_at_alpha=check.p <= alpha,
        over_raw_limit=bool(rise_items > check.limit * check.n + 1e-9),
    )


def _finalise(dec: TaskDecision, *, n_tasks: int, n_rate_checks: int, multiple_comparisons: str,
              degraded: bool, p_adjusted: float, spec_degraded: bool) -> TaskDecision:
    """Apply the levels for K tasks and J rate checks: margin floor, rate significance, verdict, reasons.

    decide_task calls this with K = 1 (the task alone); decide_overall redoes it with the real K and J.
    """
    alpha_acc, alpha_rate = gate_levels(dec.alpha, dec.alpha_split, dec.alpha_validity, n_tasks, n_rate_checks)
    k = floor = raised = None
    margin = dec.margin_requested
    warnings = list(dec.data_warnings)
    if dec.aa_psi0 is not None:
        share = alpha_acc / n_tasks  # Bonferroni over tasks: the accuracy union of all tasks stays ≤ α_acc
        needed = aa_margin_floor(dec.aa_psi0, dec.counts.n, dec.alpha, share)
        k = needed / math.sqrt(dec.aa_psi0 / dec.counts.n) if dec.aa_psi0 > 0 else None
        rule = (f"a candidate as good as the baseline would fail this task's accuracy checks with probability "
                f"> α_acc/K = {share:.4g} at A/A flip rate ψ₀ = {100 * dec.aa_psi0:.2f}% (A/A n = {dec.aa_n}, "
                f"n = {dec.counts.n}); the smallest margin that keeps it within is {100 * needed:.2f} pp")
        if dec.margin_floor_enabled:
            floor = needed
            if needed > margin:
                raised = f"{rule} (§4.6: raise M, recorded, or add data)"
                margin = needed
        elif needed > margin:
            warnings.append(f"margin M = {100 * margin:.2f} pp is below the A/A floor (margin_floor off): {rule}")
    checks = {}
    for key in ("invalid", "truncation"):
        check = getattr(dec, key)
        checks[key] = None if check is None else _judge_rate(check, alpha_rate, dec.alpha)
    updated = replace(
        dec,
        margin=margin,
        margin_effective=margin,
        margin_raised_because=raised,
        margin_floor=floor,
        margin_floor_k=k,
        alpha_accuracy=alpha_acc,
        degraded=degraded,
        p_degradation_adjusted=p_adjusted,
        non_inferior=dec.gate_lower > -margin,
        spec_degraded=spec_degraded,
        spec_non_inferior=dec.gate_lower > -dec.margin_requested,
        multiple_comparisons=multiple_comparisons,
        n_tasks=n_tasks,
        **checks,
    )
    verdict, reasons = _verdict_and_reasons(updated)
    if verdict == "PASS" and updated.spec_verdict == "FAIL":
        warnings.append("§4.8 as written (every check at α, requested margin, raw rate limit) would FAIL: "
                        + "; ".join(_spec_failures(updated)) + " — not gated under this policy")
    return replace(updated, verdict=verdict, reasons=reasons, warnings=tuple(warnings))


def _spec_failures(dec: TaskDecision) -> list[str]:
    out = []
    if dec.spec_degraded:
        out.append(f"McNemar p = {dec.p_degradation:.4g} rejects at α = {dec.alpha:g}")
    if not dec.spec_non_inferior:
        out.append(f"L = {_pp(dec.gate_lower)} ≤ -M = {_pp(-dec.margin_requested)}")
    for check in (dec.invalid, dec.truncation):
        if check is not None and check.significant_at_alpha:
            out.append(f"{check.name} McNemar p = {check.p:.4g} ≤ α = {dec.alpha:g}")
        if check is not None and check.over_raw_limit:
            out.append(f"{check.name} rise {_pp(check.rise)} > {100 * check.limit:.2f} pp")
    return out


def _margin_text(dec: TaskDecision) -> str:
    text = f"-M = {_pp(-dec.margin)}"
    if dec.margin_raised_because:
        text += (f" (M raised from {100 * dec.margin_requested:.2f} pp to {100 * dec.margin:.2f} pp: "
                 f"{dec.margin_raised_because})")
    return text


def _verdict_and_reasons(dec: TaskDecision) -> tuple[str, tuple[str, ...]]:
    """Build the verdict and reasons from a decision's checks, so decide_overall can redo them after Holm."""
    fails: list[str] = []
    if dec.degraded:
        rule = dec.multiple_comparisons if dec.n_tasks > 1 else "single task"
        fails.append(
            f"accuracy degraded: exact one-sided McNemar p = {dec.p_degradation:.4g} "
            f"(adjusted {dec.p_degradation_adjusted:.4g}, {rule}, K = {dec.n_tasks}) ≤ α = {dec.alpha_accuracy:g}; "
            f"b = {dec.counts.b} lost, c = {dec.counts.c} gained"
        )
    level = f"{100 * (1 - dec.alpha):g}%"
    if not dec.non_inferior:
        fails.append(
            f"non-inferiority not shown: {dec.ci_method.title()} one-sided {level} lower bound "
            f"L = {_pp(dec.gate_lower)} ≤ {_margin_text(dec)}"
        )
    for check in (dec.invalid, dec.truncation):
        if check is None:
            continue
        rates = f"{100 * check.base_rate:.2f}% → {100 * check.cand_rate:.2f}% ({_pp(check.rise)})"
        if check.significant:
            fails.append(f"{check.name} rate rose significantly: {rates}, exact one-sided McNemar p = "
                         f"{check.p:.4g} ≤ α = {check.alpha:.4g}")
        if check.over_limit:
            fails.append(f"{check.name} rate rose by more than the limit: {rates}, "
                         f"{check.cand_count - check.base_count} net new items > max({100 * check.limit:.2f} pp "
                         f"of n, {check.min_items} items) = {check.limit_items:.2f}")
    if fails:
        return "FAIL", tuple(fails)
    return "PASS", (
        f"non-inferior: {dec.ci_method.title()} one-sided {level} lower bound L = {_pp(dec.gate_lower)} > "
        f"{_margin_text(dec)}; no significant degradation (McNemar p = {dec.p_degradation:.4g}, "
        f"α = {dec.alpha_accuracy:g}); validity rates within limits",
    )


def decide_task(
    task: str,
    base: Sequence[bool] | None = None,
    cand: Sequence[bool] | None = None,
    *,
    counts: Counts | None = None,
    margin: float,
    alpha: float = 0.05,
    base_invalid: Sequence[bool] | None = None,
    cand_invalid: Sequence[bool] | None = None,
    base_truncated: Sequence[bool] | None = None,
    cand_truncated: Sequence[bool] | None = None,
    max_invalid_rise: float = 0.01,
    max_truncation_rise: float = 0.01,
    base_tokens: Sequence[float] | None = None,
    cand_tokens: Sequence[float] | None = None,
    token_ratio_band: tuple[float, float] = (0.9, 1.1),
    ci_method: str = "tango",
    aa_psi0: float | None = None,
    aa_n: int | None = None,
    margin_floor: bool = True,
    alpha_split: bool = True,
    alpha_validity: float = 0.01,
    min_rise_items: int = 4,
) -> TaskDecision:
    """The default per-task decision (eval-conventions §4.8 with a whole-gate α budget), as a pure function.

    Give either the binary per-item metric vectors ``base`` and ``cand`` (same item order) or ``counts``.
    ``margin``, ``max_invalid_rise`` and ``max_truncation_rise`` are fractions (1.5 pp = 0.015).
    FAIL when any of:
    - the exact one-sided McNemar rejects "no degradation" at α_acc = α − α_validity (for one task;
      ``decide_overall`` redoes this with Holm across tasks);
    - the one-sided (1 − α) lower bound for Δ (Tango by default) is ≤ −M_eff (non-inferiority, §4.4), where
      M_eff = max(margin, ``aa_margin_floor(aa_psi0, n, α, α_acc/K)``) (§4.6: a margin the A/A noise
      cannot demonstrate is raised and recorded). Without ``aa_psi0`` the requested margin is used, with a
      warning;
    - the invalid or truncation rate rose significantly (exact one-sided McNemar on the indicator at this
      check's share α_validity/J of the budget, J = number of rate checks) or by more than
      max(limit·n, ``min_rise_items``) net new items. These checks are skipped, with a warning, when the
      indicator vectors are not given.
    ``alpha_split=False, margin_floor=False, min_rise_items=0`` is §4.8 exactly (every test at α).
    The §4.8-as-written verdict is always reported (``spec_verdict``, and a warning when it differs).
    WARN (never FAIL) when the candidate's mean generated tokens fall outside ``token_ratio_band`` times
    the baseline's.
    """
    _check_alpha(alpha)
    if margin < 0:
        raise ValueError(f"margin must be ≥ 0 (a fraction), got {margin}")
    if ci_method not in ("tango", "newcombe"):
        raise ValueError(f"ci_method must be 'tango' or 'newcombe', got {ci_method!r}")
    if alpha_split and not 0.0 <= alpha_validity < alpha:
        raise ValueError(f"alpha_validity must be in [0, alpha = {alpha}), got {alpha_validity}")
    if min_rise_items < 0:
        raise ValueError(f"min_rise_items must be ≥ 0, got {min_rise_items}")
    if aa_psi0 is not None and not 0.0 <= aa_psi0 <= 1.0:
        raise ValueError(f"aa_psi0 must be a flip rate in [0, 1], got {aa_psi0}")
    if aa_n is not None and aa_n <= 0:
        raise ValueError(f"aa_n must be a positive item count, got {aa_n}")
    if counts is None:
        if base is None or cand is None:
            raise ValueError("give either base and cand vectors or counts")
        counts = paired_counts(base, cand)
    elif base is not None or cand is not None:
        raise ValueError("give either base and cand vectors or counts, not both")
    if counts.n <= 0:
        raise ValueError(f"task {task!r} has no items")
    a, b, c, d, n = counts.a, counts.b, counts.c, counts.d, counts.n

    warnings: list[str] = []
    if aa_psi0 is None:
        warnings.append(f"margin not checked against A/A noise: no A/A flip rate ψ₀ given, so the requested "
                        f"M = {100 * margin:.2f} pp is used unchanged")
    elif aa_n is not None and aa_n != n:
        warnings.append(f"the A/A calibration covered {aa_n} items, this comparison {n}")
    checks: dict[str, RateCheck | None] = {}
    for name, base_flags, cand_flags, limit in (
        ("invalid", base_invalid, cand_invalid, max_invalid_rise),
        ("truncation", base_truncated, cand_truncated, max_truncation_rise),
    ):
        if base_flags is None or cand_flags is None:
            checks[name] = None
            warnings.append(f"{name} rate not checked: no per-item {name} flags given")
            continue
        check = _rate_check(name, base_flags, cand_flags, alpha, limit, min_rise_items)
        if check.n != n:
            raise ValueError(f"{name} flags cover {check.n} items, the metric covers {n}")
        checks[name] = check

    tokens = None
    if base_tokens is not None and cand_tokens is not None:
        tokens = TokenCheck(float(np.mean(base_tokens)), float(np.mean(cand_tokens)), tuple(token_ratio_band))
        if tokens.warn:
            warnings.append(
                f"mean generated tokens moved: {tokens.base_mean:.1f} → {tokens.cand_mean:.1f} "
                f"({100 * tokens.ratio:.1f}% of baseline, outside {100 * token_ratio_band[0]:g}–"
                f"{100 * token_ratio_band[1]:g}%)"
            )

    p = mcnemar_exact_one_sided(b, c)
    tango_lower = tango_lower_bound(b, c, n, alpha)
    newcombe_lower = newcombe_interval(a, b, c, d, 2 * alpha)[0]
    gate_lower = tango_lower if ci_method == "tango" else newcombe_lower
    decision = TaskDecision(
        task=task,
        counts=counts,
        delta=counts.delta,
        flip_rate=counts.flip_rate,
        margin=margin,
        alpha=alpha,
        ci_method=ci_method,
        p_degradation=p,
        p_degradation_adjusted=p,
        p_mid=mcnemar_mid_p_one_sided(b, c),
        p_two_sided=mcnemar_exact_two_sided(b, c),
        tango_ci=tango_interval(b, c, n, alpha),
        tango_lower=tango_lower,
        newcombe_ci=newcombe_interval(a, b, c, d, alpha),
        newcombe_lower=newcombe_lower,
        wald_ci=wald_interval(b, c, n, alpha),
        gate_lower=gate_lower,
        degraded=False,
        non_inferior=True,
        invalid=checks["invalid"],
        truncation=checks["truncation"],
        tokens=tokens,
        multiple_comparisons="holm",
        n_tasks=1,
        verdict="PASS",
        reasons=(),
        margin_requested=margin,
        margin_effective=margin,
        aa_psi0=aa_psi0,
        aa_n=aa_n,
        alpha_split=alpha_split,
        alpha_validity=alpha_validity,
        min_rise_items=min_rise_items,
        margin_floor_enabled=margin_floor,
        data_warnings=tuple(warnings),
    )
    n_rate_checks = sum(check is not None for check in checks.values())
    alpha_acc, _ = gate_levels(alpha, alpha_split, alpha_validity, 1, n_rate_checks)
    return _finalise(decision, n_tasks=1, n_rate_checks=n_rate_checks, multiple_comparisons="holm",
                     degraded=p <= alpha_acc, p_adjusted=p, spec_degraded=p <= alpha)


@dataclass(frozen=True)
class OverallDecision:
    verdict: str  # "PASS" or "FAIL"
    tasks: dict[str, TaskDecision]
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    alpha: float
    multiple_comparisons: str

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def spec_verdict(self) -> str:
        """§4.8 as written on the same data: reported next to the gated verdict."""
        return "FAIL" if any(dec.spec_verdict == "FAIL" for dec in self.tasks.values()) else "PASS"

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "spec_verdict": self.spec_verdict,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "alpha": self.alpha,
            "multiple_comparisons": self.multiple_comparisons,
            "tasks": {name: dec.to_dict() for name, dec in self.tasks.items()},
        }


def _multiplicity(pvalues: dict[str, float], alpha: float, rule: str) -> tuple[dict[str, bool], dict[str, float]]:
    rejected = MULTIPLE_COMPARISONS[rule](pvalues, alpha)
    k = len(pvalues)
    if rule == "holm":
        adjusted = holm_adjusted(pvalues)
    elif rule == "bonferroni":
        adjusted = {name: min(1.0, k * p) for name, p in pvalues.items()}
    else:
        adjusted = dict(pvalues)
    return rejected, adjusted


def decide_overall(
    decisions: Sequence[TaskDecision] | Mapping[str, TaskDecision],
    alpha: float | None = None,
    multiple_comparisons: str = "holm",
) -> OverallDecision:
    """Combine per-task decisions (§4.5, §4.8): FAIL if any task fails, with one α budget for the whole gate.

    Every task's decision is redone for K tasks and J rate checks: the McNemar degradation tests are
    corrected across tasks (Holm by default) at α_acc; the A/A margin floor uses the share α_acc/K;
    each rate check gets α_validity/J. The non-inferiority bounds stay at level α per task: requiring
    non-inferiority on every task is an intersection–union test for passing a bad kernel (Berger 1982,
    Technometrics 24:295–300); the union of failures of a good kernel is what the budget controls.
    ``multiple_comparisons="none"`` gives up that control for the degradation tests.
    ``alpha`` defaults to the tasks' own α, which must all be equal (their bounds were computed with it).
    """
    if multiple_comparisons not in MULTIPLE_COMPARISONS:
        raise ValueError(f"multiple_comparisons must be one of {sorted(MULTIPLE_COMPARISONS)}")
    items = list(decisions.values()) if isinstance(decisions, Mapping) else list(decisions)
    if not items:
        raise ValueError("no task decisions to combine")
    names = [dec.task for dec in items]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate task names: {names}")
    alphas = {dec.alpha for dec in items}
    if alpha is None and len(alphas) == 1:
        alpha = alphas.pop()
    if alphas and alphas != {alpha}:
        raise ValueError(f"task decisions were computed at α = {sorted(alphas)}, not at α = {alpha}")
    policies = {(dec.alpha_split, dec.alpha_validity) for dec in items}
    if len(policies) != 1:
        raise ValueError(f"task decisions use different α budgets (alpha_split, alpha_validity): {sorted(policies)}")
    alpha_split, alpha_validity = policies.pop()
    k = len(items)
    n_rate_checks = sum(check is not None for dec in items for check in (dec.invalid, dec.truncation))
    alpha_acc, _ = gate_levels(alpha, alpha_split, alpha_validity, k, n_rate_checks)
    pvalues = {dec.task: dec.p_degradation for dec in items}
    rejected, adjusted = _multiplicity(pvalues, alpha_acc, multiple_comparisons)
    spec_rejected, _ = _multiplicity(pvalues, alpha, multiple_comparisons)

    tasks: dict[str, TaskDecision] = {}
    for dec in items:
        tasks[dec.task] = _finalise(dec, n_tasks=k, n_rate_checks=n_rate_checks,
                                    multiple_comparisons=multiple_comparisons, degraded=rejected[dec.task],
                                    p_adjusted=adjusted[dec.task], spec_degraded=spec_rejected[dec.task])

    failed = [dec for dec in tasks.values() if not dec.passed]
    if failed:
        reasons = tuple(f"{dec.task}: {reason}" for dec in failed for reason in dec.reasons)
        verdict = "FAIL"
    else:
        reasons = (f"all {k} task(s) passed",)
        verdict = "PASS"
    warnings = tuple(f"{dec.task}: {w}" for dec in tasks.values() for w in dec.warnings)
    return OverallDecision(verdict, tasks, reasons, warnings, alpha, multiple_comparisons)
