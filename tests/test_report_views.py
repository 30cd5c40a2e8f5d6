"""What people read, without a browser: the HTML report's badges, HumanEval rows and Runs table, the terminal
table in a CI log, `calibrate`'s exit code, and CLI output free of third-party import chatter."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from gate_helpers import policy
from synthetic_runs import write_pair


@pytest.fixture
def inconclusive(tmp_path):
    """A gate that loses one GSM8K item of 30: no degradation shown, non-inferiority at 5 pp not shown either."""
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand = write_pair(tmp_path / "runs", 30, 12, lost_every=29, gained_every=31)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    assert verdict.verdict == "INCONCLUSIVE"
    return verdict


def test_an_inconclusive_verdict_has_its_own_badge_not_pass_or_fail_colours(inconclusive):
    from evalgate.report.html import VERDICT_COLORS, report_html

    html = report_html(inconclusive)
    assert '<header id="verdict" class="banner INCONCLUSIVE">' in html
    assert re.search(r'<div class="big">\? <span id="verdict-text">INCONCLUSIVE</span>', html)
    assert '<span class="badge INCONCLUSIVE">INCONCLUSIVE</span>' in html
    for rule in (".eg .INCONCLUSIVE {", ".banner.INCONCLUSIVE {"):
        css = html[html.index(rule):].split("}")[0]
        assert "#fff8c5" in css and "#dafbe1" not in css and "#ffebe9" not in css
    charts = re.findall(r'<svg class="ci".*?</svg>', html, re.S)
    inconclusive_charts = [c for c, r in zip(charts, inconclusive.decision.tasks.values()) if r.outcome.verdict == "INCONCLUSIVE"]
    assert inconclusive_charts and all(VERDICT_COLORS["INCONCLUSIVE"] in c for c in inconclusive_charts)
    assert all(VERDICT_COLORS["FAIL"] not in c.split("−M")[-1] for c in inconclusive_charts)


def test_humaneval_rows_name_the_function_and_its_tests_not_the_id(tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.html import report_html

    base, cand = write_pair(tmp_path / "runs", 30, 12, lost_every=3, gained_every=4)
    html = report_html(gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True))
    rows = re.findall(r'<details class="flip"[^>]*data-task="humaneval".*?</summary>', html, re.S)
    assert rows
    for row in rows:
        doc_id = re.search(r'<span class="mono">(HumanEval/\d+)</span>', row).group(1)
        i = doc_id.split("/")[1]
        question = re.search(r'<span class="q"[^>]*>(.*?)</span>', row, re.S).group(1)
        assert question.startswith(f"def f_{i}(xs: list) -&gt; int: Sum of xs.") and doc_id not in question
        assert f">check(f_{i})</span>" in row


def test_the_runs_table_gives_each_path_header_its_own_column(inconclusive):
    from evalgate.report.html import report_html

    html = report_html(inconclusive)
    table = re.search(r'<table class="grid manifest">(.*?)</table>', html, re.S).group(1)
    assert re.search(r'<colgroup><col class="section"><col class="key"><col class="side"><col class="side"></colgroup>', table)
    headers = re.findall(r"<th>(.*?)</th>", table.split("</tr>")[0], re.S)
    assert [re.sub(r"<[^>]+>", "|", h).strip("|").split("|")[0] for h in headers[2:]] == ["baseline", "candidate"]
    css = html[html.index("<style>"):html.index("</style>")]
    # the shared .grid th nowrap would push a long path over the next header: undone for this table
    assert ".eg table.manifest th { white-space: normal; }" in css and "table-layout: fixed" in css
    assert css.index(".eg table.manifest th {") > css.index(".eg table.grid th {")  # the later rule wins


def test_the_terminal_table_in_a_log_is_one_line_per_task_and_reasons_are_not_wrapped(inconclusive):
    from evalgate.report.rows import verdict_reason
    from evalgate.report.text import LOG_WIDTH, print_verdict, verdict_lines

    out = io.StringIO()  # not a terminal: a CI log or a file
    print_verdict(inconclusive, out)
    lines = out.getvalue().splitlines()
    below = verdict_lines(inconclusive)
    # what decides the verdict comes first, whole on one line; then the table
    assert lines[0].startswith("INCONCLUSIVE — ") and lines[0] == verdict_reason(inconclusive)
    assert lines[1] == "evalgate verdict: INCONCLUSIVE" and below
    table, rest = lines[1:lines.index(below[0])], lines[lines.index(below[0]):]
    assert rest == below  # each reason, warning and note whole, on its own line, after the table
    assert all(len(line) <= LOG_WIDTH and line == line.rstrip() for line in table)
    for task, decision in inconclusive.decision.tasks.items():
        (row,) = [line for line in table if line.split()[:1] == [task]]  # exactly one table line per task
        assert row.split()[-1] == decision.outcome.verdict
    assert len(table) == 3 + len(inconclusive.decision.tasks)  # title, header, rule, one row per task


@pytest.mark.parametrize("verdicts, code", [(["PASS", "PASS"], 0), (["PASS", "INCONCLUSIVE"], 3),
                                            (["INCONCLUSIVE", "FAIL"], 1), (["FAIL"], 1)])
def test_calibrate_exits_like_the_gate(verdicts, code):
    from evalgate.cli.calibrate import exit_code

    assert exit_code({f"t{i}": {"verdict": v} for i, v in enumerate(verdicts)}) == code


def test_the_cli_hides_only_the_known_third_party_chatter():
    pytest.importorskip("torchao")
    code = ("import logging, evalgate.cli.main, transformers, torchao\n"
            "logging.getLogger('torchao').warning('another torchao warning')\n"
            "logging.getLogger('torchao').error('Failed to load /x/y.so: an error still shows')\n"
            "logging.getLogger('evalgate.test').warning('evalgate warns')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" in proc.stderr and "an error still shows" in proc.stderr  # errors are never hidden
    assert proc.stderr.count("Failed to load") == 1
    assert "natively supported by torch.compile" not in proc.stderr
    assert "another torchao warning" in proc.stderr and "evalgate warns" in proc.stderr
