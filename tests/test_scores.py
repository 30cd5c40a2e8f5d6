"""Per-item scores that are means over k samples (docs/gate.md#k-samples), the A/A bound, the MDE, and the
pin that binary (greedy, k = 1) runs are decided exactly as before: McNemar and Tango, to rounding."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy.stats import beta, norm

from evalgate.gate.rule import GateRule, TaskData, TaskRule, decide_overall, decide_task, gate_levels
from evalgate.stats.margin import mde_binary, mde_normal, mde_score, project_samples, pooled_psi, psi_upper_bound
from evalgate.stats.paired import (Counts, mcnemar_exact_one_sided, mcnemar_exact_two_sided, mcnemar_mid_p_one_sided,
                                   tango_interval, tango_lower_bound, tango_upper_bound)
from evalgate.stats.scores import (item_differences, lattice_steps, score_interval, score_lower_bound,
                                   score_upper_bound, score_z, second_moment, signflip_pvalues, symmetrised)


RULE_FIELDS = set(TaskRule.__dataclass_fields__)


def decide(task, base=None, cand=None, **kwargs):
    """decide_task on ``TaskData(task, base, cand, ...)`` and ``TaskRule(...)``, the keywords split between them."""
    rule = TaskRule(**{k: v for k, v in kwargs.items() if k in RULE_FIELDS})
    return decide_task(TaskData(task, base, cand, **{k: v for k, v in kwargs.items() if k not in RULE_FIELDS}), rule)


def binary_diffs(b: int, c: int, n: int) -> np.ndarray:
    return np.array([-1.0] * b + [1.0] * c + [0.0] * (n - b - c))


# ---------------------------------------------------------------------------- k = 1 is McNemar and Tango


@pytest.mark.parametrize("b, c, n", [(0, 0, 164), (0, 5, 164), (5, 0, 164), (8, 5, 164), (16, 6, 161),
                                     (30, 25, 1319), (53, 0, 1319), (0, 40, 200), (90, 1, 164), (164, 0, 164)])
def test_generalised_statistics_are_mcnemar_and_tango_on_binary_scores(b, c, n):
    diffs = binary_diffs(b, c, n)
    for alpha in (0.05, 0.025, 0.10):
        assert score_lower_bound(diffs, alpha=alpha) == pytest.approx(tango_lower_bound(b, c, n, alpha), abs=2e-9)
        assert score_upper_bound(diffs, alpha=alpha) == pytest.approx(tango_upper_bound(b, c, n, alpha), abs=2e-9)
    assert score_interval(diffs) == pytest.approx(tango_interval(b, c, n), abs=2e-9)
    test = signflip_pvalues(lattice_steps(diffs, 1))
    assert test.p_lower == pytest.approx(mcnemar_exact_one_sided(b, c), rel=1e-12)
    assert test.p_mid == pytest.approx(mcnemar_mid_p_one_sided(b, c), rel=1e-12, abs=1e-15)
    assert test.p_two_sided == pytest.approx(mcnemar_exact_two_sided(b, c), rel=1e-12)
    # the same binary items written as k = 4 samples that all agree: the same numbers
    test4 = signflip_pvalues(lattice_steps(diffs, 4))
    assert test4.p_lower == pytest.approx(test.p_lower, rel=1e-12)
    assert second_moment(diffs) == pytest.approx((b + c) / n)


def independent_rule(b, c, n, margin, alpha=0.05, alpha_acc=0.04):
    """The documented rule on a binary table: PASS when the exact test of "Δ ≤ −M" rejects at α, FAIL when the
    exact test of "Δ ≥ −M" rejects at α_acc (tests/test_exact_ni.py checks those p-values by brute force)."""
    from evalgate.stats.exact_ni import exact_pvalues

    p_pass, p_fail = exact_pvalues(b, c, n, margin)
    if p_pass <= alpha:
        return "PASS"
    return "FAIL" if p_fail <= alpha_acc else "INCONCLUSIVE"


def test_greedy_decisions_pinned():
    # binary (k = 1) runs: the statistics are exactly today's (McNemar, Tango), and the verdict is the
    # documented function of them — here recomputed independently over a grid of tables, both task sizes
    for n, margin in ((1319, 0.015), (164, 0.05)):
        for b, c in itertools.product(range(0, 60, 7), range(0, 40, 6)):
            dec = decide("t", counts=Counts(a=n - b - c, b=b, c=c, d=0, n=n), margin=margin)
            assert dec.statistics.p_degradation == mcnemar_exact_one_sided(b, c)  # bit for bit
            assert dec.statistics.tango_lower == tango_lower_bound(b, c, n, 0.05)
            assert dec.outcome.verdict == independent_rule(b, c, n, margin), (n, b, c)
            # from per-item vectors, the same decision, field for field
            base = np.array([1] * b + [0] * c + [1] * (n - b - c))
            cand = np.array([0] * b + [1] * c + [1] * (n - b - c))
            assert decide("t", base, cand, margin=margin) == dec


def test_original_rule_decisions_pinned():
    # the original rule (every test at α, FAIL when non-inferiority is not shown) is unchanged
    spec = dict(alpha_split=False, inconclusive=False, min_rise_items=0)
    for n, margin in ((1319, 0.015), (164, 0.05)):
        for b, c in itertools.product(range(0, 60, 9), range(0, 40, 9)):
            dec = decide("t", counts=Counts(a=n - b - c, b=b, c=c, d=0, n=n), margin=margin, **spec)
            fail = mcnemar_exact_one_sided(b, c) <= 0.05 or tango_lower_bound(b, c, n) <= -margin
            assert dec.outcome.verdict == ("FAIL" if fail else "PASS") == dec.spec_verdict


def test_stored_greedy_runs_are_decided_as_their_aa_record_says():
    # canary baselines and their A/A run recorded before k-sample scores existed (greedy, schema 1): the
    # gate's numbers are the ones stored in aa.json when they were recorded
    from pathlib import Path

    from evalgate.canary import policy_for
    from evalgate.gate.decide import gate_runs
    from evalgate.gate.policy import load_thresholds
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run

    root = Path(__file__).resolve().parent / "fixtures" / "v1-baselines"

    dirs = sorted(p.parent for p in root.glob("*/*/w4a8/manifest.json"))
    assert len(dirs) == 2
    aa_run = dirs[0] / "aa"
    run = load_run(aa_run)
    verdict = gate_runs(load_baseline(dirs), run, load_thresholds(policy_for(run)))
    assert verdict.verdict == "PASS" and verdict.exit_code == 0
    for task, dec in verdict.decision.tasks.items():
        stored = json.loads((next(d for d in dirs if d.name == "w4a8" and (d / f"{task}.jsonl").exists())
                             / "aa.json").read_text())["tasks"][task]
        assert (dec.statistics.counts.b, dec.statistics.counts.c, dec.statistics.counts.n) == (stored["b"], stored["c"], stored["n"])
        assert f"L = {100 * dec.statistics.tango_lower:+.2f} pp" in stored["reasons"][0]
        assert dec.statistics.n_samples == 1 and dec.resolution.aa_n == stored["n"] and dec.resolution.aa_psi0 == 0.0
        assert dec.resolution.aa_psi0_upper == pytest.approx(1 - 0.05 ** (1 / stored["n"]))  # CP bound with 0 flips


# ---------------------------------------------------------------------------- per-item means over k samples


def test_item_differences_and_lattice():
    diffs = item_differences([1.0, 0.5, 0.25, 0.0], [0.75, 0.5, 1.0, 0.25])
    assert diffs == pytest.approx([-0.25, 0.0, 0.75, 0.25])
    assert list(lattice_steps(diffs, 4)) == [-1, 0, 3, 1]
    with pytest.raises(ValueError, match="not a multiple of 1/3"):
        lattice_steps(diffs, 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        item_differences([1.5], [1.0])


def brute_force_signflip(steps):
    steps = [s for s in steps if s]
    total = sum(steps)
    below = equal = 0
    for signs in itertools.product((1, -1), repeat=len(steps)):
        s = sum(sign * abs(x) for sign, x in zip(signs, steps))
        below += s < total
        equal += s == total
    count = 2 ** len(steps)
    return (below + equal) / count, (below + equal / 2) / count


def test_signflip_is_exact():
    rng = np.random.default_rng(5)
    for _ in range(30):
        steps = rng.integers(-4, 5, size=int(rng.integers(1, 13)))
        lower, mid = brute_force_signflip(steps.tolist())
        test = signflip_pvalues(steps)
        assert test.p_lower == pytest.approx(lower, abs=1e-12) and test.p_mid == pytest.approx(mid, abs=1e-12)
        assert test.p_upper == pytest.approx(signflip_pvalues(-steps).p_lower, abs=1e-12)


def k_sample_items(rng, n, k, p_items, divergence, shift=0.0):
    """Per item k coupled samples: a sample diverges with probability φ and is then redrawn at the
    candidate's pass rate p + shift (the simulation benchmark's model, docs/gate.md#k-samples)."""
    u = rng.random((n, k))
    y_base = u < p_items[:, None]
    diverge = rng.random((n, k)) < divergence[:, None]
    y_redraw = rng.random((n, k)) < np.clip(p_items + shift, 0, 1)[:, None]
    y_cand = np.where(diverge, y_redraw, y_base)
    return y_base.astype(float), y_cand.astype(float)


