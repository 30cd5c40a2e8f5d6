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
    assert dec.verdict != "PASS" and dec.gate_lower <= -0.03
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
            _, p_fail = exact_pvalues(b, c, n, margin)
            assert pmf[p_fail <= alpha].sum() <= alpha + 1e-9, (alpha, p_gained)
            # the p-value and the bound are the same statement
            p_pass, _ = exact_pvalues(b, c, n, margin)
            assert ((p_pass <= alpha) == passed).mean() > 0.999


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
        assert exact_pvalues(b, c, n, margin) == pytest.approx((upper, lower), abs=1e-9)


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
    _, p = exact_pvalues(b, c, n, margin)
    _, more_lost = exact_pvalues(b + 1, c, n, margin)
    _, more_gained = exact_pvalues(b, c + 1, n, margin)
    assert (more_lost <= p + 1e-12).all() and (more_gained >= p - 1e-12).all()
