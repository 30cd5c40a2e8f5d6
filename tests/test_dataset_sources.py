"""Every task's rows through ``datasets``: the packaged files, a save_to_disk copy, Parquet and JSONL copies,
column mapping, a hub id (offline, and through a stand-in for the hub), and the identity of what was read.

No test here reaches the network; copies are built once per session from the packaged rows.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.run.spec import RunSpec, load_tasks
from evalgate.tasks import source
from evalgate.tasks.data import DATA_DIR_ENV, packaged_data_dir, parse_jsonl, read_verified
from evalgate.tasks.gsm8k import FILES as GSM8K_FILES
from evalgate.tasks.humaneval.problems import PUBLISHED as HUMANEVAL_FILE
from evalgate.tasks.source import items_sha256, parse_dataset_options
import cli_process

datasets = pytest.importorskip("datasets")

CANARY = {"gsm8k": "gsm8k-canary-v1", "humaneval": "humaneval-canary-v1"}
# the ids of the canary's packaged W4A8 baselines (evalgate/canary/baselines/...)
CANARY_IDS = {"gsm8k": "479b86ce74d8e53f20d9cdf72a12294912590381f05b426cd155da0b8e8ab6aa",
              "humaneval": "983dfc0c3eb77332db6470e3710832367a2a22be03e078a7b00e6b38b090bbab"}
HUMANEVAL = "humaneval/HumanEval.jsonl.gz"
PUBLISHED = {f.path: f for f in (*GSM8K_FILES.values(), HUMANEVAL_FILE)}  # every file the tasks declare
TRAIN = PUBLISHED["gsm8k/train.jsonl"]
FIELDS = {"gsm8k/test.jsonl": ("question", "answer"), "gsm8k/train.jsonl": ("question", "answer"),
          HUMANEVAL: ("task_id", "prompt", "canonical_solution", "test", "entry_point")}


def _published_rows(rel: str) -> list[dict]:
    return parse_jsonl(read_verified(None, PUBLISHED[rel]))


@pytest.fixture(scope="session")
def copies(tmp_path_factory) -> dict:
    """The packaged rows as a save_to_disk folder, a folder of Parquet files, JSONL files, and variants."""
    root = tmp_path_factory.mktemp("copies")
    train, test, he = (datasets.Dataset.from_list(_published_rows(r))
                       for r in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", HUMANEVAL))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(root / "gsm8k-saved"))
    he.save_to_disk(str(root / "humaneval-saved"))
    (root / "gsm8k-parquet").mkdir()
    train.to_parquet(str(root / "gsm8k-parquet" / "train.parquet"))
    test.to_parquet(str(root / "gsm8k-parquet" / "test.parquet"))
    he.to_parquet(str(root / "humaneval.parquet"))
    (root / "gsm8k-jsonl").mkdir()
    for name, part in (("train", train), ("test", test)):
        with open(root / "gsm8k-jsonl" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps({"answer": row["answer"], "question": row["question"], "extra": 1}) + "\n")
    with gzip.open(root / "humaneval.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in he:
            f.write(json.dumps(row) + "\n")
    # one row changed: the fifth canary item's question gains a word
    from evalgate.tasks.gsm8k import short_train_items

    changed = train.to_list()
    i = short_train_items(changed)[4]
    changed[i] = {**changed[i], "question": changed[i]["question"] + " Explain."}
    datasets.Dataset.from_list(changed).to_parquet(str(root / "train-changed.parquet"))
    renamed = train.rename_columns({"question": "problem", "answer": "solution"})
    renamed.to_parquet(str(root / "train-renamed.parquet"))
    train.cast_column("answer", datasets.Value("large_string")).map(lambda r: {"n": len(r["answer"])}) \
        .to_parquet(str(root / "train-with-int.parquet"))
    return {"root": root, "train": train.to_list()}


def _load(tasks=("gsm8k", "humaneval"), profiles=None, datasets_choice=None, limit=None):
    spec = RunSpec(model="m", kernel="w4a8", tasks=list(tasks), profiles=dict(profiles or CANARY), limit=limit,
                   datasets=datasets_choice or {})
    return load_tasks(spec)


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


@pytest.fixture
def no_connections(monkeypatch):
    """Any network connection (the hub or anything else) fails the test."""
    def refuse(self, address, *args, **kwargs):
        raise AssertionError(f"a connection was opened to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ---- the packaged files through datasets ----

@pytest.mark.parametrize("rel", sorted(PUBLISHED))
def test_published_items_hash_is_the_hand_parsed_rows(rel):
    assert items_sha256(_published_rows(rel), FIELDS[rel]) == PUBLISHED[rel].items_sha256


def test_packaged_rows_read_by_datasets_equal_the_jsonl_lines(no_override):
    from evalgate.tasks.gsm8k import load_split
    from evalgate.tasks.humaneval.problems import load_problems

    assert load_split("test", None) == _published_rows("gsm8k/test.jsonl")
    assert load_split("train", packaged_data_dir()) == _published_rows("gsm8k/train.jsonl")
    assert load_problems() == [{f: p[f] for f in FIELDS[HUMANEVAL]} for p in _published_rows(HUMANEVAL)]


def test_packaged_canary_keeps_its_baselines_ids_and_records_what_it_read(no_override, no_connections):
    loaded = _load()
    assert {t: lt.profile_id for t, lt in loaded.items()} == CANARY_IDS
    record = loaded["gsm8k"].resolved.summary()["data"]["train"]
    assert record["source"] == "packaged" and record["rows"] == 7473
    assert record["items_sha256"] == TRAIN.items_sha256
    assert record["files"] == {"gsm8k/train.jsonl": TRAIN.sha256}
    assert loaded["humaneval"].resolved.data["test"]["items_sha256"] == HUMANEVAL_FILE.items_sha256


@pytest.mark.slow
def test_the_packaged_default_writes_nothing_under_home_and_leaves_no_cache(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_")) and k != DATA_DIR_ENV}
    env.update(HOME=str(home), TMPDIR=str(tmp_path))
    code = ("from evalgate.run.spec import RunSpec, load_tasks; from evalgate.tasks import source; "
            "load_tasks(RunSpec(model='m', kernel='w4a8', tasks=['gsm8k', 'humaneval'])); print(source.cache_dir())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    cache = Path(out.stdout.strip().splitlines()[-1])
    assert cache.parent == tmp_path and not cache.exists()  # the Arrow cache lived in a temp folder, now gone
    assert not list(home.rglob("*.arrow")) and not (home / ".cache" / "huggingface" / "datasets").exists()


# ---- copies of the same items: the same profile ids ----

@pytest.mark.parametrize("gsm8k, humaneval", [
    ("gsm8k-saved", "humaneval-saved"),
    ("gsm8k-parquet", "humaneval.parquet"),
    ("gsm8k-jsonl", "humaneval.jsonl.gz"),
])
def test_a_copy_in_any_format_has_the_packaged_profile_ids(gsm8k, humaneval, copies, no_override, no_connections):
    root = copies["root"]
    choice = {"gsm8k": {"source": str(root / gsm8k)}, "humaneval": {"source": str(root / humaneval)}}
    loaded = _load(datasets_choice=choice)
    assert {t: lt.profile_id for t, lt in loaded.items()} == CANARY_IDS
    record = loaded["gsm8k"].resolved.data["train"]
    assert record["source"] == "local" and record["items_sha256"] == TRAIN.items_sha256
    assert record["files"] and all(len(h) == 64 for h in record["files"].values())  # the copy's own files
    lmeval = _load(["gsm8k"], {"gsm8k": "gsm8k-lmeval-v3"}, {"gsm8k": choice["gsm8k"]}, limit=3)["gsm8k"]
    packaged = _load(["gsm8k"], {"gsm8k": "gsm8k-lmeval-v3"}, limit=3)["gsm8k"]
    assert lmeval.profile_id == packaged.profile_id and lmeval.items == packaged.items


def test_a_copy_with_one_row_changed_is_another_dataset(copies, no_override):
    loaded = _load(["gsm8k"], datasets_choice={"gsm8k": {"source": str(copies["root"] / "train-changed.parquet")}})
    resolved = loaded["gsm8k"].resolved
    assert loaded["gsm8k"].profile_id != CANARY_IDS["gsm8k"]
    assert list(resolved.dataset_sha256) == ["gsm8k/train"]
    assert resolved.dataset_sha256["gsm8k/train"] == f"items-sha256:{resolved.data['train']['items_sha256']}"


# ---- column mapping ----

def test_mapped_columns_give_the_same_items(copies, no_override):
    choice = {"gsm8k": {"source": str(copies["root"] / "train-renamed.parquet"),
                        "columns": {"question": "problem", "answer": "solution"}}}
    assert _load(["gsm8k"], datasets_choice=choice)["gsm8k"].profile_id == CANARY_IDS["gsm8k"]


def test_missing_columns_are_named_in_one_line(copies, no_override):
    choice = {"gsm8k": {"source": str(copies["root"] / "train-renamed.parquet"), "columns": {"answer": "solution"}}}
    with pytest.raises(UserError) as err:
        _load(["gsm8k"], datasets_choice=choice)
    message = str(err.value)
    assert "\n" not in message and "missing column(s) 'question'" in message and "gsm8k.FIELD=COLUMN" in message
    assert "'solution'" not in message.split("it has")[0]  # the mapped one is present, only question is missing


def test_a_mapping_to_a_field_the_task_does_not_read_is_refused(copies, no_override):
    choice = {"gsm8k": {"source": str(copies["root"] / "train-renamed.parquet"), "columns": {"solutoin": "x"}}}
    with pytest.raises(UserError, match="solutoin, which the task does not read"):
        _load(["gsm8k"], datasets_choice=choice)


def test_a_column_that_is_not_text_is_refused(copies, no_override):
    choice = {"gsm8k": {"source": str(copies["root"] / "train-with-int.parquet"), "columns": {"answer": "n"}}}
    with pytest.raises(UserError, match="'n' hold int64, not text"):
        _load(["gsm8k"], datasets_choice=choice)


def test_one_unnamed_split_cannot_serve_a_profile_that_reads_two(copies, no_override):
    choice = {"gsm8k": {"source": str(copies["root"] / "train-changed.parquet")}}
    with pytest.raises(UserError, match="reads the 'test' and 'train' split"):
        _load(["gsm8k"], {"gsm8k": "gsm8k-lmeval-v3"}, choice)


def test_dataset_options_parse_sources_and_columns():
    parsed = parse_dataset_options(("gsm8k=./d", "gsm8k.question=problem", "humaneval=openai/openai_humaneval"),
                                   ["gsm8k", "humaneval"])
    assert parsed == {"gsm8k": {"source": "./d", "columns": {"question": "problem"}},
                      "humaneval": {"source": "openai/openai_humaneval", "columns": {}}}
    for bad, expected in (("gsm8k", "TASK=PATH_OR_HUB_ID"), ("mmlu=x", "unknown task 'mmlu'"),
                          ("gsm8k.question=problem", "no --dataset gsm8k=PATH")):
        with pytest.raises(UserError, match=expected):
            parse_dataset_options((bad,), ["gsm8k", "humaneval"])


def test_a_path_that_is_neither_a_file_nor_a_hub_id_is_one_line(tmp_path, no_override):
    with pytest.raises(UserError, match="no such file or folder, and not a hub id"):
        _load(["gsm8k"], datasets_choice={"gsm8k": {"source": str(tmp_path / "nope" / "x.parquet")}})


# ---- a hub id ----

def test_a_hub_id_offline_fails_at_once_naming_local_alternatives(monkeypatch, no_connections, no_override):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        _load(["gsm8k"], datasets_choice={"gsm8k": {"source": "openai/gsm8k"}})
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE=1" in message
    assert "--data-dir" in message and "--dataset gsm8k=PATH" in message


def test_a_hub_id_with_the_hub_out_of_reach_fails_within_seconds(monkeypatch, no_override):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed port: refused at once
    started = time.monotonic()
    with pytest.raises(UserError, match=r"the hub \(http://127.0.0.1:9\) is not reachable"):
        _load(["humaneval"], datasets_choice={"humaneval": {"source": "openai/openai_humaneval"}})
    assert time.monotonic() - started < 5


def test_a_reachable_hub_id_loads_through_load_dataset(monkeypatch, copies, no_override):
    """A stand-in for the hub: ``load_dataset`` is asked for the id, its default config and the revision,
    and the rows it gives are identified like any other copy."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    calls = []
    saved = datasets.load_from_disk(str(copies["root"] / "gsm8k-saved"))

    def hub(path, name=None, **kwargs):
        calls.append((path, name, kwargs.get("revision")))
        return saved

    monkeypatch.setattr(source, "_reachable", lambda endpoint: True)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    loaded = _load(["gsm8k"], datasets_choice={"gsm8k": {"source": "openai/gsm8k@e53f048"}})
    assert calls == [("openai/gsm8k", "main", "e53f048")]
    assert loaded["gsm8k"].profile_id == CANARY_IDS["gsm8k"]
    assert loaded["gsm8k"].resolved.data["train"] | {"rows": 0} == {
        "source": "hub", "id": "openai/gsm8k", "config": "main", "revision": "e53f048", "split": "train",
        "rows": 0, "items_sha256": TRAIN.items_sha256}


