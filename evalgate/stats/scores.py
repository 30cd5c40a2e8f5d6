"""Paired statistics on per-item scores in [0, 1]: a score per item that is the mean over its k samples.

The baseline and the candidate score the same n items; item i has the score s_i = (1/k)·Σ_s y_is, the mean of
its k sample outcomes (k = 1 at temperature 0: s_i ∈ {0, 1}). The paired difference of item i is

    D_i = s_i(candidate) − s_i(baseline) ∈ [−1, 1], a multiple of 1/k,

and Δ = E[D] (candidate minus baseline; negative = worse). Items are the unit of independence: the k samples
of an item share its prompt and difficulty, so they are never counted as k independent observations.
ψ = mean(D_i²) is the flip structure's second moment (for binary scores, the flip rate (b + c)/n).

Two procedures, each the exact generalisation of the binary one (docs/gate.md#k-samples):

- ``signflip_pvalues`` — the exact paired randomisation (sign-flip) test on the D_i: under "candidate and
  baseline exchangeable on every item" each D_i is as likely to be ±|D_i|. With k = 1 it *is* the exact
  McNemar test (the signs of the b + c discordant items are a Binomial(b + c, ½)).
- ``score_lower_bound`` / ``score_upper_bound`` — the multinomial score interval for the mean of D: D takes
  finitely many values; for a hypothesised Δ₀ the cell probabilities are re-estimated by maximum likelihood
  under E[D] = Δ₀ (the empirical-likelihood weights, plus mass on the unobserved extreme of the observed
  range, −max|D_i| or +max|D_i|, when reweighting alone cannot reach Δ₀), and
  Z(Δ₀) = (D̄ − Δ₀)·√n / √Var_restricted(D). With binary scores the range is ±1 and this is Tango's (1998)
  score interval, to rounding (tests/test_scores.py); with nothing moved at all the range is taken as ±1,
  Tango's b = c = 0 bound −z²/(n + z²).

Pure numbers: the rule that uses them lives in ``evalgate.gate.rule``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.stats import binom, norm

from evalgate.stats.paired import _check_alpha

# --------------------------------------------------------------------------------------------------------
# Per-item differences
# --------------------------------------------------------------------------------------------------------


def as_score_vector(values: Sequence, name: str) -> np.ndarray:
    """A one-dimensional float vector of per-item scores in [0, 1] (booleans become 0/1)."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and (not np.isfinite(arr).all() or arr.min() < 0.0 or arr.max() > 1.0):
        raise ValueError(f"{name} must hold per-item scores in [0, 1] (means over an item's samples)")
    return arr


def item_differences(base: Sequence, cand: Sequence) -> np.ndarray:
    """D_i = candidate − baseline per item, both per-item scores in [0, 1] in the same item order."""
    b = as_score_vector(base, "base")
    c = as_score_vector(cand, "cand")
    if b.shape != c.shape:
        raise ValueError(f"paired vectors differ in length: base {b.size}, cand {c.size}")
    return c - b


def lattice_steps(diffs: np.ndarray, n_samples) -> np.ndarray:
    """D_i in units of 1/L, L = lcm of the items' sample counts: the integers the exact test works on.

    ``n_samples`` is one k for all items or one per item. Raises ValueError when a difference is not a
    multiple of 1/k (the scores are not means over k samples).
    """
    ks = np.broadcast_to(np.asarray(n_samples, dtype=int), diffs.shape)
    if ks.size and ks.min() < 1:
        raise ValueError("n_samples must be ≥ 1")
    scale = int(np.lcm.reduce(np.unique(ks))) if ks.size else 1
    steps = np.rint(diffs * scale)
    if diffs.size and np.abs(steps - diffs * scale).max() > 1e-6:
        worst = int(np.argmax(np.abs(steps - diffs * scale)))
        raise ValueError(f"item {worst}: the score difference {diffs[worst]:.6g} is not a multiple of 1/{ks[worst]}; "
                         "per-item scores must be means over the item's samples")
    return steps.astype(np.int64)


