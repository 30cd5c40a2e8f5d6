"""Statistics for a Comparison that no gate has decided yet (notebooks, ``evalgate.compare``).

The same rule as the gate (``evalgate.gate.decide.decide``) with the default policy or the one passed to
``compare``, A/A data when the baseline folder has ``aa.json``, and no refusal for a missing calibration.
Imported lazily: ``evalgate.gate.decide`` imports ``evalgate.gate.compare``.
"""

from __future__ import annotations

import dataclasses

from evalgate.errors import UserError


def aa_records(baseline_run) -> dict:
    """task -> A/A summary (psi0, n, flips, verdict) stored next to a baseline; empty for a plain run."""
    from evalgate.gate.decide import aa_for_baseline

    try:
        return aa_for_baseline([baseline_run.path])
    except (OSError, ValueError):  # an unreadable aa.json must not break looking at flips
        return {}


def decide_on_demand(comparison) -> None:
    """Sets ``comparison.decision`` and notes how it was decided; on a validity problem, notes it instead."""
    from evalgate.gate.decide import decide, default_thresholds_for
    from evalgate.gate.policy import Thresholds, load_thresholds

    policy = comparison.thresholds
    if not isinstance(policy, Thresholds):
        policy = load_thresholds(policy or default_thresholds_for(comparison.candidate))
    aa = aa_records(comparison.baseline)
    given_aa_flips = comparison.aa_flips
    try:
        verdict = decide(comparison, _policy_for_runs(comparison, policy), aa=aa, require_aa=False)
    except UserError as exc:  # NotComparable included: the numbers would not be a valid gate
        comparison.stats_problem = f"no statistics: {exc}"
        comparison.notes.append(comparison.stats_problem)
        return
    comparison.notes.extend(verdict.notes)
    if not aa:
        comparison.aa_flips = given_aa_flips


def _policy_for_runs(comparison, policy):
    """The policy with each task's profile set to the one the runs used (a notebook may look at any profile)."""
    tasks = dict(policy.tasks)
    for task in comparison.pairs:
        used = comparison.candidate.manifest["tasks"][task].get("name")
        if task in tasks and tasks[task].profile != used:
            comparison.notes.append(f"{task}: the policy is written for profile {tasks[task].profile!r}; "
                                    f"its margin is applied to {used!r}")
            tasks[task] = dataclasses.replace(tasks[task], profile=used)
    return dataclasses.replace(policy, tasks=tasks)