def test_k_sample_decision_aggregates_per_item():
    rng = np.random.default_rng(11)
    n, k = 164, 4
    p_items = rng.beta(0.4, 0.08, size=n)
    yb, yc = k_sample_items(rng, n, k, p_items, np.full(n, 0.3))
    base, cand = yb.mean(axis=1), yc.mean(axis=1)
    dec = decide("humaneval", base, cand, n_samples=k, base_samples=yb, cand_samples=yc, margin=0.05)
    diffs = cand - base
    assert dec.statistics.n_samples == k and dec.resolution.mde_method == "score"
    assert dec.statistics.delta == pytest.approx(diffs.mean()) and dec.statistics.flip_rate == pytest.approx(np.mean(diffs ** 2))
    assert dec.statistics.counts.b == np.sum(diffs < 0) and dec.statistics.counts.c == np.sum(diffs > 0) and dec.statistics.counts.n == n
    assert dec.statistics.tango_lower == pytest.approx(score_lower_bound(diffs, alpha=0.05))
    assert dec.statistics.p_degradation == pytest.approx(signflip_pvalues(lattice_steps(diffs, k)).p_lower)
    assert dec.statistics.newcombe_ci is None and dec.resolution.within_variance == pytest.approx(np.mean(np.var(yc - yb, axis=1, ddof=1)))
    assert dec.outcome.verdict in ("PASS", "INCONCLUSIVE") and "k = 4 samples per item" in dec.outcome.reasons[0]
    # items, not samples, are the unit: the same data as n·k "items" would claim far more precision
    flat = decide("humaneval", yb.ravel(), yc.ravel(), margin=0.05)
    assert flat.statistics.tango_ci[1] - flat.statistics.tango_ci[0] < dec.statistics.tango_ci[1] - dec.statistics.tango_ci[0]
    with pytest.raises(ValueError, match="multiple of 1/3"):
        decide("humaneval", base, cand, n_samples=3, margin=0.05)


