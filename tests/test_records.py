"""Typed, versioned records (evalgate.records): the committed version-1 baselines load unchanged, new files
and the packaged version-2 ones load unchanged (a version-2 run that stopped early too), new files are written
as version 3 and read back the same, and an unknown version or a wrong type is one line (exit 2)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from synthetic_runs import write_pair

from evalgate import records
from evalgate.canary import BASELINES as PACKAGED
from evalgate.errors import UserError
from evalgate.run import baselines
from evalgate.run.store import load_run
from evalgate.tasks import record_model
from evalgate.tasks.gsm8k import Gsm8kRecord
from evalgate.tasks.humaneval.task import HumanEvalRecord
from evalgate.types import AdapterBase
import cli_process

# The canary baselines as an evalgate before schema versions recorded them (version 1, kept byte for byte):
# what the migration must go on reading. The packaged canary baselines are version 2.
BASELINES = Path(__file__).resolve().parent / "fixtures" / "v1-baselines"
BASELINE_DIRS = sorted(p.parent for p in BASELINES.glob("*/*/*/manifest.json"))
RUN_DIRS = BASELINE_DIRS + [d / "aa" for d in BASELINE_DIRS if (d / "aa" / "manifest.json").is_file()]
# the canary baselines packaged with evalgate: version 2, read as they are (never rewritten)
PACKAGED_DIRS = sorted(p.parent for p in PACKAGED.glob("*/*/*/manifest.json"))
PACKAGED_RUNS = PACKAGED_DIRS + [d / "aa" for d in PACKAGED_DIRS if (d / "aa" / "manifest.json").is_file()]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


# --- baselines recorded before versions existed: version 1, read as they are ------------------------------------------------


def test_the_committed_baselines_are_there():
    assert len(BASELINE_DIRS) >= 2 and len(RUN_DIRS) >= 4


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: str(p.relative_to(BASELINES)))
def test_committed_baseline_loads_as_version_1_with_the_same_dicts(run_dir):
    before = _tree_digest(run_dir)
    raw = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    assert "schema_version" not in raw  # committed before versions existed; must stay byte-for-byte as it is
    run = load_run(run_dir)
    assert run.manifest == raw  # what every reader of run.manifest saw before: no field added
    assert run.meta.read_version == 1 and run.meta.schema_version == records.SCHEMA_VERSION
    assert run.meta.to_dict() == {"schema_version": 3, **raw}  # the migrations only add the version
    for task, summary in run.meta.tasks.items():
        assert summary.n_items == raw["tasks"][task]["n_items"] and summary.profile_id == raw["tasks"][task]["profile_id"]
        lines = _jsonl(run_dir / f"{task}.jsonl")
        assert run.records[task] == lines and len(lines) == summary.n_items
        items = run.items(task)
        assert all(type(r) is record_model(task) and r.read_version == 1 for r in items)
        assert [r.doc_id for r in items] == [line["doc_id"] for line in lines]
    assert _tree_digest(run_dir) == before  # reading never touches a stored run


def test_committed_task_records_are_typed():
    gsm8k = load_run(next(d for d in BASELINE_DIRS if (d / "gsm8k.jsonl").is_file())).items("gsm8k")[0]
    assert isinstance(gsm8k, Gsm8kRecord) and isinstance(gsm8k.doc_id, int)
    assert gsm8k.exact_match_strict == gsm8k.exact_match["strict-match"] and gsm8k.invalid_strict is False
    humaneval = load_run(next(d for d in BASELINE_DIRS if (d / "humaneval.jsonl").is_file())).items("humaneval")[0]
    assert isinstance(humaneval, HumanEvalRecord) and humaneval.doc_id.startswith("HumanEval/")
    assert humaneval.pass_at_1 in (0.0, 1.0) and humaneval.n == 1 and isinstance(humaneval.passed, bool)


@pytest.mark.parametrize("base", BASELINE_DIRS, ids=lambda p: str(p.relative_to(BASELINES)))
def test_committed_aa_records_load_as_version_1(base):
    raw = json.loads((base / "aa.json").read_text(encoding="utf-8"))
    assert baselines.read_aa(base) == raw
    aa = baselines.read_aa_record(base)
    assert aa.read_version == 1 and aa.to_dict() == {"schema_version": 3, **raw}
    (task, entry), = aa.tasks.items()
    assert entry.psi0 == raw["tasks"][task]["psi0"] and entry.n == raw["tasks"][task]["n"]
    assert entry.verdict == "PASS" and entry.second_run.order == "reverse"


def test_list_baselines_gives_what_the_raw_files_say():
    before = _tree_digest(BASELINES)
    rows = baselines.list_baselines(BASELINES)
    assert [Path(r["path"]) for r in rows] == BASELINE_DIRS
    for row in rows:
        m = json.loads((Path(row["path"]) / "manifest.json").read_text(encoding="utf-8"))
        aa = json.loads((Path(row["path"]) / "aa.json").read_text(encoding="utf-8"))
        (task, summary), = m["tasks"].items()
        assert row == {"path": row["path"], "task": task, "profile": summary["name"],
                       "profile_id": summary["profile_id"], "kernel": m["kernel"]["name"],
                       "model": m["model"]["fingerprint"], "n_items": summary["n_items"], "aggregate_only": False,
                       "aa_psi0": aa["tasks"][task]["psi0"]}
    assert _tree_digest(BASELINES) == before


def test_a_version_1_baseline_recorded_again_is_written_as_version_3(tmp_path):
    source = next(d for d in BASELINE_DIRS if (d / "gsm8k.jsonl").is_file())
    (written,) = baselines.record(source, tmp_path / "root", tasks=["gsm8k"])
    manifest = json.loads((written / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["schema_version"] == 3
    run = load_run(written)
    assert run.meta.read_version == 3 and run.records["gsm8k"] == _jsonl(source / "gsm8k.jsonl")


# --- the packaged canary baselines: version 2, read as they are ----------------------------------------------


def test_the_packaged_baselines_are_there_and_version_2():
    assert len(PACKAGED_DIRS) >= 2 and len(PACKAGED_RUNS) >= 4
    for run_dir in PACKAGED_RUNS:
        assert json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))["schema_version"] == 2


@pytest.mark.parametrize("run_dir", PACKAGED_RUNS, ids=lambda p: str(p.relative_to(PACKAGED)))
def test_a_packaged_baseline_loads_as_version_2_with_the_same_dicts(run_dir):
    before = _tree_digest(run_dir)
    raw = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    run = load_run(run_dir)
    # read with this install's canary folder as its model (evalgate/run/packaged.py); nothing else changes
    from evalgate.canary import CANARY_DIR

    assert run.manifest["model"]["path"] == run.manifest["spec"]["model"] == str(CANARY_DIR)
    raw = {**raw, "model": {**raw["model"], "path": str(CANARY_DIR)},
           "spec": {**raw["spec"], "model": str(CANARY_DIR)}}
    assert run.manifest == raw and raw["status"] == "complete"
    assert run.meta.read_version == 2 and run.meta.schema_version == records.SCHEMA_VERSION == 3
    assert run.meta.to_dict() == {**raw, "schema_version": 3}  # the 2 -> 3 migration only sets the version
    for task, summary in run.meta.tasks.items():
        lines = _jsonl(run_dir / f"{task}.jsonl")
        assert run.records[task] == lines and len(lines) == summary.n_items
        items = run.items(task)
        assert all(type(r) is record_model(task) and r.read_version == 2 for r in items)
        assert [r.to_dict() for r in items] == [{**line, "schema_version": 3} for line in lines]
    if (run_dir / "aa.json").is_file():
        raw_aa = json.loads((run_dir / "aa.json").read_text(encoding="utf-8"))
        assert baselines.read_aa(run_dir) == raw_aa
        aa = baselines.read_aa_record(run_dir)
        assert aa.read_version == 2 and aa.to_dict() == {**raw_aa, "schema_version": 3}
    assert _tree_digest(run_dir) == before  # reading never touches a stored run


def test_a_version_2_baseline_recorded_again_is_written_as_version_3(tmp_path):
    source = next(d for d in PACKAGED_DIRS if (d / "gsm8k.jsonl").is_file())
    before = _tree_digest(source)
    (written,) = baselines.record(source, tmp_path / "root", tasks=["gsm8k"])
    assert json.loads((written / "manifest.json").read_text(encoding="utf-8"))["schema_version"] == 3
    run = load_run(written)
    assert run.meta.read_version == 3 and run.records["gsm8k"] == _jsonl(source / "gsm8k.jsonl")  # lines as stored
    assert _tree_digest(source) == before


# --- a run written now: version 3, round trip --------------------------------------------------------------


class FakeAdapter(AdapterBase):
    """Answers every GSM8K question with the same number; no model."""

    kernel = SimpleNamespace(name="w4a8", version="fake 1.0", id="w4a8@fake 1.0", description="fake kernel",
                             env={}, recipe={"weights": "e2m1"}, faulty=False)
    load_s = 0.0

    def info(self) -> dict:
        return {"adapter": "fake", "fingerprint": "0123456789abcdef", "config_sha256": "a" * 64,
                "safetensors_headers_sha256": "b" * 64, "tokenizer_sha256": "c" * 64, "dtype": "bfloat16",
                "model_type": "fake", "machine": {"python": sys.version.split()[0], "cuda": None}}

    def generate(self, requests):
        from evalgate.types import Generation

        return [Generation(text=" 6 + 12 = 18\n#### 18", finish_reason="stop", n_prompt_tokens=30, n_tokens=9,
                           latency_s=0.01) for _ in requests]


def _execute(out: Path, data_dir, resume: bool = False) -> Path:
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    spec = RunSpec(model="fake", kernel="w4a8", tasks=["gsm8k"], limit=5, batch_size=2, data_dir=str(data_dir))
    with open(os.devnull, "w") as devnull:
        return execute(spec, out, resume=resume, adapter=FakeAdapter(),
                       progress=Progress(enabled=False, stream=devnull))


@pytest.fixture
def fresh_run(tmp_path, data_dir) -> Path:
    return _execute(tmp_path / "run", data_dir)


def test_a_new_run_is_version_3_and_round_trips(fresh_run):
    raw = json.loads((fresh_run / "manifest.json").read_text(encoding="utf-8"))
    assert raw["schema_version"] == records.SCHEMA_VERSION == 3 and raw["status"] == "complete"
    lines = _jsonl(fresh_run / "gsm8k.jsonl")
    assert len(lines) == 5 and all(line["schema_version"] == 3 for line in lines)
    before = _tree_digest(fresh_run)
    run = load_run(fresh_run)
    assert run.manifest == raw and run.records["gsm8k"] == lines
    meta = run.meta
    assert meta.read_version == 3 and meta.to_dict() == raw  # nothing added, nothing lost
    assert records.RunManifest.model_validate(meta.to_dict()).to_dict() == raw
    assert meta.kernel.name == "w4a8" and meta.model.fingerprint == "0123456789abcdef"
    assert meta.tasks["gsm8k"].n_items == 5 and meta.spec.batch_size == 2 and meta.tasks["gsm8k"].complete is True
    items = run.items("gsm8k")
    assert [r.to_dict() for r in items] == lines
    assert all(r.exact_match_strict is not None and r.profile_id == meta.tasks["gsm8k"].profile_id for r in items)
    assert _tree_digest(fresh_run) == before


def test_a_new_baseline_and_its_aa_record_are_version_3(fresh_run, tmp_path):
    (base,) = baselines.record(fresh_run, tmp_path / "root")
    assert json.loads((base / "manifest.json").read_text())["schema_version"] == 3
    aa = {"tasks": {"gsm8k": {"psi0": 0.0, "delta0": 0.0, "n": 5, "b": 0, "c": 0, "flips": [], "verdict": "PASS",
                              "reasons": ["ok"], "second_run": {"path": str(fresh_run), "batch_size": 2, "order": "reverse"},
                              "first_batch_size": 2}},
          "thresholds_sha256": "d" * 64, "recorded": "2026-01-01T00:00:00+00:00"}
    baselines.write_aa(base, aa, fresh_run)
    written = json.loads((base / "aa.json").read_text())
    assert written == {"schema_version": 3, **aa}
    assert baselines.read_aa(base) == written and baselines.read_aa_record(base).read_version == 3
    row, = baselines.list_baselines(tmp_path / "root")
    assert row["aa_psi0"] == 0.0 and row["n_items"] == 5


def test_an_aa_record_of_the_wrong_type_is_refused_before_anything_is_written(fresh_run, tmp_path):
    (base,) = baselines.record(fresh_run, tmp_path / "root")
    before = _tree_digest(base)
    with pytest.raises(ValueError, match="psi0"):  # a writer's bug: pydantic's ValidationError
        baselines.write_aa(base, {"tasks": {"gsm8k": {"psi0": "zero", "n": 5}}}, fresh_run)
    assert _tree_digest(base) == before


def _as_version_2_stopped_early(run_dir: Path, keep: int) -> dict:
    """Turn a fresh run into a stopped-early run as evalgate wrote one before version 3 (between the early stop
    and the version bump): ``"schema_version": 2`` everywhere, ``keep`` items stored, ``early_stop`` recorded."""
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    lines = _jsonl(run_dir / "gsm8k.jsonl")[:keep]
    total = manifest["tasks"]["gsm8k"]["n_items"]
    info = {"reason": f"FAIL certain once {keep} items were stored, on their best completion: gsm8k: FAIL",
            "items_run": keep, "items_total": total, "tasks": {"gsm8k": {"items_run": keep, "items_total": total}},
            "at": "2026-01-01T00:00:00+00:00"}
    manifest.update(schema_version=2, status="stopped_early", early_stop=info)
    manifest["tasks"]["gsm8k"]["complete"] = False
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (run_dir / "gsm8k.jsonl").write_text("".join(json.dumps({**line, "schema_version": 2}, sort_keys=True) + "\n"
                                                 for line in lines), encoding="utf-8")
    return info


def test_a_version_2_run_that_stopped_early_reads_as_it_is_and_resumes_as_version_3(fresh_run, data_dir):
    # Accepted, not refused: evalgate itself wrote "stopped_early" under version 2 before version 3 existed,
    # and such a run must still gate and resume; its fields are typed the same as in version 3.
    info = _as_version_2_stopped_early(fresh_run, keep=3)
    raw = json.loads((fresh_run / "manifest.json").read_text(encoding="utf-8"))
    before = _tree_digest(fresh_run)
    run = load_run(fresh_run)
    assert run.manifest == raw and run.meta.read_version == 2 and run.meta.to_dict() == {**raw, "schema_version": 3}
    meta = run.meta
    assert meta.status == "stopped_early" and isinstance(meta.early_stop, records.EarlyStopInfo)
    assert meta.early_stop.items_run == 3 and meta.early_stop.tasks["gsm8k"].items_total == 5
    assert [r.read_version for r in run.items("gsm8k")] == [2, 2, 2]
    assert _tree_digest(fresh_run) == before  # read, not rewritten
    stored = (fresh_run / "gsm8k.jsonl").read_text(encoding="utf-8").splitlines()

    _execute(fresh_run, data_dir, resume=True)  # resumed now: the manifest it writes is version 3
    raw = json.loads((fresh_run / "manifest.json").read_text(encoding="utf-8"))
    assert raw["schema_version"] == 3 and raw["status"] == "complete" and "early_stop" not in raw
    assert raw["early_stop_history"] == [info]
    lines = (fresh_run / "gsm8k.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines[:3] == stored  # the stored items stay as written
    assert [json.loads(line)["schema_version"] for line in lines] == [2, 2, 2, 3, 3]
    run = load_run(fresh_run)
    assert run.meta.read_version == 3 and [r.read_version for r in run.items("gsm8k")] == [2, 2, 2, 3, 3]


def test_a_version_2_early_stop_of_the_wrong_type_is_one_line(fresh_run):
    _as_version_2_stopped_early(fresh_run, keep=3)
    manifest = json.loads((fresh_run / "manifest.json").read_text(encoding="utf-8"))
    manifest["early_stop"]["items_run"] = "3"
    (fresh_run / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(UserError) as exc:
        load_run(fresh_run)
    assert ("not a valid run manifest (schema_version 2): early_stop.items_run: input should be a valid integer"
            in _one_line(exc))


def test_an_aggregate_only_baseline_is_version_3(tmp_path):
    path = baselines.import_aggregate("gsm8k", 0.9, 1319, "org/model", "gsm8k-lmeval-v3", root=tmp_path)
    meta = load_run(path).meta
    assert meta.read_version == 3 and meta.aggregate_only is True and meta.tasks["gsm8k"].score == 0.9


# --- gate.json ------------------------------------------------------------------------------------------------


def _verdict(tmp_path: Path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand = write_pair(tmp_path, n_gsm8k=60, n_humaneval=20)
    return gate_runs(load_baseline([str(base)]), load_run(str(cand)), load_thresholds(), True)


def test_the_verdict_writes_and_reads_back_through_its_model(tmp_path):
    verdict = _verdict(tmp_path)
    (tmp_path / "gate.json").write_text(records.verdict_json(verdict.to_dict()), encoding="utf-8")
    raw = json.loads((tmp_path / "gate.json").read_text())
    assert list(raw)[:2] == ["schema_version", "verdict"] and raw["schema_version"] == 3
    gate = records.load_verdict(tmp_path / "gate.json")
    assert gate.read_version == 3 and gate.verdict == verdict.verdict and gate.exit_code == verdict.exit_code
    assert gate.baseline.kernel.name == "w4a8" and gate.candidate.kernel.name == "w4a4_packed"
    assert set(gate.decision.tasks) == {"gsm8k", "humaneval"} and gate.to_dict() == raw
    assert sum(len(rows) for rows in gate.flips.values()) > 0
    old = {k: v for k, v in raw.items() if k != "schema_version"}  # gate.json as evalgate 0.1.0 wrote it
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert records.load_verdict(tmp_path / "old.json").read_version == 1
    # gate.json of a stopped-early candidate as evalgate wrote it before version 3: read as it is
    early_stop = {"reason": "FAIL certain once 12 items were stored", "items_run": 12, "items_total": 80,
                  "tasks": {"gsm8k": {"items_run": 12, "items_total": 60, "b": 3, "c": 0},
                            "humaneval": {"items_run": 0, "items_total": 20, "b": 0, "c": 0}}}
    v2 = {**raw, "schema_version": 2, "early_stop": early_stop}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    gate = records.load_verdict(tmp_path / "v2.json")
    assert gate.read_version == 2 and gate.as_read == v2 and gate.to_dict() == {**v2, "schema_version": 3}
    assert gate.early_stop.items_run == 12 and gate.early_stop.tasks["gsm8k"].items_total == 60


# --- unknown versions and wrong types: one line, exit 2 ---------------------------------------------------------


@pytest.mark.parametrize("version", [4, 0, "x", None, True, 3.0])
def test_an_unknown_manifest_version_is_one_line(tmp_path, version):
    _, cand = write_pair(tmp_path, n_gsm8k=10, n_humaneval=0)
    manifest = json.loads((cand / "manifest.json").read_text())
    (cand / "manifest.json").write_text(json.dumps({**manifest, "schema_version": version}))
    with pytest.raises(UserError) as exc:
        load_run(cand)
    text = _one_line(exc)
    assert str(cand / "manifest.json") in text and f"schema_version {json.dumps(version)}" in text
    assert "1, 2 and 3" in text


def test_an_unknown_record_version_names_the_file_and_line(tmp_path):
    _, cand = write_pair(tmp_path, n_gsm8k=10, n_humaneval=0)
    lines = (cand / "gsm8k.jsonl").read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), "schema_version": 4})
    (cand / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as exc:
        load_run(cand)
    text = _one_line(exc)
    assert f"{str(cand / 'gsm8k.jsonl')!r} line 3" in text and "schema_version 4" in text and "1, 2 and 3" in text


def test_an_unknown_aa_version_is_one_line(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(BASELINE_DIRS[0], base)
    raw = json.loads((base / "aa.json").read_text())
    (base / "aa.json").write_text(json.dumps({**raw, "schema_version": 99}))
    with pytest.raises(UserError) as exc:
        baselines.read_aa(base)
    text = _one_line(exc)
    assert str(base / "aa.json") in text and "schema_version 99" in text and "1, 2 and 3" in text


def test_an_unknown_gate_json_version_is_one_line(tmp_path):
    (tmp_path / "gate.json").write_text(json.dumps({"schema_version": 4, "verdict": "PASS"}))
    with pytest.raises(UserError) as exc:
        records.load_verdict(tmp_path / "gate.json")
    text = _one_line(exc)
    assert str(tmp_path / "gate.json") in text and "schema_version 4" in text and "1, 2 and 3" in text


@pytest.mark.parametrize("where, change, expected", [
    ("manifest", lambda m: m["tasks"]["gsm8k"].update(n_items="ten"), "tasks.gsm8k.n_items: input should be a valid integer"),
    ("manifest", lambda m: m.update(status="done"), "status: input should be 'running', 'interrupted', 'complete' or 'stopped_early'"),
    ("manifest", lambda m: m["kernel"].pop("name"), "kernel.name: field required"),
    ("manifest", lambda m: m.update(tasks=["gsm8k"]), "tasks: input should be a valid dictionary"),
    ("record", lambda r: r.update(doc_id=1.5), "line 1: not a valid per-item record (schema_version 1): doc_id"),
    ("record", lambda r: r.update({"exact_match,strict-match": "1"}), "exact_match,strict-match: input should be a valid number"),
])
def test_a_wrong_type_is_one_line(tmp_path, where, change, expected):
    _, cand = write_pair(tmp_path, n_gsm8k=10, n_humaneval=0)
    if where == "manifest":
        data = json.loads((cand / "manifest.json").read_text())
        change(data)
        (cand / "manifest.json").write_text(json.dumps(data))
    else:
        lines = (cand / "gsm8k.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        change(first)
        (cand / "gsm8k.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    with pytest.raises(UserError) as exc:
        load_run(cand)
    assert expected in _one_line(exc)


def test_a_record_that_is_not_an_object_is_one_line(tmp_path):
    _, cand = write_pair(tmp_path, n_gsm8k=10, n_humaneval=0)
    with open(cand / "gsm8k.jsonl", "a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(UserError, match="line 11: a per-item record must be a JSON object") as exc:
        load_run(cand)
    _one_line(exc)


def test_an_item_stored_twice_is_one_line_and_the_files_are_left_alone(tmp_path):
    _, cand = write_pair(tmp_path, n_gsm8k=10, n_humaneval=0)
    lines = (cand / "gsm8k.jsonl").read_text().splitlines()
    (cand / "gsm8k.jsonl").write_text("\n".join(lines[:4] + [lines[2]] + lines[4:]) + "\n")
    before = _tree_digest(cand)
    with pytest.raises(UserError, match=r"holds item 2 twice \(lines 3 and 5\)") as exc:
        load_run(cand)
    _one_line(exc)
    assert _tree_digest(cand) == before


def test_a_union_mismatch_names_the_field_once():
    with pytest.raises(UserError) as exc:
        records.parse(records.AARecord, {"tasks": {"gsm8k": {"psi0": 0.0, "n": 3, "flips": [1.5]}}}, "'aa.json'")
    assert "tasks.gsm8k.flips.0: wrong type (expected int or str) (got 1.5)" in _one_line(exc)


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    return cli_process.run([*args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.parametrize("command", ["report", "gate"])
@pytest.mark.parametrize("damage", ["candidate manifest", "baseline record"])
def test_the_cli_refuses_an_unknown_version_in_one_line_with_exit_2(tmp_path, command, damage):
    base, cand = write_pair(tmp_path, n_gsm8k=20, n_humaneval=0)
    if damage == "candidate manifest":
        manifest = json.loads((cand / "manifest.json").read_text())
        (cand / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 4}))
        where = str(cand / "manifest.json")
    else:
        lines = (base / "gsm8k.jsonl").read_text().split("\n")  # records' texts may hold other line breaks
        lines[4] = json.dumps({**json.loads(lines[4]), "schema_version": 4})
        (base / "gsm8k.jsonl").write_text("\n".join(lines))
        where = f"{str(base / 'gsm8k.jsonl')!r} line 5"
    args = ["--candidate", str(cand), "--baseline", str(base), "--allow-uncalibrated"]
    args += ["--html", str(tmp_path / "report.html")] if command == "report" else ["--report-dir", str(tmp_path / "rep")]
    proc = _cli([command, *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    stderr = proc.stderr.strip()
    assert stderr.splitlines()[-1].startswith("evalgate: error:"), stderr
    assert "\n" not in stderr, f"stderr is more than the one error line (an import printing warnings?):\n{stderr}"
    assert where in stderr and "schema_version 4" in stderr and "1, 2 and 3" in stderr
    assert not (tmp_path / "report.html").exists() and not (tmp_path / "rep").exists()
