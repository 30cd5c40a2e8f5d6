"""A compressor's decoding step as one Triton kernel (``model_adapters/fast/triton_compressor.py``) against the
PyTorch step it replaces (``attention_slots._Compressed.step`` with transformers' pooling and RoPE), under
Triton's interpreter on a CPU (on a GPU where there is one). Each check runs in a fresh process
(``triton_process``)."""

from __future__ import annotations

import pytest
import torch

from triton_process import needs_triton, run

pytestmark = needs_triton

SETUP = """
import torch
from evalgate.model_adapters.fast import attention_slots
from test_attention import _model
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def states(module, slots, capacity, seed):
    '''Two equal compressor states of random contents (the previous windows' Ca gates partly -inf, as
    before a slot's first window).'''
    pair = [attention_slots._Compressed(module, slots, capacity, DEVICE) for _ in range(2)]
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name in ("kv", "gate", "entries", "prev_kv", "prev_gate"):
        if not hasattr(pair[0], name):
            continue
        t = getattr(pair[0], name)
        value = torch.randn(t.shape, generator=g).to(t.dtype).to(DEVICE)
        if name == "prev_gate":
            value[0] = float("-inf")
        for s in pair:
            getattr(s, name).copy_(value)
    return pair


def compare(module, torch_state, fused_state, steps, rows, start, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    feed = torch_state.kv.shape[-1]
    positions = torch.tensor(start, device=DEVICE)
    worst = 0.0
    closes = 0
    for step in range(steps):
        kv = torch.randn(len(rows), feed, generator=g).to(module.kv_proj.weight.dtype).to(DEVICE)
        gate = torch.randn(len(rows), feed, generator=g).to(module.gate_proj.weight.dtype).to(DEVICE)
        want = torch_state.step(module, rows, positions, kv, gate)
        got = fused_state.fused_step(module, rows, positions, kv, gate)
        assert torch.equal(got, want), (got, want)
        closes += int(((positions + 1) % torch_state.rate == 0).sum())
        for name in ("kv", "gate", "prev_kv", "prev_gate"):
            if hasattr(torch_state, name):
                a, b = getattr(torch_state, name), getattr(fused_state, name)
                assert torch.equal(a, b), (name, step, (a.float() - b.float()).abs().max())
        a, b = torch_state.entries[:, :-1].float(), fused_state.entries[:, :-1].float()  # the spare column aside
        worst = max(worst, (a - b).abs().max().item())
        positions = positions + 1
    return worst, closes
"""


def _run(body: str) -> str:
    return run(SETUP, body)


@pytest.mark.parametrize("dtypes", ["float32", "bfloat16", "bfloat16+float32 bias"])
def test_the_kernel_steps_a_compressor_as_pytorch_does(dtypes):
    """The tiny model's HCA compressor (rate 8), CSA compressor and CSA indexer (rate 4, overlapping windows):
    five rows in scattered slots at positions that close windows at different steps (one row in its first
    window, whose previous Ca is -inf gates), 20 steps. Each step's entry counts, the window rings and the
    overlap buffers are the PyTorch step's bit for bit; the entries within float rounding of the keys' dtype.
    With BF16 weights and an FP32 position bias the biased gates are FP32 and the stored Ca gates round to
    BF16; with a BF16 bias they round to BF16 first."""
    model_dtype = "float32" if dtypes == "float32" else "bfloat16"
    out = _run(f"""
        model = _model(dtype=torch.{model_dtype}, device=DEVICE)
        if "float32 bias" in "{dtypes}":
            for module in model.modules():
                if hasattr(module, "position_bias"):
                    module.position_bias.data = module.position_bias.data.float()
        attns = [layer.self_attn for layer in model.model.layers if layer.self_attn.compressor is not None]
        modules = [a.compressor for a in attns] + [a.compressor.indexer for a in attns
                                                    if hasattr(a.compressor, "indexer")]
        assert {{type(m).__name__ for m in modules}} == {{"DeepseekV4CSACompressor", "DeepseekV4HCACompressor",
                                                        "DeepseekV4Indexer"}}
        rows = torch.tensor([6, 0, 3, 5, 1], device=DEVICE)
        tol = 1e-5 if "{dtypes}" == "float32" else 2e-2
        with torch.no_grad():
            for n, module in enumerate(modules):
                torch_state, fused_state = states(module, slots=7, capacity=12, seed=n)
                rate = torch_state.rate
                start = [0, rate - 1, 2 * rate + 1, 3 * rate - 2, 5 * rate - 3]
                worst, closes = compare(module, torch_state, fused_state, 20, rows, start, seed=10 + n)
                assert closes >= 10, closes
                assert worst <= tol, (type(module).__name__, worst)
        print("ok")
    """)
    assert "ok" in out


def test_a_model_decodes_from_slots_with_the_compressor_kernel_as_without():
    """The tiny three-kind model decoding four rows from slots for 12 steps: with the compressor kernel
    bound (and the indexer's, top 3 of up to 16 entries) the logits are those of PyTorch's step within float
    rounding, the greedy tokens the same, and every compressor and indexer step went through the kernel."""
    out = _run("""
        from evalgate.model_adapters.fast import triton_compressor
        from test_attention_slots import agree_within_rounding, slot_logits_with_and_without

        model = _model(index_topk=3, device=DEVICE)
        logits, calls = slot_logits_with_and_without(model, "fused_compressor", triton_compressor, "compressor_step")
        assert not attention_slots._COMPRESSOR_FAILED, attention_slots._COMPRESSOR_FAILED
        assert len(calls) == 12 * 3  # CSA's compressor and indexer, HCA's compressor, every step
        agree_within_rounding(logits)
        print("ok")
    """)
    assert "ok" in out


def test_a_compressor_kernel_that_fails_hands_the_step_back_to_pytorch(monkeypatch):
    """A Triton failure in the compressor's step: a warning once, PyTorch's step's logits bit for bit then
    and after, and the kernel not tried again."""
    from evalgate.model_adapters.fast import triton_compressor
    from test_attention_slots import with_a_broken_kernel

    logits, calls = with_a_broken_kernel(monkeypatch, triton_compressor, "compressor_step", "_COMPRESSOR_FAILED",
                                         "fused_compressor", "no compressor kernel")
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))
