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
and the supremum is then searched off the grid: a tail's mass is a smooth function of p_c with many
near-equal local maxima (at n = 1319, M = 1.5 pp, about one every 0.014), which a fixed grid can step over
(the 221-point one left a size of 2.519% at α = 2.5%, near p_c = 0.48). Around every local maximum of the
grid's values and the highest few, a bounded Brent search finds the peak, the mass summed exactly through
b ~ Bin(n, p_c + M) and c | b ~ Bin(n − b, p_c / (1 − p_c − M)) (no truncation). The tests check the size on
a fine grid of p_c. The reported bound ``exact_lower_bound`` is Tango's bound at the exact
critical value, so "L > −M" and "p_pass ≤ α" are the same statement.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import bdtrc, gammaln, xlogy
from scipy.stats import binom

from evalgate.stats.paired import _check_alpha, _tango_root, tango_z

TAIL = 1e-12  # probability left out of each count's range per nuisance value
TOP_SEARCHED = 12  # the grid's highest values whose neighbourhoods are searched, beside every local maximum
TIE = 1e-12  # Z values this close are one value (ties share a cell's Z up to rounding)


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
    out = [_law_at(n, margin, p_gained) for p_gained in nuisance_grid(margin)]
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _stacked_law(n: int, margin: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``null_law`` end to end: (every law's Z values, their CDFs each with a 0 before it, where each law's Z
    values begin, where each law's CDF begins, each law's total mass), for ``_tails`` to take all laws at
    once."""
    laws = null_law(n, margin)
    z = np.concatenate([law[0] for law in laws])
    cdf0 = np.concatenate([np.concatenate([[0.0], law[1]]) for law in laws])
    sizes = np.array([law[0].size for law in laws])
    z_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return z, cdf0, z_starts, z_starts + np.arange(sizes.size), np.array([law[1][-1] for law in laws])


def _tails(n: int, margin: float, z_obs) -> tuple[np.ndarray, np.ndarray]:
    """The grid's suprema: (max over the grid of P(Z ≥ z), max over the grid of P(Z ≤ z)) per z."""
    z_obs = np.atleast_1d(np.asarray(z_obs, dtype=float))
    z, cdf0, z_starts, cdf_starts, totals = _stacked_law(n, margin)
    if z_obs.size * z.size > 4_000_000:  # a whole table of Z values: one law at a time
        return _tails_by_law(n, margin, z_obs)
    # per law and z: the cells with Z < z_obs (below) and with Z ≤ z_obs (at or below), counted
    below = np.add.reduceat(z[None, :] < (z_obs - TIE)[:, None], z_starts, axis=1)
    at_or_below = np.add.reduceat(z[None, :] <= (z_obs + TIE)[:, None], z_starts, axis=1)
    upper = (totals[None, :] - cdf0[cdf_starts[None, :] + below]).max(axis=1)  # sup P(Z ≥ z)
    lower = cdf0[cdf_starts[None, :] + at_or_below].max(axis=1)  # sup P(Z ≤ z)
    return np.minimum(np.maximum(upper, 0.0), 1.0), np.minimum(np.maximum(lower, 0.0), 1.0)


def _tails_by_law(n: int, margin: float, z_obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_tails``, one law at a time (sorted search: no table of laws x z)."""
    upper = np.zeros_like(z_obs)  # sup P(Z ≥ z)
    lower = np.zeros_like(z_obs)  # sup P(Z ≤ z)
    for z, cdf in null_law(n, margin):
        total = cdf[-1]
        below = np.searchsorted(z, z_obs - TIE, side="left")  # cells with Z < z_obs
        at_or_below = np.searchsorted(z, z_obs + TIE, side="right")  # cells with Z ≤ z_obs
        cdf0 = np.concatenate([[0.0], cdf])
        upper = np.maximum(upper, total - cdf0[below])
        lower = np.maximum(lower, cdf0[at_or_below])
    return np.minimum(upper, 1.0), np.minimum(lower, 1.0)


def _first_c_above(n: int, margin: float, z0: float, strict: bool) -> np.ndarray:
    """Per b = 0..n: the smallest c with Z(b, c) > z0 (strict) or ≥ z0 − TIE, n − b + 1 when none (Z rises
    with c at fixed b). An integer bisection, vectorised over b."""
    b = np.arange(n + 1)
    lo, hi = np.zeros(n + 1, dtype=np.int64), n - b + 1
    while np.any(lo < hi):
        active = lo < hi
        mid = (lo + hi) // 2
        z = np.asarray(tango_z(-margin, b, np.minimum(mid, n - b), n), dtype=float)
        above = (z > z0 + TIE) if strict else (z >= z0 - TIE)
        hi = np.where(active & above, mid, hi)
        lo = np.where(active & ~above, mid + 1, lo)
    return lo


class _Tail:
    """One tail of a test, P(c ≥ first_c(b)) (upper) or P(c < first_c(b)), as a function of the nuisance
    value, summed exactly over the trinomial as b ~ Bin(n, p_gained + M), c | b ~ Bin(n − b, p_gained /
    (1 − p_gained − M)). What does not depend on the nuisance value is computed once."""

    def __init__(self, n: int, margin: float, first_c: np.ndarray, upper: bool):
        self.n, self.margin, self.upper = n, margin, upper
        self.b = np.arange(n + 1)
        self.log_choose = gammaln(n + 1) - gammaln(self.b + 1) - gammaln(n - self.b + 1)
        m = n - self.b
        # P(c ≥ k | b): 1 when k ≤ 0, 0 when k > m; bdtrc(k − 1, m, q) = P(c > k − 1) between
        self.inside = np.clip(first_c - 1, 0, np.maximum(m - 1, 0))
        self.m = m
        self.sure = np.where(first_c <= 0, 1.0, np.where(first_c > m, 0.0, np.nan))  # nan: bdtrc decides

    def _log_pmf(self, p_lost):
        return self.log_choose + xlogy(self.b, p_lost) + xlogy(self.m, 1 - p_lost)

    def mass(self, p_gained: float) -> float:
        p_lost = min(p_gained + self.margin, 1.0)
        log_pmf = self._log_pmf(p_lost)
        live = np.flatnonzero(log_pmf > np.log(TAIL) - 20)  # b's beyond carry < 1e-20 of the mass
        pmf = np.exp(log_pmf[live])
        given = min(p_gained / (1.0 - p_lost), 1.0) if p_lost < 1 else 0.0
        sure = self.sure[live]
        sf = np.where(np.isnan(sure), bdtrc(self.inside[live], self.m[live], given), sure)
        return float(np.dot(pmf, sf if self.upper else 1.0 - sf))

    def masses(self, grid: np.ndarray) -> np.ndarray:
        """``mass`` at every nuisance value of ``grid``, the same floats: the live (nuisance value, b) terms
        of the whole grid at once, then one dot product per nuisance value over its own terms."""
        p_lost = np.minimum(grid + self.margin, 1.0)
        log_pmf = self._log_pmf(p_lost[:, None])
        live = log_pmf > np.log(TAIL) - 20
        row, col = np.nonzero(live)  # row-major: each nuisance value's live b's ascending, as in ``mass``
        pmf = np.exp(log_pmf[row, col])
        with np.errstate(divide="ignore", invalid="ignore"):
            given = np.where(p_lost < 1, np.minimum(grid / (1.0 - p_lost), 1.0), 0.0)
        sure = self.sure[col]
        sf = np.where(np.isnan(sure), bdtrc(self.inside[col], self.m[col], given[row]), sure)
        tail = sf if self.upper else 1.0 - sf
        counts = live.sum(axis=1)
        ends = np.cumsum(counts)
        starts = ends - counts
        # copies: fresh arrays, as in ``mass``, so the BLAS dot product sums them the same way
        return np.array([float(np.dot(pmf[s:e].copy(), tail[s:e].copy())) for s, e in zip(starts, ends)])


def _supremum(n: int, margin: float, first_c: np.ndarray, upper: bool) -> tuple[float, float]:
    """(sup over p_c of a tail's mass, the p_c reaching it): the grid, then a bounded Brent search in the
    neighbourhood of every local maximum of the grid's values and of its TOP_SEARCHED highest points."""
    tail = _Tail(n, margin, first_c, upper)
    grid = nuisance_grid(margin)
    values = tail.masses(grid)
    inner = np.flatnonzero((values[1:-1] >= values[:-2]) & (values[1:-1] >= values[2:])) + 1
    seeds = set(inner.tolist()) | set(np.argsort(values)[-TOP_SEARCHED:].tolist())
    best, where = float(values.max()), float(grid[int(values.argmax())])
    for i in sorted(seeds):
        left, right = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
        found = minimize_scalar(lambda p: -tail.mass(p), bounds=(left, right), method="bounded",
                                options={"xatol": 1e-4 * (right - left)})
        if -float(found.fun) > best:
            best, where = -float(found.fun), float(found.x)
    return min(best, 1.0), where


@functools.lru_cache(maxsize=4096)
def _refined_tail(n: int, margin: float, z0: float, upper: bool) -> float:
    """sup P(Z ≥ z0) (upper) or sup P(Z ≤ z0), searched off the grid."""
    first_c = _first_c_above(n, margin, z0, strict=not upper)  # upper: Z ≥ z0; lower: Z ≤ z0 ⇔ not Z > z0
    return _supremum(n, margin, first_c, upper)[0]


def exact_pvalues(b, c, n: int, margin: float, refine: bool = True):
    """(p_pass, p_fail) of the observed (b, c): the exact unconditional p-values of H0: Δ ≤ −M (small: shown
    within the margin) and H0: Δ ≥ −M (small: shown worse than the margin). Vectorised over b and c.

    ``refine=False`` takes the supremum over the grid only (a lower bound of the exact p-value, never above
    it; fast for whole tables of cells); the gate decides with the refined one, which is never smaller."""
    z = np.atleast_1d(np.asarray(tango_z(-margin, b, c, n), dtype=float))
    upper, lower = _tails(n, margin, z)
    if refine:
        for i, value in enumerate(z):
            key = float(value)  # one search per distinct Z, shared across calls (not rounded: ties are 1e-12)
            upper[i] = max(upper[i], _refined_tail(n, round(margin, 12), key, True))
            lower[i] = max(lower[i], _refined_tail(n, round(margin, 12), key, False))
    if np.ndim(b) == 0 and np.ndim(c) == 0:
        return float(upper[0]), float(lower[0])
    return upper, lower


def _critical_at(law, alpha: float) -> float:
    """The largest Z that one nuisance value's law (Z ascending, its CDF) leaves with more than α at or
    above it; −inf when none."""
    z, cdf = law
    mass_at_or_above = cdf[-1] - np.concatenate([[0.0], cdf[:-1]])  # P(Z ≥ z_i) for each sorted cell
    over = mass_at_or_above > alpha + 1e-15
    # ties share a Z value: the last over-α cell is the largest Z that cannot reject
    return float(z[np.flatnonzero(over)[-1]]) if over.any() else -np.inf


def _law_at(n: int, margin: float, p_gained: float):
    b, c, pmf = _cells(n, p_gained + margin, p_gained)
    z = np.asarray(tango_z(-margin, b, c, n), dtype=float)
    order = np.argsort(z, kind="stable")
    return z[order], np.cumsum(pmf[order])


@functools.lru_cache(maxsize=1024)
def critical_value(n: int, margin: float, alpha: float) -> float:
    """The exact critical value of Z(−M) for PASS at level α: PASS ⇔ Z(−M) > critical_value. It is the
    largest Z some nuisance value leaves with more than α of its mass at or above it: the grid's, then
    raised at the searched peak of P(Z > it) while that peak is still over α."""
    _check_alpha(alpha)
    worst = max(_critical_at(law, alpha) for law in null_law(n, margin))
    while np.isfinite(worst):
        size, where = _supremum(n, margin, _first_c_above(n, margin, worst, strict=True), True)
        if size <= alpha + 1e-15:
            break
        raised = _critical_at(_law_at(n, margin, where), alpha)
        if raised <= worst:  # cannot happen in exact arithmetic: the peak's own law has > α above worst
            raise ArithmeticError(f"exact test: no critical value found at n = {n}, M = {margin}, α = {alpha}")
        worst = raised
    return worst


def exact_lower_bound(b, c, n: int, margin: float, alpha: float = 0.05):
    """Tango's lower bound at the exact critical value: L > −M exactly when the exact test PASSes at α.
    (Below the margin it is Tango's bound at that critical value, not an exact bound for other Δ₀.)"""
    _check_alpha(alpha)
    target = critical_value(n, round(margin, 12), alpha)
    delta_hat = (np.asarray(c, dtype=float) - np.asarray(b, dtype=float)) / n
    low = _tango_root(b, c, n, target, np.full_like(delta_hat, -1.0), delta_hat)
    return float(low) if np.ndim(low) == 0 else low
