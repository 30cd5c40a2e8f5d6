"""Stored HumanEval runs and baselines recorded while the profile id hashed the sandbox's Python version move
to the new ids (evalgate.tasks.humaneval.profile_migration): verified first, rewritten only then, found by
the gate afterwards. Works on a copy of the canary's packaged baseline, turned into its pre-migration form
whichever form it ships in (the packaged files are never touched)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evalgate.canary import BASELINES
from evalgate.tasks.humaneval import profile_migration as pm

HUMANEVAL = sorted(BASELINES.glob("*/humaneval-*/w4a8"))


def _legacy_copy(root: Path, python: str = "3.11") -> tuple[Path, str, str]:
    """The packaged HumanEval baseline (with its aa/) as it was stored before: ``settings.sandbox.python``
    hashed into its id, folder named by that id. Returns (folder, legacy id, current id)."""
    (source,) = HUMANEVAL
    model = source.parent.parent.name
    work = root / "work"
    shutil.copytree(source, work)
    for run in (work, work / "aa"):
        manifest = json.loads((run / "manifest.json").read_text())
        summary = manifest["tasks"]["humaneval"]
        items = pm._dataset_order({json.loads(l)["doc_id"] for l in (run / "humaneval.jsonl").read_text().splitlines()})
        current = pm._profile_id(pm._identity(summary, items, pm.new_settings(summary["settings"])))
        legacy_settings = {**summary["settings"], "sandbox": {**summary["settings"]["sandbox"], "python": python}}
        legacy = pm._profile_id(pm._identity(summary, items, legacy_settings))
        text = (run / "humaneval.jsonl").read_text().replace(summary["profile_id"], legacy)
        (run / "humaneval.jsonl").write_text(text)
        summary.update(settings=legacy_settings, profile_id=legacy)
        (run / "manifest.json").write_text(pm._json_text(manifest))
    name = source.parent.name[:-12]
    target = root / "baselines" / model / f"{name}{legacy[:12]}" / "w4a8"
    target.parent.mkdir(parents=True)
    work.rename(target)
    return target, legacy, current


@pytest.mark.skipif(len(HUMANEVAL) != 1, reason="needs exactly one packaged HumanEval baseline")
def test_a_legacy_baseline_moves_to_the_new_id_and_the_gate_finds_it(tmp_path):
    from evalgate.plan import planned_profile_ids
    from evalgate.run.baselines import find_stored_baseline
    from evalgate.run.runner import RunSpec
    from evalgate.run.store import load_run

    folder, legacy, current = _legacy_copy(tmp_path)
    root = tmp_path / "baselines"
    planned = planned_profile_ids(RunSpec(model="canary", kernel="w4a8", tasks=["humaneval"],
                                          profiles={"humaneval": "humaneval-canary-v1"}))["humaneval"]
    assert current == planned != legacy  # what this code records, and what the packaged record hashes to
    fingerprint = json.loads((folder / "manifest.json").read_text())["model"]["fingerprint"]
    assert find_stored_baseline([root], fingerprint, planned, "w4a8") is None

    (dry,) = pm.migrate_baselines(root, dry_run=True)
    assert dry.skipped is None and (dry.old_id, dry.new_id) == (legacy, planned) and folder.is_dir()
    (done,) = pm.migrate_baselines(root)
    assert done.skipped is None and done.records == 164 and not folder.exists()
    found = find_stored_baseline([root], fingerprint, planned, "w4a8")
    assert found == done.renamed_to and found.parent.name.endswith(planned[:12])
    run, aa = load_run(found), load_run(found / "aa")
    for r in (run, aa):
        summary = r.manifest["tasks"]["humaneval"]
        assert summary["profile_id"] == planned and "python" not in summary["settings"]["sandbox"]
        assert summary["prepare"]["python"].startswith("3.")  # still recorded
        assert {rec["profile_id"] for rec in r.records["humaneval"]} == {planned}
    assert (found / "aa.json").read_bytes() == (HUMANEVAL[0] / "aa.json").read_bytes()
    # idempotent: nothing left to do
    (again,) = pm.migrate_baselines(root)
    assert again.skipped and "already" in again.skipped


@pytest.mark.skipif(len(HUMANEVAL) != 1, reason="needs exactly one packaged HumanEval baseline")
def test_a_record_that_does_not_verify_is_left_as_it_is(tmp_path):
    folder, legacy, _ = _legacy_copy(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tasks"]["humaneval"]["settings"]["max_new_tokens"] = 999  # not what its id was hashed from
    (folder / "manifest.json").write_text(pm._json_text(manifest))
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    (m,) = pm.migrate_baselines(tmp_path / "baselines")
    assert m.skipped and "not what its manifest and items hash to" in m.skipped
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_the_command_line_reports_each_folder(tmp_path, capsys):
    assert pm.main([]) == 2
    assert pm.main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert pm.main([str(tmp_path / "empty"), "--dry-run"]) == 0
