"""The notebook API over stored runs: summary with statistics, flips and their filters, show(), HTML reprs.

Runs are synthetic (tests/synthetic_runs.py): the real format, chosen flips, hostile HTML in the text.
"""

from __future__ import annotations

import json

import pytest

import evalgate
from evalgate.errors import UserError
from gate_helpers import policy
from synthetic_runs import HOSTILE, expected_flips, write_pair

N_GSM8K, N_HUMANEVAL = 200, 40


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    base, cand = write_pair(root, N_GSM8K, N_HUMANEVAL)
    return base, cand, expected_flips(root)


@pytest.fixture(scope="module")
def cmp(runs):
    return evalgate.compare(evalgate.load_run(runs[0]), evalgate.load_run(runs[1]))


def test_summary_has_the_statistics_without_a_gate(cmp, runs):
    s = cmp.summary.set_index("task")
    assert list(cmp.summary.columns[:11]) == ["task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high",
                                              "b", "c", "p", "verdict"]
    assert list(s.index) == ["gsm8k", "humaneval"] and s.loc["gsm8k", "n"] == N_GSM8K
    for task, (lost, gained) in runs[2].items():
        assert (s.loc[task, "b"], s.loc[task, "c"]) == (lost, gained)
        assert s.loc[task, "ci_low"] <= s.loc[task, "delta"] <= s.loc[task, "ci_high"]
        assert 0 <= s.loc[task, "p"] <= 1 and s.loc[task, "verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
    assert s.loc["gsm8k", "verdict"] == "FAIL"  # ~10% of right answers lost
    assert any("A/A" in n for n in cmp.notes)  # decided without a calibration, and says so


def test_flips_filter_by_task_direction_and_failure_class(cmp, runs):
    lost, gained = runs[2]["gsm8k"]
    flips = cmp.flips("gsm8k")
    assert len(flips) == lost + gained
    assert list(flips["direction"]) == ["lost"] * lost + ["gained"] * gained  # lost first
    assert {"doc_id", "question", "gold", "base_extracted", "cand_extracted", "base_correct", "cand_correct",
            "base_finish_reason", "cand_finish_reason", "cand_failure_class", "flips_in_aa"} <= set(flips.columns)
    assert len(cmp.flips("gsm8k", direction="gained")) == gained
    syntax = cmp.flips("humaneval", failure_class="failed:syntax")
    assert len(syntax) > 0 and (syntax["cand_failure_class"] == "failed:syntax").all()
    # HumanEval rows name the function by its signature and docstring line (the id is a column of its own)
    # and what it is checked with
    row = syntax.iloc[0]
    i = row["doc_id"].split("/")[1]
    assert (row["question"], row["gold"]) == (f"def f_{i}(xs: list) -> int: Sum of xs. <script>doc</script>",
                                              f"check(f_{i})")
    every = cmp.flips()
    assert every.columns[0] == "task" and len(every) == sum(a + b for a, b in runs[2].values())
    assert set(every["task"]) == {"gsm8k", "humaneval"}
    with pytest.raises(UserError, match="direction"):
        cmp.flips("gsm8k", direction="worse")
    with pytest.raises(UserError, match="no task"):
        cmp.flips("mmlu")


def test_show_diffs_the_two_completions_and_escapes_them(cmp):
    doc_id = int(cmp.flips("gsm8k", direction="lost")["doc_id"].iloc[0])
    view = cmp.show("gsm8k", doc_id)
    html = view._repr_html_()
    assert '<span class="del">base</span>' in html and '<span class="ins">cand</span>' in html
    assert 'class="ans"' in html and "lost" in html
    text = str(view)
    assert text.startswith(f"gsm8k {doc_id}: lost") and "--- baseline" in text and "+++ candidate" in text
    hostile = cmp.show("gsm8k", 0)._repr_html_()  # item 0 carries <script> in question and completions
    assert "<script>alert" not in hostile and "&lt;script&gt;alert" in hostile
    code = cmp.show("humaneval", cmp.flips("humaneval", direction="lost")["doc_id"].iloc[0])
    assert "Traceback" in code._repr_html_() and "prompt" in code._repr_html_() and "stderr" in str(code)
    with pytest.raises(UserError, match="no item"):
        cmp.show("gsm8k", 10_000)


def test_repr_html_is_a_summary_with_verdict_and_flip_counts(cmp, runs):
    html = cmp._repr_html_()
    lost, gained = runs[2]["gsm8k"]
    assert "gsm8k" in html and "humaneval" in html and "FAIL" in html
    assert f"{lost} lost" in html and f"{gained} gained" in html and "<svg" in html
    assert repr(cmp).startswith("Comparison(") and len(repr(cmp)) < 300


def test_aa_record_marks_noise_flips_and_is_used(tmp_path):
    base, cand = write_pair(tmp_path, 60, 0)
    lost_ids = [int(i) for i in evalgate.compare(base, cand).flips("gsm8k", direction="lost")["doc_id"][:2]]
    (base / "aa.json").write_text(json.dumps({"tasks": {"gsm8k": {"psi0": 0.05, "n": 60, "flips": lost_ids,
                                                                   "verdict": "PASS"}}}))
    cmp = evalgate.compare(base, cand)
    flips = cmp.flips("gsm8k")
    assert set(flips.loc[flips["flips_in_aa"], "doc_id"]) == set(lost_ids)
    _ = cmp.summary  # renders
    assert cmp.decision.tasks["gsm8k"].resolution.aa_psi0 == 0.05
    assert not any("A/A" in n for n in cmp.notes)


def test_the_gate_decision_is_kept_and_report_html_written(runs, tmp_path):
    from evalgate.report.outputs import write_outputs

    path = str(policy(tmp_path, margin=5.0))
    verdict = evalgate.decide(runs[0], runs[1], path, allow_uncalibrated=True)
    decision = verdict.decision
    cmp = evalgate.compare(runs[0], runs[1], thresholds=path)
    first = cmp.decision
    assert cmp.summary.set_index("task").loc["gsm8k", "p"] == decision.tasks["gsm8k"].statistics.p_degradation
    assert cmp.decision is first  # decided once, then kept
    paths = write_outputs(verdict, tmp_path / "rep")
    page = paths["html"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "FAIL" in page
    assert page.count("</script>") == 2  # the JSON and the script: no completion closed a script element
    for hostile in HOSTILE[:2]:
        assert hostile not in page


def test_report_html_for_an_aggregate_only_baseline(tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.html import report_html
    from evalgate.run.baselines import import_aggregate

    published = import_aggregate("gsm8k", 0.80, 200, "feedc0ffee123456", "gsm8k-lmeval-v3", root=tmp_path / "b")
    _, cand = write_pair(tmp_path / "runs", 200, 0)
    verdict = gate_runs(load_baseline(published), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0, paired="false")))
    page = report_html(verdict)
    assert "unpaired" in page and verdict.verdict in page and 'id="flips"' not in page


def test_compare_takes_a_gates_output_and_per_task_baselines(runs, tmp_path):
    # what a notebook user has after `evalgate gate`: per-task baseline folders, and the gate's own folder
    from evalgate.report.outputs import write_outputs
    from evalgate.run.baselines import record

    dirs = record(runs[0], tmp_path / "baselines")
    assert len(dirs) == 2  # one stored baseline per task
    by_list = evalgate.compare(dirs, runs[1])
    assert by_list.tasks == ["gsm8k", "humaneval"]
    direct = evalgate.compare(runs[0], runs[1])
    for task in direct.tasks:
        assert list(by_list.flips(task)["doc_id"]) == list(direct.flips(task)["doc_id"])
    verdict = evalgate.decide(dirs, runs[1], str(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    write_outputs(verdict, runs[1] / "gate")
    for folder in (runs[1], runs[1] / "gate"):
        from_gate = evalgate.compare(folder)
        assert from_gate.tasks == direct.tasks and str(from_gate.candidate.path) == str(runs[1])
        assert list(from_gate.flips("humaneval")["doc_id"]) == list(direct.flips("humaneval")["doc_id"])
    with pytest.raises(UserError, match="gate's output folder"):
        evalgate.compare(tmp_path)


@pytest.mark.parametrize("field", ["forward", "accumulation"])
def test_a_run_with_other_numerics_is_not_comparable(tmp_path, field):
    """A baseline recorded before canonical numerics (no scheme in its manifest) is refused against a
    canonical-v1 candidate, in words that say to re-record it (docs/kernels.md#accumulation)."""
    from evalgate.errors import NotComparable

    base, cand = write_pair(tmp_path)
    m = json.loads((cand / "manifest.json").read_text())
    if field == "forward":
        m["model"]["numerics"] = "canonical-v1"
    else:  # two emulated recipes (group_size: evalgate's own), one recorded before the scheme was named
        m["kernel"]["recipe"] = {"group_size": 32, "accumulation": "canonical-v1"}
        mb = json.loads((base / "manifest.json").read_text())
        mb["kernel"]["recipe"] = {"group_size": 32}
        (base / "manifest.json").write_text(json.dumps(mb))
    (cand / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(NotComparable, match="re-record the baseline"):
        evalgate.compare(base, cand)
    # the same scheme on both sides is comparable again
    mb = json.loads((base / "manifest.json").read_text())
    mb["model"].update({k: v for k, v in m["model"].items() if k == "numerics"})
    mb["kernel"]["recipe"] = m["kernel"].get("recipe", {})
    (base / "manifest.json").write_text(json.dumps(mb))
    evalgate.compare(base, cand)


def test_the_bf16_reference_is_comparable_with_an_emulated_baseline(tmp_path):
    """The BF16 reference (transformers' experts, no emulated recipe) accumulates its own way: that is what the
    gate compares, not a stale scheme (evalgate selfcheck's bf16 row)."""
    from evalgate.kernels import KERNELS

    base, cand = write_pair(tmp_path)
    for folder, kernel in ((base, "w4a8"), (cand, "bf16")):
        m = json.loads((folder / "manifest.json").read_text())
        m["model"]["numerics"] = "canonical-v1"
        m["kernel"]["recipe"] = KERNELS[kernel].recipe
        (folder / "manifest.json").write_text(json.dumps(m))
    evalgate.compare(base, cand)