def second_moment(diffs: np.ndarray) -> float:
    """ψ = mean(D_i²): the flip rate (b + c)/n for binary scores."""
    return float(np.mean(np.square(diffs))) if diffs.size else 0.0


# --------------------------------------------------------------------------------------------------------
# The exact sign-flip test (McNemar's exact test when k = 1)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignFlip:
    """Exact sign-flip p-values for S = Σ D_i (in lattice steps); small p_lower: the candidate is worse."""

    p_lower: float  # P(S* ≤ S): one-sided, H0 "no degradation" (McNemar's P(X ≥ b | b + c) when k = 1)
    p_upper: float  # P(S* ≥ S): one-sided the other way (a rise, for the rate checks)
    p_mid: float  # P(S* < S) + ½·P(S* = S), reported only
    p_two_sided: float  # min(1, 2·min(p_lower, p_upper))


def signflip_null(steps: np.ndarray) -> tuple[np.ndarray, int]:
    """The exact null distribution of S* = Σ ε_i·|steps_i| with independent fair signs ε_i.

    Returns (pmf over S* = −T..T, T). Items with equal |steps| contribute |steps|·(2·Binomial(m, ½) − m), so the
    distribution is a convolution over the distinct magnitudes (at most L of them).
    """
    mags = np.abs(np.asarray(steps, dtype=np.int64))
    mags = mags[mags > 0]
    total = int(mags.sum())
    pmf = np.ones(1)
    if total == 0:
        return pmf, 0
    values, counts = np.unique(mags, return_counts=True)
    for w, m in zip(values.tolist(), counts.tolist()):
        part = np.zeros(2 * w * m + 1)
        part[:: 2 * w] = _fair_binomial(m)
        pmf = np.convolve(pmf, part)
    return pmf, total


@functools.lru_cache(maxsize=4096)
def _fair_binomial(m: int) -> np.ndarray:
    """The Binomial(m, ½) probabilities (cached: the simulation asks for the same m thousands of times)."""
    return binom.pmf(np.arange(m + 1), m, 0.5)


def signflip_pvalues(steps: Sequence[int] | np.ndarray) -> SignFlip:
    """Exact sign-flip p-values for the observed S = Σ steps (D_i in lattice units). With all |steps| ≤ 1
    (binary scores) p_lower equals the exact one-sided McNemar P(X ≥ b | b + c), X ~ Binomial(b + c, ½)."""
    lattice = np.asarray(steps, dtype=np.int64)
    pmf, total = signflip_null(lattice)
    if total == 0:
        return SignFlip(1.0, 1.0, 1.0, 1.0)
    s = int(lattice.sum())
    at = s + total  # index of S* = s
    lower = float(min(1.0, pmf[: at + 1].sum()))
    upper = float(min(1.0, pmf[at:].sum()))
    mid = float(min(1.0, pmf[:at].sum() + 0.5 * pmf[at]))
    return SignFlip(lower, upper, mid, float(min(1.0, 2.0 * min(lower, upper))))


# --------------------------------------------------------------------------------------------------------
# The multinomial score interval for E[D] (Tango's interval when k = 1)
# --------------------------------------------------------------------------------------------------------