def test_fractional_rate_checks():
    n = 200
    base = np.zeros(n)
    cand = np.zeros(n)
    cand[:40] = 0.5  # 40 items with 2 of 4 samples newly invalid: +20 items' worth
    scores = np.ones(n)
    dec = decide("gsm8k", scores, scores, n_samples=4, margin=0.03, base_invalid=base, cand_invalid=cand,
                      base_truncated=base, cand_truncated=base)
    assert dec.checks.invalid.cand_count == pytest.approx(20.0) and dec.checks.invalid.over_limit and dec.checks.invalid.significant
    assert dec.outcome.verdict == "FAIL" and "score test (k samples) of rise ≤ limit" in dec.outcome.reasons[0]
    assert dec.checks.invalid.p_over_limit < 1e-6 and dec.checks.invalid.p < dec.checks.invalid.p_over_limit  # shown above 1 pp too
    # the same rise within the limit (4 items' worth of 200, 2 pp limit): significant, not a FAIL
    small = np.zeros(n)
    small[:8] = 0.5
    within = decide("gsm8k", scores, scores, n_samples=4, margin=0.03, base_invalid=base, cand_invalid=small,
                    base_truncated=base, cand_truncated=base, max_invalid_rise=0.02)
    assert within.checks.invalid.p < 0.01 and not within.checks.invalid.failed and within.outcome.verdict == "PASS"


