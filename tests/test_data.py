"""The data evalgate reads: the GSM8K splits shipped in the package, overrides, and one-line failures.

No test here needs a data directory or the network.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.tasks import data
from evalgate.tasks.data import DATA_DIR_ENV, packaged_data_dir, parse_jsonl, read_verified, resolve_data_dir, sha256_file
from evalgate.tasks.gsm8k import FILES as GSM8K_FILES
from evalgate.tasks.humaneval.problems import PUBLISHED as HUMANEVAL_FILE
import cli_process

REPO = Path(__file__).resolve().parents[1]
HUMANEVAL = "humaneval/HumanEval.jsonl.gz"
PACKAGED = [f for f in (*GSM8K_FILES.values(), HUMANEVAL_FILE) if f.packaged]  # the files evalgate ships
# Profile ids from before GSM8K was packaged (read from a data dir then); stored baselines are keyed by them.
PROFILE_IDS = {
    ("gsm8k-lmeval-v3", None): "95143ea2c8c4e6cfcb3f32427355368a7af0a6c03e6a0b6381abd30598384f9c",
    ("gsm8k-lmeval-v3", 2): "5244f38fe73395ee2e2ddcc760e36acb7826774da15f860f84c84d11b19d5814",
    ("gsm8k-cot-8shot", None): "080fd0d96b6bbe6aecefe63f27e90c07f2da04aeb9fc52b68ad9e302c70062e2",
    ("gsm8k-canary-v1", None): "479b86ce74d8e53f20d9cdf72a12294912590381f05b426cd155da0b8e8ab6aa",  # the canary baseline's
}


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


@pytest.fixture
def hub_unreachable(monkeypatch):
    """Any attempt to open a network connection (the hub, or anything else) fails the test."""
    import socket

    def reached(self, address, *args, **kwargs):
        raise AssertionError(f"a connection was opened to {address}")

    monkeypatch.setattr(socket.socket, "connect", reached)
    monkeypatch.setattr(socket.socket, "connect_ex", reached)


def _offline_env(**extra) -> dict:
    """A CLI environment with no data dir and no way to the hub (offline flags, and a closed port as endpoint)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_") and k != DATA_DIR_ENV}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", **extra)
    return env


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("evalgate: error:")]


# ---- the packaged copy ----

@pytest.mark.parametrize("file", PACKAGED, ids=lambda f: f.path)
def test_packaged_files_match_their_published_sha256(file):
    assert sha256_file(packaged_data_dir() / file.path) == file.sha256


def test_packaged_gsm8k_is_the_whole_of_both_splits_with_its_licence():
    folder = packaged_data_dir() / "gsm8k"
    assert [f.path for f in PACKAGED] == ["gsm8k/test.jsonl", "gsm8k/train.jsonl"]
    assert len(parse_jsonl(read_verified(None, GSM8K_FILES["test"]))) == 1319
    assert len(parse_jsonl(read_verified(None, GSM8K_FILES["train"]))) == 7473
    licence = (folder / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in licence


def test_the_wheel_declares_every_packaged_file_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["evalgate.tasks"]
    root = REPO / "evalgate" / "tasks"
    assert packaged_data_dir() == root / "datafiles"
    for path in sorted((root / "datafiles").rglob("*")):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} would not be in the wheel"


# ---- resolution: override, else packaged, else the installed source ----

def test_no_data_dir_means_the_packaged_copy(no_override, monkeypatch, tmp_path):
    assert resolve_data_dir(None) == packaged_data_dir()
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    other = tmp_path / "other"
    other.mkdir()
    assert resolve_data_dir(str(other)) == other  # --data-dir beats the environment


def test_humaneval_is_not_packaged_and_comes_from_the_wheel():
    assert HUMANEVAL_FILE.path == HUMANEVAL and not HUMANEVAL_FILE.packaged
    assert not (packaged_data_dir() / HUMANEVAL).exists()
    from_wheel = read_verified(None, HUMANEVAL_FILE)
    assert read_verified(packaged_data_dir(), HUMANEVAL_FILE) == from_wheel
    assert len(parse_jsonl(from_wheel)) == 164


@pytest.mark.parametrize("profile, limit", sorted(PROFILE_IDS, key=str))
def test_gsm8k_without_a_data_dir_is_offline_and_keeps_its_profile_ids(profile, limit, no_override, hub_unreachable):
    from evalgate.tasks import get_task, resolve_profile

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, profile), resolve_data_dir(None), limit)
    assert resolved.profile_id == PROFILE_IDS[(profile, limit)]
    assert len(items) == (limit or (200 if "canary" in profile else 1319))


