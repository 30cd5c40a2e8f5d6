"""The exact level at the margin (issue 32, finding 2): PASS and FAIL of a binary task keep their α at every n
the gate runs at, summed exactly over the trinomial law of (b, c) — including nuisance values off the grid the
critical values are computed on — and Newcombe's bound, which does not, decides nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from evalgate.canary import THRESHOLDS as CANARY_POLICY
from evalgate.errors import UserError
from evalgate.gate.policy import load_thresholds, parse_thresholds
from evalgate.gate.rule import TaskData, TaskRule, decide_task
from evalgate.stats.exact_ni import exact_lower_bound, exact_pvalues, nuisance_grid
from evalgate.stats.paired import Counts, tango_lower_bound, tango_z


def trinomial(n: int, p_lost: float, p_gained: float):
    """Every (b, c) and its probability, from two binomials (independent of evalgate's own sums)."""
    b, c = (x.ravel() for x in np.meshgrid(np.arange(n + 1), np.arange(n + 1)))
    keep = b + c <= n
    b, c = b[keep], c[keep]
    p_moved = p_lost + p_gained
    pmf = binom.pmf(b + c, n, p_moved) * (binom.pmf(b, b + c, p_lost / p_moved) if p_moved > 0 else (b == 0))
    return b, c, pmf


def test_the_canary_cell_that_passed_a_kernel_3pp_worse_does_not_pass():
    # Tango's L(2, 0; 200) = −2.977 pp > −3 pp: the canary's GSM8K rule passed it, and a kernel losing 3% of
    # its items with no gains PASSed 5.9% of the time
    assert tango_lower_bound(2, 0, 200) > -0.03
    rule = TaskRule.from_policy(load_thresholds(CANARY_POLICY), "gsm8k")
    dec = decide_task(TaskData.from_counts("gsm8k", Counts(a=194, b=2, c=0, d=4, n=200)), rule)
    assert dec.outcome.verdict != "PASS" and dec.statistics.gate_lower <= -0.03
    b, c, pmf = trinomial(200, 0.03, 0.0)
    assert pmf[tango_lower_bound(b, c, 200) > -0.03].sum() > 0.05  # the liberal cell, measured
    assert pmf[exact_lower_bound(b, c, 200, 0.03) > -0.03].sum() <= 0.05


@pytest.mark.parametrize("n, margin", [(200, 0.03), pytest.param(164, 0.05, marks=pytest.mark.slow),
                                       pytest.param(1319, 0.015, marks=pytest.mark.slow)])
def test_pass_and_fail_keep_their_level_at_the_margin_on_and_off_the_grid(n, margin):
    grid = nuisance_grid(margin)
    off = [0.0, 3.3e-5, 7.7e-4, 0.0123, 0.031, 0.137, 0.4]  # mostly between grid points
    assert any(not np.isclose(grid, p).any() for p in off)
    for alpha in (0.05, 0.0125):  # the first look's α and a later one's
        for p_gained in off:
            b, c, pmf = trinomial(n, p_gained + margin, p_gained)
            live = pmf > 1e-15
            b, c, pmf = b[live], c[live], pmf[live]
            passed = exact_lower_bound(b, c, n, margin, alpha) > -margin
            assert pmf[passed].sum() <= alpha + 1e-9, (alpha, p_gained)
            # the grid's p-values (refine=False) are never above the gate's refined ones: a level kept by
            # them is kept by the gate's
            _, p_fail = exact_pvalues(b, c, n, margin, refine=False)
            assert pmf[p_fail <= alpha].sum() <= alpha + 1e-9, (alpha, p_gained)
            # the p-value and the bound are the same statement
            p_pass, _ = exact_pvalues(b, c, n, margin, refine=False)
            assert ((p_pass <= alpha) == passed).mean() > 0.99
            differ = np.flatnonzero((p_pass <= alpha) != passed)[:20]  # the grid's p misses a peak off it
            if differ.size:
                assert ((exact_pvalues(b[differ], c[differ], n, margin)[0] <= alpha) == passed[differ]).all()


def test_exact_pvalues_are_the_supremum_of_brute_force_sums():
    n, margin = 25, 0.08
    cells = [(bb, cc) for bb in range(n + 1) for cc in range(n + 1 - bb)]
    zz = np.array([float(tango_z(-margin, bb, cc, n)) for bb, cc in cells])
    for b, c in ((0, 0), (1, 3), (5, 0), (2, 2), (9, 1)):
        z_obs = float(tango_z(-margin, b, c, n))
        upper = lower = 0.0
        for p_gained in nuisance_grid(margin):
            p_lost = p_gained + margin
            mass = np.array([math.comb(n, bb) * math.comb(n - bb, cc) * p_lost ** bb * p_gained ** cc
                             * (1 - p_lost - p_gained) ** (n - bb - cc) for bb, cc in cells])
            upper = max(upper, mass[zz >= z_obs - 1e-12].sum())
            lower = max(lower, mass[zz <= z_obs + 1e-12].sum())
        assert exact_pvalues(b, c, n, margin, refine=False) == pytest.approx((upper, lower), abs=1e-9)
        # off the grid the supremum is only higher, and no higher than a fine scan of p_c finds
        refined = exact_pvalues(b, c, n, margin)
        fine_upper = fine_lower = 0.0
        for p_gained in np.linspace(0.0, (1 - margin) / 2, 601):
            p_lost = p_gained + margin
            mass = np.array([math.comb(n, bb) * math.comb(n - bb, cc) * p_lost ** bb * p_gained ** cc
                             * (1 - p_lost - p_gained) ** (n - bb - cc) for bb, cc in cells])
            fine_upper = max(fine_upper, mass[zz >= z_obs - 1e-12].sum())
            fine_lower = max(fine_lower, mass[zz <= z_obs + 1e-12].sum())
        assert upper - 1e-12 <= refined[0] <= max(upper, fine_upper) + 1e-6
        assert lower - 1e-12 <= refined[1] <= max(lower, fine_lower) + 1e-6
        assert refined[0] >= fine_upper - 1e-6 and refined[1] >= fine_lower - 1e-6


def test_newcombe_cannot_be_the_deciding_method():
    text = load_thresholds().path
    yaml_text = open(text, encoding="utf-8").read().replace("ci_method: tango", "ci_method: newcombe")
    with pytest.raises(UserError) as err:
        parse_thresholds(yaml_text, "policy.yaml")
    message = str(err.value)
    assert "\n" not in message and "ci_method" in message and "no longer a deciding method" in message
    with pytest.raises(ValueError, match="reported only"):
        TaskRule(margin=0.015, ci_method="newcombe")


def test_the_fail_test_is_monotone_in_each_items_outcome():
    # what stopping early relies on (docs/gate.md#stopping-early): a lost item more never raises the p of
    # "Δ ≥ −M", a gained item more never lowers it — every table of n = 200, the canary's GSM8K
    n, margin = 200, 0.03
    b, c = (x.ravel() for x in np.meshgrid(np.arange(n + 1), np.arange(n + 1)))
    keep = b + c < n
    b, c = b[keep], c[keep]
    _, p = exact_pvalues(b, c, n, margin, refine=False)
    _, more_lost = exact_pvalues(b + 1, c, n, margin, refine=False)
    _, more_gained = exact_pvalues(b, c + 1, n, margin, refine=False)
    assert (more_lost <= p + 1e-12).all() and (more_gained >= p - 1e-12).all()


def size_on_a_fine_grid(n: int, margin: float, alpha: float, points: int = 4001) -> tuple[float, float]:
    """The largest P(PASS) under Δ = −M over a fine scan of p_c (with its p_c), summed exactly here as
    b ~ Bin(n, p_c + M), c | b ~ Bin(n − b, p_c / (1 − p_c − M)) over the gate's own PASS cells."""
    from evalgate.stats.exact_ni import critical_value

    crit = critical_value(n, margin, alpha)
    b = np.arange(n + 1)
    # PASS ⇔ Z(−M) > crit, Z rising in c: per b, the first passing c (n − b + 1 when none)
    first = np.array([np.searchsorted(np.asarray(tango_z(-margin, bb, np.arange(n - bb + 1), n)) > crit, True)
                      for bb in b])
    some = np.flatnonzero(first <= n - b)[:3]
    assert (exact_lower_bound(some, first[some], n, margin, alpha) > -margin).all()  # the gate's bound agrees
    top = (1 - margin) / 2
    p_gained = np.unique(np.concatenate([np.linspace(0, top, points), np.geomspace(1e-6, 0.05, 400)]))[:, None]
    p_lost = p_gained + margin
    given = np.minimum(p_gained / (1 - p_lost), 1.0)
    mass = binom.pmf(b, n, p_lost) * binom.sf(first - 1, n - b, given)
    size = mass.sum(axis=1)
    return float(size.max()), float(p_gained[size.argmax(), 0])


@pytest.mark.parametrize("n, margin, alpha", [(200, 0.015, 0.0125),
                                              pytest.param(1319, 0.015, 0.025, marks=pytest.mark.slow)])
def test_pass_keeps_its_size_between_the_grid_points(n, margin, alpha):
    # a 221-point grid of p_c stepped over the peak near p_c = 0.48: 1.2595% at n = 200, α/4 and 2.519% at
    # n = 1319, α/2 (GSM8K's 1.5 pp)
    size, where = size_on_a_fine_grid(n, margin, alpha)
    assert size <= alpha + 1e-12, (size, where)
    assert size > 0.9 * alpha  # and the test is not made conservative to get there
