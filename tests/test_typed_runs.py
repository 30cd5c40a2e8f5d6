"""Runs are models through the flow: the store makes a run's manifest a ``RunManifest`` once (``Run.meta``) and
everything after it reads attributes; a record is serialised and validated once when it is written."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from evalgate.records import ItemRecord, RunManifest
from evalgate.run.store import RecordWriter, Run, load_run, write_manifest
from evalgate.tasks import record_model

ROOT = Path(__file__).resolve().parents[1]
# where a run's files become models (and a shipped baseline's paths are shown as this install's)
EDGE = {"evalgate/run/store.py", "evalgate/run/packaged.py"}
FIELDS = frozenset(RunManifest.model_fields) - {"schema_version"}
LOADERS = {"load_manifest", "dump_manifest", "read_json"}


def _names_manifest(node: ast.AST) -> bool:
    """An expression that holds a manifest as a dict: ``run.manifest``, ``x.as_read``, ``base_manifest``,
    ``run.meta.to_dict()``, ``load_manifest(...)``..."""
    if isinstance(node, ast.Attribute):
        return "manifest" in node.attr or node.attr in ("as_read", "meta")
    if isinstance(node, ast.Name):
        return "manifest" in node.id
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in LOADERS:
            return True
        if name in ("to_dict", "model_dump", "copy", "dict") and isinstance(func, ast.Attribute):
            return _names_manifest(func.value) or (name == "dict" and any(map(_names_manifest, node.args)))
    return False


def _key_read(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(receiver, key) of ``x["key"]`` or ``x.get/pop/setdefault("key", ...)`` with a constant string key."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.value, node.slice.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault")
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.func.value, node.args[0].value
    return None


def manifest_key_reads(source: str) -> list[str]:
    """Every string-key read of a manifest field in ``source``: on an expression that names a manifest, or on
    a variable bound to one (``m = run.manifest``; ``m["kernel"]``). A dict literal is never a manifest."""
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):  # names bound to a manifest anywhere in the module (a conservative reading)
        if isinstance(node, ast.Assign) and _names_manifest(node.value):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None and _names_manifest(node.value):
            if isinstance(node.target, ast.Name):
                bound.add(node.target.id)
    found = []
    for node in ast.walk(tree):
        read = _key_read(node)
        if read is None:
            continue
        receiver, key = read
        if key not in FIELDS or isinstance(receiver, ast.Dict):
            continue
        if _names_manifest(receiver) or (isinstance(receiver, ast.Name) and receiver.id in bound):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_scan_catches_a_manifest_read_by_string_key():
    """The counter below is only as good as what it sees: each way a manifest was read by key before is one."""
    for line in ('kernel = run.manifest["kernel"]["name"]',
                 'fp = run.manifest.get("model", {}).get("fingerprint")',
                 'm = run.manifest\nx = m.get("tasks", {})',
                 'def f(manifest):\n    return manifest["status"]',
                 'x = cand.meta.as_read.get("early_stop")',
                 'x = run.meta.to_dict()["spec"]',
                 'x = load_manifest(path)["kernel"]',
                 'base_manifest = dict(base.manifest)\nbase_manifest["tasks"] = {}'):
        assert manifest_key_reads(line), line
    # not a manifest: a literal, a report row, a field read by attribute
    for line in ('x = {"kernel": 1}["kernel"]', 'x = row["kernel"]', 'x = run.meta.kernel.name',
                 'x = manifest.tasks["gsm8k"].n_items'):
        assert not manifest_key_reads(line), line


def test_no_manifest_field_is_read_by_string_key_outside_the_store():
    found = {}
    for path in sorted((ROOT / "evalgate").rglob("*.py")) + sorted((ROOT / "model_adapters").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in EDGE:
            continue
        reads = manifest_key_reads(path.read_text(encoding="utf-8"))
        if reads:
            found[rel] = reads
    assert sum(map(len, found.values())) == 0, found


def test_a_run_reads_its_manifest_once_as_a_model(tmp_path):
    """``load_run`` validates the manifest and every record once; what the flow gets are those models."""
    from evalgate.canary import BASELINES

    folder = next(p.parent for p in sorted(BASELINES.rglob("manifest.json")) if p.parent.name != "aa")
    run = load_run(folder)
    assert isinstance(run.meta, RunManifest) and run.meta is run.meta  # made once, not per access
    assert run.kernel == run.meta.kernel.name and run.tasks == list(run.meta.tasks)
    task = run.tasks[0]
    items = run.items(task)
    assert items is run.items(task) and len(items) == len(run.records[task]) == run.meta.tasks[task].n_items
    assert all(isinstance(i, record_model(task)) for i in items)
    # a Run made in memory from a dict validates it there, once; a wrong type is refused in one line
    made = Run(tmp_path, dict(run.manifest), run.records)
    assert made.meta.to_dict() == run.meta.to_dict()
    from evalgate.errors import UserError

    with pytest.raises(UserError, match="n_items"):
        Run(tmp_path, {**run.manifest, "tasks": {task: {**run.manifest["tasks"][task], "n_items": "3"}}})


def test_the_writer_validates_each_record_once_and_hands_it_on_without_reading_it_back(tmp_path, monkeypatch):
    model = record_model("gsm8k")
    calls = {"json": 0, "python": 0}
    validate_json, validate = model.model_validate_json, model.model_validate

    def counted_json(*a, **k):
        calls["json"] += 1
        return validate_json(*a, **k)

    def counted(*a, **k):
        calls["python"] += 1
        return validate(*a, **k)

    monkeypatch.setattr(model, "model_validate_json", counted_json)
    monkeypatch.setattr(model, "model_validate", counted)
    from evalgate.canary import BASELINES

    stored = next(p for p in sorted(BASELINES.rglob("gsm8k.jsonl")) if p.parent.name != "aa")
    records = [{k: v for k, v in json.loads(line).items() if k != "schema_version"}  # as a scorer hands them over
               for line in stored.read_text(encoding="utf-8").splitlines()[:3]]
    ids = [r["doc_id"] for r in records]
    writer = RecordWriter(tmp_path / "gsm8k.jsonl")
    written = writer.append(records)
    assert calls == {"json": 3, "python": 0}  # one validation per record, from the line written
    lines = [json.loads(line) for line in (tmp_path / "gsm8k.jsonl").read_text(encoding="utf-8").splitlines()]
    assert written == lines and all(line["schema_version"] == 3 for line in lines)
    assert [i.doc_id for i in writer.items] == ids and all(isinstance(i, ItemRecord) for i in writer.items)
    assert writer.append(records) == [] and calls["json"] == 3  # stored already: neither written nor validated
    writer.close(ids)
    assert [r.to_dict() for r in load_run_items(tmp_path, "gsm8k")] == lines  # what a reader gets, once more


def load_run_items(folder: Path, task: str) -> list[ItemRecord]:
    from evalgate.records import parse

    model = record_model(task)
    return [parse(model, json.loads(line), "test") for line in (folder / f"{task}.jsonl").read_text().splitlines()]


def test_a_manifest_is_written_from_its_model_as_it_reads_back(tmp_path):
    import shutil

    from evalgate.canary import BASELINES

    folder = next(p.parent for p in sorted(BASELINES.rglob("manifest.json")) if p.parent.name != "aa")
    run = load_run(folder)  # a version-2 file, migrated as it is read
    meta = run.meta.updated(status="interrupted", run_id="again")
    write_manifest(tmp_path, meta)
    for task in run.tasks:
        shutil.copyfile(folder / f"{task}.jsonl", tmp_path / f"{task}.jsonl")
    raw = json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8"))
    assert raw == meta.to_dict() and raw["status"] == "interrupted" and raw["schema_version"] == 3
    back = load_run(tmp_path).meta
    assert back.to_dict() == raw and back.read_version == 3 and run.meta.read_version == 2
