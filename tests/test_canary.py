"""The built-in canary: a DeepSeek-V4 FP4 checkpoint loaded through the real path, and the gate working on
it out of the box (a reduced version of benchmarks/canary_selfcheck.py)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from evalgate.canary import CANARY_DIR, canary_path
import cli_process

pytestmark = pytest.mark.slow  # end to end: each test takes more than a few seconds

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_canary_ships_in_the_dsv4_fp4_format():
    config = json.loads((CANARY_DIR / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["expert_dtype"] == "fp4"
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    header = _header(CANARY_DIR / "model.safetensors")
    w1 = next(v for k, v in header.items() if k.endswith("ffn.experts.0.w1.weight"))
    scale = next(v for k, v in header.items() if k.endswith("ffn.experts.0.w1.scale"))
    assert w1["dtype"] == "I8" and w1["shape"] == [config["moe_intermediate_size"], config["hidden_size"] // 2]
    assert scale["dtype"] == "F8_E8M0" and scale["shape"] == [config["moe_intermediate_size"], config["hidden_size"] // 32]
    assert (CANARY_DIR / "MODEL_CARD.md").is_file() and (CANARY_DIR / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in CANARY_DIR.iterdir())
    assert size < 20 * 2**20


@pytest.fixture(scope="module")
def canary():
    from evalgate.model_adapters.hf.adapter import load_model

    return load_model(canary_path(), "w4a4_packed")


def test_kernels_compute_with_the_stored_codes(canary):
    from evalgate.kernels.weights import fp4_weights

    model, _ = canary
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert len(experts) == model.config.num_hidden_layers
    assert {fp4_weights(m).source for m in experts} == {"checkpoint"}
    assert model.config._experts_implementation == "w4a4_packed"


def test_cached_decoding_matches_a_full_forward(canary):
    from evalgate.model_adapters.hf.generation import greedy_generate

    model, tok = canary
    prompt = "def add(a: int, b: int) -> int:\n    \"\"\"Add two numbers.\"\"\"\n"
    out = greedy_generate(model, tok, [prompt], [()], [24])[0]
    ids = tok(prompt, add_special_tokens=False)["input_ids"] + out.token_ids
    with torch.no_grad():
        cached_free = model(torch.tensor([ids])).logits[0].float()
    n = len(out.token_ids)
    assert cached_free[-n - 1:-1].argmax(-1).tolist() == out.token_ids


def _gate(args, tmp_path, data_dir):
    env = {**os.environ, "EVALGATE_DATA_DIR": str(data_dir)}
    return cli_process.run(["gate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)


def test_aa_on_the_canary_passes_with_no_flips(tmp_path, data_dir):
    # the stored W4A8 baseline was recorded with batch 32; another batch size must change nothing
    out = tmp_path / "aa"
    proc = _gate(["--tasks", "gsm8k", "--kernel", "w4a8", "--batch-size", "19", "--out", str(out)], tmp_path, data_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gate = json.loads((out / "gate/gate.json").read_text())
    assert gate["flips"]["gsm8k"] == [] and gate["verdict"] == "PASS"
    assert gate["decision"]["tasks"]["gsm8k"]["statistics"]["counts"]["n"] == 200


def test_a_fault_injected_kernel_stops_before_generating_and_no_early_stop_measures_its_accuracy(tmp_path, data_dir):
    out = tmp_path / "faulty"
    args = ["--tasks", "gsm8k", "--kernel", "faulty/w4a4_packed-drop-slot", "--batch-size", "50", "--out", str(out)]
    proc = _gate(args, tmp_path, data_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gate = json.loads((out / "gate/gate.json").read_text())
    assert gate["conformance"]["ok"] is False and gate["early_stop"]["items_run"] == 0
    assert json.loads((out / "manifest.json").read_text())["status"] == "stopped_early"
    from evalgate.gate.stopped import headline

    assert f"verdict: FAIL ({headline(gate['early_stop'])})" in proc.stdout
    for report in ("report.md", "report.html"):
        assert headline(gate["early_stop"]) in (out / "gate" / report).read_text()
    assert 'name="early_stop"' in (out / "gate/junit.xml").read_text()

    proc = _gate([*args, "--no-early-stop"], tmp_path, data_dir)  # the same --out: resumed, every item run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gate = json.loads((out / "gate/gate.json").read_text())
    task = gate["decision"]["tasks"]["gsm8k"]
    assert gate["early_stop"] is None and task["statistics"]["counts"]["n"] == 200
    # its accuracy is measured: worse than the baseline, never shown within the margin (FAIL itself needs
    # "shown worse than M" on gsm8k alone; the gate FAILs on conformance)
    counts = task["statistics"]["counts"]
    assert task["outcome"]["verdict"] != "PASS" and counts["b"] > counts["c"]
    assert gate["verdict"] == "FAIL" and gate["conformance"]["ok"] is False
    assert {f["direction"] for f in gate["flips"]["gsm8k"]} >= {"lost"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["early_stop_history"]) == 1
    assert "stopped early" not in proc.stdout and "stopped before" not in proc.stdout


def test_a_kernel_that_fails_its_conformance_check_fails_the_gate_before_generating(tmp_path, data_dir):
    out = tmp_path / "requant"
    proc = _gate(["--kernel", "faulty/w4a4_packed-weight-after-requant", "--out", str(out)], tmp_path, data_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gate = json.loads((out / "gate/gate.json").read_text())
    assert gate["verdict"] == "FAIL" and gate["conformance"]["ok"] is False
    assert gate["early_stop"]["items_run"] == 0 and gate["early_stop"]["items_total"] == 364
    assert "verdict: FAIL (stopped before generating any of its 364 items" in proc.stdout
    assert "kernel conformance FAIL" in proc.stdout
    # the bound counts the items not run right: their "gains" are not the kernel's noise
    assert "than the baseline's own noise" not in proc.stdout
    assert all(not (out / f"{t}.jsonl").read_text() for t in ("gsm8k", "humaneval"))
    assert json.loads((out / "manifest.json").read_text())["tasks"]["humaneval"]["prepare"]["ok"] is True


def test_w4a4_and_w4a4_packed_answer_identically(tmp_path, data_dir):
    env = {**os.environ, "EVALGATE_DATA_DIR": str(data_dir)}
    outs = {}
    for kernel in ("w4a4", "w4a4_packed"):
        outs[kernel] = tmp_path / kernel
        proc = cli_process.run(["run", "--tasks", "gsm8k", "--limit", "16",
                               "--kernel", kernel, "--batch-size", "16", "--out", str(outs[kernel])],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
    from evalgate import load_run

    a, b = (load_run(outs[k]).records["gsm8k"] for k in ("w4a4", "w4a4_packed"))
    assert [r["resps"] for r in sorted(a, key=lambda r: r["doc_id"])] == \
        [r["resps"] for r in sorted(b, key=lambda r: r["doc_id"])]


def test_evalgate_gate_with_no_arguments(tmp_path, data_dir):
    """The README's main job: canary, candidate w4a4_packed, stored canary W4A8 baseline, both tasks."""
    out = tmp_path / "default"
    proc = _gate(["--out", str(out)], tmp_path, data_dir)
    documented = re.search(r"The main job prints \*\*(PASS|FAIL|INCONCLUSIVE)\*\* \(exit code (\d)\)", README.read_text(encoding="utf-8"))
    assert documented, "the README states the main job's verdict"
    assert (f"verdict: {documented[1]}" in proc.stdout, proc.returncode) == (True, int(documented[2])), proc.stdout + proc.stderr
    gate = json.loads((out / "gate/gate.json").read_text())
    assert gate["candidate"]["kernel"]["name"] == "w4a4_packed" and gate["baseline"]["kernel"]["name"] == "w4a8"
    assert set(gate["decision"]["tasks"]) == {"gsm8k", "humaneval"}
    assert gate["aa"]["gsm8k"]["n"] == 200 and gate["aa"]["humaneval"]["n"] == 164
    flips = gate["flips"]["gsm8k"] + gate["flips"]["humaneval"]
    assert flips, "the canary must show real per-item flips between W4A4 and W4A8"
    assert f"verdict: {gate['verdict']}" in proc.stdout
    for name in ("report.md", "junit.xml", "report.html"):
        assert (out / "gate" / name).is_file()
