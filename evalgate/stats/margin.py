"""Margins and noise: the minimum detectable effect, the A/A flip structure's upper bound, the samples a
margin needs."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import gammaln, xlogy
from scipy.stats import beta, binom, norm

from evalgate.stats.paired import _check_alpha, _tango_root, tango_lower_bound


def trinomial_cells(psi: float, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (b, c) with non-negligible mass under P(b) = P(c) = ψ/2 per item over n items (a trinomial),
    and its probability: (b, c, pmf), flat arrays. Each count's range leaves tails < 1e-12."""
    half = psi / 2
    if half > 0:
        span = binom.ppf(1e-12, n, half), binom.isf(1e-12, n, half)
        counts = np.arange(int(span[0]), int(span[1]) + 1)
    else:
        counts = np.array([0])
    b, c = (x.ravel() for x in np.meshgrid(counts, counts))
    keep = b + c <= n
    b, c = b[keep], c[keep]
    log_pmf = (gammaln(n + 1) - gammaln(b + 1) - gammaln(c + 1) - gammaln(n - b - c + 1)
               + xlogy(b + c, half) + xlogy(n - b - c, 1 - psi))
    return b, c, np.exp(log_pmf)


# --------------------------------------------------------------------------------------------------------
# The A/A flip structure with its uncertainty
# --------------------------------------------------------------------------------------------------------


def psi_upper_bound(psi: float, n: int, alpha: float = 0.05) -> float:
    """One-sided (1 − α) upper confidence bound for a flip structure ψ measured on n items.

    Clopper–Pearson on x = n·ψ "flips" out of n: U = Beta⁻¹(1 − α; x + 1, n − x), exact for binary scores
    (ψ = (b + c)/n). For k-sample scores ψ = mean(D_i²) is a mean of values in [0, 1] and x need not be whole;
    the same formula, continuous in x, is used (its coverage is checked by simulation, tests/test_scores.py).
    Several A/A runs pool by summing x and n (``pooled_psi``).
    """
    _check_alpha(alpha)
    if n <= 0:
        raise ValueError("n must be positive")
    if not 0.0 <= psi <= 1.0:
        raise ValueError(f"psi must be in [0, 1], got {psi}")
    x = psi * n
    if x >= n:
        return 1.0
    return float(beta.ppf(1 - alpha, x + 1, n - x))


def pooled_psi(runs) -> tuple[float, int]:
    """(ψ, n) of several A/A runs, each (ψ_r, n_r), pooled item-weighted: Σ ψ_r·n_r / Σ n_r."""
    runs = list(runs)
    total = sum(n for _, n in runs)
    if total <= 0:
        raise ValueError("no A/A items to pool")
    return sum(psi * n for psi, n in runs) / total, total


# --------------------------------------------------------------------------------------------------------
# The minimum detectable effect, and the samples a margin needs
# --------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def mde_binary(psi: float, n: int, alpha: float = 0.05, power: float = 0.8, critical: float | None = None) -> float:
    """The smallest margin M that a candidate exactly as good as the baseline (Δ = 0, flip rate ψ, binary
    scores, n items) demonstrates — one-sided (1 − α) Tango bound L > −M — with probability ≥ ``power``.

    Exact: sums the trinomial distribution of (b, c), P(b) = P(c) = ψ/2, over every cell with mass > 1e-12.
    With ψ = 0 it is −L(0, 0) = z²/(n + z²). ``critical``: the critical value of Tango's Z the gate uses
    (the exact one at the policy's margin, ``evalgate.stats.exact_ni.critical_value``; default z_{1−α}). The
    gate's own decision at a margin M′ ≠ M would use M′'s critical value, so at other margins this is an
    estimate (the critical values differ by < 0.06 across the margins of thresholds.yaml).
    """
    _check_alpha(alpha)
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if not 0.0 <= psi <= 1.0:
        raise ValueError(f"psi must be a flip rate in [0, 1], got {psi}")
    if n <= 0:
        raise ValueError("n must be positive")
    b, c, pmf = trinomial_cells(psi, n)
    if critical is None:
        lower = np.atleast_1d(tango_lower_bound(b, c, n, alpha))
    else:
        delta_hat = (c - b) / n
        lower = np.atleast_1d(_tango_root(b, c, n, critical, np.full(b.shape, -1.0), delta_hat))
    order = np.argsort(lower, kind="stable")
    # P(L ≤ −M) ≤ 1 − power: M must exceed −L at the first cell past that mass
    first = int(np.searchsorted(np.cumsum(pmf[order]), 1 - power, side="right"))
    first = min(first, order.size - 1)
    return float(math.floor(-lower[order[first]] * 1e6) / 1e6 + 1e-6)


