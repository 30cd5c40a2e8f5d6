"""Multiple-comparison corrections over a family of per-task p-values (Holm, Bonferroni, none)."""

from __future__ import annotations

from typing import Mapping

from evalgate.stats.alpha import check_alpha as _check_alpha

def holm_adjusted(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm step-down adjusted p-values: p̃(j) = max_{i ≤ j} min(1, (K − i + 1)·p(i)).

    Reference: Holm (1979), "A simple sequentially rejective multiple test procedure", Scand. J. Statist.
    6:65–70.
    """
    order = sorted(pvalues, key=lambda name: (pvalues[name], name))
    k = len(order)
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (k - i) * pvalues[name]))
        adjusted[name] = running
    return {name: adjusted[name] for name in pvalues}  # in the caller's order


def holm(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Holm's procedure: sort p ascending, reject H(j) while p(j) ≤ α/(K − j + 1); returns name → rejected."""
    _check_alpha(alpha)
    order = sorted(pvalues, key=lambda name: (pvalues[name], name))
    k = len(order)
    rejected = {name: False for name in pvalues}
    for j, name in enumerate(order):  # j is 0-based, so the divisor is K − j
        if pvalues[name] <= alpha / (k - j):
            rejected[name] = True
        else:
            break  # step-down: stop at the first non-rejection
    return rejected


def bonferroni(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Bonferroni: reject when p ≤ α/K."""
    _check_alpha(alpha)
    k = len(pvalues)
    return {name: p <= alpha / k for name, p in pvalues.items()}


def unadjusted(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """No multiplicity correction: reject when p ≤ α."""
    _check_alpha(alpha)
    return {name: p <= alpha for name, p in pvalues.items()}


MULTIPLE_COMPARISONS = {"holm": holm, "bonferroni": bonferroni, "none": unadjusted}


def adjusted_pvalues(pvalues: Mapping[str, float], alpha: float, rule: str) -> tuple[dict[str, bool], dict[str, float]]:
    """(rejected at α, adjusted p-values) under ``rule``: "holm", "bonferroni" or "none"."""
    rejected = MULTIPLE_COMPARISONS[rule](pvalues, alpha)
    k = len(pvalues)
    if rule == "holm":
        adjusted = holm_adjusted(pvalues)
    elif rule == "bonferroni":
        adjusted = {name: min(1.0, k * p) for name, p in pvalues.items()}
    else:
        adjusted = dict(pvalues)
    return rejected, adjusted
