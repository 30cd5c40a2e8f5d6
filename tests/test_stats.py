"""Gate statistics: against scipy/statsmodels, the test vectors (docs/gate.md#test-vectors) and worked examples (docs/gate.md#the-decision-rule)."""

import math

import numpy as np
import pytest
from scipy.stats import binomtest, norm
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from evalgate.gate.rule import GateRule, TaskData, TaskRule, decide_overall, decide_task, gate_levels
from evalgate.stats.multiplicity import holm, holm_adjusted
from evalgate.stats.paired import (
    Counts,
    mcnemar_exact_one_sided,
    mcnemar_exact_two_sided,
    mcnemar_mid_p_one_sided,
    newcombe_interval,
    paired_counts,
    tango_interval,
    tango_lower_bound,
    tango_upper_bound,
    tango_z,
    wald_interval,
)
from evalgate.stats.unpaired import unpaired_two_proportion

RULE_FIELDS = set(TaskRule.__dataclass_fields__)


def decide(task, base=None, cand=None, **kwargs):
    """decide_task on ``TaskData(task, base, cand, ...)`` and ``TaskRule(...)``, the keywords split between them."""
    rule = TaskRule(**{k: v for k, v in kwargs.items() if k in RULE_FIELDS})
    return decide_task(TaskData(task, base, cand, **{k: v for k, v in kwargs.items() if k not in RULE_FIELDS}), rule)


def combine(decisions, **gate):
    """decide_overall under the gate-wide settings ``gate`` (GateRule's fields; the others are ignored)."""
    return decide_overall(decisions, GateRule(**{k: v for k, v in gate.items() if k in GateRule.__dataclass_fields__}))


# ---------------------------------------------------------------------------- counts


def test_paired_counts_orientation():
    base = [1, 1, 1, 0, 0, 1]
    cand = [1, 0, 0, 1, 0, 1]
    assert paired_counts(base, cand) == Counts(a=2, b=2, c=1, d=1, n=6)
    counts = paired_counts([True] * 3, [False] * 3)
    assert (counts.b, counts.delta) == (3, -1.0)


def test_paired_counts_rejects_bad_input():
    with pytest.raises(ValueError, match="length"):
        paired_counts([1, 0], [1])
    with pytest.raises(ValueError, match="binary"):
        paired_counts([0.5, 1], [1, 1])


# ---------------------------------------------------------------------------- McNemar


def random_tables(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        b, c = rng.integers(0, 60, size=2)
        yield int(b), int(c)


def test_mcnemar_matches_scipy_and_statsmodels():
    for b, c in random_tables(200, seed=1):
        m = b + c
        one = mcnemar_exact_one_sided(b, c)
        two = mcnemar_exact_two_sided(b, c)
        if m == 0:
            assert one == two == 1.0
            continue
        assert one == pytest.approx(binomtest(b, m, 0.5, alternative="greater").pvalue, rel=1e-10)
        table = [[50, b], [c, 40]]
        assert two == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-10)
        assert two == pytest.approx(binomtest(b, m, 0.5).pvalue, rel=1e-9)


def test_mcnemar_edge_cases():
    assert mcnemar_exact_one_sided(0, 0) == 1.0
    assert mcnemar_exact_one_sided(0, 7) == 1.0
    # with m <= 4 p can never fall below 0.05 (docs/gate.md#mcnemar-test)
    assert min(mcnemar_exact_one_sided(b, m - b) for m in range(1, 5) for b in range(m + 1)) > 0.05
    assert mcnemar_exact_one_sided(5, 0) == pytest.approx(1 / 32)


def test_mcnemar_rejection_table_of_spec():
    # docs/gate.md#resolution: the smallest b that rejects at α = 0.05 given m discordant items
    for m, b_min in {5: 5, 10: 9, 20: 15, 40: 26, 80: 48, 130: 75}.items():
        assert mcnemar_exact_one_sided(b_min, m - b_min) <= 0.05
        assert mcnemar_exact_one_sided(b_min - 1, m - b_min + 1) > 0.05


def test_mid_p_is_below_exact_and_matches_definition():
    for b, c in random_tables(50, seed=2):
        m = b + c
        if m == 0:
            continue
        mid = mcnemar_mid_p_one_sided(b, c)
        assert mid <= mcnemar_exact_one_sided(b, c)
        direct = sum(math.comb(m, k) for k in range(b + 1, m + 1)) / 2**m + 0.5 * math.comb(m, b) / 2**m
        assert mid == pytest.approx(direct, rel=1e-9)


# ---------------------------------------------------------------------------- docs/gate.md#test-vectors test vectors

CAVO = dict(a=59, b=16, c=6, d=80)  # n = 161, Cavo et al. (2012), evalgate orientation


def test_spec_vectors_mcnemar():
    assert mcnemar_exact_one_sided(16, 6) == pytest.approx(0.026239, abs=5e-7)
    assert mcnemar_exact_two_sided(16, 6) == pytest.approx(0.052479, abs=5e-7)


def test_spec_vectors_intervals():
    n = 161
    assert (6 - 16) / n == pytest.approx(-0.0621, abs=5e-5)
    assert tango_interval(16, 6, n) == pytest.approx((-0.1240, -0.0054), abs=5e-5)
    assert newcombe_interval(**CAVO) == pytest.approx((-0.1186, -0.0046), abs=5e-5)
    assert wald_interval(16, 6, n) == pytest.approx((-0.1184, -0.0058), abs=5e-5)
    assert tango_lower_bound(16, 6, n) == pytest.approx(-0.1131, abs=5e-5)
    assert tango_interval(16, 6, n, sided="lower") == (pytest.approx(-0.1131, abs=5e-5), 1.0)