def histogram(diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(support, counts): the distinct values of D and how many items take each, support ascending."""
    support, counts = np.unique(np.round(np.asarray(diffs, dtype=float), 12), return_counts=True)
    return support, counts.astype(float)


def _range(support: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per row, the largest observed |D| (1 when nothing moved): the extreme the restricted fit may add."""
    observed = counts > 0
    mags = np.where(observed, np.abs(support)[None, :], 0.0).max(axis=1)
    return np.where(mags > 0, mags, 1.0)


def _restricted_variance_below(y_support: np.ndarray, w: np.ndarray, d0: np.ndarray, iterations: int) -> np.ndarray:
    """Var(D) under the maximum-likelihood cell probabilities restricted to E[D] = Δ₀ < D̄, in units of the
    observed range (values in [−1, 1], the extreme −1 = −max|D_i|); one row per data set.

    Observed cells get p_j = w_j / (1 + λ(x_j − Δ₀)), λ ∈ [0, 1/(1 + Δ₀)] solving Σ p_j (x_j − Δ₀) = 0 (the
    empirical-likelihood solution). When that has no root — the extreme −1 is unobserved and the observed
    cells cannot be reweighted down to Δ₀ — the maximum sits on the boundary λ = 1/(1 + Δ₀), and the
    remaining mass 1 − Σ p_j goes to the extreme (Tango's q̃ > 0 with b = 0).
    """
    y = y_support - d0[:, None]  # (R, m)
    with np.errstate(divide="ignore"):
        lam_max = 1.0 / (1.0 + d0)  # inf only at Δ₀ = −1 = D̄, where every item lost everything
    observed = w > 0
    has_min = (observed & (y_support <= -1.0 + 1e-12)).any(axis=1)

    def g(lam):
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(observed, w * y / (1.0 + lam[:, None] * y), 0.0)
        return terms.sum(axis=1)

    def g_prime(lam):
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(observed, -w * y * y / (1.0 + lam[:, None] * y) ** 2, 0.0)
        return terms.sum(axis=1)

    boundary = ~has_min & (g(lam_max) >= 0)
    # safeguarded Newton on the decreasing g over the bracket [lo, hi]
    lo, hi = np.zeros_like(d0), lam_max.copy()
    lam = np.zeros_like(d0)
    for _ in range(iterations):
        value = g(lam)
        lo = np.where(value > 0, lam, lo)
        hi = np.where(value > 0, hi, lam)
        with np.errstate(divide="ignore", invalid="ignore"):
            step = lam - value / g_prime(lam)
        inside = np.isfinite(step) & (step > lo) & (step < hi)
        lam = np.where(inside, step, 0.5 * (lo + hi))
    lam = np.where(boundary, lam_max, lam)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(observed, w / (1.0 + lam[:, None] * y), 0.0)
    p_min = np.where(has_min, 0.0, np.clip(1.0 - p.sum(axis=1), 0.0, None))
    y_min = -1.0 - d0
    return (p * y * y).sum(axis=1) + p_min * y_min * y_min


def _scaled(support, counts):
    support = np.asarray(support, dtype=float)
    counts = np.atleast_2d(np.asarray(counts, dtype=float))
    scale = _range(support, counts)
    n = counts.sum(axis=1)
    w = counts / n[:, None]
    y_support = support[None, :] / scale[:, None]
    return y_support, w, n, scale, (w * y_support).sum(axis=1)


def score_z(support, counts, delta0) -> np.ndarray:
    """Z(Δ₀) = (D̄ − Δ₀)·√n / √Var_restricted(D), per row of ``counts`` over ``support``.

    Z decreases in Δ₀, so "L > −M" is "Z(−M) > z_{1−α}": one evaluation decides non-inferiority (the
    simulation uses this). Rows with D̄ ≤ Δ₀ get −inf (their bound is below Δ₀); rows whose observed range
    does not reach down to Δ₀ (Δ₀ ≤ −max|D_i|) get +inf (their bound is above it).
    """
    y_support, w, n, scale, mean = _scaled(support, counts)
    d0 = np.broadcast_to(np.asarray(delta0, dtype=float), mean.shape) / scale
    below = d0 < mean
    reachable = d0 > -1.0
    safe = np.clip(np.where(below, d0, mean - 1e-9), -1.0 + 1e-12, None)
    var = _restricted_variance_below(y_support, w, safe, 30)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 0, (mean - d0) * np.sqrt(n) / np.sqrt(var), np.inf)
    return np.where(below, np.where(reachable, z, np.inf), -np.inf)


