"""A gate decided in rounds shows one look's numbers per table: a task decided at a later look (more samples
per item) has that look's Δ, CI and counts, and no score of the first look beside them; the first look's
scores and flips are said as that look's; the α shown is the deciding look's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gate_helpers import policy
from synthetic_runs import write_pair


@pytest.fixture
def rounds(tmp_path):
    """A k = 1 verdict whose gsm8k decision is replaced by a k = 8 look's at half the α, as rounds leave it."""
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand = write_pair(tmp_path / "runs", 30, 12, lost_every=29, gained_every=31)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0, rate=50.0)), allow_uncalibrated=True)
    first = verdict.decision.tasks["gsm8k"]
    later = replace(first, rule=replace(first.rule, alpha=first.rule.alpha / 2),
                    statistics=replace(first.statistics, n_samples=8, delta=-0.05),
                    outcome=replace(first.outcome, verdict="FAIL"))
    tasks = {**verdict.decision.tasks, "gsm8k": later}
    return replace(verdict, decision=replace(verdict.decision, tasks=tasks)), first


def test_a_task_decided_at_a_later_look_shows_that_looks_numbers_only(rounds):
    from evalgate.report.html import report_html
    from evalgate.report.rows import task_rows
    from evalgate.report.text import markdown, verdict_lines

    verdict, first = rounds
    (row,) = [r for r in task_rows(verdict) if r["task"] == "gsm8k"]
    assert row["baseline"] is None and row["candidate"] is None and row["delta"] == -0.05
    md = markdown(verdict)
    (line,) = [l for l in md.splitlines() if l.startswith("| gsm8k |")]
    assert "| — | — | -5.00 |" in line  # no first-look score beside the later look's Δ
    assert f"α = {first.rule.alpha / 2:.4g} (gsm8k)" in md
    said = [l for l in verdict_lines(verdict) if l.startswith("gsm8k: the row's")]
    assert said and "k = 8" in said[0] and "first look (k = 1)" in said[0]
    assert "flipped item(s) at the first look (k = 1)" in md
    html = report_html(verdict)
    assert "the look that decided this task (k = 8" in html
    (other,) = [r for r in task_rows(verdict) if r["task"] == "humaneval"]  # decided at the first look
    assert other["baseline"] is not None and other["earlier"] is None


def test_a_task_the_gate_stopped_before_shows_no_numbers_of_items_never_run(rounds, monkeypatch):
    """A kernel that failed before any item of a task ran: that row is "not run", not "undecided" with the
    best completion's scores of 0 items."""
    from evalgate.report import text
    from evalgate.report.rows import task_rows

    verdict, _ = rounds
    rows = task_rows(verdict)
    never = {**rows[1], "decided": False, "verdict": "PASS",
             "observed": {"items_run": 0, "items_total": rows[1]["n"], "b": 0, "c": 0}}
    monkeypatch.setattr(text, "task_rows", lambda v: [rows[0], never])
    (line,) = [l for l in text.markdown(verdict).splitlines() if l.startswith(f"| {never['task']} |")]
    assert line.endswith("| — | **not run** |") and f"| 0/{never['n']} |" in line and "undecided" not in line
    assert line.count("—") == 7  # candidate, Δ, CI, b / c, p, ψ, MDE
    assert any(f"{never['task']} not run (the gate stopped before its first item)" in l
               for l in text.verdict_lines(verdict))