@pytest.mark.parametrize("n, expected", [(1319, -0.00205), (164, -0.01623)])
def test_tango_bound_with_no_discordant_items(n, expected):
    z = norm.ppf(0.95)
    bound = tango_lower_bound(0, 0, n)
    assert bound == pytest.approx(-(z**2) / (n + z**2), abs=1e-12)
    assert bound == pytest.approx(expected, abs=5e-6)
    assert tango_interval(0, 0, n, sided="upper")[1] == pytest.approx(z**2 / (n + z**2), abs=1e-12)


def test_tango_bound_solves_the_score_equation():
    z = norm.ppf(0.95)
    for b, c in random_tables(30, seed=3):
        n = b + c + 100
        lower = tango_lower_bound(b, c, n)
        assert -1 <= lower <= (c - b) / n
        if lower > -1 + 1e-9:
            assert float(tango_z(lower, b, c, n)) == pytest.approx(z, abs=1e-6)


def test_tango_vectorised_matches_scalar():
    b = np.array([16, 0, 30, 8, 3])
    c = np.array([6, 0, 25, 5, 9])
    bounds = tango_lower_bound(b, c, 500)
    assert bounds == pytest.approx([tango_lower_bound(int(x), int(y), 500) for x, y in zip(b, c)], abs=1e-14)


def test_newcombe_degenerate_tables_stay_in_range():
    for table in [(10, 0, 0, 0), (0, 0, 0, 10), (0, 5, 0, 0), (0, 0, 5, 0), (3, 0, 0, 7)]:
        lower, upper = newcombe_interval(*table)
        assert -1 <= lower <= upper <= 1


# ---------------------------------------------------------------------------- coverage by simulation


@pytest.mark.parametrize("n, psi, delta", [(1319, 0.04, 0.0), (1319, 0.02, -0.01), (164, 0.06, 0.0),
                                           (164, 0.10, -0.05)])
def test_tango_two_sided_coverage(n, psi, delta):
    rng = np.random.default_rng(20240601)
    p_b, p_c = (psi - delta) / 2, (psi + delta) / 2
    draws = rng.multinomial(n, [p_b, p_c, 1 - psi], size=4000)
    b, c = draws[:, 0], draws[:, 1]
    lower = tango_lower_bound(b, c, n, 0.025)
    upper = tango_upper_bound(b, c, n, 0.025)
    assert tango_interval(int(b[0]), int(c[0]), n) == (lower[0], upper[0])
    assert np.mean(lower < delta) == pytest.approx(0.975, abs=0.015)  # one-sided 97.5% bound
    assert np.mean((lower <= delta) & (delta <= upper)) == pytest.approx(0.95, abs=0.02)


def test_tango_one_sided_bound_keeps_non_inferiority_error():
    # At Δ = −M exactly, "L > −M" (a wrong PASS) must happen at most ~α of the time.
    rng = np.random.default_rng(7)
    n, psi, margin = 1319, 0.04, 0.015
    draws = rng.multinomial(n, [(psi + margin) / 2, (psi - margin) / 2, 1 - psi], size=5000)
    wrong_pass = np.mean(tango_lower_bound(draws[:, 0], draws[:, 1], n) > -margin)
    assert wrong_pass <= 0.05 + 0.01



# ---------------------------------------------------------------------------- Holm


def test_holm_hand_examples():
    # K = 3, α = 0.05: thresholds 0.0167, 0.025, 0.05
    assert holm({"x": 0.01, "y": 0.02, "z": 0.04}) == {"x": True, "y": True, "z": True}
    assert holm({"x": 0.01, "y": 0.03, "z": 0.04}) == {"x": True, "y": False, "z": False}
    assert holm({"x": 0.03, "y": 0.03, "z": 0.001}) == {"x": False, "y": False, "z": True}
    assert holm({"x": 0.02, "y": 0.02, "z": 0.001}) == {"x": True, "y": True, "z": True}
    # first step is Bonferroni: nothing below α/K means nothing rejected
    assert holm({"gsm8k": 0.03, "humaneval": 0.04}) == {"gsm8k": False, "humaneval": False}
    assert holm({"gsm8k": 0.024, "humaneval": 0.04}) == {"gsm8k": True, "humaneval": True}
    assert holm({"only": 0.05}) == {"only": True}


def test_holm_matches_statsmodels(monkeypatch):
    import gc

    # multipletests runs a full gc.collect() per call: 0.2-0.7 s each in a worker that holds models
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    rng = np.random.default_rng(4)
    for _ in range(100):
        k = int(rng.integers(1, 6))
        pvalues = {f"t{i}": float(p) for i, p in enumerate(rng.random(k) ** 3)}
        reject, adjusted, _, _ = multipletests(list(pvalues.values()), alpha=0.05, method="holm")
        assert list(holm(pvalues).values()) == list(reject)
        assert list(holm_adjusted(pvalues).values()) == pytest.approx(list(adjusted))


# ---------------------------------------------------------------------------- unpaired fallback, power


def test_unpaired_fallback_is_labelled_and_wider():
    result = unpaired_two_proportion(0.962, 1319, 0.966, 1319, margin=0.015)
    assert result.paired is False and result.to_dict()["paired"] is False
    assert result.delta == pytest.approx(0.004)
    assert result.ci[0] < result.lower_bound < result.delta < result.ci[1]
    assert result.non_inferior and result.p_degradation > 0.5
    worse = unpaired_two_proportion(0.90, 1319, 0.87, 1319, margin=0.015)
    assert not worse.non_inferior and worse.p_degradation < 0.01