# ---------------------------------------------------------------------------- coverage and error rates, simulated


@pytest.mark.parametrize("k, shift", [(4, 0.0), (8, -0.12)])
def test_score_bound_coverage_with_k_samples(k, shift):
    # one-sided 95% lower bound for Δ, heterogeneous items, coupled samples: covers Δ ≥ ~95% of the time
    rng = np.random.default_rng(100 + k)
    n, reps = 164, 1500
    p_items = rng.beta(0.4, 0.08, size=n)
    phi = rng.beta(1.0, 2.0, size=n)
    truth = np.mean(phi * (np.clip(p_items + shift, 0, 1) - p_items))
    support = np.arange(-k, k + 1) / k
    counts = np.zeros((reps, support.size))
    for r in range(reps):
        yb, yc = k_sample_items(rng, n, k, p_items, phi, shift)
        steps = np.rint((yc.mean(axis=1) - yb.mean(axis=1)) * k).astype(int) + k
        counts[r] = np.bincount(steps, minlength=support.size)
    # L < Δ exactly when Z(Δ) < z (Z decreases in Δ₀): one evaluation per data set
    assert np.mean(score_z(support, counts, truth) < norm.ppf(0.95)) == pytest.approx(0.95, abs=0.025)
    lower = score_lower_bound(support, counts[:60], 0.05)
    margin = 0.03
    assert np.array_equal(lower > -margin, score_z(support, counts[:60], -margin) > norm.ppf(0.95))


@pytest.mark.parametrize("k, catastrophic, small", [(8, 0.05, 0.3), (4, 0.05, 0.5), (8, 0.03, 0.3)])
def test_score_bound_coverage_when_losses_hide_in_few_items(k, catastrophic, small):
    # the adversary of a variance-matched interval: a few items lose every sample while many move by one
    # sample either way. The restricted fit puts mass on the observed extreme, so coverage stays ≥ ~94%
    # (a Rao–Scott design-effect Tango interval covers 91% here).
    rng = np.random.default_rng(int(100 * catastrophic) + k)
    n, reps = 164, 2000
    values = np.array([-1.0, -1 / k, 1 / k, 0.0])
    probs = np.array([catastrophic, small / 2, small / 2, 1 - catastrophic - small])
    truth = float(values @ probs)
    draws = rng.choice(4, size=(reps, n), p=probs)
    support = np.arange(-k, k + 1) / k
    steps = np.rint(values[draws] * k).astype(int) + k
    counts = np.stack([np.bincount(row, minlength=support.size) for row in steps])
    assert np.mean(score_z(support, counts, truth) < norm.ppf(0.95)) >= 0.95 - 0.012


def test_degradation_test_false_fail_with_k_samples():
    # a candidate exchangeable with the baseline on every item: the exact sign-flip test rejects ≤ α
    rng = np.random.default_rng(7)
    n, k, reps = 164, 4, 800
    p_items = rng.beta(0.4, 0.08, size=n)
    rejections = 0
    for _ in range(reps):
        yb, yc = k_sample_items(rng, n, k, p_items, np.full(n, 0.4))
        rejections += signflip_pvalues(lattice_steps(yc.mean(axis=1) - yb.mean(axis=1), k)).p_lower <= 0.04
    assert rejections / reps <= 0.04 + 0.015