def _lower_root(support: np.ndarray, counts: np.ndarray, target: float, iterations: int = 50) -> np.ndarray:
    """Δ₀ ∈ [−max|D_i|, D̄] with Z(Δ₀) = target (Z decreases in Δ₀), per row of counts, by bisection."""
    y_support, w, n, scale, mean = _scaled(support, counts)
    lo, hi = np.full_like(mean, -1.0), mean.copy()
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        var = _restricted_variance_below(y_support, w, mid, 30)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(var > 0, (mean - mid) * np.sqrt(n) / np.sqrt(var), np.inf)
        right = z > target  # still above the target: the root lies to the right
        lo = np.where(right, mid, lo)
        hi = np.where(right, hi, mid)
    return scale * 0.5 * (lo + hi)


def _as_histogram(diffs_or_support, counts):
    if counts is None:
        support, counts = histogram(np.asarray(diffs_or_support, dtype=float))
        return support, counts[None, :], True
    support = np.asarray(diffs_or_support, dtype=float)
    counts = np.asarray(counts, dtype=float)
    scalar = counts.ndim == 1
    return support, np.atleast_2d(counts), scalar


def _out(x, scalar):
    return float(x[0]) if scalar else x


def score_lower_bound(diffs_or_support, counts=None, alpha: float = 0.05):
    """One-sided (1 − α) lower bound L for Δ = E[D]: solves Z(L) = z_{1−α} (docs/gate.md#k-samples).

    Give the per-item differences D_i, or a common ``support`` (ascending) with ``counts`` per support point
    (one row per data set: the simulation passes thousands at once; counts may be fractional weights).
    With binary scores this is Tango's one-sided bound (``evalgate.stats.paired.tango_lower_bound``).
    """
    _check_alpha(alpha)
    support, counts, scalar = _as_histogram(diffs_or_support, counts)
    if (counts.sum(axis=1) <= 0).any():
        raise ValueError("n must be positive")
    return _out(_lower_root(support, counts, norm.ppf(1 - alpha)), scalar)


def score_upper_bound(diffs_or_support, counts=None, alpha: float = 0.05):
    """One-sided (1 − α) upper bound U for Δ: the lower bound of −D, negated."""
    _check_alpha(alpha)
    support, counts, scalar = _as_histogram(diffs_or_support, counts)
    if (counts.sum(axis=1) <= 0).any():
        raise ValueError("n must be positive")
    flipped = -_lower_root(-support[::-1], counts[:, ::-1], norm.ppf(1 - alpha))
    return _out(flipped, scalar)


def score_interval(diffs: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided (1 − α) score interval for Δ = E[D] (Tango's when the scores are binary)."""
    return score_lower_bound(diffs, alpha=alpha / 2), score_upper_bound(diffs, alpha=alpha / 2)


def wald_interval_scores(diffs: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """D̄ ± z·sd(D)/√n (population sd, as the binary Wald interval): report only, poor with few flips."""
    _check_alpha(alpha)
    n = diffs.size
    mean = float(diffs.mean())
    se = math.sqrt(max(float(np.mean(np.square(diffs))) - mean * mean, 0.0) / n)
    z = norm.ppf(1 - alpha / 2)
    return mean - z * se, mean + z * se


def symmetrised(diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flip structure of D with Δ = 0: each |D_i| half at +|D_i|, half at −|D_i| (support, weights).

    What a candidate exactly as good as the baseline would show with this data's per-item flip pattern.
    """
    mags = np.abs(np.round(np.asarray(diffs, dtype=float), 12))
    values, counts = np.unique(mags, return_counts=True)
    counts = counts.astype(float)
    nonzero = values > 0
    support = np.concatenate([-values[nonzero][::-1], values[~nonzero], values[nonzero]])
    weights = np.concatenate([counts[nonzero][::-1] / 2, counts[~nonzero], counts[nonzero] / 2])
    if support.size == 0:
        return np.array([0.0]), np.array([0.0])
    return support, weights