# ---------------------------------------------------------------------------- decision rule (docs/gate.md#the-decision-rule)


def test_worked_example_gsm8k_pass():
    dec = decide("gsm8k", counts=Counts(a=1170, b=30, c=25, d=94, n=1319), margin=0.015)
    assert 100 * dec.statistics.delta == pytest.approx(-0.38, abs=0.005)
    assert dec.statistics.p_degradation == pytest.approx(0.295, abs=5e-4)
    assert 100 * dec.statistics.tango_lower == pytest.approx(-1.33, abs=0.005)
    assert dec.outcome.verdict == "PASS" and not dec.outcome.degraded and dec.non_inferior


def test_worked_example_humaneval_is_inconclusive():
    # docs/gate.md#worked-examples: L = −5.84 pp ≤ −5 pp, but McNemar p = 0.29: the data show neither
    # non-inferiority at 5 pp nor a degradation, and n = 164 greedy at ψ = 7.9% cannot resolve 5 pp
    dec = decide("humaneval", counts=Counts(a=130, b=8, c=5, d=21, n=164), margin=0.05)
    assert 100 * dec.statistics.delta == pytest.approx(-1.83, abs=0.005)
    assert dec.statistics.p_degradation == pytest.approx(0.291, abs=5e-4)
    assert 100 * dec.statistics.tango_lower == pytest.approx(-5.84, abs=0.005)
    assert dec.outcome.verdict == "INCONCLUSIVE" and not dec.outcome.degraded and not dec.non_inferior
    assert dec.rule.margin == 0.05  # never raised
    assert not dec.resolves_margin and dec.resolution.mde == pytest.approx(aa_mde_exact(13 / 164, 164), abs=1e-6)
    reason = dec.outcome.reasons[0]
    assert reason.startswith("inconclusive: non-inferiority not shown") and f"{100 * dec.statistics.gate_lower:.2f} pp" in reason
    assert "not shown worse than the margin" in reason
    # the MDE is an estimate from this run's own ψ̂, and the line says so
    assert "estimated not to resolve 5.00 pp at n = 164, k = 1 (greedy) and ψ = 7.93%" in reason
    assert f"MDE ≈ {100 * dec.resolution.mde:.2f} pp at 80% power (exact at ψ̂)" in reason
    assert "use k ≥ 2 samples per item" in reason
    overall = combine([
        decide("gsm8k", counts=Counts(a=1170, b=30, c=25, d=94, n=1319), margin=0.015), dec])
    assert overall.verdict == "INCONCLUSIVE" and overall.exit_code == 3
    assert overall.tasks["gsm8k"].outcome.verdict == "PASS"
    assert overall.reasons[0].startswith("humaneval: inconclusive")
    # the original rule (two outcomes) fails it for lack of evidence, as docs/gate.md's worked example says
    spec = decide("humaneval", counts=Counts(a=130, b=8, c=5, d=21, n=164), margin=0.05, **SPEC_RULE)
    assert spec.outcome.verdict == "FAIL" and spec.outcome.reasons[0].startswith("non-inferiority not shown")
    assert dec.spec_verdict == "FAIL" and any("the original rule" in w for w in dec.outcome.warnings)


def aa_mde_exact(psi, n, margin=0.05):
    from evalgate.stats.exact_ni import critical_value
    from evalgate.stats.margin import mde_binary

    return mde_binary(psi, n, 0.05, 0.8, critical_value(n, margin, 0.05))


def test_fail_means_shown_worse_than_the_margin():
    # issue 32, finding 3: FAIL is "shown worse than M" (H0 Δ ≥ −M rejected), not "worse than the baseline
    # and not shown within M". 20 lost, 4 gained of 164: McNemar p = 0.0008 (worse than the baseline), but a
    # loss of 9.8 pp is not shown beyond 5 pp: INCONCLUSIVE, with a warning (the rule before FAILed it)
    within = decide("humaneval", counts=Counts(a=120, b=20, c=4, d=20, n=164), margin=0.05)
    assert within.outcome.degraded and not within.non_inferior and not within.outcome.inferior
    assert within.outcome.verdict == "INCONCLUSIVE" and 0.04 < within.statistics.p_inferior < 0.1
    assert any(w.startswith("worse than the baseline, not shown worse than the margin") for w in within.outcome.warnings)
    # 30 lost, 4 gained: shown worse than 5 pp (exact p = 0.0006): FAIL (exit 1)
    dec = decide("humaneval", counts=Counts(a=110, b=30, c=4, d=20, n=164), margin=0.05)
    assert dec.outcome.inferior and not dec.non_inferior and dec.outcome.verdict == "FAIL"
    assert dec.outcome.reasons[0].startswith("shown worse than the margin: exact unconditional test of Δ ≥ -M: p = ")
    overall = combine([dec, decide("gsm8k", counts=Counts(a=1170, b=0, c=0, d=149, n=1319),
                                               margin=0.015)])
    assert overall.verdict == "FAIL" and overall.exit_code == 1


def test_degradation_within_the_margin_passes_with_a_warning():
    # n = 1319, 40 lost / 15 gained: Δ̂ = −1.9 pp, significantly worse (p = 0.0006) but L = −2.8 pp > −4 pp
    dec = decide("gsm8k", counts=Counts(a=1150, b=40, c=15, d=114, n=1319), margin=0.04)
    assert dec.outcome.degraded and dec.non_inferior and dec.outcome.verdict == "PASS"
    assert any(w.startswith("worse than the baseline, not shown worse than the margin") for w in dec.outcome.warnings)
    # the original rule fails it
    assert decide("gsm8k", counts=Counts(a=1150, b=40, c=15, d=114, n=1319), margin=0.04,
                       **SPEC_RULE).outcome.verdict == "FAIL"