@pytest.mark.slow
def test_the_cli_refuses_a_hub_id_offline_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    env.update(HF_HUB_OFFLINE="1")
    started = time.monotonic()
    proc = cli_process.run(["gate", "--dataset", "gsm8k=openai/gsm8k"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("evalgate: error: --dataset gsm8k=openai/gsm8k: the hub is off")
    assert elapsed < 20, f"{elapsed:.1f} s"  # the interpreter's start on a busy machine; the refusal itself is instant


# ---- a HumanEval of other problems ----

def test_other_humaneval_problems_are_self_tested_on_their_own(tmp_path, monkeypatch, no_override):
    """Six problems under new ids: not the published set, so the self-test runs in this process on them
    (never the published one's child), and every timeout is its own problem's."""
    from evalgate.tasks.humaneval import task as humaneval
    from evalgate.types import Generation

    rows = [{**p, "task_id": p["task_id"].replace("HumanEval/", "Mine/")} for p in _published_rows(HUMANEVAL)[:6]]
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "mine.jsonl"))
    monkeypatch.setattr(humaneval, "start_selftest", lambda *a: pytest.fail("the published self-test was started"))
    loaded = _load(["humaneval"], datasets_choice={"humaneval": {"source": str(tmp_path / "mine.jsonl")}})["humaneval"]
    assert loaded.resolved.dataset_sha256 == {"humaneval/test": f"items-sha256:{items_sha256(rows, FIELDS[HUMANEVAL])}"}
    loaded.task.prepare_ahead(loaded.resolved, None)
    result = loaded.task.prepare(loaded.resolved, None)
    assert result["ok"] and result["n_problems"] == 6 and sorted(result["timeouts_s"]) == sorted(r["task_id"] for r in rows)
    requests = loaded.task.requests(loaded.items, loaded.resolved)
    records = loaded.task.score_batch(loaded.items, requests, [Generation(p["canonical_solution"], "stop") for p in rows],
                                      loaded.resolved)
    assert [r["passed"] for r in records] == [True] * 6


