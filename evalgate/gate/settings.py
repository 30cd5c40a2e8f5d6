"""The policy's settings a decision is made under: ``TaskRule`` for one task, ``GateRule`` for the whole gate.

A task's decision holds its ``TaskRule`` (each setting once); ``decide_overall`` takes the ``GateRule`` itself
rather than rebuilding it from the decisions. Both come from a policy (thresholds.yaml) by ``from_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from evalgate.stats.multiplicity import MULTIPLE_COMPARISONS
from evalgate.stats.paired import _check_alpha

if TYPE_CHECKING:
    from evalgate.gate.policy import Thresholds


@dataclass(frozen=True)
class TaskRule:
    """The policy's settings for one task (docs/gate.md#the-decision-rule): what ``decide_task`` gates on.

    ``alpha`` is the level of this look (docs/gate.md#reruns); ``alpha_validity`` the rate checks' share of it
    when ``alpha_split``. With alpha_split = False, inconclusive = False and min_rise_items = 0 the rule is the
    original one (docs/gate.md#the-original-rule)."""

    margin: float
    alpha: float = 0.05
    ci_method: str = "tango"  # the bound gated on: Tango's at the exact critical value (its k-sample generalisation when k > 1)
    max_invalid_rise: float = 0.01
    max_truncation_rise: float = 0.01
    token_ratio_band: tuple[float, float] = (0.9, 1.1)  # WARN (never FAIL) outside it
    alpha_split: bool = True  # α_acc = α − α_validity for accuracy, α_validity shared by the rate checks
    alpha_validity: float = 0.01
    min_rise_items: int = 4  # the item floor of a rate check's absolute limit
    inconclusive: bool = True  # the third outcome (False: FAIL whenever non-inferiority is not shown)

    def __post_init__(self):
        _check_alpha(self.alpha)
        if self.margin < 0:
            raise ValueError(f"margin must be ≥ 0 (a fraction), got {self.margin}")
        if self.ci_method != "tango":  # Newcombe's bound runs above α at the margin: reported, never gated
            raise ValueError(f"ci_method must be 'tango' (Newcombe's interval is reported only), got {self.ci_method!r}")
        if self.alpha_split and not 0.0 <= self.alpha_validity < self.alpha:
            raise ValueError(f"alpha_validity must be in [0, alpha = {self.alpha}), got {self.alpha_validity}")
        if self.min_rise_items < 0:
            raise ValueError(f"min_rise_items must be ≥ 0, got {self.min_rise_items}")
        object.__setattr__(self, "token_ratio_band", tuple(self.token_ratio_band))

    @classmethod
    def from_policy(cls, thresholds: Thresholds, task: str) -> TaskRule:
        """The rule a policy (thresholds.yaml) sets for ``task``."""
        return cls(**thresholds.decision_kwargs(task))

    def original(self) -> TaskRule:
        """The same settings under docs/gate.md#the-original-rule: every test at α, two outcomes, no item floor."""
        return replace(self, alpha_split=False, inconclusive=False, min_rise_items=0)

    def to_dict(self) -> dict:
        return {**self.__dict__, "token_ratio_band": list(self.token_ratio_band)}


@dataclass(frozen=True)
class GateRule:
    """The settings that hold across tasks: the gate's α (this look's), how the degradation and inferiority
    tests are corrected across tasks, and the α budget and outcomes every task shares."""

    alpha: float = 0.05
    multiple_comparisons: str = "holm"  # "holm", "bonferroni" or "none"
    alpha_split: bool = True
    alpha_validity: float = 0.01
    inconclusive: bool = True

    def __post_init__(self):
        _check_alpha(self.alpha)
        if self.multiple_comparisons not in MULTIPLE_COMPARISONS:
            raise ValueError(f"multiple_comparisons must be one of {sorted(MULTIPLE_COMPARISONS)}")

    @classmethod
    def from_policy(cls, thresholds: Thresholds) -> GateRule:
        """The gate-wide settings of a policy (thresholds.yaml)."""
        return cls(alpha=thresholds.alpha, multiple_comparisons=thresholds.multiple_comparisons,
                   alpha_split=thresholds.alpha_split, alpha_validity=thresholds.alpha_validity,
                   inconclusive=thresholds.inconclusive)

    @classmethod
    def of(cls, rule: TaskRule, multiple_comparisons: str = "holm") -> GateRule:
        """The gate-wide part of one task's rule (tasks decided under the same policy share it)."""
        return cls(alpha=rule.alpha, multiple_comparisons=multiple_comparisons, alpha_split=rule.alpha_split,
                   alpha_validity=rule.alpha_validity, inconclusive=rule.inconclusive)

    def agrees_with(self, rule: TaskRule) -> bool:
        """Whether a task's rule was set by this gate's policy (the same α, budget and outcomes)."""
        return (rule.alpha, rule.alpha_split, rule.alpha_validity, rule.inconclusive) == (
            self.alpha, self.alpha_split, self.alpha_validity, self.inconclusive)