def test_decide_task_from_vectors_equals_from_counts():
    rng = np.random.default_rng(9)
    base = rng.random(300) < 0.85
    cand = base ^ (rng.random(300) < 0.03)
    from_vectors = decide("t", base, cand, margin=0.05)
    from_counts = decide("t", counts=paired_counts(base, cand), margin=0.05)
    assert from_vectors == from_counts


def test_holm_turns_a_single_task_failure_into_inconclusive():
    # the test of "Δ ≥ −M": p = 0.030 (b = 30, c = 6, M = 1 pp) rejects alone at α_acc = 0.04 but not at
    # Holm's first step α_acc/2, so the FAIL depends on the correction across tasks.
    bad = Counts(a=1250, b=30, c=6, d=33, n=1319)
    clean = Counts(a=140, b=3, c=3, d=18, n=164)
    alone = decide("gsm8k", counts=bad, margin=0.01)
    assert 0.025 < alone.statistics.p_inferior <= 0.04
    assert alone.outcome.inferior and not alone.non_inferior and alone.outcome.verdict == "FAIL"
    overall = combine([alone, decide("humaneval", counts=clean, margin=0.10)])
    gsm = overall.tasks["gsm8k"]
    assert not gsm.outcome.inferior and gsm.outcome.verdict == "INCONCLUSIVE" and overall.verdict == "INCONCLUSIVE"
    assert gsm.outcome.p_inferior_adjusted == pytest.approx(2 * alone.statistics.p_inferior)
    assert gsm.outcome.n_tasks == 2 and gsm.outcome.multiple_comparisons == "holm"
    # with no correction the same data fail, and the reason says which rule was applied
    none = combine([alone, decide("humaneval", counts=clean, margin=0.10)], multiple_comparisons="none")
    assert none.verdict == "FAIL" and "Δ ≥ -M" in none.reasons[0] and "K = 2" in none.reasons[0]


def flags(n, on):
    out = np.zeros(n, dtype=bool)
    out[list(on)] = True
    return out


# the original rule (docs/gate.md#the-original-rule): every check at α, the requested margin, the raw 1 pp rate limit
SPEC_RULE = dict(alpha_split=False, inconclusive=False, min_rise_items=0)


def test_rate_gates_limit_and_significance():
    n = 1319
    counts = Counts(a=1187, b=0, c=0, d=132, n=n)
    base_invalid = flags(n, range(10))
    # +14 items = +1.06 pp: over the 1 pp limit (13.19 items), and McNemar p = 2^-14. The original rule FAILs
    # it; under one α a rise FAILs only when shown larger than the limit (issue 45: a kernel within the limit
    # must FAIL ≤ α), which +1.06 pp is not (p of "rise ≤ 1 pp" = 0.45)
    rest = dict(counts=counts, margin=0.015, base_invalid=base_invalid, base_truncated=flags(n, []),
                cand_truncated=flags(n, []))
    spec = decide("gsm8k", cand_invalid=flags(n, range(24)), **rest, **SPEC_RULE)
    assert spec.outcome.verdict == "FAIL" and spec.checks.invalid.over_raw_limit and spec.checks.invalid.significant_at_alpha
    assert spec.checks.invalid.p == pytest.approx(2.0**-14)
    dec = decide("gsm8k", cand_invalid=flags(n, range(24)), **rest)
    assert dec.outcome.verdict == "PASS" and dec.checks.invalid.over_limit and not dec.checks.invalid.significant
    assert dec.checks.invalid.p_over_limit == pytest.approx(0.448, abs=1e-3)
    assert any("not shown above 1.00 pp" in w for w in dec.outcome.warnings)
    # +24 items = +1.82 pp: shown above the limit at the check's share of α (p = 0.0045 ≤ 0.005)
    dec = decide("gsm8k", cand_invalid=flags(n, range(34)), **rest)
    assert dec.outcome.verdict == "FAIL" and dec.checks.invalid.significant and dec.checks.invalid.failed
    assert any(r.startswith("invalid rate shown risen by more than the limit") for r in dec.outcome.reasons)
    assert not dec.checks.truncation.failed
    # exactly the limit (1 of 100 items) is allowed; flags that move but do not rise pass
    dec = decide("t", counts=Counts(90, 0, 0, 10, 100), margin=0.05, base_invalid=flags(100, []),
                      cand_invalid=flags(100, [0]), base_truncated=flags(100, [1, 2]),
                      cand_truncated=flags(100, [3, 4]), **SPEC_RULE)
    assert not dec.checks.invalid.failed and not dec.checks.truncation.failed and dec.outcome.verdict == "PASS"


