"""The exact unconditional test of Tango's statistic at the margin: non-inferiority (PASS) and inferiority
(FAIL) for binary paired scores, each at its level at every n (docs/gate.md#exact-level-at-the-margin).

Tango's score bound is asymptotic: at n = 200 and M = 3 pp, L(b = 2, c = 0) = −2.977 pp > −3 pp, and a kernel
that loses 3% of its items with no gains PASSes 5.9% of the time at α = 5%. Here the statistic is kept and only
its critical value is made exact. Under H0 at the boundary Δ = −M the table has P(lost) = p_c + M and
P(gained) = p_c, with the nuisance p_c ∈ [0, (1 − M)/2]; for each p_c on a grid the trinomial law of (b, c) is
summed exactly, and

    p_pass(z) = sup over p_c of P(Z(−M) ≥ z)   (H0: Δ ≤ −M; PASS when p_pass(z_obs) ≤ α)
    p_fail(z) = sup over p_c of P(Z(−M) ≤ z)   (H0: Δ ≥ −M; FAIL when p_fail(z_obs) ≤ its level)

with Z Tango's Z(Δ₀ = −M) (``evalgate.stats.paired.tango_z``), the observed one decreasing in b and increasing
in c. Both tails are Berger & Boos-free "maximise over the nuisance" exact unconditional tests (Suissa & Shuster
1991 for the paired design; Sidik 2003 for non-inferiority): conservative wherever the grid holds the maximum,
which the tests check off the grid. The reported bound ``exact_lower_bound`` is Tango's bound at the exact
critical value, so "L > −M" and "p_pass ≤ α" are the same statement.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.special import gammaln, xlogy
from scipy.stats import binom

from evalgate.stats.paired import _check_alpha, _tango_root, tango_z

TAIL = 1e-12  # probability left out of each count's range per nuisance value


def nuisance_grid(margin: float) -> np.ndarray:
    """The values of p_c (the gained-item probability under Δ = −M) the supremum is taken over: dense near 0,
    where the counts are small and the test most discrete, then up to (1 − M)/2 (every item flips)."""
    top = (1.0 - margin) / 2
    fine = np.geomspace(1e-5, min(0.05, top), 160)
    coarse = np.linspace(min(0.05, top), top, 60)
    return np.unique(np.concatenate([[0.0], fine, coarse]))


def _cells(n: int, p_lost: float, p_gained: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (b, c) with non-negligible trinomial mass, and that mass."""
    def span(p):
        if p <= 0:
            return np.array([0])
        return np.arange(int(binom.ppf(TAIL, n, p)), int(binom.isf(TAIL, n, p)) + 1)

    b, c = (x.ravel() for x in np.meshgrid(span(p_lost), span(p_gained)))
    keep = b + c <= n
    b, c = b[keep], c[keep]
    rest = max(1.0 - p_lost - p_gained, 0.0)
    log_pmf = (gammaln(n + 1) - gammaln(b + 1) - gammaln(c + 1) - gammaln(n - b - c + 1)
               + xlogy(b, p_lost) + xlogy(c, p_gained) + xlogy(n - b - c, rest))
    return b, c, np.exp(log_pmf)


@functools.lru_cache(maxsize=256)
def null_law(n: int, margin: float) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per nuisance value: (Z values ascending, P(Z ≤ each)) under Δ = −M — the sufficient summary of both tails."""
    if n <= 0:
        raise ValueError("n must be positive")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    out = []
    for p_gained in nuisance_grid(margin):
        b, c, pmf = _cells(n, p_gained + margin, p_gained)
        z = np.asarray(tango_z(-margin, b, c, n), dtype=float)
        order = np.argsort(z, kind="stable")
        out.append((z[order], np.cumsum(pmf[order])))
    return tuple(out)


def _tails(n: int, margin: float, z_obs) -> tuple[np.ndarray, np.ndarray]:
    z_obs = np.atleast_1d(np.asarray(z_obs, dtype=float))
    upper = np.zeros_like(z_obs)  # sup P(Z ≥ z)
    lower = np.zeros_like(z_obs)  # sup P(Z ≤ z)
    for z, cdf in null_law(n, margin):
        total = cdf[-1]
        below = np.searchsorted(z, z_obs - 1e-12, side="left")  # cells with Z < z_obs
        at_or_below = np.searchsorted(z, z_obs + 1e-12, side="right")  # cells with Z ≤ z_obs
        cdf0 = np.concatenate([[0.0], cdf])
        upper = np.maximum(upper, total - cdf0[below])
        lower = np.maximum(lower, cdf0[at_or_below])
    return np.minimum(upper, 1.0), np.minimum(lower, 1.0)


def exact_pvalues(b, c, n: int, margin: float):
    """(p_pass, p_fail) of the observed (b, c): the exact unconditional p-values of H0: Δ ≤ −M (small: shown
    within the margin) and H0: Δ ≥ −M (small: shown worse than the margin). Vectorised over b and c."""
    z = tango_z(-margin, b, c, n)
    upper, lower = _tails(n, margin, z)
    if np.ndim(b) == 0 and np.ndim(c) == 0:
        return float(upper[0]), float(lower[0])
    return upper, lower


@functools.lru_cache(maxsize=1024)
def critical_value(n: int, margin: float, alpha: float) -> float:
    """The exact critical value of Z(−M) for PASS at level α: PASS ⇔ Z(−M) > critical_value. It is the
    largest Z any nuisance value leaves with more than α of its mass at or above it (never below the
    asymptotic z_{1−α} when the exact test is more liberal nowhere; exact either way)."""
    _check_alpha(alpha)
    worst = -np.inf
    for z, cdf in null_law(n, margin):
        total = cdf[-1]
        mass_at_or_above = total - np.concatenate([[0.0], cdf[:-1]])  # P(Z ≥ z_i) for each sorted cell
        over = mass_at_or_above > alpha + 1e-15
        if over.any():  # ties share a Z value: the last over-α cell is the largest Z that cannot reject
            worst = max(worst, float(z[np.flatnonzero(over)[-1]]))
    return worst


def exact_lower_bound(b, c, n: int, margin: float, alpha: float = 0.05):
    """Tango's lower bound at the exact critical value: L > −M exactly when the exact test PASSes at α.
    (Below the margin it is Tango's bound at that critical value, not an exact bound for other Δ₀.)"""
    _check_alpha(alpha)
    target = critical_value(n, round(margin, 12), alpha)
    delta_hat = (np.asarray(c, dtype=float) - np.asarray(b, dtype=float)) / n
    low = _tango_root(b, c, n, target, np.full_like(delta_hat, -1.0), delta_hat)
    return float(low) if np.ndim(low) == 0 else low