# ---- the gate on copies ----

@pytest.mark.slow
def test_the_canary_gate_on_a_parquet_copy_passes_against_the_packaged_baseline(copies, tmp_path):
    root = copies["root"]
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    env.update(HF_HUB_OFFLINE="1")
    # GSM8K alone keeps the suite short; HumanEval's copies have the packaged ids (above), so the same baseline
    proc = cli_process.run(["gate", "--tasks", "gsm8k", "--dataset", f"gsm8k={root / 'gsm8k-parquet'}",
                                      "--out", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = json.loads((tmp_path / "run" / "gate" / "gate.json").read_text())
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert verdict["verdict"] == "PASS"
    assert manifest["tasks"]["gsm8k"]["profile_id"] == CANARY_IDS["gsm8k"]
    assert manifest["tasks"]["gsm8k"]["data"]["train"]["source"] == "local"
    assert manifest["spec"]["datasets"]["gsm8k"]["source"] == str(root / "gsm8k-parquet")


@pytest.mark.slow
def test_the_canary_gate_refuses_a_copy_with_one_row_changed(copies, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    env.update(HF_HUB_OFFLINE="1")
    proc = cli_process.run(["gate", "--tasks", "gsm8k", "--dataset",
                                      f"gsm8k={copies['root'] / 'train-changed.parquet'}", "--out", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("evalgate: error:")]
    assert len(lines) == 1 and "no stored w4a8 baseline" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "gsm8k.jsonl").exists()
