"""The words of a verdict: why each task passed or failed, in the units people read (pp, items, p)."""

from __future__ import annotations

from evalgate.formatting import pp
from evalgate.gate.verdict import TaskDecision


def spec_failures(dec: TaskDecision) -> list[str]:
    out = []
    if dec.spec_degraded:
        out.append(f"McNemar p = {dec.p_degradation:.4g} rejects at α = {dec.alpha:g}")
    if not dec.spec_non_inferior:
        out.append(f"L = {pp(dec.gate_lower)} ≤ -M = {pp(-dec.margin_requested)}")
    for check in (dec.invalid, dec.truncation):
        if check is not None and check.significant_at_alpha:
            out.append(f"{check.name} McNemar p = {check.p:.4g} ≤ α = {dec.alpha:g}")
        if check is not None and check.over_raw_limit:
            out.append(f"{check.name} rise {pp(check.rise)} > {100 * check.limit:.2f} pp")
    return out


def margin_text(dec: TaskDecision) -> str:
    text = f"-M = {pp(-dec.margin)}"
    if dec.margin_raised_because:
        text += (f" (M raised from {100 * dec.margin_requested:.2f} pp to {100 * dec.margin:.2f} pp: "
                 f"{dec.margin_raised_because})")
    return text


def verdict_and_reasons(dec: TaskDecision) -> tuple[str, tuple[str, ...]]:
    """Build the verdict and reasons from a decision's checks, so decide_overall can redo them after Holm."""
    fails: list[str] = []
    if dec.degraded:
        rule = dec.multiple_comparisons if dec.n_tasks > 1 else "single task"
        fails.append(
            f"accuracy degraded: exact one-sided McNemar p = {dec.p_degradation:.4g} "
            f"(adjusted {dec.p_degradation_adjusted:.4g}, {rule}, K = {dec.n_tasks}) ≤ α = {dec.alpha_accuracy:g}; "
            f"b = {dec.counts.b} lost, c = {dec.counts.c} gained"
        )
    level = f"{100 * (1 - dec.alpha):g}%"
    if not dec.non_inferior:
        fails.append(
            f"non-inferiority not shown: {dec.ci_method.title()} one-sided {level} lower bound "
            f"L = {pp(dec.gate_lower)} ≤ {margin_text(dec)}"
        )
    for check in (dec.invalid, dec.truncation):
        if check is None:
            continue
        rates = f"{100 * check.base_rate:.2f}% → {100 * check.cand_rate:.2f}% ({pp(check.rise)})"
        if check.significant:
            fails.append(f"{check.name} rate rose significantly: {rates}, exact one-sided McNemar p = "
                         f"{check.p:.4g} ≤ α = {check.alpha:.4g}")
        if check.over_limit:
            fails.append(f"{check.name} rate rose by more than the limit: {rates}, "
                         f"{check.cand_count - check.base_count} net new items > max({100 * check.limit:.2f} pp "
                         f"of n, {check.min_items} items) = {check.limit_items:.2f}")
    if fails:
        return "FAIL", tuple(fails)
    return "PASS", (
        f"non-inferior: {dec.ci_method.title()} one-sided {level} lower bound L = {pp(dec.gate_lower)} > "
        f"{margin_text(dec)}; no significant degradation (McNemar p = {dec.p_degradation:.4g}, "
        f"α = {dec.alpha_accuracy:g}); validity rates within limits",
    )
