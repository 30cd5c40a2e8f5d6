"""examples/inspect_flips.ipynb runs top to bottom in a fresh kernel (nbclient) on real runs — the canary's
packaged W4A8 baseline and a candidate run of the packed W4A4 kernel on a subset of HumanEval — and what it
shows agrees with the two runs' records read independently, item by item.

Nothing here pins today's canary: no flip count, score or item id. The canary and its baseline are re-trained
and re-recorded; the checks are structural and of consistency.
"""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end: the candidate run takes about a minute

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "inspect_flips.ipynb"
SUMMARY_COLUMNS = ("task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high", "b", "c", "p", "verdict")


@pytest.fixture(scope="module")
def notebook_tmp(tmp_path_factory):
    """The notebook kernel's temporary folder ($TMPDIR)."""
    return tmp_path_factory.mktemp("nb")


@pytest.fixture(scope="module")
def examples_before():
    """What the notebook's folder (its working directory) holds before it runs."""
    return sorted(p.name for p in NOTEBOOK.parent.iterdir())


@pytest.fixture(scope="module")
def kept_candidate(tmp_path_factory):
    """A copy of the candidate run the notebook made, taken before its last cell removes it."""
    return tmp_path_factory.mktemp("kept") / "candidate"


@pytest.fixture(scope="module")
def executed(data_dir, notebook_tmp, kept_candidate, examples_before):
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items()
           if k not in ("EVALGATE_BASELINE", "EVALGATE_CANDIDATE", "EVALGATE_EXAMPLE_LIMIT", "EVALGATE_BASELINES")}
    env.update(EVALGATE_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1", TMPDIR=str(notebook_tmp))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        with client.setup_kernel():
            last = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
            for index, cell in enumerate(nb.cells):
                if index == last:  # the cleanup: keep what the tests read of the candidate first
                    first = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.output_type == "stream")
                    made = Path(re.search(r"^candidate:\s*(.+)$", first, re.M).group(1).strip())
                    shutil.copytree(made, kept_candidate)
                client.execute_cell(cell, index)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [c for c in nb.cells if c.cell_type == "code"]


def _cell(cells, source_start: str):
    found = [c for c in cells if c.source.strip().startswith(source_start)]
    assert found, f"no code cell starts with {source_start!r}"
    return found[0]


def _html(cell) -> str:
    return "".join(o["data"].get("text/html", "") for o in cell.outputs if o.output_type == "execute_result")


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _frame(html: str) -> tuple[list[str], list[list[str]]]:
    """A pandas DataFrame's HTML as (column headers, rows of cell texts)."""
    head = re.search(r"<thead>(.*?)</thead>", html, re.S).group(1)
    headers = [html_lib.unescape(h) for h in re.findall(r"<th>([^<]*)</th>", head)]
    body = re.search(r"<tbody>(.*?)</tbody>", html, re.S)
    rows = re.findall(r"<tr>\s*<th>\d+</th>(.*?)</tr>", body.group(1) if body else "", re.S)
    return headers, [[html_lib.unescape(c) for c in re.findall(r"<td>(.*?)</td>", r, re.S)] for r in rows]