def test_rate_significance_uses_its_share_of_alpha():
    # +5 truncations = +0.38 pp, McNemar p = 1/32: significant at α (the original rule (docs/gate.md#the-original-rule)) but not at the rate
    # checks' share of the budget, α_validity / J = 0.01 / 2 for one task, 0.01 / 4 for two.
    n = 1319
    counts = Counts(a=1187, b=0, c=0, d=132, n=n)
    kwargs = dict(counts=counts, margin=0.015, base_truncated=flags(n, []), cand_truncated=flags(n, range(5)),
                  base_invalid=flags(n, range(10)), cand_invalid=flags(n, range(10)))
    spec = decide("gsm8k", **kwargs, **SPEC_RULE)
    assert spec.outcome.verdict == "FAIL" and spec.checks.truncation.significant_at_alpha and not spec.checks.truncation.over_limit
    assert any(r.startswith("truncation rate rose significantly") for r in spec.outcome.reasons)
    dec = decide("gsm8k", **kwargs)
    assert dec.checks.truncation.alpha == pytest.approx(0.005) and not dec.checks.truncation.significant
    assert dec.outcome.verdict == "PASS"
    # the spec check is still reported, and a warning says the original rule (docs/gate.md#the-original-rule) would fail
    assert dec.checks.truncation.significant_at_alpha and dec.spec_verdict == "FAIL"
    assert any("the original rule (docs/gate.md#the-original-rule)" in w and "truncation McNemar p = 0.03125" in w for w in dec.outcome.warnings)
    overall = combine([dec, decide("humaneval", counts=Counts(140, 0, 0, 24, 164), margin=0.05,
                                               base_invalid=flags(164, []), cand_invalid=flags(164, []),
                                               base_truncated=flags(164, []), cand_truncated=flags(164, []))])
    assert overall.tasks["gsm8k"].checks.truncation.alpha == pytest.approx(0.0025)
    assert overall.verdict == "PASS" and overall.spec_verdict == "FAIL"
    # a rise within the limit never FAILs, however significant: +12 items (0.91 pp), McNemar p = 2^-12
    within = decide("gsm8k", **{**kwargs, "cand_truncated": flags(n, range(12))})
    assert within.checks.truncation.p == pytest.approx(2.0**-12) and within.outcome.verdict == "PASS"
    assert any("within the 1.00 pp limit (not a FAIL)" in w for w in within.outcome.warnings)
    # one shown above the limit FAILs: +40 items (3.03 pp)
    big = decide("gsm8k", **{**kwargs, "cand_truncated": flags(n, range(40))})
    assert big.checks.truncation.significant and big.checks.truncation.over_limit and big.outcome.verdict == "FAIL"


def test_rate_limit_at_humaneval_size():
    # at n = 164 a 1 pp limit is 1.64 items: two net new invalid items (+1.22 pp) exceed it (the original rule (docs/gate.md#the-original-rule)),
    # which indicator noise alone does ~20% of the time; the item floor (min_rise_items = 4) needs 5
    kwargs = dict(counts=Counts(140, 0, 0, 24, 164), margin=0.05, base_invalid=flags(164, []),
                  base_truncated=flags(164, []), cand_truncated=flags(164, []))
    spec = decide("humaneval", cand_invalid=flags(164, [0, 1]), **kwargs, **SPEC_RULE)
    assert spec.checks.invalid.over_limit and not spec.checks.invalid.significant and spec.outcome.verdict == "FAIL"
    dec = decide("humaneval", cand_invalid=flags(164, [0, 1]), **kwargs)
    assert dec.checks.invalid.limit_items == 4 and not dec.checks.invalid.over_limit and dec.checks.invalid.over_raw_limit
    assert dec.outcome.verdict == "PASS" and dec.spec_verdict == "FAIL"
    four = decide("humaneval", cand_invalid=flags(164, range(4)), **kwargs)
    assert four.outcome.verdict == "PASS"
    # issue 32, finding 1: the absolute limit has no level, so under one α it warns; the exact test on the
    # discordant flags against the limit decides (5 new, 0 gone: p of "rise ≤ 1 pp" = 0.052 > α_validity/2)
    five = decide("humaneval", cand_invalid=flags(164, range(5)), **kwargs)
    assert five.checks.invalid.over_limit and not five.checks.invalid.significant and five.outcome.verdict == "PASS"
    assert any("invalid rate rose by more than the limit" in w and "not a FAIL" in w for w in five.outcome.warnings)
    # shown above the limit at its share (9 new: p = 0.0036): FAIL
    many = decide("humaneval", cand_invalid=flags(164, range(9)), **kwargs)
    assert many.checks.invalid.significant and many.outcome.verdict == "FAIL"


def test_gate_levels_split_the_budget():
    assert gate_levels(0.05, True, 0.01, 2, 4) == pytest.approx((0.04, 0.0025))
    assert gate_levels(0.05, True, 0.01, 1, 0) == pytest.approx((0.04, 0.01))
    assert gate_levels(0.05, False, 0.01, 2, 4) == (0.05, 0.05)
    with pytest.raises(ValueError, match="alpha_validity"):
        gate_levels(0.05, True, 0.05, 2, 4)


# ---------------------------------------------------------------------------- A/A margin floor, never raising the margin (docs/gate.md#margins-are-never-raised)


HE_EXAMPLE = Counts(a=130, b=8, c=5, d=21, n=164)
GSM_EXAMPLE = Counts(a=1170, b=30, c=25, d=94, n=1319)