def test_an_override_copy_gives_the_same_items_and_ids(no_override, tmp_path):
    from evalgate.tasks.gsm8k import PROFILES, TASK

    (tmp_path / "gsm8k").mkdir()
    for file in PACKAGED:
        shutil.copyfile(packaged_data_dir() / file.path, tmp_path / file.path)
    packaged = TASK.load(PROFILES["gsm8k-lmeval-v3"], resolve_data_dir(None), 5)
    override = TASK.load(PROFILES["gsm8k-lmeval-v3"], resolve_data_dir(tmp_path), 5)
    assert packaged[0] == override[0] and packaged[1].profile_id == override[1].profile_id


# ---- failures are one line ----

def _tampered_copy(tmp_path: Path) -> Path:
    (tmp_path / "gsm8k").mkdir(parents=True)
    for file in PACKAGED:
        shutil.copyfile(packaged_data_dir() / file.path, tmp_path / file.path)
    test = tmp_path / "gsm8k/test.jsonl"
    test.write_bytes(test.read_bytes().replace(b"Janet", b"Jane", 1))
    return tmp_path


def test_a_tampered_copy_in_a_data_dir_is_refused_in_one_line(tmp_path):
    folder = _tampered_copy(tmp_path)
    with pytest.raises(UserError, match="sha256 mismatch") as err:
        read_verified(folder, GSM8K_FILES["test"])
    assert "\n" not in str(err.value) and str(folder / "gsm8k/test.jsonl") in str(err.value)


def test_a_missing_file_in_a_data_dir_is_not_taken_from_elsewhere(tmp_path):
    with pytest.raises(UserError, match="missing data file") as err:
        read_verified(tmp_path, HUMANEVAL_FILE)  # the wheel has it, but an override must hold every file it is asked for
    assert "\n" not in str(err.value) and DATA_DIR_ENV in str(err.value)


def test_a_broken_install_is_one_line(monkeypatch, tmp_path):
    tampered = _tampered_copy(tmp_path / "tampered").resolve()
    monkeypatch.setattr(data, "PACKAGED_DIR", (tmp_path / "empty").resolve())
    with pytest.raises(UserError, match="reinstall evalgate") as err:
        read_verified(None, GSM8K_FILES["test"])
    assert "\n" not in str(err.value)
    monkeypatch.setattr(data, "PACKAGED_DIR", tampered)
    with pytest.raises(UserError, match="sha256 mismatch"):
        read_verified(None, GSM8K_FILES["test"])


# ---- the command line, with no data dir and no hub ----

def test_run_without_a_data_dir_works_offline(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = cli_process.run(["run", "--tasks", "gsm8k", "--limit", "2", "--max-new-tokens", "4",
                                      "--model", str(tiny_model), "--out", str(out)],
                          env=_offline_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["data_dir"] is None
    assert manifest["tasks"]["gsm8k"]["dataset_sha256"] == {f.path: f.sha256 for f in PACKAGED}
    assert len((out / "gsm8k.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("case, expected", [
    ("missing file", "missing data file"),
    ("tampered file", "sha256 mismatch"),
])
def test_a_bad_data_dir_is_one_line_exit_2_within_seconds(case, expected, tiny_model, tmp_path):
    folder = _tampered_copy(tmp_path / "data")
    if case == "missing file":
        (folder / "gsm8k/test.jsonl").write_bytes((packaged_data_dir() / "gsm8k/test.jsonl").read_bytes())
        (folder / "gsm8k/train.jsonl").unlink()  # gsm8k-lmeval-v3 draws its shots from train
    # no HF_HUB_OFFLINE here: were the hub tried, its retries against the closed port would take ~25 s
    env = {k: v for k, v in _offline_env().items() if not k.endswith("_OFFLINE")}
    started = time.monotonic()
    proc = cli_process.run(["run", "--tasks", "gsm8k", "--limit", "2", "--max-new-tokens", "4",
                                      "--model", str(tiny_model), "--data-dir", str(folder), "--out", str(tmp_path / "out")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "gsm8k.jsonl").exists()
    assert elapsed < 20, f"{elapsed:.1f} s"  # the interpreter and torch's import on a busy machine, no retries
