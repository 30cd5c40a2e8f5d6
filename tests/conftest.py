"""Shared fixtures: the offline data copy and a tiny random DeepSeek-V4 checkpoint built once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _data_dir() -> Path:
    env = os.environ.get("EVALGATE_DATA_DIR")
    path = Path(env) if env else REPO.parent / "shared" / "data"
    return path.resolve()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = _data_dir()
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.fail(f"offline data not found at {path}; set EVALGATE_DATA_DIR to a copy of shared/data")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, data_dir) -> Path:
    """A random 2-layer DeepSeek-V4 (hash layer + routed layer, 16 experts, top-6) with a BPE tokenizer."""
    from evalgate.model_adapters.tiny import build_tiny_model

    lines = (data_dir / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:2000]
    texts = [json.loads(line)["question"] + "\n" + json.loads(line)["answer"] for line in lines]
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", texts, seed=0)


@pytest.fixture
def cli_env(data_dir) -> dict:
    """Environment for running the CLI in a subprocess: offline data, no terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    env["EVALGATE_DATA_DIR"] = str(data_dir)
    env["HF_HUB_OFFLINE"] = "1"
    return env
