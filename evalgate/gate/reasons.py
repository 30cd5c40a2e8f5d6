"""The words of a verdict: why each task passed, failed or was inconclusive, in the units people read (pp,
items, p), and what the data can resolve."""

from __future__ import annotations

from evalgate.formatting import pp
from evalgate.gate.verdict import TaskDecision


def spec_failures(dec: TaskDecision) -> list[str]:
    out = []
    if dec.outcome.spec_degraded:
        out.append(f"{degradation_test(dec)} p = {dec.statistics.p_degradation:.4g} rejects at α = {dec.rule.alpha:g}")
    if not dec.non_inferior:
        out.append(f"L = {pp(dec.statistics.gate_lower)} ≤ -M = {pp(-dec.rule.margin)}")
    for check in (dec.checks.invalid, dec.checks.truncation):
        if check is not None and check.significant_at_alpha:
            out.append(f"{check.name} McNemar p = {check.p:.4g} ≤ α = {dec.rule.alpha:g}")
        if check is not None and check.over_raw_limit:
            out.append(f"{check.name} rise {pp(check.rise)} > {100 * check.limit:.2f} pp")
    return out


def inferiority_text(dec: TaskDecision) -> str:
    """The FAIL test in words: H0 "Δ ≥ −M", its p (raw and adjusted) against α_acc."""
    test = "exact unconditional test" if dec.statistics.n_samples == 1 else "score test (k samples)"
    rule = dec.outcome.multiple_comparisons if dec.outcome.n_tasks > 1 else "single task"
    return (f"{test} of Δ ≥ -M: p = {dec.statistics.p_inferior:.4g} (adjusted {dec.outcome.p_inferior_adjusted:.4g}, {rule}, "
            f"K = {dec.outcome.n_tasks}) {'≤' if dec.outcome.inferior else '>'} α = {dec.outcome.alpha_accuracy:.4g}")


def degradation_test(dec: TaskDecision) -> str:
    return "exact one-sided McNemar" if dec.statistics.n_samples == 1 else "exact one-sided sign-flip test"


def bound_name(dec: TaskDecision) -> str:
    level = f"{100 * (1 - dec.rule.alpha):.4g}%"
    if dec.statistics.n_samples == 1:
        return f"Tango one-sided {level} lower bound at the exact critical value"
    return f"score (k samples) one-sided {level} lower bound"


def structure_text(dec: TaskDecision) -> str:
    """n, k and ψ in words: what the resolution depends on."""
    k = "k = 1 (greedy)" if dec.statistics.n_samples == 1 else f"k = {dec.statistics.n_samples} samples per item"
    return f"n = {dec.statistics.counts.n}, {k} and ψ = {100 * dec.statistics.flip_rate:.2f}%"


def samples_text(dec: TaskDecision) -> str:
    """How many samples per item would resolve the margin, or why none would."""
    if dec.resolution.samples_needed is None:
        limit = f" (averaging samples cannot go below {100 * dec.resolution.mde_limit:.2f} pp)" if dec.resolution.mde_limit else ""
        return f"no k ≤ 64 resolves it at this n{limit}: add items"
    if dec.resolution.samples_needed <= dec.statistics.n_samples:
        return "more samples per item would not change that"
    how = ("at least: it assumes every item's variation averages out over samples"
           if dec.resolution.samples_needed_is_bound else "from the within-item variance of these runs")
    return f"use k ≥ {dec.resolution.samples_needed} samples per item ({how})"


def resolution_text(dec: TaskDecision) -> str:
    """The sentence every verdict carries: the minimum detectable effect at 80% power for n, k and ψ — an
    estimate, from this run's own ψ̂ (the MDE at the true ψ may be either side of it)."""
    mde = f"{100 * dec.resolution.mde:.2f} pp"
    power = f"{100 * dec.resolution.mde_power:g}%"
    how = {"exact": "exact at ψ̂", "score": "the score test at ψ̂"}.get(dec.resolution.mde_method, "normal approximation at ψ̂")
    if dec.resolves_margin:
        return (f"estimated resolvable: MDE ≈ {mde} at {power} power ({how}; {structure_text(dec)}), within M = "
                f"{100 * dec.rule.margin:.2f} pp")
    return (f"estimated not to resolve {100 * dec.rule.margin:.2f} pp at {structure_text(dec)}: MDE ≈ {mde} at "
            f"{power} power ({how}); {samples_text(dec)}")


