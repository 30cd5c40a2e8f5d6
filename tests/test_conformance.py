"""Kernel conformance: a kernel held against the kernel it declares it computes, and what the gate does with it."""

from __future__ import annotations

import json

import pytest
import torch

from evalgate.gate.decide import CONFORMANCE_UNCHECKED, gate_runs
from evalgate.run.baselines import load_baseline
from evalgate.run.store import load_run
from evalgate.gate.policy import load_thresholds
from evalgate.kernels import get_kernel, kernel_names
from synthetic_runs import write_pair
import cli_process

FAULTY = sorted(n for n in kernel_names() if get_kernel(n).faulty)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model):
    """The tiny model as the adapter loads it, and the token ids of two task-like prompts."""
    from evalgate.model_adapters.hf.adapter import load_model

    model, tokenizer = load_model(tiny_model, "w4a4_packed")
    texts = ["Question: Natalia sold clips to 48 of her friends in April, and then half as many in May. "
             "How many clips did she sell altogether?\nAnswer:",
             "Question: Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?\nAnswer:"]
    return model, [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]


@pytest.mark.parametrize("name", FAULTY)
def test_a_faulty_kernel_does_not_conform_to_its_twin(tiny_loaded, name):
    from evalgate.kernels.conformance import model_conformance

    model, prompts = tiny_loaded
    c = model_conformance(model, name, prompts)
    assert c.checked and c.reference == get_kernel(name).twin == "w4a4_packed"
    assert not c.ok and not c.identical and c.differing > 0 and c.limit == 0.0  # bit-identity: exact sums
    assert c.failed_experts + c.failed_tokens > 0 and not (c.worst_experts[0]["ok"] and c.worst_tokens[0]["ok"])
    assert "does NOT compute w4a4_packed" in c.to_dict()["summary"]


def test_a_fault_in_one_expert_fails_in_that_expert_alone(tiny_loaded):
    """Expert 1's router weight x (1 + 1/512): every layer's expert 1 is over the limit, no other expert is,
    and the worst expert listed first is an expert 1."""
    from evalgate.kernels.conformance import model_conformance

    model, prompts = tiny_loaded
    c = model_conformance(model, "faulty/w4a4_packed-one-expert", prompts)
    failed = [f for f in c.worst_experts if not f["ok"]]
    assert not c.ok and failed and {f["index"] for f in failed} == {1}
    assert c.failed_experts == len({f["layer"] for f in failed}) == c.layers
    assert c.worst_experts[0]["index"] == 1 and c.per_layer[0]["worst_expert"]["index"] == 1


def test_hidden_states_come_from_the_models_own_forward(tiny_loaded):
    """Every MoE layer records what its experts were handed: all prompts' tokens, top-k routing, weights."""
    from evalgate.kernels.checkpoint import experts_modules
    from evalgate.kernels.conformance import capture_routed_inputs

    model, prompts = tiny_loaded
    captured = capture_routed_inputs(model, prompts)
    assert sorted(captured) == sorted(experts_modules(model))
    tokens = sum(len(p) for p in prompts)
    for x, idx, w in captured.values():
        assert x.shape[0] == idx.shape[0] == w.shape[0] == tokens and idx.shape == w.shape
    a, b = (captured[layer][0] for layer in sorted(captured)[:2])
    assert not torch.equal(a, b)  # each layer its own hidden states, not one synthetic batch


def test_a_kernel_that_computes_what_it_declares_conforms(tiny_loaded):
    """A kernel registered under a new name that declares w4a4_packed and computes it: bit-identical."""
    from dataclasses import replace

    from evalgate.kernels.conformance import model_conformance
    from evalgate.kernels.registry import KERNELS, register_kernel

    model, prompts = tiny_loaded
    healthy = get_kernel("w4a4_packed")
    register_kernel(replace(healthy, name="test/wrapped-w4a4_packed", twin="w4a4_packed"))
    try:
        c = model_conformance(model, "test/wrapped-w4a4_packed", prompts)
    finally:
        KERNELS.pop("test/wrapped-w4a4_packed")
    assert c.checked and c.ok and c.identical and c.differing == 0 and c.calc_diff == 0.0
    assert c.layers == len(c.per_layer) >= 1 and c.prompts == 2 and c.failed_experts == c.failed_tokens == 0


