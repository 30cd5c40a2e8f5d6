"""Two proportions from aggregate scores only (no per-item pairing): a much weaker comparison."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scipy.stats import norm

from evalgate.stats.paired import _check_alpha, wilson_interval

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
    so the shared item difficulty is not cancelled and the interval is several times wider (docs/gate.md#resolution: ±1.6 pp
    for GSM8K at 0.9 unpaired vs ~±1 pp paired). Use only when the baseline is a published score (docs/gate.md#aggregate-only-baselines).

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
    )