def test_the_margin_is_never_raised_and_the_aa_noise_is_reported_with_its_bound():
    # before issue 14 an A/A ψ₀ of 4% raised M to 6.36 pp and passed this example; now M stays 5 pp,
    # and ψ₀ is reported with its one-sided 95% Clopper–Pearson bound and the items it rests on
    from scipy.stats import beta

    dec = decide("humaneval", counts=HE_EXAMPLE, margin=0.05, aa_psi0=0.04, aa_n=164)
    assert dec.rule.margin == 0.05
    assert dec.outcome.verdict == "INCONCLUSIVE"
    x = 0.04 * 164
    assert dec.resolution.aa_psi0_upper == pytest.approx(beta.ppf(0.95, x + 1, 164 - x)) and dec.resolution.aa_n == 164
    assert dec.resolution.aa_mde == pytest.approx(aa_mde_exact(round(dec.resolution.aa_psi0_upper, 9), 164))
    out = combine([decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015, aa_psi0=0.04, aa_n=1319),
                          dec]).to_dict()["tasks"]["humaneval"]
    for part, key in (("rule", "margin"), ("resolution", "mde"), ("resolution", "aa_psi0"),
                      ("resolution", "aa_psi0_upper"), ("resolution", "aa_n"), ("statistics", "n_samples")):
        assert key in out[part]
    assert "margin_requested" not in out and "margin_enforced" not in out  # one margin (issue 28)
    assert "margin_floor" not in out and "margin_raised_because" not in out
    # the verdict is the same with any ψ₀, or none: it never depends on the A/A estimate
    for psi0 in (None, 0.0, 0.01, 0.2):
        assert decide("humaneval", counts=HE_EXAMPLE, margin=0.05, aa_psi0=psi0,
                           aa_n=None if psi0 is None else 164).outcome.verdict == "INCONCLUSIVE"
    # a candidate that moves far more items than the A/A noise is named
    quiet = decide("humaneval", counts=HE_EXAMPLE, margin=0.05, aa_psi0=0.0, aa_n=164)
    assert any("moves more items than the baseline's own noise" in w and "(164 A/A items)" in w
               for w in quiet.outcome.warnings)


def test_a_stopped_early_candidate_is_compared_with_the_aa_noise_on_the_items_it_ran():
    # 40 items: the candidate ran the first 10 and moved none of them; its best completion counts the 30 others
    # right, so each of the 6 the baseline got wrong there looks like a gain (ψ = 15% over all 40)
    base = [1.0] * 34 + [0.0] * 6
    cand = [1.0] * 40
    run = [True] * 10 + [False] * 30
    noise = "moves more items than the baseline's own noise"
    everything = decide("gsm8k", base, cand, margin=0.03, aa_psi0=0.0, aa_n=200)
    assert any(noise in w for w in everything.outcome.warnings)
    on_run = decide("gsm8k", base, cand, margin=0.03, aa_psi0=0.0, aa_n=200, items_run=run)
    assert not any(noise in w for w in on_run.outcome.warnings)
    assert on_run.outcome.verdict == everything.outcome.verdict  # a warning only: the verdict never depends on it
    # a flip among the items run is still named, with the items it rests on
    moved = decide("gsm8k", [0.0] + base[1:], cand, margin=0.03, aa_psi0=0.0, aa_n=200, items_run=run)
    assert any(noise in w and "ψ = 10.00% on the 10 items run" in w for w in moved.outcome.warnings)
    with pytest.raises(ValueError, match="items_run has 3 entries for 40 items"):
        decide("gsm8k", base, cand, margin=0.03, aa_psi0=0.0, aa_n=200, items_run=[True] * 3)


def test_without_aa_data_nothing_changes_but_the_report():
    dec = decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015)
    assert dec.rule.margin == 0.015
    assert dec.resolution.aa_psi0 is None and dec.resolution.aa_psi0_upper is None and dec.resolution.aa_mde is None
    assert dec.outcome.verdict == decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015, aa_psi0=0.04, aa_n=1319).outcome.verdict
    dec = decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015, aa_psi0=0.04, aa_n=1000)
    assert any("A/A calibration covered 1000 items" in w for w in dec.outcome.warnings)


def test_spec_rule_reproduces_section_4_8_exactly():
    # with the split off, two outcomes and no item floor, both worked examples and their numbers are docs/gate.md#the-decision-rule's
    gsm = decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015, aa_psi0=0.04, aa_n=1319, **SPEC_RULE)
    he = decide("humaneval", counts=HE_EXAMPLE, margin=0.05, aa_psi0=0.04, aa_n=164, **SPEC_RULE)
    assert gsm.outcome.verdict == "PASS" and gsm.outcome.alpha_accuracy == 0.05 and gsm.rule.margin == 0.015
    assert he.outcome.verdict == "FAIL" and he.rule.margin == 0.05
    overall = combine([gsm, he], **SPEC_RULE)
    assert overall.verdict == overall.spec_verdict == "FAIL"
    assert overall.reasons[0].startswith("humaneval: non-inferiority not shown")


def test_decision_policies_must_agree_across_tasks():
    a = decide("t", counts=Counts(1, 0, 0, 0, 1), margin=0.01)
    b = decide("u", counts=Counts(1, 0, 0, 0, 1), margin=0.01, alpha_validity=0.02)
    with pytest.raises(ValueError, match="another policy than the gate's"):
        combine([a, b])
    with pytest.raises(ValueError, match="another policy than the gate's"):
        combine([a], alpha_validity=0.02)  # the gate's own policy decides, not the one read back from a task


def test_missing_flags_warn_and_tokens_warn_but_never_fail():
    counts = Counts(a=1170, b=30, c=25, d=94, n=1319)
    dec = decide("gsm8k", counts=counts, margin=0.015, base_tokens=[100] * 10, cand_tokens=[115] * 10)
    assert dec.outcome.verdict == "PASS"
    assert dec.checks.invalid is None and dec.checks.truncation is None
    assert any("mean generated tokens" in w and "115.0%" in w for w in dec.outcome.warnings)
    assert any("invalid rate not checked" in w for w in dec.outcome.warnings)
    dec = decide("gsm8k", counts=counts, margin=0.015, base_tokens=[100] * 10, cand_tokens=[108] * 10)
    assert dec.checks.tokens.ratio == pytest.approx(1.08) and not dec.checks.tokens.warn
    overall = combine([dec])
    assert overall.verdict == "PASS" and overall.exit_code == 0 and overall.warnings


