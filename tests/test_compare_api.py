"""``evalgate.compare`` on the gate's own outputs: baselines roots, gate folders, a candidate run on a subset
of the items (checked item by item, never silently mismatched), and runs under different Python minors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import evalgate
from evalgate.errors import NotComparable, UserError
from gate_helpers import policy
from synthetic_runs import write_pair


def _rewrite(run: Path, task: str, change) -> None:
    path = run / f"{task}.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
    kept = [r for r in (change(r) for r in records) if r is not None]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def _manifest(run: Path, change) -> None:
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _with_prompt_hashes(run: Path) -> None:
    _rewrite(run, "humaneval", lambda r: {**r, "prompt_hash": f"h-{r['doc_id']}"})


@pytest.fixture
def pair(tmp_path):
    base, cand = write_pair(tmp_path / "runs", 30, 12, lost_every=3, gained_every=4)
    for run in (base, cand):
        _with_prompt_hashes(run)
    return base, cand


def _limited(cand: Path, dest: Path, n: int) -> Path:
    """The candidate as a ``--limit n`` GSM8K run would store it: the first n items, another profile id."""
    shutil.copytree(cand, dest)
    (dest / "humaneval.jsonl").unlink()
    _rewrite(dest, "gsm8k", lambda r: r if r["doc_id"] < n else None)

    def cut(m):
        del m["tasks"]["humaneval"]
        m["tasks"]["gsm8k"].update(n_items=n, profile_id="9" * 64)
    _manifest(dest, cut)
    return dest


def _records(run: Path, task: str) -> dict:
    return {r["doc_id"]: r for r in map(json.loads, (l for l in (run / f"{task}.jsonl").read_text(encoding="utf-8").split("\n") if l))}


def test_a_limited_candidate_is_refused_with_a_hint_then_compared_on_its_items(pair, tmp_path):
    base, cand = pair
    small = _limited(cand, tmp_path / "small", 10)
    with pytest.raises(NotComparable, match='items="candidate"'):
        evalgate.compare(base, small)
    cmp = evalgate.compare(base, small, items="candidate")
    assert cmp.tasks == ["gsm8k"] and cmp.pairs["gsm8k"].doc_ids == list(range(10))
    b, c = _records(base, "gsm8k"), _records(small, "gsm8k")
    metric = "exact_match,strict-match"
    expected = {d: "lost" if b[d][metric] > c[d][metric] else "gained" for d in c if b[d][metric] != c[d][metric]}
    flips = cmp.flips("gsm8k")
    assert dict(zip(flips["doc_id"], flips["direction"])) == expected and expected
    row = cmp.summary.iloc[0]
    assert row["n"] == 10 and (row["b"], row["c"]) == (sum(v == "lost" for v in expected.values()),
                                                        sum(v == "gained" for v in expected.values()))
    assert any("10 of the baseline's 30 items" in n and "checked item by item" in n for n in cmp.notes)
    # an explicit list and a dict say the same
    same = evalgate.compare(base, small, items={"gsm8k": list(range(10))})
    assert same.pairs["gsm8k"].doc_ids == cmp.pairs["gsm8k"].doc_ids


def test_a_subset_refuses_items_asked_differently_or_missing(pair, tmp_path):
    base, cand = pair
    small = _limited(cand, tmp_path / "small", 10)
    _rewrite(small, "gsm8k", lambda r: {**r, "prompt_hash": "0" * 64} if r["doc_id"] == 4 else r)
    with pytest.raises(NotComparable, match="prompted differently.*first: '4'"):
        evalgate.compare(base, small, items="candidate")
    with pytest.raises(NotComparable, match="not in the candidate"):
        evalgate.compare(base, small, items={"gsm8k": [0, 1, 20]})
    other = _limited(cand, tmp_path / "other", 10)
    _manifest(other, lambda m: m["tasks"]["gsm8k"].update(decoding={"temperature": 0.7, "n": 1}))
    with pytest.raises(NotComparable, match="decoding differs"):
        evalgate.compare(base, other, items="candidate")
    with pytest.raises(UserError, match="items must be"):
        evalgate.compare(base, small, items="all")


def test_a_baselines_root_and_a_gate_folder_stand_for_their_runs(pair, tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.outputs import write_outputs
    from evalgate.run.baselines import record

    base, cand = pair
    root = tmp_path / "baselines"
    dirs = record(base, root)
    assert len(dirs) == 2
    cmp = evalgate.compare(root, cand)
    assert set(cmp.tasks) == {"gsm8k", "humaneval"} and {Path(d) for d in cmp.baseline_dirs} == set(dirs)
    direct = evalgate.compare(dirs, cand)
    assert cmp.summary[["b", "c"]].values.tolist() == direct.summary[["b", "c"]].values.tolist()
    with pytest.raises(NotComparable, match="no stored w4a4 baseline of task"):
        evalgate.compare(root, cand, baseline_kernel="w4a4")

    verdict = gate_runs(load_baseline(dirs), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    write_outputs(verdict, cand / "gate")
    for reopened in (evalgate.compare(cand / "gate"), evalgate.compare(root, cand / "gate"),
                     evalgate.compare(cand / "gate", cand)):
        assert reopened.candidate.path == cand
        assert reopened.summary[["b", "c"]].values.tolist() == direct.summary[["b", "c"]].values.tolist()


def test_runs_under_different_python_minors_are_compared_with_a_warning(pair, tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.html import report_html
    from evalgate.report.text import markdown, verdict_lines

    base, cand = pair
    _manifest(base, lambda m: m["tasks"]["humaneval"]["prepare"].update(python="3.11.7"))
    _manifest(cand, lambda m: m["tasks"]["humaneval"]["prepare"].update(python="3.12.1"))
    cmp = evalgate.compare(base, cand)
    (warning,) = [n for n in cmp.notes if "Python" in n]
    assert warning.startswith("humaneval: the baseline's programs ran under Python 3.11, the candidate's under 3.12")
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    assert verdict.verdict in ("PASS", "FAIL", "INCONCLUSIVE")  # decided, not refused
    assert warning in markdown(verdict) and f"note: {warning}" in verdict_lines(verdict)
    assert verdict_lines(verdict).count(f"note: {warning}") == 1
    assert warning in verdict.to_dict()["notes"]  # gate.json says it too
    assert "ran under Python 3.11, the candidate&#39;s under 3.12" in report_html(verdict)
    # a patch release is not a warning
    _manifest(cand, lambda m: m["tasks"]["humaneval"]["prepare"].update(python="3.11.9"))
    assert not [n for n in evalgate.compare(base, cand).notes if "Python" in n]


def test_a_legacy_profile_with_the_sandbox_python_is_recognised_by_its_recorded_python():
    from evalgate.tasks.humaneval.runtime import recorded_python

    assert recorded_python({"settings": {"sandbox": {"python": "3.11"}}}) == "3.11"
    assert recorded_python({"prepare": {"python": "3.12.3"}, "settings": {"sandbox": {}}}) == "3.12.3"
    assert recorded_python({"settings": {}}) is None
