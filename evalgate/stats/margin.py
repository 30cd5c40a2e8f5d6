"""The smallest non-inferiority margin that A/A noise lets a paired comparison demonstrate."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.special import gammaln, xlogy
from scipy.stats import binom

from evalgate.stats.paired import _check_alpha, tango_lower_bound


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