@pytest.mark.parametrize("n, psi", [(164, 0.005), (164, 0.04), (164, 0.085), (1319, 0.02), (1319, 0.04)])
def test_psi0_upper_bound_coverage_binary(n, psi):
    # one A/A run of n items: the one-sided 95% bound is ≥ the true flip rate at least 95% of the time
    rng = np.random.default_rng(int(psi * 1e4) + n)
    flips = rng.binomial(n, psi, size=4000)
    bounds = np.array([psi_upper_bound(x / n, n, 0.05) for x in flips])
    assert np.mean(bounds >= psi) >= 0.95 - 0.008
    # and the plug-in ψ̂₀ does not: it underestimates about half the time
    assert np.mean(flips / n >= psi) < 0.7


@pytest.mark.parametrize("k", [4, 8])
def test_psi0_upper_bound_coverage_k_samples(k):
    # ψ₀ = mean(D²) of an A/A pair with k coupled samples (a fractional "flip count"): coverage ≥ ~95%
    rng = np.random.default_rng(40 + k)
    n, reps = 164, 1500
    p_items = rng.beta(0.4, 0.08, size=n)
    phi = rng.beta(0.5, 2.0, size=n)
    truth = np.mean(phi * 2 * p_items * (1 - p_items) / k + 0.0)  # E[D²] with no per-item shift
    covered = 0
    for _ in range(reps):
        yb, yc = k_sample_items(rng, n, k, p_items, phi)
        covered += psi_upper_bound(second_moment(yc.mean(axis=1) - yb.mean(axis=1)), n, 0.05) >= truth
    assert covered / reps >= 0.95 - 0.015


def test_psi_bound_values_and_pooling():
    assert psi_upper_bound(0.0, 164) == pytest.approx(1 - 0.05 ** (1 / 164))
    assert psi_upper_bound(53 / 1319, 1319) == pytest.approx(beta.ppf(0.95, 54, 1319 - 53))
    assert psi_upper_bound(1.0, 10) == 1.0
    psi, n = pooled_psi([(0.04, 1319), (0.02, 1319)])
    assert (psi, n) == (pytest.approx(0.03), 2638)
    assert psi_upper_bound(psi, n) < psi_upper_bound(0.03, 1319)  # pooling narrows the bound
    with pytest.raises(ValueError):
        pooled_psi([])


# ---------------------------------------------------------------------------- the minimum detectable effect


def brute_pass_rate(psi, n, margin, alpha=0.05):
    from scipy.stats import multinomial

    total = 0.0
    top = int(n * psi) + 30
    for b in range(top):
        for c in range(top - b):
            pmf = multinomial.pmf([b, c, n - b - c], n, [psi / 2, psi / 2, 1 - psi])
            if pmf > 1e-14 and tango_lower_bound(b, c, n, alpha) > -margin:
                total += pmf
    return total


@pytest.mark.parametrize("psi, n", [(0.04, 164), (0.02, 164)])
def test_mde_binary_is_the_smallest_margin_with_80_percent_power(psi, n):
    mde = mde_binary(psi, n)
    assert brute_pass_rate(psi, n, mde) >= 0.8
    assert brute_pass_rate(psi, n, mde - 2e-6) < 0.8


def test_mde_values_and_normal_approximation():
    z = norm.ppf(0.95)
    assert mde_binary(0.0, 1319) == pytest.approx(z * z / (1319 + z * z), abs=2e-6)
    for psi, n, tol in ((0.04, 1319, 2e-4), (0.085, 1319, 2e-4), (0.04, 164, 3e-3), (0.085, 164, 3e-3)):
        support, weights = symmetrised(binary_diffs(int(round(psi * n / 2)), int(round(psi * n / 2)), n))
        approx = mde_normal(score_lower_bound(support, weights, 0.05), psi, n)
        assert approx == pytest.approx(mde_binary(psi, n), abs=tol)
    # the docs' rule of thumb (z_0.95 + z_0.8)·√(ψ/n) is close at n = 1319
    assert mde_binary(0.04, 1319) == pytest.approx(2.486 * math.sqrt(0.04 / 1319), abs=5e-4)


