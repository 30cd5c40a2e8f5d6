"""`evalgate run` end to end on the tiny model: records, manifest, resume after SIGKILL, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from evalgate.cli.preflight import run_lock
from evalgate.run.store import load_run
import cli_process

VOLATILE = {"latency_s"}


def evalgate(args, env, cwd, check=True, **kw):
    proc = cli_process.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"evalgate {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def stable(records):
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in records), key=lambda r: r["doc_id"])


def test_run_writes_manifest_and_one_record_per_item(tiny_model, cli_env, tmp_path):
    out = tmp_path / "run"
    proc = evalgate(["run", "--model", str(tiny_model), "--kernel", "bf16", "--tasks", "gsm8k", "--limit", "4",
                     "--max-new-tokens", "12", "--batch-size", "3", "--out", str(out)], cli_env, tmp_path)
    assert "gsm8k: exact_match,strict-match" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["kernel"]["name"] == "bf16"
    task = manifest["tasks"]["gsm8k"]
    assert task["dataset_sha256"]["gsm8k/test.jsonl"].startswith("3730d312") and task["n_items"] == 4
    lines = (out / "gsm8k.jsonl").read_text().splitlines()
    assert len(lines) == 4
    records = [json.loads(l) for l in lines]
    assert sorted(r["doc_id"] for r in records) == [0, 1, 2, 3]
    for r in records:
        assert r["profile_id"] == task["profile_id"]
        assert r["finish_reason"] in ("stop", "length") and 0 < r["n_tokens"] <= 12
        for field in ("prompt_hash", "resps", "filtered_resps", "exact_match", "extracted", "doc_hash", "target"):
            assert field in r
    df = load_run(out).samples("gsm8k")
    assert list(df["doc_id"]) == [0, 1, 2, 3] and "exact_match,strict-match" in df.columns
    # stderr holds the progress lines only: no third-party import warnings (torchao, torch pytree)
    noise = [line for line in proc.stderr.splitlines() if not line.startswith("gsm8k [bf16]:")]
    assert noise == []


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tiny_model, cli_env, tmp_path):
    args = ["run", "--model", str(tiny_model), "--kernel", "bf16", "--tasks", "gsm8k", "--limit", "8",
            "--max-new-tokens", "40", "--batch-size", "2"]
    full = tmp_path / "full"
    evalgate(args + ["--out", str(full)], cli_env, tmp_path)

    killed = tmp_path / "killed"
    proc = cli_process.start(args + ["--out", str(killed)], env=cli_env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jsonl = killed / "gsm8k.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if jsonl.exists() and jsonl.read_bytes().count(b"\n") >= 2:
            break
        if proc.poll() is not None:
            pytest.fail("run finished before it could be killed")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    partial = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
    assert 2 <= len(partial) < 8
    assert json.loads((killed / "manifest.json").read_text())["status"] == "running"

    # the lock died with the killed command, whatever its forked decoding workers were doing
    with run_lock(killed):
        assert time.monotonic() - killed_at < 5
    evalgate(args + ["--out", str(killed), "--resume"], cli_env, tmp_path)
    resumed = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert len(resumed) == 8 and len({r["doc_id"] for r in resumed}) == 8  # nothing redone or duplicated
    # finished items were kept as they were (records are written as items finish, put in item order at the end)
    by_id = {r["doc_id"]: r for r in resumed}
    assert stable([by_id[r["doc_id"]] for r in partial]) == stable(partial)
    assert [r["doc_id"] for r in resumed] == [r["doc_id"] for r in load_run(full).records["gsm8k"]]
    assert stable(resumed) == stable(load_run(full).records["gsm8k"])
    assert json.loads((killed / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_resume_refuses_a_different_run(tiny_model, cli_env, tmp_path):
    out = tmp_path / "r"
    base = ["run", "--model", str(tiny_model), "--tasks", "gsm8k", "--max-new-tokens", "4", "--out", str(out)]
    evalgate(base + ["--limit", "2"], cli_env, tmp_path)
    before = (out / "gsm8k.jsonl").read_bytes()
    proc = evalgate(base + ["--limit", "3", "--resume"], cli_env, tmp_path, check=False)
    assert proc.returncode == 2 and "profile" in proc.stderr
    proc = evalgate(base + ["--limit", "2"], cli_env, tmp_path, check=False)  # no --resume on a stored run
    assert proc.returncode == 2 and "already holds files" in proc.stderr
    assert (out / "gsm8k.jsonl").read_bytes() == before


def test_resume_refuses_a_run_begun_under_other_kernel_code(tiny_model, cli_env, tmp_path):
    """The stored run's kernel digest is another code's (the kernel's source changed since it began): its
    records would mix two codes under one kernel id, so --resume refuses and the stored run is untouched."""
    import json

    out = tmp_path / "r"
    base = ["run", "--model", str(tiny_model), "--tasks", "gsm8k", "--max-new-tokens", "4", "--limit", "2",
            "--out", str(out)]
    evalgate(base, cli_env, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kernel"]["source_sha256"]
    manifest["kernel"]["source_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    proc = evalgate(base + ["--resume"], cli_env, tmp_path, check=False)
    assert proc.returncode == 2 and "kernel source" in proc.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before


def _corrupt_model(tiny_model: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for f in tiny_model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text('{"model_type": "deepseek_v4", ')
    return bad


def _bad_data(data_dir: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "data"
    (bad / "gsm8k").mkdir(parents=True)
    (bad / "gsm8k/test.jsonl").write_text((data_dir / "gsm8k/test.jsonl").read_text().replace("Janet", "Jane", 1))
    (bad / "gsm8k/train.jsonl").write_bytes((data_dir / "gsm8k/train.jsonl").read_bytes())
    return bad


@pytest.mark.parametrize("case, expected", [
    ("unknown kernel", "unknown kernel 'w9a9'"),
    ("unknown task", "unknown task 'mmlu'"),
    ("unknown profile", "unknown profile 'gsm8k-zero'"),
    ("missing model dir", "does not exist"),
    ("corrupt config", "config.json"),
    ("wrong data hash", "sha256 mismatch"),
    ("missing data dir", "data dir"),
])
def test_bad_input_is_one_line_and_exit_2(case, expected, tiny_model, cli_env, data_dir, tmp_path):
    model, env = str(tiny_model), dict(cli_env)
    args = {"--kernel": "bf16", "--tasks": "gsm8k"}
    if case == "unknown kernel":
        args["--kernel"] = "w9a9"
    elif case == "unknown task":
        args["--tasks"] = "mmlu"
    elif case == "unknown profile":
        args["--profile"] = "gsm8k-zero"
    elif case == "missing model dir":
        model = str(tmp_path / "nowhere")
    elif case == "corrupt config":
        model = str(_corrupt_model(tiny_model, tmp_path))
    elif case == "wrong data hash":
        env["EVALGATE_DATA_DIR"] = str(_bad_data(data_dir, tmp_path))
    elif case == "missing data dir":
        env["EVALGATE_DATA_DIR"] = str(tmp_path / "no-data")
    flat = [x for kv in args.items() for x in kv]
    proc = evalgate(["run", "--model", model, "--limit", "1", "--out", str(tmp_path / "out")] + flat, env, tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("evalgate: error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "gsm8k.jsonl").exists()
