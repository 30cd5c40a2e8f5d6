"""gate.json's task decisions in parts (rule, statistics, checks, resolution, outcome), and a flat gate.json
as evalgate wrote it before the parts still read, each value as it was.

``fixtures/gate-json-flat/gate.json`` was written by evalgate at commit 2433133 (the last with one flat dict
per task): ``write_pair(root, n_gsm8k=60, n_humaneval=20)`` from ``tests/synthetic_runs.py``, an ``aa.json``
(:data:`AA`) beside the baseline, ``decide_pair([base], cand)`` under the packaged policy, and
``records.verdict_json(verdict.to_dict())``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from evalgate import records
from evalgate.api import decide

from synthetic_runs import write_pair

FLAT = Path(__file__).parent / "fixtures" / "gate-json-flat" / "gate.json"
AA = {"schema_version": 3, "tasks": {"gsm8k": {"psi0": 0.05, "n": 60, "flips": [1, 4, 7]},
                                     "humaneval": {"psi0": 0.10, "n": 20, "flips": ["HumanEval/1", "HumanEval/3"]}}}
PARTS = ["task", "rule", "statistics", "checks", "resolution", "outcome"]


def _today(tmp_path: Path) -> Path:
    """The fixture's pair decided by this evalgate, its gate.json written as now."""
    base, cand = write_pair(tmp_path, n_gsm8k=60, n_humaneval=20)
    (base / "aa.json").write_text(json.dumps(AA))
    verdict = decide([str(base)], str(cand))  # the API's edge: folders loaded, the policy resolved
    (tmp_path / "gate.json").write_text(records.verdict_json(verdict.to_dict()), encoding="utf-8")
    return tmp_path / "gate.json"


def _same(a, b) -> bool:
    """Equal, floats to 12 significant digits."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    return type(a) is type(b) and a == b


def test_a_flat_gate_json_reads_in_parts_with_the_verdict_and_numbers_of_today(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./thresholds.yaml: the packaged policy, as when the fixture was written
    flat = json.loads(FLAT.read_text())
    assert "outcome" not in flat["decision"]["tasks"]["gsm8k"]  # the fixture is the flat form
    old = records.load_verdict(FLAT)
    new = records.load_verdict(_today(tmp_path / "now"))
    written = json.loads((tmp_path / "now" / "gate.json").read_text())
    assert list(written["decision"]["tasks"]["gsm8k"]) == PARTS
    assert old.verdict == new.verdict and old.exit_code == new.exit_code
    assert set(old.decision.tasks) == set(new.decision.tasks) == {"gsm8k", "humaneval"}
    for task in new.decision.tasks:
        then, now = old.decision.tasks[task], new.decision.tasks[task]
        # every part the same, value for value: the flat form's numbers are today's, in today's places (a
        # p-value may differ in its last bits between scipy builds)
        assert _same(then.model_dump(), now.model_dump()), task
        assert then.outcome.verdict == now.outcome.verdict and then.rule.margin == now.rule.margin
        assert then.resolution.aa_psi0 == AA["tasks"][task]["psi0"] and then.statistics.n_samples == 1
    assert old.as_read == flat  # the file itself is read as it is, never rewritten
    assert FLAT.read_text() == json.dumps(flat, indent=2, ensure_ascii=False) + "\n"


def test_no_flat_value_is_lost_or_changed_in_the_parts():
    flat = json.loads(FLAT.read_text())["decision"]["tasks"]["humaneval"]
    nested = records.nested_task_decision(flat)
    assert list(nested) == PARTS
    found = {key: value for part in PARTS[1:] for key, value in nested[part].items()}
    renamed = {"inconclusive_enabled": "inconclusive", "data_warnings": "input_warnings"}
    for key, value in flat.items():
        if key != "task":
            assert found[renamed.get(key, key)] == value, key
    # the rule's rate limits and token band, which the flat form kept only in its checks
    assert nested["rule"]["max_invalid_rise"] == flat["invalid"]["limit"]
    assert nested["rule"]["max_truncation_rise"] == flat["truncation"]["limit"]
    assert nested["rule"]["token_ratio_band"] == flat["tokens"]["band"]
    # the parts form reads as it is
    assert records.TaskDecisionRecord.model_validate(nested).model_dump() == \
        records.TaskDecisionRecord.model_validate(flat).model_dump()
