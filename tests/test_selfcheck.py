"""`evalgate selfcheck`: one row per kernel through the gate's own flow (pipeline.gate_model), expected PASS
for healthy kernels and FAIL for faulty ones, exit 0 only when every row matches."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from evalgate.cli import selfcheck
from evalgate.cli.main import main
from evalgate.gate.stopped import headline

FAULTY = "faulty/w4a4_packed-drop-slot"


def fake_verdict(overall: str, conformance: dict | None = None, **tasks: str):
    decision = SimpleNamespace(tasks={t: SimpleNamespace(outcome=SimpleNamespace(verdict=v)) for t, v in tasks.items()})
    return SimpleNamespace(verdict=overall, decision=decision, conformance=conformance)


def test_default_kernels_are_the_healthy_five_and_every_faulty_one():
    from evalgate.kernels import get_kernel, kernel_names

    kernels = selfcheck.default_kernels()
    assert kernels[:5] == ["bf16", "w4a8", "w4a4", "w4a4_packed", "w4a4_te"]
    assert set(kernels[5:]) == {k for k in kernel_names() if get_kernel(k).faulty} and len(kernels) > 5
    assert [selfcheck.expected_verdict(k) for k in kernels] == ["PASS"] * 5 + ["FAIL"] * (len(kernels) - 5)


def test_rows_and_table_say_which_kernel_did_not_do_what_it_should():
    verdicts = {"w4a8": fake_verdict("PASS", gsm8k="PASS", humaneval="PASS"),
                "w4a4_te": fake_verdict("INCONCLUSIVE", gsm8k="PASS", humaneval="INCONCLUSIVE"),
                FAULTY: fake_verdict("FAIL", {"checked": True, "ok": False}, gsm8k="FAIL", humaneval="PASS")}
    seen = []
    rows = selfcheck.check(list(verdicts), lambda k: (verdicts[k], Path("runs") / k), on_row=seen.append)
    assert seen == rows
    assert [(r.kernel, r.expected, r.verdict, r.ok) for r in rows] == [
        ("w4a8", "PASS", "PASS", True), ("w4a4_te", "PASS", "INCONCLUSIVE", False), (FAULTY, "FAIL", "FAIL", True)]
    text = selfcheck.table(rows, ["gsm8k", "humaneval"])
    lines = text.splitlines()
    assert lines[0].split() == ["kernel", "expected", "conformance", "gsm8k", "humaneval", "overall", "items", "time",
                                "match"]
    assert lines[3].split()[:6] == ["w4a4_te", "PASS", "-", "PASS", "INCONCLUSIVE", "INCONCLUSIVE"]
    assert lines[3].endswith("NO") and lines[2].endswith("yes") and lines[4].endswith("yes")
    assert lines[4].split()[:6] == [FAULTY, "FAIL", "FAIL", "FAIL", "PASS", "FAIL"]
    assert lines[2].split()[6] == "all"


def test_the_table_says_which_rows_stopped_early():
    stopped = fake_verdict("FAIL", gsm8k="FAIL", humaneval="PASS")
    stopped.early_stop = {"items_run": 58, "items_total": 364,
                          "tasks": {"gsm8k": {"items_run": 58, "items_total": 200},
                                    "humaneval": {"items_run": 0, "items_total": 164}}}
    rows = selfcheck.check([FAULTY], lambda k: (stopped, Path("runs") / k))
    assert rows[0].items == "58/364" and rows[0].ok
    # the task the gate stopped before its first item shows no verdict: not run (as the gate's own table)
    assert rows[0].tasks == {"gsm8k": "FAIL", "humaneval": "not run"}
    assert "58/364 (stopped early)" in selfcheck.table(rows, ["gsm8k", "humaneval"])
    # a task it stopped part-way is only "at best PASS" on its best completion: undecided, not PASS
    stopped.early_stop["tasks"]["humaneval"]["items_run"] = 10
    rows = selfcheck.check([FAULTY], lambda k: (stopped, Path("runs") / k))
    assert rows[0].tasks == {"gsm8k": "FAIL", "humaneval": "undecided"}


@pytest.fixture
def gate_calls(monkeypatch):
    """pipeline.gate_model replaced: what selfcheck asks of the gate, answered with a chosen verdict."""
    import evalgate.pipeline
    import evalgate.report.outputs

    calls, answers = [], {}

    def gate_model(spec, baseline_kernel, root, out, thresholds, *rest, **kwargs):
        calls.append({"spec": spec, "baseline_kernel": baseline_kernel, "root": root, "out": out,
                      "thresholds": thresholds, "early_stop": kwargs.get("early_stop", True)})
        return answers[spec.kernel], out

    monkeypatch.setattr(evalgate.pipeline, "gate_model", gate_model)
    monkeypatch.setattr(evalgate.report.outputs, "write_outputs", lambda verdict, out: {})
    return calls, answers


def test_selfcheck_runs_the_default_gate_per_kernel_and_exits_0_when_all_match(gate_calls, tmp_path):
    from evalgate.canary import PROFILES, THRESHOLDS, canary_path

    calls, answers = gate_calls
    answers.update({"w4a8": fake_verdict("PASS", gsm8k="PASS"), FAULTY: fake_verdict("FAIL", gsm8k="FAIL")})
    result = CliRunner().invoke(main, ["selfcheck", "--kernels", f"w4a8,{FAULTY}", "--tasks", "gsm8k",
                                       "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "rows.json")])
    assert result.exit_code == 0, result.output
    assert "all 2 kernels as expected" in result.output
    assert [c["spec"].kernel for c in calls] == ["w4a8", FAULTY]
    for c in calls:  # exactly the default gate: the canary, its profiles and policy, against stored W4A8
        assert c["spec"].model == str(canary_path()) and c["spec"].profiles == {"gsm8k": PROFILES["gsm8k"]}
        assert c["baseline_kernel"] == "w4a8" and c["thresholds"].path == str(THRESHOLDS) and c["thresholds"].source == "canary"
        assert c["spec"].batch_size == selfcheck.BATCH_SIZE != 32
        assert c["early_stop"] is True  # as the gate: a FAIL stops once it is certain
    assert calls[1]["out"] == tmp_path / "runs" / "faulty_w4a4_packed-drop-slot"
    assert '"ok": true' in (tmp_path / "rows.json").read_text()


def test_selfcheck_exits_1_when_a_faulty_kernel_passes(gate_calls, tmp_path):
    calls, answers = gate_calls
    answers.update({"w4a8": fake_verdict("PASS", gsm8k="PASS"), FAULTY: fake_verdict("PASS", gsm8k="PASS")})
    result = CliRunner().invoke(main, ["selfcheck", "--kernels", f"w4a8,{FAULTY}", "--tasks", "gsm8k",
                                       "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 1, result.output
    assert f"NOT as expected: {FAULTY}" in result.output


def test_an_unknown_kernel_is_one_line_exit_2_before_anything_runs(gate_calls, tmp_path):
    calls, _ = gate_calls
    result = CliRunner().invoke(main, ["selfcheck", "--kernels", "w4a8,no-such-kernel", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no-such-kernel" in result.output and calls == []


def test_a_kernel_whose_gate_errors_is_an_error_row_and_the_others_still_run():
    from evalgate.errors import UserError

    def gate_one(kernel):
        if kernel == "bf16":
            raise UserError("the kernel broke")
        return fake_verdict("PASS", gsm8k="PASS"), Path("runs") / kernel

    rows = selfcheck.check(["bf16", "w4a8"], gate_one)
    assert [(r.kernel, r.verdict, r.ok, r.error) for r in rows] == [("bf16", "ERROR", False, "the kernel broke"),
                                                                    ("w4a8", "PASS", True, "")]


def test_no_baseline_or_no_aa_stops_before_any_kernel_runs(gate_calls, tmp_path, monkeypatch):
    import shutil

    from evalgate.canary import BASELINES
    from evalgate.run import baselines

    calls, _ = gate_calls
    args = ["selfcheck", "--kernels", "w4a8", "--tasks", "gsm8k", "--runs-dir", str(tmp_path / "runs")]
    mine = tmp_path / "mine"
    (packaged,) = BASELINES.glob("*/gsm8k-*/w4a8")
    shutil.copytree(packaged, mine / packaged.relative_to(BASELINES), ignore=shutil.ignore_patterns("aa*"))
    result = CliRunner().invoke(main, [*args, "--baselines-root", str(mine)])
    assert result.exit_code == 2 and "no A/A calibration" in result.output and calls == []
    monkeypatch.setattr(baselines, "packaged_root", lambda: tmp_path / "nothing-packaged")
    result = CliRunner().invoke(main, [*args, "--baselines-root", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no stored canary w4a8 baseline for gsm8k" in result.output and calls == []


@pytest.mark.slow
def test_selfcheck_on_the_canary_for_real(tmp_path, data_dir):
    # the A/A row and one faulty kernel, GSM8K only, through the real model and the stored canary baseline
    result = CliRunner().invoke(main, ["selfcheck", "--kernels", f"w4a8,{FAULTY}", "--tasks", "gsm8k",
                                       "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "w4a8" / "gate" / "gate.json").is_file()
    # the faulty kernel fails its conformance check, yet runs until its accuracy FAIL is certain: that is
    # what the table is for (the canary's accuracy catching the fault), and it stops there
    faulty = tmp_path / "runs" / FAULTY.replace("/", "_")
    gate = json.loads((faulty / "gate" / "gate.json").read_text())
    assert gate["conformance"]["ok"] is False and gate["verdict"] == "FAIL"
    assert gate["decision"]["verdict"] != "PASS"  # its accuracy is never shown within the margin
    stop = gate["early_stop"]
    if gate["decision"]["verdict"] == "FAIL":  # stopped once the accuracy FAIL was certain, and says so
        assert 0 < stop["items_run"] < 200 and stop["tasks"]["gsm8k"]["b"] > stop["tasks"]["gsm8k"]["c"]
        assert headline(stop) in (faulty / "gate" / "report.md").read_text()
        assert headline(stop) in (faulty / "gate" / "report.html").read_text()
        assert 'name="early_stop"' in (faulty / "gate" / "junit.xml").read_text()
    else:  # on GSM8K alone the accuracy is not shown worse than M: every item runs
        assert stop is None and gate["decision"]["tasks"]["gsm8k"]["statistics"]["counts"]["n"] == 200
