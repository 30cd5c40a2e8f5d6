"""What a decision produces: per-task decisions, the overall decision, and the Verdict a gate returns.

Plain records: the rule (``evalgate.gate.rule``) fills them, reports read them; nothing here decides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from evalgate.gate.compare import Pairing
from evalgate.gate.policy import Thresholds
from evalgate.gate.settings import TaskRule
from evalgate.run.store import Run
from evalgate.stats.paired import Counts


VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")
EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}  # 2: error or not comparable (no verdict)


@dataclass(frozen=True)
class RateCheck:
    """A validity-rate gate (invalid answers or truncations): fails on a significant or too-large rise.

    With k samples per item the flags are per-item fractions of flagged samples and the counts are sums of
    them (so they need not be whole)."""

    name: str  # "invalid" or "truncation"
    base_count: float
    cand_count: float
    n: int
    p: float  # exact one-sided McNemar (sign-flip with k samples) on the indicator: H0 "the rate did not rise"
    limit: float  # largest allowed absolute rise, as a fraction
    significant: bool  # shown risen by more than the limit: p_over_limit ≤ alpha (this check's share of the budget)
    over_limit: bool  # net new flagged items > max(limit·n, min_items)
    alpha: float = 0.05  # level the significance was judged at
    min_items: int = 0  # item floor of the absolute limit
    new_count: float = 0  # items flagged by the candidate only
    gone_count: float = 0  # items flagged by the baseline only
    significant_at_alpha: bool = False  # the original rule (docs/gate.md#the-original-rule): p ≤ α (reported, gated only when alpha_split off)
    over_raw_limit: bool = False  # the original rule (docs/gate.md#the-original-rule): rise > limit·n (reported)
    # exact p of H0 "the rate rose by at most the limit" (the paired non-inferiority test with the limit as its
    # margin; the score test with k samples): the FAIL test, so a kernel within the limit FAILs it ≤ its α
    p_over_limit: float | None = None

    @property
    def base_rate(self) -> float:
        return self.base_count / self.n

    @property
    def cand_rate(self) -> float:
        return self.cand_count / self.n

    @property
    def rise(self) -> float:
        return (self.cand_count - self.base_count) / self.n

    @property
    def limit_items(self) -> float:
        """The absolute limit in items: max(limit·n, min_items)."""
        return max(self.limit * self.n, float(self.min_items))

    @property
    def failed(self) -> bool:
        """Under one α (docs/gate.md#rate-checks) a rate check fails only when its rise is shown larger than the
        limit (the exact test of "rise ≤ limit" at its level) and the net new items exceed the item floor."""
        return self.significant and self.over_limit


@dataclass(frozen=True)
class TokenCheck:
    """Mean generated tokens, candidate vs baseline; WARN outside the band (MLPerf's 90–110%)."""

    base_mean: float
    cand_mean: float
    band: tuple[float, float]

    @property
    def ratio(self) -> float:
        return self.cand_mean / self.base_mean if self.base_mean > 0 else math.inf

    @property
    def warn(self) -> bool:
        return not (self.band[0] <= self.ratio <= self.band[1])


@dataclass(frozen=True)
class Statistics:
    """The paired difference's statistics for one task (docs/gate.md#the-decision-rule).

    Per-item scores are means over k = ``n_samples`` samples (k = 1: binary, greedy). With k = 1 the interval
    is Tango's and the degradation test exact McNemar; with k > 1 the same fields hold their generalisations
    on the per-item differences (the multinomial score interval and the exact sign-flip test,
    docs/gate.md#k-samples), and ``counts`` counts items by the sign of their difference. Every p-value here is
    unadjusted (the corrected ones are the outcome's)."""

    counts: Counts
    n_samples: int  # k: samples per item (1 = greedy)
    delta: float  # Δ̂ = mean per-item difference, candidate − baseline
    flip_rate: float  # ψ = mean squared per-item difference ((b + c)/n for binary scores)
    p_degradation: float  # exact one-sided McNemar (sign-flip when k > 1)
    p_mid: float  # mid-p, reported only
    p_two_sided: float  # reported only
    tango_ci: tuple[float, float]  # two-sided (1 − α) score interval (Tango's when k = 1)
    tango_lower: float  # one-sided (1 − α) lower bound
    newcombe_ci: tuple[float, float] | None  # two-sided (1 − α); binary scores only
    newcombe_lower: float | None  # one-sided (1 − α): lower end of the two-sided (1 − 2α) interval
    wald_ci: tuple[float, float]  # report only
    # FAIL on accuracy = shown worse than the margin (docs/gate.md#what-fail-means): H0 "Δ ≥ −M" rejected
    p_inferior: float = 1.0  # exact unconditional p (k = 1; score test with k samples) of H0: Δ ≥ −M
    p_pass: float | None = None  # exact unconditional p of H0: Δ ≤ −M (k = 1): PASS when ≤ α
    exact_lower: float | None = None  # Tango's bound at the exact critical value (k = 1): the bound gated on

    @property
    def gate_lower(self) -> float:
        """The one-sided lower bound compared with −M: Tango's at the exact critical value (k = 1), the score
        interval's with k samples. (Newcombe's is reported only: it runs above α at the margin.)"""
        return self.exact_lower if self.exact_lower is not None else self.tango_lower


@dataclass(frozen=True)
class Checks:
    """The validity checks (invalid answers, truncations; None where a side's flags are missing), the token
    ratio, and the warnings the inputs raised (missing flags, tokens, the A/A noise)."""

    invalid: RateCheck | None
    truncation: RateCheck | None
    tokens: TokenCheck | None
    input_warnings: tuple[str, ...] = field(default=())  # the outcome's warnings start with these


@dataclass(frozen=True)
class Resolution:
    """What this n, k and flip structure can resolve (docs/gate.md#resolution), and the baseline's A/A
    calibration: ψ₀, its one-sided (1 − α) upper bound, the items it rests on, the MDE at the bound."""

    mde: float  # minimum detectable effect at ``mde_power`` for n, k and the measured (symmetrised) structure
    mde_power: float = 0.8
    mde_method: str = "exact"  # "exact" (binary: trinomial sum), "score" (k > 1), "normal" (older records)
    samples_needed: int | None = None  # the fewest samples per item whose MDE reaches the margin (None: none ≤ 64)
    samples_needed_is_bound: bool = True  # True when K assumes all per-item variation averages out (a lower bound)
    mde_limit: float | None = None  # the MDE as k → ∞ (what averaging samples cannot remove)
    within_variance: float | None = None  # mean within-item variance of one sample's paired difference (k > 1)
    aa_psi0: float | None = None
    aa_psi0_upper: float | None = None
    aa_n: int | None = None
    aa_mde: float | None = None


@dataclass(frozen=True)
class Outcome:
    """What the gate made of the statistics at its levels: the tests' corrected p-values and findings, the
    verdict with its reasons and warnings, and which look of the candidate's sequence decided it
    (docs/gate.md#reruns)."""

    verdict: str  # "PASS", "FAIL" or "INCONCLUSIVE"
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())
    look: int = 0  # the look's α is the rule's
    n_tasks: int = 1  # K tasks decided together
    multiple_comparisons: str = "holm"  # "holm", "bonferroni", "none"
    alpha_accuracy: float = 0.05  # level of the degradation and inferiority tests (before Holm)
    p_degradation_adjusted: float = 1.0  # after the multiple-comparison rule (= unadjusted for one task)
    p_inferior_adjusted: float = 1.0
    degraded: bool = False  # the degradation test rejected "no degradation" at α_acc: reported, warns
    inferior: bool = False  # H0 "Δ ≥ −M" rejected at α_acc: the accuracy FAIL
    # the original rule (docs/gate.md#the-original-rule): degradation at α, reported even when not gated
    spec_degraded: bool = False


@dataclass(frozen=True)
class TaskDecision:
    """Everything the rule (docs/gate.md#the-decision-rule) decided for one task, in five parts, each number
    once: the ``rule`` it was decided under (the policy's settings for the task, at this look's α), the
    ``statistics`` of the paired difference, the validity ``checks``, the ``resolution`` (what the data can
    resolve) and the ``outcome`` (verdict, reasons, the corrected tests, the look)."""

    task: str
    rule: TaskRule
    statistics: Statistics
    checks: Checks
    resolution: Resolution
    outcome: Outcome

    @property
    def passed(self) -> bool:
        return self.outcome.verdict == "PASS"

    @property
    def failed(self) -> bool:
        return self.outcome.verdict == "FAIL"

    @property
    def non_inferior(self) -> bool:
        """gate_lower > −margin (the original rule's non-inferiority test too)."""
        return bool(self.statistics.gate_lower > -self.rule.margin)

    @property
    def resolves_margin(self) -> bool:
        """The margin is at least the minimum detectable effect."""
        return bool(self.resolution.mde <= self.rule.margin)

    @property
    def spec_verdict(self) -> str:
        """The verdict of the original rule (docs/gate.md#the-original-rule) on the same data (reported, not gated unless the policy says so)."""
        rates = any(c is not None and (c.significant_at_alpha or c.over_raw_limit)
                    for c in (self.checks.invalid, self.checks.truncation))
        return "FAIL" if self.outcome.spec_degraded or not self.non_inferior or rates else "PASS"

    def to_dict(self) -> dict:
        """gate.json's ``decision.tasks[task]``: the five parts, with the derived values its readers use
        beside the numbers they come from (the bound gated on, the rates, the findings)."""
        checks = asdict(self.checks)
        for key in ("invalid", "truncation"):
            check = getattr(self.checks, key)
            if check is not None:
                checks[key].update(base_rate=check.base_rate, cand_rate=check.cand_rate, rise=check.rise,
                                   limit_items=check.limit_items, failed=check.failed)
        if self.checks.tokens is not None:
            checks["tokens"].update(ratio=self.checks.tokens.ratio, warn=self.checks.tokens.warn)
        return {
            "task": self.task,
            "rule": self.rule.to_dict(),
            "statistics": {**asdict(self.statistics), "gate_lower": self.statistics.gate_lower},
            "checks": checks,
            "resolution": {**asdict(self.resolution), "resolves_margin": self.resolves_margin},
            "outcome": {**asdict(self.outcome), "non_inferior": self.non_inferior, "spec_verdict": self.spec_verdict},
        }


def overall_verdict(verdicts) -> str:
    """FAIL if any task failed, else INCONCLUSIVE if any task is, else PASS."""
    verdicts = list(verdicts)
    if "FAIL" in verdicts:
        return "FAIL"
    return "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "PASS"


@dataclass(frozen=True)
class OverallDecision:
    verdict: str  # "PASS", "FAIL" or "INCONCLUSIVE"
    tasks: dict[str, TaskDecision]
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    alpha: float
    multiple_comparisons: str

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 3 INCONCLUSIVE (2 is an error: no decision at all)."""
        return EXIT_CODES[self.verdict]

    @property
    def spec_verdict(self) -> str:
        """the original rule (docs/gate.md#the-original-rule) on the same data: reported next to the gated verdict."""
        return "FAIL" if any(dec.spec_verdict == "FAIL" for dec in self.tasks.values()) else "PASS"

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "spec_verdict": self.spec_verdict,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "alpha": self.alpha,
            "multiple_comparisons": self.multiple_comparisons,
            "tasks": {name: dec.to_dict() for name, dec in self.tasks.items()},
        }




@dataclass
class Verdict:
    verdict: str  # "PASS" | "FAIL" | "INCONCLUSIVE"
    exit_code: int  # 0 | 1 | 3
    decision: OverallDecision | None
    comparison: Pairing | None  # the pairing it decided on (scored on the policy's metrics)
    thresholds: Thresholds
    aa: dict = field(default_factory=dict)  # task -> A/A summary used (psi0, n, flips)
    notes: list[str] = field(default_factory=list)
    unpaired: dict = field(default_factory=dict)  # task -> UnpairedResult.to_dict() (aggregate-only baselines)
    baseline_dirs: list[str] = field(default_factory=list)  # every baseline folder decided against (one per task)
    conformance: dict | None = None  # the candidate kernel vs the kernel it declares (kernels/conformance.py)
    # the candidate stopped early (docs/gate.md#stopping-early): items run / total per task, observed flips,
    # why; the decision's numbers are those of its best completion
    early_stop: dict | None = None
    # the gate's looks (docs/gate.md#sequential-rounds): its identity, each look's k, α and verdict; the
    # per-task decisions are those of the look that decided each task
    sequence: dict | None = None

    def to_dict(self) -> dict:
        cmp = self.comparison
        out = {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "notes": self.notes,
            "thresholds": {"path": self.thresholds.path, "sha256": self.thresholds.sha256,
                           "source": self.thresholds.source,
                           "alpha": self.thresholds.alpha, "multiple_comparisons": self.thresholds.multiple_comparisons,
                           "ci_method": self.thresholds.ci_method},
            "aa": {t: {k: v for k, v in a.items() if k != "flips"} | {"flips": sorted(a.get("flips", []), key=str)}
                   for t, a in self.aa.items()},
            "decision": self.decision.to_dict() if self.decision is not None else None,
            "unpaired": self.unpaired,
            "baseline_dirs": self.baseline_dirs,
            "conformance": self.conformance,
            "early_stop": self.early_stop,
            "sequence": self.sequence,
        }
        if cmp is not None:
            out["baseline"] = run_identity(cmp.baseline)
            out["candidate"] = run_identity(cmp.candidate)
            out["flips"] = {t: cmp.flips(t).drop(columns=["base_response", "cand_response"]).to_dict("records")
                            for t in cmp.tasks}
        return out


def run_identity(run: Run) -> dict:
    """Who a run is, as every output names it: path, run id, kernel, model, task profiles, DG_* env."""
    m = run.meta
    return {"path": str(run.path), "run_id": m.run_id, "kernel": m.kernel.to_dict(), "model": m.model.to_dict(),
            "tasks": {t: s.model_dump(by_alias=True, exclude_unset=True, exclude={"settings"}) for t, s in m.tasks.items()},
            "dg_env": m.dg_env or {}, "created": m.created, "aggregate_only": bool(m.aggregate_only)}