def verdict_and_reasons(dec: TaskDecision) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The verdict, its reasons and the warnings the checks add; decide_overall redoes this after Holm."""
    fails: list[str] = []
    warnings: list[str] = []
    rule = dec.outcome.multiple_comparisons if dec.outcome.n_tasks > 1 else "single task"
    degraded = (f"{degradation_test(dec)} p = {dec.statistics.p_degradation:.4g} (adjusted {dec.outcome.p_degradation_adjusted:.4g}, "
                f"{rule}, K = {dec.outcome.n_tasks}) ≤ α = {dec.outcome.alpha_accuracy:g}; b = {dec.statistics.counts.b} lost, "
                f"c = {dec.statistics.counts.c} gained")
    not_shown = f"non-inferiority not shown: {bound_name(dec)} L = {pp(dec.statistics.gate_lower)} ≤ -M = {pp(-dec.rule.margin)}"
    if dec.rule.inconclusive:
        if dec.outcome.inferior:
            fails.append(f"shown worse than the margin: {inferiority_text(dec)}; Δ̂ = {pp(dec.statistics.delta)}, "
                         f"b = {dec.statistics.counts.b} lost, c = {dec.statistics.counts.c} gained")
        elif dec.outcome.degraded:
            warnings.append(f"worse than the baseline, not shown worse than the margin (not a FAIL): {degraded}")
    else:  # the original rule: either check fails on its own
        if dec.outcome.degraded:
            fails.append(f"accuracy degraded: {degraded}")
        if not dec.non_inferior:
            fails.append(f"{not_shown} ({resolution_text(dec)})")
    for check in (dec.checks.invalid, dec.checks.truncation):
        if check is None:
            continue
        rates = f"{100 * check.base_rate:.2f}% → {100 * check.cand_rate:.2f}% ({pp(check.rise)})"
        p_over = check.p if check.p_over_limit is None else check.p_over_limit
        test = "exact unconditional test" if dec.statistics.n_samples == 1 else "score test (k samples)"
        if dec.rule.alpha_split and check.failed:
            fails.append(f"{check.name} rate shown risen by more than the limit: {rates} > {100 * check.limit:.2f} pp, "
                         f"{test} of rise ≤ limit p = {p_over:.4g} ≤ α = {check.alpha:.4g}; "
                         f"{check.cand_count - check.base_count:g} net new items > {check.limit_items:.2f}")
        elif dec.rule.alpha_split and check.over_limit:
            warnings.append(f"{check.name} rate rose by more than the limit: {rates}, not shown above "
                            f"{100 * check.limit:.2f} pp ({test} of rise ≤ limit p = {p_over:.4g} > α = "
                            f"{check.alpha:.4g}; not a FAIL)")
        elif dec.rule.alpha_split and check.p <= check.alpha and check.rise > 0:
            warnings.append(f"{check.name} rate rose: {rates}, within the {100 * check.limit:.2f} pp limit (not a FAIL)")
        elif not dec.rule.alpha_split:  # the original rule: a significant rise, or one over the raw limit
            if check.significant_at_alpha:
                fails.append(f"{check.name} rate rose significantly: {rates}, exact one-sided McNemar p = "
                             f"{check.p:.4g} ≤ α = {dec.rule.alpha:g}")
            if check.over_raw_limit:
                fails.append(f"{check.name} rate rose by more than the limit: {rates} > {100 * check.limit:.2f} pp")
    if fails:
        return "FAIL", tuple(fails), tuple(warnings)
    if dec.rule.inconclusive and not dec.non_inferior:
        return "INCONCLUSIVE", (
            f"inconclusive: {not_shown}, and not shown worse than the margin ({inferiority_text(dec)}); "
            f"{resolution_text(dec)}"
            + ("" if not dec.resolves_margin else
               f" — a loss close to the margin, or chance: a candidate as good as the baseline lands here "
               f"about {100 * (1 - dec.resolution.mde_power):g}% of the time"),
        ), tuple(warnings)
    return "PASS", (
        f"non-inferior: {bound_name(dec)} L = {pp(dec.statistics.gate_lower)} > -M = {pp(-dec.rule.margin)}; no validity "
        f"rate shown risen; {resolution_text(dec)}",
    ), tuple(warnings)