def test_decision_serialises():
    dec = decide("gsm8k", counts=Counts(a=1170, b=30, c=25, d=94, n=1319), margin=0.015,
                      base_invalid=flags(1319, [1]), cand_invalid=flags(1319, [1, 2]),
                      base_truncated=flags(1319, []), cand_truncated=flags(1319, []))
    out = combine([dec]).to_dict()
    assert out["verdict"] == "PASS"
    task = out["tasks"]["gsm8k"]
    assert list(task) == ["task", "rule", "statistics", "checks", "resolution", "outcome"]
    assert task["statistics"]["counts"] == {"a": 1170, "b": 30, "c": 25, "d": 94, "n": 1319}
    assert task["checks"]["invalid"]["rise"] == pytest.approx(1 / 1319)
    assert task["rule"] == {**TaskRule(margin=0.015).to_dict(), "margin": 0.015} and task["outcome"]["verdict"] == "PASS"


def test_newcombe_is_reported_never_gated_on():
    # issue 32, finding 2: Newcombe's bound runs above α at the margin, so no rule gates on it
    counts = Counts(a=1170, b=30, c=25, d=94, n=1319)
    with pytest.raises(ValueError, match="reported only"):
        TaskRule(margin=0.015, ci_method="newcombe")
    dec = decide("gsm8k", counts=counts, margin=0.015)
    assert dec.statistics.newcombe_ci == newcombe_interval(1170, 30, 25, 94, 0.05)
    assert dec.statistics.newcombe_lower == newcombe_interval(1170, 30, 25, 94, 0.10)[0] and dec.statistics.gate_lower == dec.statistics.exact_lower


def test_decide_rejects_misuse():
    with pytest.raises(ValueError, match="give either"):
        TaskData("t")
    with pytest.raises(ValueError, match="not both"):
        TaskData("t", [1], [1], counts=Counts(1, 0, 0, 0, 1))
    a = decide("t", counts=Counts(1, 0, 0, 0, 1), margin=0.01, alpha=0.05)
    b = decide("u", counts=Counts(1, 0, 0, 0, 1), margin=0.01, alpha=0.10)
    with pytest.raises(ValueError, match="α"):
        combine([a, b])
    with pytest.raises(ValueError, match="α = 0.05"):
        combine([b])
    with pytest.raises(ValueError, match="duplicate"):
        combine([a, a])
    for bad in (dict(alpha_validity=0.05), dict(min_rise_items=-1), dict(margin=-0.01), dict(ci_method="wald"),
                dict(alpha=1.5)):
        with pytest.raises(ValueError):
            TaskRule(**{"margin": 0.01, **bad})
    for bad in (dict(aa_psi0=1.5), dict(aa_n=0), dict(items_run=[True])):
        with pytest.raises(ValueError):
            TaskData.from_counts("t", Counts(1, 0, 0, 0, 1), **bad)
    with pytest.raises(ValueError, match="n_samples"):
        decide_task(TaskData("t", [1.0], [1.0], n_samples=0), TaskRule(margin=0.01))


# ---------------------------------------------------------------------------- the decision's inputs and record (issue 28)


def test_decide_task_takes_the_data_and_one_rule():
    import inspect

    params = inspect.signature(decide_task).parameters
    assert list(params) == ["data", "rule"] and len(params) <= 6
    # the policy's settings for a task are one rule, built from the policy alone
    from evalgate.gate.policy import load_thresholds

    policy = load_thresholds()
    rule = TaskRule.from_policy(policy, "humaneval")
    assert rule == TaskRule(**policy.decision_kwargs("humaneval")) and rule.margin == pytest.approx(0.05)
    assert set(policy.decision_kwargs("humaneval")) == RULE_FIELDS
    assert rule.original() == TaskRule(**{**policy.decision_kwargs("humaneval"), **SPEC_RULE})
    # from counts and from the equivalent vectors: the same decision, with the hand-computed numbers
    by_counts = decide_task(TaskData.from_counts("humaneval", HE_EXAMPLE), TaskRule(margin=0.05))
    assert 100 * by_counts.statistics.tango_lower == pytest.approx(-5.84, abs=0.005) and by_counts.outcome.verdict == "INCONCLUSIVE"
    base = [1.0] * 138 + [0.0] * 26
    cand = [1.0] * 130 + [0.0] * 8 + [1.0] * 5 + [0.0] * 21
    assert decide_task(TaskData("humaneval", base, cand), TaskRule(margin=0.05)) == by_counts


def test_a_task_decision_carries_each_number_once():
    from dataclasses import fields

    from evalgate.gate.verdict import Checks, Outcome, Resolution, Statistics, TaskDecision

    parts = {"rule": TaskRule, "statistics": Statistics, "checks": Checks, "resolution": Resolution, "outcome": Outcome}
    assert [f.name for f in fields(TaskDecision)] == ["task", *parts]
    names = [f.name for part in parts.values() for f in fields(part)]
    assert len(names) == len(set(names))  # no field in two parts
    assert "margin" in names and not set(names) & {"margin_requested", "margin_enforced", "spec_non_inferior"}
    # the policy's settings are the rule, once: not copied beside the statistics
    assert not set(names) & {"inconclusive_enabled", "data_warnings"}
    # what follows from other fields is derived, and still written for gate.json's readers
    assert not set(names) & {"gate_lower", "non_inferior", "resolves_margin"}
    dec = decide("gsm8k", counts=GSM_EXAMPLE, margin=0.015)
    assert dec.rule == TaskRule(margin=0.015)
    out = dec.to_dict()
    assert out["statistics"]["gate_lower"] == dec.statistics.exact_lower
    assert out["outcome"]["non_inferior"] is True and out["resolution"]["resolves_margin"] is True
    assert out["rule"]["margin"] == 0.015 and "margin_requested" not in out["rule"]


