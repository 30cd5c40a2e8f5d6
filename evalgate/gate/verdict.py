"""What a decision produces: per-task decisions, the overall decision, and the Verdict a gate returns.

Plain records: the rule (``evalgate.gate.rule``) fills them, reports read them; nothing here decides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from evalgate.gate.compare import Pairing
from evalgate.gate.policy import Thresholds
from evalgate.run.store import Run
from evalgate.stats.paired import Counts


@dataclass(frozen=True)
class RateCheck:
    """A validity-rate gate (invalid answers or truncations): fails on a significant or too-large rise."""

    name: str  # "invalid" or "truncation"
    base_count: int
    cand_count: int
    n: int
    p: float  # exact one-sided McNemar on the indicator: H0 "the rate did not rise"
    limit: float  # largest allowed absolute rise, as a fraction
    significant: bool  # p ≤ alpha (this check's share of the budget)
    over_limit: bool  # net new flagged items > max(limit·n, min_items)
    alpha: float = 0.05  # level the significance was judged at
    min_items: int = 0  # item floor of the absolute limit
    new_count: int = 0  # items flagged by the candidate only
    gone_count: int = 0  # items flagged by the baseline only
    significant_at_alpha: bool = False  # the original rule (docs/gate.md#the-original-rule): p ≤ α (reported, gated only when alpha_split off)
    over_raw_limit: bool = False  # the original rule (docs/gate.md#the-original-rule): rise > limit·n (reported)

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
        return self.significant or self.over_limit


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
class TaskDecision:
    """Everything the docs/gate.md#the-decision-rule rule computed for one task, with its verdict and human-readable reasons."""

    task: str
    counts: Counts
    delta: float
    flip_rate: float
    margin: float  # the margin gated on (= margin_effective)
    alpha: float
    ci_method: str  # the interval gated on: "tango" (default) or "newcombe"
    p_degradation: float  # exact one-sided McNemar, unadjusted
    p_degradation_adjusted: float  # after the multiple-comparison rule (= unadjusted for one task)
    p_mid: float  # mid-p, reported only
    p_two_sided: float  # reported only
    tango_ci: tuple[float, float]  # two-sided (1 − α)
    tango_lower: float  # one-sided (1 − α) lower bound
    newcombe_ci: tuple[float, float]  # two-sided (1 − α)
    newcombe_lower: float  # one-sided (1 − α): lower end of the two-sided (1 − 2α) interval
    wald_ci: tuple[float, float]  # report only
    gate_lower: float  # the one-sided lower bound compared with −M (tango_lower unless ci_method says)
    degraded: bool  # McNemar rejected "no degradation" at α_acc (after the multiple-comparison rule)
    non_inferior: bool  # gate_lower > −margin_effective
    invalid: RateCheck | None
    truncation: RateCheck | None
    tokens: TokenCheck | None
    multiple_comparisons: str  # "holm", "bonferroni", "none"; with K tasks
    n_tasks: int
    verdict: str  # "PASS" or "FAIL"
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())
    # the whole-gate budget and the A/A margin floor
    margin_requested: float = 0.0  # M from the policy
    margin_effective: float = 0.0  # max(M, floor) when the floor applies, else M
    margin_raised_because: str | None = None  # why M_eff > M, or None
    margin_floor: float | None = None  # k·√(ψ₀/n), None without A/A data or with the floor off
    margin_floor_k: float | None = None
    aa_psi0: float | None = None
    aa_n: int | None = None
    alpha_split: bool = True
    alpha_validity: float = 0.01
    alpha_accuracy: float = 0.05  # level of the McNemar degradation tests (before Holm)
    min_rise_items: int = 0
    margin_floor_enabled: bool = True
    # the original rule (docs/gate.md#the-original-rule) (every test at α, requested M, raw 1 pp limit): reported even when not gated
    spec_degraded: bool = False
    spec_non_inferior: bool = True
    data_warnings: tuple[str, ...] = field(default=())  # warnings from the inputs (flags, tokens, A/A)

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def spec_verdict(self) -> str:
        """The verdict of the original rule (docs/gate.md#the-original-rule) on the same data (reported, not gated unless the policy says so)."""
        rates = any(c is not None and (c.significant_at_alpha or c.over_raw_limit)
                    for c in (self.invalid, self.truncation))
        return "FAIL" if self.spec_degraded or not self.spec_non_inferior or rates else "PASS"

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("invalid", "truncation"):
            check = getattr(self, key)
            if check is not None:
                out[key].update(base_rate=check.base_rate, cand_rate=check.cand_rate, rise=check.rise,
                                limit_items=check.limit_items, failed=check.failed)
        if self.tokens is not None:
            out["tokens"].update(ratio=self.tokens.ratio, warn=self.tokens.warn)
        out["spec_verdict"] = self.spec_verdict
        return out


@dataclass(frozen=True)
class OverallDecision:
    verdict: str  # "PASS" or "FAIL"
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
        return 0 if self.passed else 1

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
    verdict: str  # "PASS" | "FAIL"
    exit_code: int
    decision: OverallDecision | None
    comparison: Pairing | None  # the pairing it decided on (scored on the policy's metrics)
    thresholds: Thresholds
    aa: dict = field(default_factory=dict)  # task -> A/A summary used (psi0, n, flips)
    notes: list[str] = field(default_factory=list)
    unpaired: dict = field(default_factory=dict)  # task -> UnpairedResult.to_dict() (aggregate-only baselines)
    baseline_dirs: list[str] = field(default_factory=list)  # every baseline folder decided against (one per task)

    def to_dict(self) -> dict:
        cmp = self.comparison
        out = {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "notes": self.notes,
            "thresholds": {"path": self.thresholds.path, "sha256": self.thresholds.sha256,
                           "alpha": self.thresholds.alpha, "multiple_comparisons": self.thresholds.multiple_comparisons,
                           "ci_method": self.thresholds.ci_method},
            "aa": {t: {k: v for k, v in a.items() if k != "flips"} | {"flips": sorted(a.get("flips", []), key=str)}
                   for t, a in self.aa.items()},
            "decision": self.decision.to_dict() if self.decision is not None else None,
            "unpaired": self.unpaired,
            "baseline_dirs": self.baseline_dirs,
        }
        if cmp is not None:
            out["baseline"] = run_identity(cmp.baseline)
            out["candidate"] = run_identity(cmp.candidate)
            out["flips"] = {t: cmp.flips(t).drop(columns=["base_response", "cand_response"]).to_dict("records")
                            for t in cmp.tasks}
        return out


def run_identity(run: Run) -> dict:
    """Who a run is, as every output names it: path, run id, kernel, model, task profiles, DG_* env."""
    m = run.manifest
    return {"path": str(run.path), "run_id": m.get("run_id"), "kernel": m.get("kernel", {}), "model": m.get("model", {}),
            "tasks": {t: {k: v for k, v in s.items() if k != "settings"} for t, s in m.get("tasks", {}).items()},
            "dg_env": m.get("dg_env", {}), "created": m.get("created"), "aggregate_only": bool(m.get("aggregate_only"))}