def _records(path: Path, task: str) -> dict:
    lines = (path / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["doc_id"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(executed, kept_candidate):
    """The two folders the notebook compared, and their records read here without evalgate."""
    first = _text(executed[0])
    candidate = Path(re.search(r"^candidate:\s*(.+)$", first, re.M).group(1).strip())
    assert not candidate.exists()  # the notebook's last cell removed it: the copy taken before is read
    candidate = kept_candidate
    text = _text(_cell(executed, "cmp = evalgate.compare"))
    baseline = Path(re.search(r"^baseline folder:\s*(.+)$", text, re.M).group(1).strip())
    cand, base = _records(candidate, "humaneval"), _records(baseline, "humaneval")
    expected = {}
    for doc_id, c in cand.items():
        b = base[doc_id]  # every candidate item is one of the baseline's
        if b["pass@1"] != c["pass@1"]:
            expected[doc_id] = "lost" if b["pass@1"] > c["pass@1"] else "gained"
    return {"candidate": candidate, "baseline": baseline, "cand": cand, "base": base, "flips": expected}


def test_the_notebook_runs_without_errors(executed):
    errors = [o for c in executed for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[:1]
    assert all(c.execution_count for c in executed)


def test_it_compares_the_packaged_canary_baseline_with_a_real_candidate_subset(executed, runs):
    from evalgate.canary import BASELINES

    assert BASELINES.resolve() in runs["baseline"].resolve().parents  # the baseline shipped with evalgate
    manifest = json.loads((runs["candidate"] / "manifest.json").read_text())
    assert manifest["kernel"]["name"] == "w4a4_packed" and manifest["status"] == "complete"
    assert list(manifest["tasks"]) == ["humaneval"]
    n = manifest["tasks"]["humaneval"]["n_items"]
    assert 0 < n < len(runs["base"]) and len(runs["cand"]) == n  # a subset, and all of it
    text = _text(_cell(executed, "cmp = evalgate.compare"))
    assert f"humaneval: {n} items" in text
    assert re.search(rf"note: humaneval: {n} of the baseline's {len(runs['base'])} items, checked item by item", text)


def test_summary_agrees_with_the_records(executed, runs):
    headers, rows = _frame(_html(_cell(executed, "cmp.summary")))
    for column in SUMMARY_COLUMNS:
        assert column in headers
    (row,) = rows
    cell = dict(zip(headers[1:], row))  # the first header is the index's
    cand, base, flips = runs["cand"], runs["base"], runs["flips"]
    assert cell["task"] == "humaneval" and int(cell["n"]) == len(cand)
    assert float(cell["baseline"]) == pytest.approx(sum(base[d]["pass@1"] for d in cand) / len(cand), abs=1e-5)
    assert float(cell["candidate"]) == pytest.approx(sum(r["pass@1"] for r in cand.values()) / len(cand), abs=1e-5)
    assert int(cell["b"]) == sum(v == "lost" for v in flips.values())
    assert int(cell["c"]) == sum(v == "gained" for v in flips.values())
    assert cell["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")


def test_comparison_renders_as_rich_html(executed):
    html = _html(next(c for c in executed if c.source.strip() == "cmp"))
    assert "evalgate comparison" in html and "<svg" in html and "humaneval" in html and "lost" in html
    assert re.search(r'class="badge (PASS|FAIL|INCONCLUSIVE)"', html)


def test_flips_are_the_per_item_differences(executed, runs):
    headers, rows = _frame(_html(_cell(executed, 'cmp.flips(task)[')))
    assert headers[1:5] == ["doc_id", "direction", "question", "gold"]
    shown = {r[0]: r[1] for r in rows}
    assert shown == runs["flips"]  # exactly the items whose pass@1 differs, with their direction
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), key=["lost", "gained"].index)  # lost first
    for doc_id, _, question, gold, *_ in rows:
        record = runs["base"][doc_id]
        assert question.startswith(f"def {record['entry_point']}(") and doc_id not in question
        assert gold == f"check({record['entry_point']})"
    lost, gained = (sum(v == d for v in runs["flips"].values()) for d in ("lost", "gained"))
    assert f"{lost} lost, {gained} gained" in _text(_cell(executed, "lost = cmp.flips"))


def test_changed_lists_every_item_whose_completion_differs(executed, runs):
    _, rows = _frame(_html(_cell(executed, "changed = cmp.changed")))
    differ = {d for d, c in runs["cand"].items() if c["resps"] != runs["base"][d]["resps"]}
    assert {r[0] for r in rows} == differ
    assert set(runs["flips"]) <= differ  # a score moves only when the text does


def test_show_renders_the_side_by_side_diff_of_a_flip(executed, runs):
    html = _html(_cell(executed, "flipped = cmp.flips"))
    text = _text(_cell(executed, "print(view)"))
    assert 'class="sides"' in html and "baseline" in html and "candidate" in html
    doc_id = re.match(r"humaneval (\S+): (lost|gained|same)", text).group(1)
    if runs["flips"]:  # the first flip, lost before gained, is the one shown
        first = sorted(runs["flips"], key=lambda d: (["lost", "gained"].index(runs["flips"][d]), d))[0]
        assert doc_id == first and f"humaneval {doc_id}: {runs['flips'][doc_id]}" in text
    record = runs["base"][doc_id]
    assert f"question: def {record['entry_point']}(" in text and f"gold: check({record['entry_point']})" in text
    if runs["cand"][doc_id]["resps"] != record["resps"]:  # different text: the diff marks it both ways
        assert '<span class="del">' in html or '<span class="ins">' in html
        assert "--- baseline" in text and "+++ candidate" in text
    else:
        assert "identical completions" in text


def test_the_notebook_writes_nothing_into_its_folder(examples_before, executed):
    # (a comparison's look record went to ./results/baselines/looks of the working directory)
    assert sorted(p.name for p in NOTEBOOK.parent.iterdir()) == examples_before


def test_the_notebook_leaves_no_temporary_folder_behind(executed, notebook_tmp):
    # the example run and the report page live in one folder its last cell removes; the kernel has exited
    assert "removed" in _text(executed[-1])
    # (torch keeps its compile cache, torchinductor_<user>, in $TMPDIR for every later process: not ours)
    left = [p.name for p in notebook_tmp.iterdir() if not p.name.startswith("torchinductor_")]
    assert not left, "left behind in the kernel's TMPDIR"
