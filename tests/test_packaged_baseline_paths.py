"""A baseline shipped with evalgate names the canary model where this install has it, never the folder it was
recorded in on another machine (stored baselines are not rewritten: the path is resolved at read)."""

from __future__ import annotations

import json
import shutil

import evalgate.canary
from evalgate.canary import BASELINES, CANARY_DIR
from evalgate.run.store import MANIFEST, load_run

ELSEWHERE = "/home/someone/checkout/evalgate/canary/model"


def _recorded_elsewhere(root):
    """A copy of the packaged baselines as a developer's machine would have recorded them."""
    shutil.copytree(BASELINES, root)
    manifests = sorted(root.rglob(MANIFEST))
    for manifest in manifests:
        data = json.loads(manifest.read_text())
        data["model"]["path"] = ELSEWHERE
        data["spec"]["model"] = ELSEWHERE
        manifest.write_text(json.dumps(data))
    return [m.parent for m in manifests]


def test_a_shipped_baseline_reads_with_this_installs_canary_path(tmp_path, monkeypatch):
    runs = _recorded_elsewhere(tmp_path / "baselines")
    monkeypatch.setattr(evalgate.canary, "BASELINES", tmp_path / "baselines")  # these are the shipped ones
    for folder in runs:
        run = load_run(folder)
        assert run.manifest["model"]["path"] == str(CANARY_DIR) == run.manifest["spec"]["model"]
        assert ELSEWHERE in (folder / MANIFEST).read_text()  # the stored file is left as it was


def test_a_gate_against_the_shipped_baseline_shows_no_recorded_path(tmp_path, monkeypatch):
    from evalgate.report.html import manifest_rows

    runs = _recorded_elsewhere(tmp_path / "baselines")
    monkeypatch.setattr(evalgate.canary, "BASELINES", tmp_path / "baselines")
    base = load_run(runs[0])
    rows = manifest_rows(base.manifest, base.manifest)
    assert ELSEWHERE not in json.dumps(rows) and str(CANARY_DIR) in json.dumps(rows)


def test_a_run_elsewhere_keeps_its_recorded_path(tmp_path):
    runs = _recorded_elsewhere(tmp_path / "mine")  # a user's own baselines root: not shipped
    assert load_run(runs[0]).manifest["model"]["path"] == ELSEWHERE
