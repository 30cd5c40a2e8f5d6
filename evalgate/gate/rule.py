"""The gate's decision rule for paired runs, as pure functions: one task (``decide_task``, on its paired data
``TaskData`` and the policy's ``TaskRule`` for it), then all tasks (``decide_overall``). The statistics come
from ``evalgate.stats``; the words a verdict gives come from ``evalgate.gate.reasons``. docs/gate.md explains the
rule and why it departs from the textbook one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from evalgate.gate.reasons import spec_failures, verdict_and_reasons
from evalgate.gate.settings import GateRule, TaskRule
from evalgate.gate.verdict import (Checks, Outcome, OverallDecision, RateCheck, Resolution, Statistics, TaskDecision,
                                   TokenCheck, overall_verdict)
from evalgate.stats.exact_ni import critical_value, exact_lower_bound, exact_pvalues
from evalgate.stats.margin import mde_binary, mde_score, project_samples, psi_upper_bound
from evalgate.stats.multiplicity import adjusted_pvalues
from evalgate.stats.paired import (Counts, _as_bool_vector, mcnemar_exact_one_sided,
                                   mcnemar_exact_two_sided, mcnemar_mid_p_one_sided, newcombe_interval,
                                   paired_counts, tango_interval, tango_lower_bound, wald_interval)
from evalgate.stats.scores import (as_score_vector, histogram, lattice_steps, score_interval, score_lower_bound,
                                   score_z, second_moment, signflip_pvalues, symmetrised, wald_interval_scores)
from scipy.stats import norm

__all__ = ["GateRule", "TaskData", "TaskRule", "decide_overall", "decide_task", "gate_levels"]

# --------------------------------------------------------------------------------------------------------
# One α for the whole gate (docs/gate.md#one-alpha)
# --------------------------------------------------------------------------------------------------------
#
# Per task three outcomes, each a statement about the margin M the policy names (never raised):
# - PASS: shown within M — H0 "Δ ≤ −M" rejected at α (k = 1: the exact unconditional test of Tango's statistic,
#   evalgate.stats.exact_ni; k > 1: the score interval's bound L > −M).
# - FAIL: shown worse than M — H0 "Δ ≥ −M" rejected at α_acc (Holm across tasks), or a validity rate shown
#   risen by more than its limit (the exact test of "rise ≤ limit" on the discordant flags at α_validity/J). So a
#   kernel whose loss is within M, and whose flags rise by no more than the limits, FAILs with probability
#   ≤ α_acc + α_validity ≤ α (at Δ = 0 and at every Δ ≥ −M): M is the loss the policy accepts.
# - INCONCLUSIVE: neither; the verdict says what margin the data resolve and how many samples would resolve M.
#
# - A candidate inferior by M or more on some task PASSes with probability ≤ α: each task's NI test is at
#   level α and PASS needs all of them (intersection–union, Berger 1982).
# - The exact McNemar / sign-flip degradation test ("worse than the baseline at all") is reported and warns;
#   it decides nothing. No part of the rule uses the A/A flip rate ψ₀.
#
# With alpha_split = False, inconclusive = False and min_rise_items = 0 the rule is the original one
# (docs/gate.md#the-original-rule): every test at α, and FAIL whenever non-inferiority is not shown.

POWER = 0.8  # the power at which the minimum detectable effect is reported


def gate_levels(alpha: float, alpha_split: bool, alpha_validity: float, n_tasks: int,
                n_rate_checks: int) -> tuple[float, float]:
    """(α_acc, α per rate check): the levels of the accuracy degradation tests and of each validity check.

    alpha_split=True: accuracy gets α − α_validity (Holm across tasks on top), and each of the
    ``n_rate_checks`` validity checks (all tasks together) gets α_validity / n_rate_checks (Bonferroni).
    alpha_split=False: the original rule (docs/gate.md#the-original-rule), every test at α.
    """
    if not alpha_split:
        return alpha, alpha
    if not 0.0 <= alpha_validity < alpha:
        raise ValueError(f"alpha_validity must be in [0, alpha = {alpha}), got {alpha_validity}")
    return alpha - alpha_validity, alpha_validity / max(n_rate_checks, 1)


def _flag_vector(values, name: str) -> tuple[np.ndarray, bool]:
    """Per-item flags as floats, and whether they are binary (k = 1) or fractions of an item's samples."""
    arr = np.asarray(values)
    if arr.dtype == bool or (arr.size and np.isin(arr, (0, 1)).all()) or not arr.size:
        return _as_bool_vector(values, name).astype(float), True
    return as_score_vector(values, name), False


def _rate_check(name: str, base_flags, cand_flags, alpha: float, limit: float, min_items: int,
                n_samples=1) -> RateCheck:
    base_arr, base_binary = _flag_vector(base_flags, f"base_{name}")
    cand_arr, cand_binary = _flag_vector(cand_flags, f"cand_{name}")
    if base_arr.shape != cand_arr.shape:
        raise ValueError(f"{name} flags differ in length: base {base_arr.size}, cand {cand_arr.size}")
    rise = cand_arr - base_arr  # > 0: newly flagged
    new: float  # whole items (binary flags) or fractions of an item's samples
    gone: float
    base_count: float
    cand_count: float
    if base_binary and cand_binary:
        new, gone = int(np.sum(rise > 0)), int(np.sum(rise < 0))
        p = mcnemar_exact_one_sided(new, gone)
        # "risen by more than the limit": new flags are the losses, gone ones the gains of the paired NI test
        p_over = (1.0 if limit >= 1 else  # a rise above 100% cannot be shown
                  exact_pvalues(new, gone, int(rise.size), round(limit, 12))[1] if limit > 0 else p)
        base_count, cand_count = int(base_arr.sum()), int(cand_arr.sum())
    else:  # fractions of an item's samples: the exact sign-flip test on the per-item rise
        p = signflip_pvalues(lattice_steps(rise, n_samples)).p_upper
        p_over = 1.0 if limit >= 1 else _score_pvalues(-rise, limit)[1] if limit > 0 and np.any(rise != 0) else p
        new, gone = float(rise[rise > 0].sum()), float(-rise[rise < 0].sum())
        base_count, cand_count = float(base_arr.sum()), float(cand_arr.sum())
    check = RateCheck(name, base_count, cand_count, int(base_arr.size), p, limit, p_over <= alpha, False,
                      alpha=alpha, min_items=min_items, new_count=new, gone_count=gone, p_over_limit=p_over)
    return _judge_rate(check, alpha, alpha)


def _judge_rate(check: RateCheck, alpha_check: float, alpha: float) -> RateCheck:
    rise_items = check.cand_count - check.base_count
    # compare counts, not float rates, so a rise of exactly the limit is not failed by rounding
    p_fail = check.p if check.p_over_limit is None else check.p_over_limit  # an old record: the rise test
    return replace(
        check,
        alpha=alpha_check,
        significant=p_fail <= alpha_check,
        over_limit=bool(rise_items > check.limit_items + 1e-9),
        significant_at_alpha=check.p <= alpha,
        over_raw_limit=bool(rise_items > check.limit * check.n + 1e-9),
    )


# the start of the warning that the candidate's flip rate is over the A/A record's upper bound
NOISE_WARNING = "the candidate moves more items than the baseline's own noise"


def _finalise(dec: TaskDecision, *, gate: GateRule, n_tasks: int, n_rate_checks: int, degraded: bool,
              p_adjusted: float, spec_degraded: bool, inferior: bool, p_inferior_adjusted: float) -> TaskDecision:
    """Apply the levels for K tasks and J rate checks: rate significance, verdict, reasons.

    decide_task calls this with K = 1 (the task alone); decide_overall redoes it with the real K and J.
    """
    alpha_acc, alpha_rate = gate_levels(gate.alpha, gate.alpha_split, gate.alpha_validity, n_tasks, n_rate_checks)
    warnings = list(dec.checks.input_warnings)
    def judged(check: RateCheck | None) -> RateCheck | None:
        return None if check is None else _judge_rate(check, alpha_rate, gate.alpha)

    checks = replace(dec.checks, invalid=judged(dec.checks.invalid), truncation=judged(dec.checks.truncation))
    outcome = replace(dec.outcome, n_tasks=n_tasks, multiple_comparisons=gate.multiple_comparisons,
                      alpha_accuracy=alpha_acc, p_degradation_adjusted=p_adjusted,
                      p_inferior_adjusted=p_inferior_adjusted, degraded=degraded, inferior=inferior,
                      spec_degraded=spec_degraded)
    updated = replace(dec, checks=checks, outcome=outcome)
    verdict, reasons, more = verdict_and_reasons(updated)
    warnings.extend(more)
    if verdict != "FAIL" and updated.spec_verdict == "FAIL":
        warnings.append("the original rule (docs/gate.md#the-original-rule) (every check at α, two outcomes, raw rate "
                        "limit) would FAIL: " + "; ".join(spec_failures(updated)) + " — not gated under this policy")
    return replace(updated, outcome=replace(outcome, verdict=verdict, reasons=reasons, warnings=tuple(warnings)))


def _binary_statistics(counts: Counts, alpha: float, margin: float) -> dict:
    a, b, c, d, n = counts.a, counts.b, counts.c, counts.d, counts.n
    p_pass, p_inferior = exact_pvalues(b, c, n, margin)
    return dict(
        p_pass=p_pass, p_inferior=p_inferior, exact_lower=exact_lower_bound(b, c, n, margin, alpha),
        delta=counts.delta, flip_rate=counts.flip_rate,
        p_degradation=mcnemar_exact_one_sided(b, c), p_mid=mcnemar_mid_p_one_sided(b, c),
        p_two_sided=mcnemar_exact_two_sided(b, c),
        tango_ci=tango_interval(b, c, n, alpha), tango_lower=tango_lower_bound(b, c, n, alpha),
        newcombe_ci=newcombe_interval(a, b, c, d, alpha), newcombe_lower=newcombe_interval(a, b, c, d, 2 * alpha)[0],
        wald_ci=wald_interval(b, c, n, alpha),
        mde=mde_binary(counts.flip_rate, n, alpha, POWER, critical_value(n, round(margin, 12), alpha)),
        mde_method="exact",
    )


def _score_pvalues(diffs: np.ndarray, margin: float) -> tuple[float, float]:
    """(p of H0 "Δ ≤ −M", p of H0 "Δ ≥ −M") from the score statistic Z(−M) (normal: the k-sample interval's
    own approximation, whose level the simulation checks)."""
    support, counts = histogram(diffs)
    z_pass = float(score_z(support, counts, -margin)[0])
    z_fail = float(score_z(-support[::-1], counts[::-1], margin)[0])  # −D against +M
    return float(norm.sf(z_pass)), float(norm.sf(z_fail))


def _score_statistics(base: np.ndarray, diffs: np.ndarray, n_samples, alpha: float,
                      margin: float) -> tuple[Counts, dict]:
    """The k-sample generalisations on the per-item differences (docs/gate.md#k-samples)."""
    n = diffs.size
    lost, gained = int(np.sum(diffs < 0)), int(np.sum(diffs > 0))
    tied = diffs == 0
    counts = Counts(a=int(np.sum(tied & (base >= 0.5))), b=lost, c=gained, d=int(np.sum(tied & (base < 0.5))), n=n)
    test = signflip_pvalues(lattice_steps(diffs, n_samples))
    psi = second_moment(diffs)
    support, weights = symmetrised(diffs)
    p_pass, p_inferior = _score_pvalues(diffs, margin)
    return counts, dict(
        p_pass=p_pass, p_inferior=p_inferior, exact_lower=None,
        delta=float(diffs.mean()), flip_rate=psi,
        p_degradation=test.p_lower, p_mid=test.p_mid, p_two_sided=test.p_two_sided,
        tango_ci=score_interval(diffs, alpha), tango_lower=score_lower_bound(diffs, alpha=alpha),
        newcombe_ci=None, newcombe_lower=None, wald_ci=wald_interval_scores(diffs, alpha),
        mde=mde_score(support, weights, alpha, POWER), mde_method="score",
    )


def next_look_factor(alpha: float) -> float:
    """How much larger the MDE is at the next look's α (α/2) than at α: (z_{1−α/2} + z_P) / (z_{1−α} + z_P)."""
    return float((norm.ppf(1 - alpha / 2) + norm.ppf(POWER)) / (norm.ppf(1 - alpha) + norm.ppf(POWER)))


def within_item_variance(base_samples, cand_samples) -> float | None:
    """W: the mean over items of the variance, across an item's k samples, of the paired sample difference
    y_cand,s − y_base,s (samples matched by index: the same seed in both runs). None below 2 samples."""
    if base_samples is None or cand_samples is None:
        return None
    variances = []
    for b, c in zip(base_samples, cand_samples):
        b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
        if b.shape != c.shape or b.size < 2:
            return None
        variances.append(float(np.var(c - b, ddof=1)))
    return float(np.mean(variances)) if variances else None


# --------------------------------------------------------------------------------------------------------
# The inputs: one task's paired data, and the policy's settings for it
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskData:
    """One task's paired data, baseline and candidate in the same item order.

    The per-item scores ``base`` and ``cand``, or for binary scores their ``counts`` alone
    (:meth:`from_counts`). Scores are means over ``n_samples`` samples per item (k; one value or one per
    item): binary when k = 1. ``base_samples`` / ``cand_samples`` (per item, the k sample scores in seed
    order) only refine how many samples the margin needs. The flags (per item; fractions of an item's
    samples when k > 1) feed the validity checks, which are skipped with a warning when a side is missing;
    the tokens (per item) the token-ratio warning.

    ``aa_psi0`` / ``aa_n``: the baseline's A/A flip structure and item count. They never change the verdict;
    the decision reports ψ₀, its one-sided (1 − α) upper bound and the MDE at that bound, and warns when the
    candidate's ψ exceeds that bound. ``items_run`` (per item; score vectors only): the items a stopped-early
    candidate ran - the warning's ψ is taken on them, since the best completion of the others turns every
    item the baseline got wrong into a gain.
    """

    task: str
    base: Sequence[float] | None = None
    cand: Sequence[float] | None = None
    counts: Counts | None = None
    n_samples: int | Sequence[int] = 1
    base_samples: Sequence[Sequence[float]] | None = None
    cand_samples: Sequence[Sequence[float]] | None = None
    base_invalid: Sequence[float] | None = None
    cand_invalid: Sequence[float] | None = None
    base_truncated: Sequence[float] | None = None
    cand_truncated: Sequence[float] | None = None
    base_tokens: Sequence[float] | None = None
    cand_tokens: Sequence[float] | None = None
    aa_psi0: float | None = None
    aa_n: int | None = None
    items_run: Sequence[bool] | None = None

    def __post_init__(self):
        if self.aa_psi0 is not None and not 0.0 <= self.aa_psi0 <= 1.0:
            raise ValueError(f"aa_psi0 must be a flip rate in [0, 1], got {self.aa_psi0}")
        if self.aa_n is not None and self.aa_n <= 0:
            raise ValueError(f"aa_n must be a positive item count, got {self.aa_n}")
        if self.items_run is not None and self.counts is not None:
            raise ValueError("items_run needs the per-item score vectors, not counts")
        if self.counts is not None and (self.base is not None or self.cand is not None):
            raise ValueError("give either base and cand vectors or counts, not both")
        if self.counts is None and (self.base is None or self.cand is None):
            raise ValueError("give either base and cand vectors or counts")

    @classmethod
    def from_counts(cls, task: str, counts: Counts, **rest) -> TaskData:
        """Binary scores given by their paired counts alone (the flags, tokens and A/A record as keywords)."""
        return cls(task, counts=counts, **rest)

    @property
    def samples_per_item(self) -> tuple[int, int | np.ndarray]:
        """(k, the samples per item as the tests take them: k, or one value per item where they differ)."""
        ks = np.atleast_1d(np.asarray(self.n_samples, dtype=int))
        if ks.size == 0 or ks.min() < 1:
            raise ValueError("n_samples must be ≥ 1")
        k = int(ks.max())
        return k, ks if ks.size > 1 else k


# --------------------------------------------------------------------------------------------------------
# One task: a helper per check, then the verdict
# --------------------------------------------------------------------------------------------------------


def _paired_statistics(data: TaskData, alpha: float, margin: float) -> tuple[Counts, dict, np.ndarray | None]:
    """The counts, the statistics of the paired difference and the per-item differences (None from counts)."""
    if data.counts is not None:
        if data.counts.n <= 0:
            raise ValueError(f"task {data.task!r} has no items")
        return data.counts, _binary_statistics(data.counts, alpha, margin), None
    assert data.base is not None and data.cand is not None  # TaskData holds counts or both vectors
    base, cand = as_score_vector(data.base, "base"), as_score_vector(data.cand, "cand")
    if base.shape != cand.shape:
        raise ValueError(f"paired vectors differ in length: base {base.size}, cand {cand.size}")
    if base.size == 0:
        raise ValueError(f"task {data.task!r} has no items")
    k, per_item = data.samples_per_item
    diffs = cand - base
    lattice_steps(diffs, per_item if np.ndim(per_item) == 0 else np.broadcast_to(per_item, diffs.shape))  # means of k
    if np.isin(base, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all():
        # k = 1, or k samples that all agree within each item: exactly McNemar and Tango
        counts = paired_counts(base, cand)
        return counts, _binary_statistics(counts, alpha, margin), diffs
    counts, stats = _score_statistics(base, diffs, per_item, alpha, margin)
    return counts, stats, diffs


def _aa_noise(data: TaskData, stats: dict, diffs: np.ndarray | None, n: int, k: int, alpha: float, margin: float,
              warnings: list[str]) -> tuple[float | None, float | None]:
    """ψ₀'s one-sided (1 − α) upper bound and the MDE at it (the task's own formula: exact for k = 1, the
    normal one for k samples); warns when the candidate moves more items."""
    if data.aa_psi0 is None:
        return None, None
    aa_items = data.aa_n if data.aa_n is not None else n
    upper = psi_upper_bound(data.aa_psi0, aa_items, alpha)
    if k == 1:
        mde = mde_binary(round(upper, 9), n, alpha, POWER, critical_value(n, round(margin, 12), alpha))
    else:  # k samples: ψ is mean(D²), not a flip rate; the MDE of a symmetric structure of that second moment
        mde = float((norm.ppf(1 - alpha) + norm.ppf(POWER)) * np.sqrt(upper / n))
    if data.aa_n is not None and data.aa_n != n:
        warnings.append(f"the A/A calibration covered {data.aa_n} items, this comparison {n}")
    psi, on = stats["flip_rate"], ""
    if data.items_run is not None:
        if diffs is None:
            raise ValueError("items_run needs the per-item scores, not counts")
        run = np.asarray(data.items_run, dtype=bool)
        if run.shape != diffs.shape:
            raise ValueError(f"items_run has {run.size} entries for {diffs.size} items")
        psi = second_moment(diffs[run]) if run.any() else None
        on = f" on the {int(run.sum())} items run"
    if psi is not None and psi > upper:
        warnings.append(f"{NOISE_WARNING}: ψ = {100 * psi:.2f}%{on} > {100 * upper:.2f}%, the one-sided "
                        f"{100 * (1 - alpha):g}% upper bound of the A/A ψ₀ = {100 * data.aa_psi0:.2f}% "
                        f"({aa_items} A/A items)")
    return upper, mde


def _rate_checks(data: TaskData, rule: TaskRule, n: int, warnings: list[str]) -> dict[str, RateCheck | None]:
    """The invalid and truncation checks (None, with a warning, where a side's flags are missing)."""
    _, per_item = data.samples_per_item
    checks: dict[str, RateCheck | None] = {}
    for name, base_flags, cand_flags, limit in (
        ("invalid", data.base_invalid, data.cand_invalid, rule.max_invalid_rise),
        ("truncation", data.base_truncated, data.cand_truncated, rule.max_truncation_rise),
    ):
        if base_flags is None or cand_flags is None:
            checks[name] = None
            warnings.append(f"{name} rate not checked: no per-item {name} flags given")
            continue
        check = _rate_check(name, base_flags, cand_flags, rule.alpha, limit, rule.min_rise_items, per_item)
        if check.n != n:
            raise ValueError(f"{name} flags cover {check.n} items, the metric covers {n}")
        checks[name] = check
    return checks


def _token_check(data: TaskData, band: tuple[float, float], warnings: list[str]) -> TokenCheck | None:
    """Mean generated tokens, candidate vs baseline; a warning outside the band."""
    if data.base_tokens is None or data.cand_tokens is None:
        return None
    tokens = TokenCheck(float(np.mean(data.base_tokens)), float(np.mean(data.cand_tokens)), band)
    if tokens.warn:
        warnings.append(f"mean generated tokens moved: {tokens.base_mean:.1f} → {tokens.cand_mean:.1f} "
                        f"({100 * tokens.ratio:.1f}% of baseline, outside {100 * band[0]:g}–{100 * band[1]:g}%)")
    return tokens


def decide_task(data: TaskData, rule: TaskRule) -> TaskDecision:
    """The per-task decision (docs/gate.md#the-decision-rule), as a pure function of the task's paired data
    and the policy's rule for it. Verdict:

    - FAIL when a validity rate is shown risen by more than its limit (the exact paired test of "rise ≤
      limit" at its share α_validity/J), or the candidate is shown worse than the margin (H0 "Δ ≥ −M" rejected at
      α_acc = α − α_validity; Holm across tasks in ``decide_overall``);
    - PASS when shown within the margin: the one-sided (1 − α) lower bound for Δ (Tango's at the exact
      critical value; its k-sample generalisation) is > −margin;
    - INCONCLUSIVE otherwise: the data show neither. ``inconclusive=False`` turns it into FAIL, and a
      significant degradation then FAILs even within the margin (the original rule, with its raw rate limit).

    WARN (never FAIL) when the candidate's mean generated tokens fall outside ``token_ratio_band`` times
    the baseline's, or its flip rate exceeds the A/A bound.
    """
    if data.counts is None and (data.base is None or len(data.base) == 0):
        raise ValueError(f"task {data.task!r} has no items")  # before anything reads a per-item value
    k, _ = data.samples_per_item
    counts, stats, diffs = _paired_statistics(data, rule.alpha, rule.margin)
    n = counts.n
    warnings: list[str] = []
    # what this n, k and flip structure resolve; how many samples per item would resolve the margin
    within = within_item_variance(data.base_samples, data.cand_samples) if k > 1 else None
    # the samples advised are for the round that would take them: the next look, at half this look's α
    needed, limit, is_bound = project_samples(stats["mde"] * next_look_factor(rule.alpha), rule.margin,
                                              stats["flip_rate"], k, within)
    aa_upper, aa_mde = _aa_noise(data, stats, diffs, n, k, rule.alpha, rule.margin, warnings)
    checks = _rate_checks(data, rule, n, warnings)
    tokens = _token_check(data, rule.token_ratio_band, warnings)

    p = stats["p_degradation"]
    decision = TaskDecision(
        task=data.task, rule=rule,
        statistics=Statistics(counts=counts, n_samples=k, **{key: stats[key] for key in (
            "delta", "flip_rate", "p_degradation", "p_mid", "p_two_sided", "tango_ci", "tango_lower", "newcombe_ci",
            "newcombe_lower", "wald_ci", "p_pass", "p_inferior", "exact_lower")}),
        checks=Checks(invalid=checks["invalid"], truncation=checks["truncation"], tokens=tokens,
                      input_warnings=tuple(warnings)),
        resolution=Resolution(mde=stats["mde"], mde_power=POWER, mde_method=stats["mde_method"], samples_needed=needed,
                              samples_needed_is_bound=is_bound, mde_limit=limit, within_variance=within,
                              aa_psi0=data.aa_psi0, aa_psi0_upper=aa_upper, aa_n=data.aa_n, aa_mde=aa_mde),
        outcome=Outcome(verdict="PASS", reasons=()),
    )
    n_rate_checks = sum(check is not None for check in checks.values())
    alpha_acc, _ = gate_levels(rule.alpha, rule.alpha_split, rule.alpha_validity, 1, n_rate_checks)
    return _finalise(decision, gate=GateRule.of(rule), n_tasks=1, n_rate_checks=n_rate_checks,
                     degraded=p <= alpha_acc, p_adjusted=p, spec_degraded=p <= rule.alpha,
                     inferior=stats["p_inferior"] <= alpha_acc, p_inferior_adjusted=stats["p_inferior"])


def decide_overall(decisions: Sequence[TaskDecision] | Mapping[str, TaskDecision], gate: GateRule) -> OverallDecision:
    """Combine per-task decisions (docs/gate.md#several-tasks) under the gate's policy ``gate``: FAIL if any
    task fails, else INCONCLUSIVE if any task is, else PASS; one α budget for the whole gate.

    Every task's decision is redone for K tasks and J rate checks: the degradation tests are corrected
    across tasks (Holm by default) at α_acc; each rate check gets α_validity/J. The non-inferiority bounds
    stay at level α per task: requiring non-inferiority on every task is an intersection–union test for
    passing a bad kernel (Berger 1982, Technometrics 24:295–300); the union of failures of a good kernel is
    what the budget controls. ``multiple_comparisons="none"`` gives up that control for the degradation tests.
    Every task must have been decided under this policy (its rule's α, budget and outcomes are the gate's).
    """
    items = list(decisions.values()) if isinstance(decisions, Mapping) else list(decisions)
    if not items:
        raise ValueError("no task decisions to combine")
    names = [dec.task for dec in items]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate task names: {names}")
    other = sorted({(d.task, d.rule.alpha, d.rule.alpha_split, d.rule.alpha_validity, d.rule.inconclusive)
                    for d in items if not gate.agrees_with(d.rule)})
    if other:
        raise ValueError(f"task decisions made under another policy than the gate's (α = {gate.alpha}, "
                         f"alpha_split = {gate.alpha_split}, alpha_validity = {gate.alpha_validity}, inconclusive = "
                         f"{gate.inconclusive}): (task, α, alpha_split, alpha_validity, inconclusive) {other}")
    k = len(items)
    n_rate_checks = sum(check is not None for dec in items for check in (dec.checks.invalid, dec.checks.truncation))
    alpha_acc, _ = gate_levels(gate.alpha, gate.alpha_split, gate.alpha_validity, k, n_rate_checks)
    pvalues = {dec.task: dec.statistics.p_degradation for dec in items}
    rejected, adjusted = adjusted_pvalues(pvalues, alpha_acc, gate.multiple_comparisons)
    spec_rejected, _ = adjusted_pvalues(pvalues, gate.alpha, gate.multiple_comparisons)
    # the accuracy FAIL: "shown worse than M", corrected across tasks like the degradation test
    inferior, inferior_adjusted = adjusted_pvalues({dec.task: dec.statistics.p_inferior for dec in items}, alpha_acc,
                                                   gate.multiple_comparisons)

    tasks: dict[str, TaskDecision] = {}
    for dec in items:
        tasks[dec.task] = _finalise(dec, gate=gate, n_tasks=k, n_rate_checks=n_rate_checks,
                                    degraded=rejected[dec.task], p_adjusted=adjusted[dec.task],
                                    spec_degraded=spec_rejected[dec.task], inferior=inferior[dec.task],
                                    p_inferior_adjusted=inferior_adjusted[dec.task])

    verdict = overall_verdict(dec.outcome.verdict for dec in tasks.values())
    reasons: tuple[str, ...]
    if verdict == "PASS":
        reasons = (f"all {k} task(s) passed",)
    else:
        reasons = tuple(f"{dec.task}: {reason}" for dec in tasks.values() if dec.outcome.verdict == verdict
                        for reason in dec.outcome.reasons)
        if verdict == "FAIL":  # the inconclusive tasks say why too
            reasons += tuple(f"{dec.task}: {reason}" for dec in tasks.values() if dec.outcome.verdict == "INCONCLUSIVE"
                             for reason in dec.outcome.reasons)
    warnings = tuple(f"{dec.task}: {w}" for dec in tasks.values() for w in dec.outcome.warnings)
    return OverallDecision(verdict, tasks, reasons, warnings, gate.alpha, gate.multiple_comparisons)
