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

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
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
# Default decision rule (§4.8)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RateCheck:
    """A validity-rate gate (invalid answers or truncations): fails on a significant or too-large rise."""

    name: str  # "invalid" or "truncation"
    base_count: int
    cand_count: int
    n: int
    p: float  # exact one-sided McNemar on the indicator: H0 "the rate did not rise"
    limit: float  # largest allowed absolute rise, as a fraction
    significant: bool  # p ≤ α
    over_limit: bool  # cand_rate − base_rate > limit

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
    margin: float
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
    degraded: bool  # McNemar rejected "no degradation" (after the multiple-comparison rule)
    non_inferior: bool  # gate_lower > −M
    invalid: RateCheck | None
    truncation: RateCheck | None
    tokens: TokenCheck | None
    multiple_comparisons: str  # "holm", "bonferroni", "none"; with K tasks
    n_tasks: int
    verdict: str  # "PASS" or "FAIL"
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("invalid", "truncation"):
            check = getattr(self, key)
            if check is not None:
                out[key].update(base_rate=check.base_rate, cand_rate=check.cand_rate, rise=check.rise,
                                failed=check.failed)
        if self.tokens is not None:
            out["tokens"].update(ratio=self.tokens.ratio, warn=self.tokens.warn)
        return out


def _pp(x: float) -> str:
    return f"{100 * x:+.2f} pp"


def _rate_check(name: str, base_flags, cand_flags, alpha: float, limit: float) -> RateCheck:
    base_arr = _as_bool_vector(base_flags, f"base_{name}")
    cand_arr = _as_bool_vector(cand_flags, f"cand_{name}")
    # "OK" plays the role of "right": b = baseline OK but candidate flagged, i.e. a new invalid/truncation.
    counts = paired_counts(~base_arr, ~cand_arr)
    base_count, cand_count = int(base_arr.sum()), int(cand_arr.sum())
    p = mcnemar_exact_one_sided(counts.b, counts.c)
    # compare counts, not float rates, so a rise of exactly the limit is not failed by rounding
    over = (cand_count - base_count) > limit * counts.n + 1e-9
    return RateCheck(name, base_count, cand_count, counts.n, p, limit, p <= alpha, bool(over))