def test_the_k_sample_mde_holds_its_power_in_simulation():
    # HumanEval's n with k = 4 samples, a candidate exactly as good as the baseline (the symmetrised structure:
    # 2 items one sample better, 2 one sample worse), at the α of a second look: the gate PASSes (score bound
    # L > −MDE) with the MDE's promised 80%. L at mean 0 plus z_P·√(ψ/n) was 8% smaller and gave 75%.
    n, alpha, power = 164, 0.025, 0.8
    diffs = np.concatenate([[0.25, 0.25, -0.25, -0.25], np.zeros(n - 4)])
    support, weights = symmetrised(diffs)
    mde = mde_score(support, weights, alpha, power)
    draws = 10_000
    counts = np.random.default_rng(7).multinomial(n, weights / n, size=draws).astype(float)
    lower = score_lower_bound(support, counts, alpha)
    se = math.sqrt(power * (1 - power) / draws)
    assert power - 3 * se <= np.mean(lower > -mde) <= power + 0.03  # the promised power, not padded
    old = mde_normal(score_lower_bound(support, weights, alpha), float(np.mean(diffs ** 2)), n)
    assert np.mean(lower > -old) < power - 6 * se


def test_samples_needed_projection():
    # k = 1: everything assumed to average out, K = ceil((MDE/M)²), a lower bound
    k_needed, limit, bound = project_samples(0.065, 0.05, 0.085, 1, None)
    assert (k_needed, limit, bound) == (2, 0.0, True)
    # measured within-item variance: V(k') = B + W/k'
    k_needed, limit, bound = project_samples(0.06, 0.05, psi=0.02, k=4, within=0.04)
    b = 0.02 - 0.04 / 4
    assert not bound and limit == pytest.approx(0.06 * math.sqrt(b / 0.02))
    assert 0.06 * math.sqrt((b + 0.04 / k_needed) / 0.02) <= 0.05 < 0.06 * math.sqrt((b + 0.04 / (k_needed - 1)) / 0.02)
    # what averaging cannot remove: no k resolves a margin below the between-item limit
    assert project_samples(0.06, 0.01, psi=0.02, k=4, within=0.01)[0] is None


def test_inconclusive_message_names_the_samples_needed():
    dec = decide("humaneval", counts=Counts(a=130, b=8, c=5, d=21, n=164), margin=0.05)
    assert not dec.resolves_margin and dec.resolution.samples_needed == 2 and dec.resolution.samples_needed_is_bound
    overall = decide_overall([dec], GateRule())
    assert overall.exit_code == 3 and "use k ≥ 2 samples per item" in overall.reasons[0]


def test_gate_levels_unchanged():
    assert gate_levels(0.05, True, 0.01, 2, 4) == pytest.approx((0.04, 0.0025))


# ---------------------------------------------------------------------------- stored k-sample runs


def k_sample_runs(tmp_path, k=4, n=60, seed=3):
    """Synthetic stored runs whose GSM8K items carry k samples: the metric is the per-item mean,
    ``n_samples`` = k and ``samples`` the per-sample scores (what generation must write)."""
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", n, 0)
    rng = np.random.default_rng(seed)
    p_items = rng.beta(0.5, 0.1, size=n)
    yb, yc = k_sample_items(rng, n, k, p_items, np.full(n, 0.3))
    for run, y in ((base, yb), (cand, yc)):
        path = run / "gsm8k.jsonl"
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
        for r, ys in zip(sorted(records, key=lambda r: r["doc_id"]), y):
            r["exact_match,strict-match"] = float(ys.mean())
            r["n_samples"] = k
            r["samples"] = [{"seed": 1000 * r["doc_id"] + s, "exact_match,strict-match": float(v),
                             "invalid,strict-match": False, "finish_reason": "stop"} for s, v in enumerate(ys)]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["tasks"]["gsm8k"]["decoding"] = {"temperature": 0.8, "n_samples": k, "seed": 1234}
        (run / "manifest.json").write_text(json.dumps(manifest))
    return base, cand, yb, yc