def test_an_old_gate_json_with_three_margins_still_loads(tmp_path):
    import json
    from pathlib import Path

    from evalgate.records import load_verdict, verdict_json

    # a flat gate.json as evalgate wrote it (tests/fixtures/gate-json-flat), with the margin three times as
    # evalgate wrote it before issue 28
    old = json.loads((Path(__file__).parent / "fixtures" / "gate-json-flat" / "gate.json").read_text())
    task = old["decision"]["tasks"]["humaneval"]
    task.update(margin_requested=0.05, margin_enforced=0.05)
    for version in (None, 2, 3):
        data = {k: v for k, v in old.items() if k != "schema_version"} if version is None else \
            {**old, "schema_version": version}
        (tmp_path / "gate.json").write_text(json.dumps(data))
        record = load_verdict(tmp_path / "gate.json")
        read = record.decision.tasks["humaneval"]
        assert read.rule.margin == 0.05 and read.outcome.verdict == "INCONCLUSIVE"
        assert "margin_requested" not in str(read.model_dump()) and "margin_enforced" not in str(read.model_dump())
        assert record.as_read == data  # the file as it is on disk
    # a file with only the old fields: its margin is theirs
    del task["margin"]
    (tmp_path / "gate.json").write_text(json.dumps(old))
    assert load_verdict(tmp_path / "gate.json").decision.tasks["humaneval"].rule.margin == 0.05
    # what is written now: one margin, in the rule
    dec = decide("humaneval", counts=HE_EXAMPLE, margin=0.05)
    new = {"verdict": "INCONCLUSIVE", "exit_code": 3,
           "thresholds": {"alpha": 0.05, "multiple_comparisons": "holm", "ci_method": "tango"},
           "decision": combine([dec]).to_dict()}
    written = json.loads(verdict_json(new))["decision"]["tasks"]["humaneval"]
    assert written["rule"]["margin"] == 0.05 and "margin_requested" not in str(written)
    assert "margin_enforced" not in str(written)


@pytest.mark.slow
def test_flag_noise_alone_fails_a_healthy_task_at_most_the_checks_share():
    # issue 32, finding 1: symmetric noise of r = 6% on the invalid flags, no accuracy change, n = 164. The
    # task's FAIL probability, summed exactly over (new, gone), is the check's share α_validity/J = 0.005;
    # the absolute limit (FAIL above max(1 pp·n, 4) net new items) alone used to fail 7.4%.
    from scipy.stats import multinomial

    n, r = 164, 0.06
    fail = limit = 0.0
    left_out = 1.0  # the mass of the (new, gone) not decided, counted as FAILs: an upper bound of the FAIL rate
    for new in range(0, 31):
        for gone in range(0, 31 - new):
            mass = multinomial.pmf([new, gone, n - new - gone], n, [r / 2, r / 2, 1 - r])
            if mass < 1e-7:
                continue
            left_out -= mass
            dec = decide("humaneval", counts=Counts(140, 0, 0, 24, n), margin=0.05, base_invalid=flags(n, range(gone)),
                         cand_invalid=flags(n, range(gone, gone + new)), base_truncated=flags(n, []),
                         cand_truncated=flags(n, []))
            fail += mass * (dec.outcome.verdict == "FAIL")
            limit += mass * dec.checks.invalid.over_limit
    assert fail + left_out <= 0.005 and limit > 0.07


def test_a_rise_within_the_limit_fails_at_most_its_alpha():
    """Issue 45, finding 3: GSM8K 30 lost / 20 gained with the 10 net lost answers new invalid ones (+0.76 pp,
    below the 1 pp limit) FAILed on the invalid rate. The check now tests "rise ≤ limit": it does not FAIL
    there, and a kernel at −M/2 whose net lost answers are all invalid FAILs it ≤ its α (simulated)."""
    n = 1319
    dec = decide("gsm8k", counts=Counts(1100, 30, 20, 169, n), margin=0.015, base_invalid=flags(n, []),
                 cand_invalid=flags(n, range(10)), base_truncated=flags(n, []), cand_truncated=flags(n, []))
    assert dec.checks.invalid.p < 0.005 and not dec.checks.invalid.significant and dec.outcome.verdict != "FAIL"
    from evalgate.gate.rule import _rate_check

    rng = np.random.default_rng(45)
    psi, delta, reps = 0.04, 0.0075, 20_000
    lost = rng.binomial(n, psi / 2 + delta / 2, size=reps)
    # each lost item's answer is invalid with the chance that makes the expected rise the net loss
    new_invalid = rng.binomial(lost, delta / (psi / 2 + delta / 2))
    values, times = np.unique(new_invalid, return_counts=True)
    fails = sum(t for v, t in zip(values, times)
                if _rate_check("invalid", flags(n, []), flags(n, range(v)), 0.005, 0.01, 4).failed)
    assert fails / reps <= 0.005  # the check's level, α_validity / 2; the issue measured 19.5%
    assert _rate_check("invalid", flags(n, []), flags(n, range(40)), 0.005, 0.01, 4).failed  # +3 pp is caught
