"""Paired statistics on two score vectors over the same n items: counts, exact tests and intervals.

Orientation everywhere: the baseline and the candidate score the same n items, and

    |                 | candidate right | candidate wrong |
    | baseline right  |        a        |        b        |
    | baseline wrong  |        c        |        d        |

so Δ̂ = (c − b)/n is candidate minus baseline (negative = the candidate is worse) and ψ = (b + c)/n is the
flip rate. Intervals are returned as (lower, upper) fractions, not percentage points. Pure numbers: the
gate's rule that uses them lives in ``evalgate.gate.rule`` (docs/gate.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.stats import binom, norm

from evalgate.stats.alpha import check_alpha as _check_alpha

# --------------------------------------------------------------------------------------------------------
# Counts
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """The paired 2×2 table (docs/gate.md#the-paired-table). b = baseline right & candidate wrong, c = baseline wrong & candidate right."""

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


def _as_bool_vector(values: Sequence | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != bool:
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold booleans or 0/1 values (a binary per-item metric)")
        arr = arr.astype(bool)
    return arr


def paired_counts(base: Sequence[bool] | np.ndarray, cand: Sequence[bool] | np.ndarray) -> Counts:
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
# McNemar exact tests (docs/gate.md#mcnemar-test)
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
    """One-sided mid-p McNemar: P(X > b) + ½·P(X = b). Reported only, never gated on (docs/gate.md#mcnemar-test).

    Reference: Fagerland, Lydersen & Laake (2013), "The McNemar test for binary matched-pairs data:
    mid-p and asymptotic are better than exact conditional", BMC Med Res Methodol 13:91.
    """
    m = b + c
    if m == 0:
        return 1.0
    return float(binom.sf(b, m, 0.5) + 0.5 * binom.pmf(b, m, 0.5))


# --------------------------------------------------------------------------------------------------------
# Confidence intervals for Δ (docs/gate.md#intervals)
# --------------------------------------------------------------------------------------------------------

_SIDED = ("two", "lower", "upper")


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
    """One-sided (1 − α) Tango lower bound L for Δ: solves Z(L) = z_{1−α} by bisection on [−1, Δ̂] (docs/gate.md#intervals).

    PASS on non-inferiority requires L > −M (docs/gate.md#non-inferiority). With b = c = 0, L = −z²/(n + z²).
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
    """Tango score interval for Δ = p_candidate − p_baseline, {Δ₀ : |Z(Δ₀)| ≤ z} (docs/gate.md#intervals).

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
    """Wald interval Δ̂ ± z·√(ψ − Δ̂²)/√n. Report only: poor at small discordant counts (docs/gate.md#intervals)."""
    _check_alpha(alpha)
    delta = (c - b) / n
    se = math.sqrt(max((b + c) / n - delta * delta, 0.0) / n)
    z = norm.ppf(1 - alpha / 2)
    return float(delta - z * se), float(delta + z * se)