@pytest.mark.parametrize("name", ["bf16", "w4a8", "w4a4", "w4a4_packed", "w4a4_te", "fp8_block128"])
def test_an_emulated_recipe_is_its_own_reference(tiny_loaded, name):
    from evalgate.kernels.conformance import model_conformance

    c = model_conformance(tiny_loaded[0], name, tiny_loaded[1])
    assert (c.checked, c.ok, c.reference) == (False, True, name)


def _with_conformance(run, ok: bool | None):
    manifest = json.loads((run / "manifest.json").read_text())
    if ok is not None:
        manifest["kernel"]["conformance"] = {
            "kernel": "w4a4_packed", "reference": "w4a4_packed" if ok else "w4a4", "checked": True, "ok": ok,
            "summary": "test summary", "calc_diff": 0.0 if ok else 0.02, "limit": 1e-5}
    (run / "manifest.json").write_text(json.dumps(manifest))


def _pass_pair(tmp_path):
    from gate_helpers import policy

    base, cand = write_pair(tmp_path, n_gsm8k=200, n_humaneval=0, lost_every=10 ** 6, gained_every=10 ** 6)
    return base, cand, policy(tmp_path, margin=5.0)


def test_a_non_conforming_kernel_fails_the_gate_whatever_its_accuracy(tmp_path):
    base, cand, pol = _pass_pair(tmp_path)
    assert gate_runs(load_baseline(base), load_run(cand), load_thresholds(pol), allow_uncalibrated=True).verdict == "PASS"  # identical answers
    _with_conformance(cand, ok=False)
    v = gate_runs(load_baseline(base), load_run(cand), load_thresholds(pol), allow_uncalibrated=True)
    assert (v.verdict, v.exit_code) == ("FAIL", 1)
    assert v.decision.tasks["gsm8k"].outcome.verdict == "PASS"  # accuracy alone still passes: the kernel fails it
    out = v.to_dict()
    assert out["conformance"]["ok"] is False
    from evalgate.report.rows import verdict_reason
    from evalgate.report.text import junit_xml, markdown

    assert verdict_reason(v) == "FAIL — kernel conformance FAIL: test summary"  # said first, as the deciding reason
    assert "kernel conformance FAIL: test summary" in markdown(v)
    assert 'name="kernel-conformance"' in junit_xml(v) and 'failures="1"' in junit_xml(v)


def test_a_conforming_kernel_is_decided_on_accuracy_and_an_unchecked_one_says_so(tmp_path):
    base, cand, pol = _pass_pair(tmp_path)
    v = gate_runs(load_baseline(base), load_run(cand), load_thresholds(pol), allow_uncalibrated=True)  # no record: a server run
    assert v.verdict == "PASS" and CONFORMANCE_UNCHECKED in v.notes and v.conformance is None
    _with_conformance(cand, ok=True)
    v = gate_runs(load_baseline(base), load_run(cand), load_thresholds(pol), allow_uncalibrated=True)
    assert v.verdict == "PASS" and CONFORMANCE_UNCHECKED not in v.notes and v.conformance["ok"] is True


def test_a_run_records_its_kernels_conformance(tiny_model, tmp_path, cli_env):
    """`evalgate run` with a faulty kernel writes the failed check into the manifest, readable by the store."""
    out = tmp_path / "run"
    cli_process.run(["run", "--model", str(tiny_model), "--kernel",
                    "faulty/w4a4_packed-weight-after-requant", "--tasks", "gsm8k", "--limit", "2",
                    "--max-new-tokens", "4", "--out", str(out)], check=True, env=cli_env, capture_output=True)
    from evalgate.run.store import load_run

    conf = load_run(out).manifest["kernel"]["conformance"]
    assert conf["checked"] and not conf["ok"] and conf["reference"] == "w4a4_packed" and conf["calc_diff"] > 1e-5
    assert conf["prompts"] == 2 and conf["layers"] >= 1  # the run's first prompts (it has two items)
    # the code that computed it, part of the candidate's content identity (evalgate.gate.sequence)
    source = load_run(out).manifest["kernel"]["source_sha256"]
    assert source == get_kernel("faulty/w4a4_packed-weight-after-requant").source_sha256 and len(source) == 64