def _verdict_and_reasons(dec: TaskDecision) -> tuple[str, tuple[str, ...]]:
    """Build the verdict and reasons from a decision's checks, so decide_overall can redo them after Holm."""
    fails: list[str] = []
    if dec.degraded:
        rule = dec.multiple_comparisons if dec.n_tasks > 1 else "single task"
        fails.append(
            f"accuracy degraded: exact one-sided McNemar p = {dec.p_degradation:.4g} "
            f"(adjusted {dec.p_degradation_adjusted:.4g}, {rule}, K = {dec.n_tasks}) ≤ α = {dec.alpha:g}; "
            f"b = {dec.counts.b} lost, c = {dec.counts.c} gained"
        )
    level = f"{100 * (1 - dec.alpha):g}%"
    if not dec.non_inferior:
        fails.append(
            f"non-inferiority not shown: {dec.ci_method.title()} one-sided {level} lower bound "
            f"L = {_pp(dec.gate_lower)} ≤ -M = {_pp(-dec.margin)}"
        )
    for check in (dec.invalid, dec.truncation):
        if check is None:
            continue
        rates = f"{100 * check.base_rate:.2f}% → {100 * check.cand_rate:.2f}% ({_pp(check.rise)})"
        if check.significant:
            fails.append(f"{check.name} rate rose significantly: {rates}, exact one-sided McNemar p = "
                         f"{check.p:.4g} ≤ α = {dec.alpha:g}")
        if check.over_limit:
            fails.append(f"{check.name} rate rose by more than the limit: {rates} > {100 * check.limit:.2f} pp")
    if fails:
        return "FAIL", tuple(fails)
    return "PASS", (
        f"non-inferior: {dec.ci_method.title()} one-sided {level} lower bound L = {_pp(dec.gate_lower)} > "
        f"-M = {_pp(-dec.margin)}; no significant degradation (McNemar p = {dec.p_degradation:.4g}); "
        f"validity rates within limits",
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
) -> TaskDecision:
    """The default per-task decision of eval-conventions §4.8, as a pure function.

    Give either the binary per-item metric vectors ``base`` and ``cand`` (same item order) or ``counts``.
    ``margin``, ``max_invalid_rise`` and ``max_truncation_rise`` are fractions (1.5 pp = 0.015).
    FAIL when any of:
    - the exact one-sided McNemar rejects "no degradation" at α (for one task; ``decide_overall`` redoes
      this with Holm across tasks);
    - the one-sided (1 − α) lower bound for Δ (Tango by default) is ≤ −margin (non-inferiority, §4.4);
    - the invalid or truncation rate rose significantly (exact one-sided McNemar on the indicator at α) or
      by more than its limit (absolute). These checks are skipped, with a warning, when the indicator
      vectors are not given.
    WARN (never FAIL) when the candidate's mean generated tokens fall outside ``token_ratio_band`` times
    the baseline's.
    """
    _check_alpha(alpha)
    if margin < 0:
        raise ValueError(f"margin must be ≥ 0 (a fraction), got {margin}")
    if ci_method not in ("tango", "newcombe"):
        raise ValueError(f"ci_method must be 'tango' or 'newcombe', got {ci_method!r}")
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
    checks: dict[str, RateCheck | None] = {}
    for name, base_flags, cand_flags, limit in (
        ("invalid", base_invalid, cand_invalid, max_invalid_rise),
        ("truncation", base_truncated, cand_truncated, max_truncation_rise),
    ):
        if base_flags is None or cand_flags is None:
            checks[name] = None
            warnings.append(f"{name} rate not checked: no per-item {name} flags given")
            continue
        check = _rate_check(name, base_flags, cand_flags, alpha, limit)
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
        degraded=p <= alpha,
        non_inferior=gate_lower > -margin,
        invalid=checks["invalid"],
        truncation=checks["truncation"],
        tokens=tokens,
        multiple_comparisons="holm",
        n_tasks=1,
        verdict="PASS",
        reasons=(),
        warnings=tuple(warnings),
    )
    verdict, reasons = _verdict_and_reasons(decision)
    return replace(decision, verdict=verdict, reasons=reasons)


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

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "alpha": self.alpha,
            "multiple_comparisons": self.multiple_comparisons,
            "tasks": {name: dec.to_dict() for name, dec in self.tasks.items()},
        }


def decide_overall(
    decisions: Sequence[TaskDecision] | Mapping[str, TaskDecision],
    alpha: float | None = None,
    multiple_comparisons: str = "holm",
) -> OverallDecision:
    """Combine per-task decisions (§4.5, §4.8): multiplicity rule on McNemar, then FAIL if any task fails.

    The degradation tests are corrected across tasks (Holm by default): each task's ``degraded`` flag,
    adjusted p-value, verdict and reasons are recomputed. The non-inferiority bounds and the rate gates are
    left at level α per task: requiring non-inferiority on every task is an intersection–union test, which
    needs no correction (Berger 1982, Technometrics 24:295–300).
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
    pvalues = {dec.task: dec.p_degradation for dec in items}
    rejected = MULTIPLE_COMPARISONS[multiple_comparisons](pvalues, alpha)
    k = len(items)
    if multiple_comparisons == "holm":
        adjusted = holm_adjusted(pvalues)
    elif multiple_comparisons == "bonferroni":
        adjusted = {name: min(1.0, k * p) for name, p in pvalues.items()}
    else:
        adjusted = dict(pvalues)

    tasks: dict[str, TaskDecision] = {}
    for dec in items:
        updated = replace(
            dec,
            degraded=rejected[dec.task],
            p_degradation_adjusted=adjusted[dec.task],
            multiple_comparisons=multiple_comparisons,
            n_tasks=k,
        )
        verdict, reasons = _verdict_and_reasons(updated)
        tasks[dec.task] = replace(updated, verdict=verdict, reasons=reasons)

    failed = [dec for dec in tasks.values() if not dec.passed]
    if failed:
        reasons = tuple(f"{dec.task}: {reason}" for dec in failed for reason in dec.reasons)
        verdict = "FAIL"
    else:
        reasons = (f"all {k} task(s) passed",)
        verdict = "PASS"
    warnings = tuple(f"{dec.task}: {w}" for dec in tasks.values() for w in dec.warnings)
    return OverallDecision(verdict, tasks, reasons, warnings, alpha, multiple_comparisons)
