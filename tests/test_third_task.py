"""A third task in one file (tests/arith_task.py) plus a policy section: installed as a package that offers it
through the ``evalgate.tasks`` entry point, evalgate finds it by name, stores its records with its own record
model, renders its items its way, and calibrates and gates it end to end on the built-in canary."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import evalgate.tasks as tasks
from evalgate.errors import UserError

HERE = Path(__file__).resolve().parent
POLICY_SECTION = """
  arith:
    profile: arith-v1
    metric: exact_match
    margin_pp: 30.0
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder laid out as an installed distribution (arith-task 0.1) whose one module is the task's file."""
    root = tmp_path_factory.mktemp("site")
    shutil.copyfile(HERE / "arith_task.py", root / "arith_task.py")
    info = root / "arith_task-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: arith-task\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[evalgate.tasks]\narith = arith_task:TASK\n")
    broken = root / "broken_tasks-0.1.dist-info"  # a package whose tasks cannot be used
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-tasks\nVersion: 0.1\n")
    (broken / "entry_points.txt").write_text("[evalgate.tasks]\nmissing = no_such_module:TASK\n"
                                             "misnamed = arith_task:TASK\ngsm8k = arith_task:TASK\n")
    return root


def _forget() -> None:
    tasks._entry_points.cache_clear()
    tasks._installed.cache_clear()
    sys.modules.pop("arith_task", None)


@pytest.fixture
def installed(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    _forget()
    yield site
    _forget()


def _policy(tmp_path: Path) -> Path:
    """The packaged default policy with a section for the new task."""
    policy = tmp_path / "thresholds.yaml"
    policy.write_text((HERE.parent / "thresholds.yaml").read_text(encoding="utf-8").rstrip("\n") + "\n" + POLICY_SECTION)
    return policy


def test_an_installed_task_is_known_by_its_entry_point_and_brings_its_record_model(installed):
    assert tasks.task_names()[:2] == ["gsm8k", "humaneval"] and "arith" in tasks.task_names()
    assert "arith_task" not in sys.modules  # listed from the package's metadata alone: nothing imported
    task = tasks.get_task("arith")
    assert task.name == "arith" and task.default_profile == "arith-v1"
    assert tasks.record_model("arith").__name__ == "ArithRecord"
    assert tasks.record_model("no_such_task").__name__ == "ItemRecord"  # an unknown task's records still read


def test_without_the_package_the_task_is_unknown_in_one_line(monkeypatch):
    _forget()
    with pytest.raises(UserError, match=r"unknown task 'arith'; choose from: gsm8k, humaneval$"):
        tasks.get_task("arith")


def test_an_installed_task_that_cannot_be_used_is_refused_in_one_line(installed):
    with pytest.raises(UserError, match=r"task 'missing' \(entry point no_such_module:TASK\): loading it failed "
                                        r"\(ModuleNotFoundError: No module named 'no_such_module'\)"):
        tasks.get_task("missing")
    with pytest.raises(UserError, match="the object is named 'arith'; an entry point is named as its task"):
        tasks.get_task("misnamed")
    assert type(tasks.get_task("gsm8k")).__module__ == "evalgate.tasks.gsm8k"  # a name of evalgate's stays its own
    assert tasks.task_names().count("gsm8k") == 1


def test_a_task_that_lacks_a_declaration_is_refused_by_name(installed):
    class Partial:
        name = "partial"
        profiles: dict = {}
        default_profile = "p"
        gate_metric = "exact_match"

    with pytest.raises(UserError, match="task 'partial' lacks record_model, data_files, load"):
        tasks.register_task(Partial())
    from arith_task import Arith

    theirs = Arith()
    theirs.name = "gsm8k"
    with pytest.raises(UserError, match="'gsm8k' is evalgate's own task"):
        tasks.register_task(theirs)


def test_a_registered_task_is_found_and_forgotten(installed):
    from arith_task import Arith

    mine = Arith()
    mine.name = "arith_copy"
    mine.profiles = {"arith-copy": _renamed(mine.profiles["arith-v1"], "arith-copy", "arith_copy")}
    mine.default_profile = "arith-copy"
    assert tasks.register_task(mine) is mine
    try:
        assert tasks.get_task("arith_copy") is mine and "arith_copy" in tasks.task_names()
    finally:
        tasks.unregister_task("arith_copy")
    assert "arith_copy" not in tasks.task_names()


def _renamed(profile, name: str, task: str):
    from dataclasses import replace

    return replace(profile, name=name, task=task)


def test_the_reports_name_the_item_as_the_task_does(installed):
    from evalgate.gate.compare import item_gold, item_question
    from evalgate.report.html import item_data

    base = {"doc_id": 3, "question": "25 + 25", "target": "50", "extracted": "50", "exact_match": 1.0,
            "resps": " 50", "finish_reason": "stop"}
    cand = {**base, "extracted": "5", "exact_match": 0.0, "resps": " 5"}
    shown = item_data("arith", 3, base, cand, "exact_match")
    assert shown["question"] == "What is 25 plus 25?"  # the task's item_heading
    assert shown["gold"] == "50" and shown["direction"] == "lost"  # TaskBase's defaults: target, extracted
    assert shown["base"]["extracted"] == "50" and shown["cand"]["extracted"] == "5"
    assert item_question("arith", base) == "25 + 25" and item_gold("arith", base) == "50"


@pytest.mark.slow
def test_a_third_task_in_one_file_is_calibrated_and_gated_end_to_end(installed, tmp_path, monkeypatch):
    from evalgate.cli.main import main

    monkeypatch.chdir(tmp_path)
    policy, root, run = _policy(tmp_path), tmp_path / "baselines", tmp_path / "candidate"
    runner = CliRunner()
    calibrated = runner.invoke(main, ["calibrate", "--tasks", "arith", "--baselines-root", str(root), "--thresholds",
                                      str(policy), "--runs-dir", str(tmp_path / "aa")], catch_exceptions=False)
    assert calibrated.exit_code == 0, calibrated.output
    stored = sorted(p.parent for p in root.glob("*/*/*/manifest.json"))
    assert len(stored) == 1 and (stored[0] / "aa.json").is_file() and (stored[0] / "arith.jsonl").is_file()

    gated = runner.invoke(main, ["gate", "--tasks", "arith", "--baselines-root", str(root), "--thresholds",
                                 str(policy), "--out", str(run), "--max-samples", "1"], catch_exceptions=False)
    verdict = json.loads((run / "gate" / "gate.json").read_text())
    assert gated.exit_code == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}[verdict["verdict"]], gated.output
    decision = verdict["decision"]["tasks"]["arith"]
    assert list(verdict["decision"]["tasks"]) == ["arith"]
    assert verdict["baseline_dirs"] == [str(stored[0])]
    n = len(__import__("arith_task").ITEMS)
    counts = decision.get("statistics", decision)["counts"]  # the task decision's numbers, in parts or flat
    assert counts["n"] == n and counts["a"] + counts["b"] + counts["c"] + counts["d"] == n
    assert "| arith | 20 |" in (run / "gate" / "report.md").read_text()

    # every record was written and is read back through the task's own model
    from evalgate.run.store import load_run

    items = load_run(run).items("arith")
    assert len(items) == n and all(type(r).__name__ == "ArithRecord" for r in items)
    assert all(r.target == str(sum(__import__("arith_task").ITEMS[r.doc_id])) for r in items)

    # the stored pair decided again from the Python API: the same verdict
    import evalgate

    again = evalgate.decide([stored[0]], run, policy)
    assert again.verdict == verdict["verdict"]