def mde_normal(lower_symmetric: float, psi: float, n: int, power: float = 0.8) -> float:
    """The normal-approximation MDE for any flip structure: M = −L_sym + z_power·√(ψ/n), where L_sym is
    the one-sided bound of the structure at Δ̂ = 0 (``evalgate.stats.scores.symmetrised``) and ψ = mean(D²).

    Within 0.3 pp of ``mde_binary`` for binary scores at n = 164 and 0.02 pp at n = 1319.
    """
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    return float(-lower_symmetric + norm.ppf(power) * math.sqrt(max(psi, 0.0) / n))


def mde_score(support: np.ndarray, weights: np.ndarray, alpha: float = 0.05, power: float = 0.8) -> float:
    """The MDE of the k-sample score test the gate decides with (L > −M, L the score bound at α) for a
    candidate exactly as good as the baseline with this flip structure (``evalgate.stats.scores.symmetrised``:
    support, weights summing to n): −L of the data set whose mean sits at its (1 − power) quantile,
    −z_power·√(ψ/n), with the structure reweighted to that mean the way the score test reweights it
    (empirical likelihood: w_j / (1 + λ(x_j − mean))).

    ``mde_normal`` takes L at the mean 0 instead and adds z_power·√(ψ/n); the score test's restricted variance
    at the lower mean is larger, so that MDE is optimistic (power 0.78 where it promises 0.80, HumanEval
    sizes; tests/test_scores.py simulates both)."""
    from evalgate.stats.scores import score_lower_bound  # scores imports nothing of this module's

    support = np.asarray(support, dtype=float)
    weights = np.asarray(weights, dtype=float)
    n = float(weights.sum())
    if n <= 0:
        raise ValueError("n must be positive")
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    p = weights / n
    psi = float(np.dot(p, support * support))
    if psi <= 0:
        return float(-score_lower_bound(support, weights, alpha))
    y = support - (-norm.ppf(power) * math.sqrt(psi / n))  # the support around the target mean
    live = p > 0
    lam = brentq(lambda lam: float(np.sum(p[live] * y[live] / (1 + lam * y[live]))),
                 -1 / y[live].max() + 1e-12, -1 / y[live].min() - 1e-12, xtol=1e-14)
    tilted = np.where(live, p / (1 + lam * y), 0.0)
    return float(-score_lower_bound(support, tilted / tilted.sum() * n, alpha))


def project_samples(mde: float, margin: float, psi: float, k: int, within: float | None,
                    k_max: int = 64) -> tuple[int | None, float, bool]:
    """The fewest samples per item K for which the MDE reaches ``margin``, from the MDE measured at k.

    The per-item variance at k' samples is V(k') = B + W/k' (W: the mean within-item variance of one sample's
    paired difference; B: what averaging cannot remove — items the kernel helps or hurts). B = ψ − W/k, where
    ψ = mean(D²) at k. The MDE scales as √V. Without ``within`` (k = 1, or no per-sample scores) W = k·ψ,
    B = 0: every item's variation averages out, so K is a lower bound.

    Returns (K or None when even k_max does not reach the margin, the MDE as k → ∞, whether K is a bound).
    """
    bound = within is None
    w = k * psi if within is None else max(float(within), 0.0)
    b = max(psi - w / k, 0.0)
    if psi <= 0 or mde <= margin:
        return (k if mde <= margin else None), (mde if psi <= 0 else mde * math.sqrt(b / psi)), bound
    limit = mde * math.sqrt(b / psi)
    for kk in range(1, k_max + 1):
        if mde * math.sqrt((b + w / kk) / psi) <= margin:
            return kk, limit, bound
    return None, limit, bound
