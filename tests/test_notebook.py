"""examples/inspect_flips.ipynb runs top to bottom in a fresh kernel (nbclient) and shows what it promises."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end: each test takes more than a few seconds

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "inspect_flips.ipynb"
FLIP_COLUMNS = ["doc_id", "direction", "question", "gold", "base_extracted", "cand_extracted", "base_correct",
                "cand_correct", "base_finish_reason", "cand_finish_reason", "base_failure_class",
                "cand_failure_class", "flips_in_aa"]


@pytest.fixture(scope="module")
def executed(data_dir, tmp_path_factory):
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in ("EVALGATE_BASELINE", "EVALGATE_CANDIDATE")}
    env.update(EVALGATE_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path_factory.mktemp("nb")))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client.execute()
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


def test_the_notebook_runs_without_errors(executed):
    errors = [o for c in executed for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert all(c.execution_count for c in executed)


def test_summary_table_has_the_task_and_its_statistics(executed):
    html = _html(_cell(executed, "cmp = evalgate.compare"))
    headers = re.findall(r"<th>([^<]+)</th>", html)
    for column in ("task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high", "b", "c", "p", "verdict"):
        assert column in headers
    rows = re.findall(r"<tr>\s*<th>\d+</th>(.*?)</tr>", html, re.S)
    cells = [re.findall(r"<td>([^<]*)</td>", r) for r in rows]
    verdicts = {c[0]: c[headers.index("verdict")] for c in cells}  # cells after the row's index <th>
    # 6 items can show neither non-inferiority within 1.5 pp (the bound at n = 6 is far below -M) nor a
    # degradation (the random model answers every item wrong with both kernels: no flip, Δ = 0)
    assert verdicts == {"gsm8k": "INCONCLUSIVE"}


def test_comparison_renders_as_rich_html(executed):
    html = _html(next(c for c in executed if c.source.strip() == "cmp"))
    assert "evalgate comparison" in html and "<svg" in html and "gsm8k" in html and "lost" in html


def test_flips_dataframe_has_the_expected_columns(executed):
    html = _html(_cell(executed, 'cmp.flips("gsm8k")'))
    headers = re.findall(r"<th>([^<]+)</th>", html)
    assert headers[: len(FLIP_COLUMNS)] == FLIP_COLUMNS
    assert re.search(r"\d+ lost, \d+ gained", _text(_cell(executed, "lost = cmp.flips")))


def test_show_renders_the_side_by_side_diff(executed):
    changed = _html(_cell(executed, "changed = cmp.changed"))
    html = _html(_cell(executed, "flipped = cmp.flips"))
    assert 'class="sides"' in html and "baseline" in html and "candidate" in html and "gold" in html
    if "<td>" in changed:  # the kernels wrote different text for some item: the diff marks it
        assert '<span class="del">' in html or '<span class="ins">' in html
    text = _text(_cell(executed, "print(view)"))
    assert text.startswith("gsm8k ") and "question:" in text and ("--- baseline" in text or "identical" in text)