def test_stored_k_sample_runs_gate_end_to_end(tmp_path):
    from evalgate.gate.compare import compare
    from evalgate.run.store import load_run
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.gate.policy import load_thresholds
    from evalgate.records import load_verdict
    from evalgate.report.outputs import write_outputs
    from evalgate.report.text import markdown
    from gate_helpers import policy

    base, cand, yb, yc = k_sample_runs(tmp_path)
    pairs = compare(load_run(base), load_run(cand)).pairs["gsm8k"]
    assert pairs.k == 4 and pairs.sample_scores("base") == yb.tolist()
    assert pairs.invalid("cand") == [0.0] * 60  # fractions of samples, not the first sample's flag
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=20.0)), allow_uncalibrated=True)
    dec = verdict.decision.tasks["gsm8k"]
    assert dec.statistics.n_samples == 4 and dec.statistics.delta == pytest.approx(np.mean(yc.mean(axis=1) - yb.mean(axis=1)))
    assert dec.resolution.within_variance is not None and not dec.resolution.samples_needed_is_bound
    paths = write_outputs(verdict, tmp_path / "rep")
    record = load_verdict(paths["json"]) if "json" in paths else load_verdict(tmp_path / "rep" / "gate.json")
    task = record.decision.tasks["gsm8k"]
    assert task.statistics.n_samples == 4 and task.resolution.mde == pytest.approx(dec.resolution.mde)
    assert task.rule.margin == pytest.approx(0.2)
    assert "MDE (80% power)" in markdown(verdict) and "(k = 4)" in markdown(verdict)


def test_runs_with_different_k_are_not_comparable(tmp_path):
    from evalgate.errors import NotComparable
    from evalgate.gate.compare import compare
    from evalgate.run.store import load_run

    base, cand, _, _ = k_sample_runs(tmp_path)
    path = cand / "gsm8k.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
    records[0]["n_samples"] = 8
    records[0]["samples"] = records[0]["samples"] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(NotComparable, match="different sample counts k"):
        compare(load_run(base), load_run(cand))
    records[0]["n_samples"] = 4
    records[0]["samples"] = records[0]["samples"][:4]
    records[0]["exact_match,strict-match"] = 0.3  # not a mean over 4 samples
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(NotComparable, match="not a mean over its k = 4"):
        compare(load_run(base), load_run(cand))


def test_inconclusive_verdict_is_a_valid_gate_json(tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.records import verdict_json
    from evalgate.report.text import junit_xml
    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", 60, 0, lost_every=12, gained_every=30)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    assert verdict.verdict == "INCONCLUSIVE" and verdict.exit_code == 3
    text = verdict_json(verdict.to_dict())
    assert '"verdict": "INCONCLUSIVE"' in text and '"exit_code": 3' in text
    assert 'type="INCONCLUSIVE"' in junit_xml(verdict)


def test_the_samples_advised_are_for_the_next_looks_alpha():
    """Issue 45, finding 7: "use k ≥ K" was computed at this look's α, but the round that takes K samples is
    the next look, at α/2 — at its own α the advice left 70-92% power. K is now projected from the MDE at α/2."""
    from evalgate.gate.rule import next_look_factor
    from evalgate.stats.margin import project_samples

    assert next_look_factor(0.025) == pytest.approx((norm.ppf(1 - 0.0125) + norm.ppf(0.8))
                                                    / (norm.ppf(1 - 0.025) + norm.ppf(0.8)))
    larger = 0
    for b in range(4, 20):
        dec = decide("humaneval", counts=Counts(130, b, 2, 32 - b, 164), margin=0.05, alpha=0.025)
        at_this_look, _, _ = project_samples(dec.resolution.mde, dec.rule.margin, dec.statistics.flip_rate, 1, None)
        assert dec.resolution.samples_needed == project_samples(dec.resolution.mde * next_look_factor(0.025), dec.rule.margin, dec.statistics.flip_rate,
                                                     1, None)[0]
        assert at_this_look is not None and dec.resolution.samples_needed >= at_this_look
        larger += dec.resolution.samples_needed > at_this_look
    assert larger >= 3
