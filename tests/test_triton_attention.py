"""A decoding step's attention as one Triton kernel, or with its keys split over several programs and merged
(``model_adapters/fast/triton_attention.py``), against the gathered form it replaces
(``attention_slots._attend_gathered``: eager's ``_attend`` over the rows' ring keys and entries, joined, with
an additive mask), under Triton's interpreter on a CPU (on a GPU where there is one). Each check runs in a
fresh process (``triton_process``)."""

from __future__ import annotations

import pytest
import torch

from triton_process import needs_triton, run

pytestmark = needs_triton

SETUP = """
import types
import torch
from evalgate.kernels.triton import availability
from evalgate.model_adapters.fast import attention_slots, triton_attention
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gathered(q, ring, rows, positions, entries, chosen, sinks, scaling):
    attn = types.SimpleNamespace(sinks=sinks, scaling=scaling)
    state = types.SimpleNamespace(keys=ring, window=ring.shape[1],
                                  compressor=None if entries is None else types.SimpleNamespace(entries=entries))
    cache = types.SimpleNamespace(attend=attention_slots.native_attend)
    return attention_slots._attend_gathered(attn, cache, q, state, rows, positions, chosen)
"""


def _run(body: str) -> str:
    return run(SETUP, body)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_attends_as_the_gathered_form(dtype):
    """Three rows in scattered slots of a ring of 16 (one row inside its first window: unwritten ring keys
    stay shut), 20 heads (two programs, the second partial), entries chosen at random (one row chooses none:
    the ring and the sink alone), sinks of both signs: within float rounding of the gathered form; with no
    entries (a sliding-window layer) likewise."""
    out = _run(f"""
        torch.manual_seed(0)
        dt = torch.{dtype}
        slots, w, c, h, d = 5, 16, 9, 20, 32
        ring = torch.randn(slots, w, d, device=DEVICE).to(dt)
        entries = torch.randn(slots, c, d, device=DEVICE).to(dt)
        rows = torch.tensor([3, 0, 4], device=DEVICE)
        positions = torch.tensor([5, 16, 40], device=DEVICE)
        chosen = torch.rand(3, c, device=DEVICE) < 0.5
        chosen[1] = False
        sinks = torch.randn(h, device=DEVICE) * 2
        q = (torch.randn(3, h, 1, d, device=DEVICE) * 0.5).to(dt)
        scaling = d ** -0.5
        tol = 1e-5 if dt == torch.float32 else 2e-2
        for e, ch in ((entries, chosen), (None, None)):
            got = triton_attention.decode_attention(q, ring, rows, positions, e, ch, sinks, scaling)
            ref = gathered(q, ring, rows, positions, e, ch, sinks, scaling)
            assert got.shape == ref.shape == (3, h, 1, d) and got.dtype == dt
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= tol, err
        # unwritten ring keys (slot 3 holds positions 0-5) and entries not chosen are shut: garbage there
        # changes no bit of any row
        before = triton_attention.decode_attention(q, ring, rows, positions, entries, chosen, sinks, scaling)
        ring[3, 6:] = 1e4
        entries[~torch.zeros(slots, c, dtype=torch.bool, device=DEVICE).index_put_((rows,), chosen)] = -1e4
        after = triton_attention.decode_attention(q, ring, rows, positions, entries, chosen, sinks, scaling)
        assert torch.equal(after, before)
        print("ok")
    """)
    assert "ok" in out



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_chunk_attends_as_the_masked_form(dtype):
    """A prefill chunk's attention (``chunk_attention``: tokens x heads a program, each token its own keys)
    against eager's masked form it replaces (``native_attend`` with an additive mask): 3 rows of 5 tokens
    (the last token block partial), 20 heads (the last head block partial), 45 keys (the last key block
    partial), each token's keys at random with its own key always open, one key block shut for every
    token of a row (not read: garbage there changes no bit), sinks of both signs and -inf: within float
    rounding, a query layout that is a view, and the output's."""
    out = _run(f"""
        torch.manual_seed(0)
        dt = torch.{dtype}
        b, c, h, d, t = 3, 5, 20, 32, 45
        keys = torch.randn(b, t, d, device=DEVICE).to(dt)
        opened = torch.rand(b, c, t, device=DEVICE) < 0.4
        opened[:, torch.arange(c), torch.arange(c) + 20] = True  # each token's own key
        opened[1, :, 32:] = False  # row 1: its last key block is shut for every token
        sinks = torch.randn(h, device=DEVICE) * 2
        sinks[3] = float("-inf")
        q = (torch.randn(b, c, h, d, device=DEVICE) * 0.5).to(dt).transpose(1, 2)  # [b, H, C, D], a view
        scaling = d ** -0.5
        attn = types.SimpleNamespace(sinks=sinks, scaling=scaling)
        mask = attention_slots.additive_mask(opened, dt)
        ref = attention_slots.native_attend(attn, q, keys.unsqueeze(1), mask.unsqueeze(1))
        tol = 1e-5 if dt == torch.float32 else 2e-2
        for tokens in (1, 2, 4):
            triton_attention.CHUNK["tokens"] = tokens
            got = triton_attention.chunk_attention(q, keys, opened, sinks, scaling)
            assert got.shape == ref.shape == (b, h, c, d) and got.dtype == dt
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= tol, (tokens, err)
        before = triton_attention.chunk_attention(q, keys, opened, sinks, scaling)
        keys[1, 32:] = 1e4
        assert torch.equal(triton_attention.chunk_attention(q, keys, opened, sinks, scaling), before)
        print("ok")
    """)
    assert "ok" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keys_split_over_programs_attend_as_the_gathered_form(dtype):
    """The keys split over 2, 3, 4 and 8 programs a row (forced; 1 is the one kernel), with entries (7 key
    blocks of 16) and without (4: 8 splits leave some with no block at all), three rows at different
    positions (one whose keys all lie in the first block, so every other split has no open key), a -inf
    sink in each head program: within float rounding of the gathered form, no NaN, and the split path ran
    with the SPLIT asked. Left to choose, it splits on 132 SMs and not on one."""
    out = _run(f"""
        torch.manual_seed(0)
        dt = torch.{dtype}
        triton_attention.KEYS = 16  # small blocks: several a row at shapes the interpreter runs in seconds
        slots, w, c, h, d = 5, 64, 40, 20, 32
        ring = torch.randn(slots, w, d, device=DEVICE).to(dt)
        entries = torch.randn(slots, c, d, device=DEVICE).to(dt)
        rows = torch.tensor([3, 0, 4], device=DEVICE)
        positions = torch.tensor([5, 70, 40], device=DEVICE)
        chosen = torch.rand(3, c, device=DEVICE) < 0.5
        chosen[0] = False
        sinks = torch.randn(h, device=DEVICE) * 2
        sinks[[1, 17]] = float("-inf")
        q = (torch.randn(3, h, 1, d, device=DEVICE) * 0.5).to(dt)
        scaling = d ** -0.5
        tol = 1e-5 if dt == torch.float32 else 2e-2
        splits = []  # the SPLIT of each launch of the split path
        split_attention = triton_attention._split_attention

        def counted(*args):
            splits.append(args[-2])
            return split_attention(*args)

        triton_attention._split_attention = counted
        for e, ch in ((entries, chosen), (None, None)):
            ref = gathered(q, ring, rows, positions, e, ch, sinks, scaling)
            for split in (1, 2, 3, 4, 8):
                triton_attention.SPLIT["force"] = split
                splits.clear()
                got = triton_attention.decode_attention(q, ring, rows, positions, e, ch, sinks, scaling)
                assert splits == ([] if split == 1 else [split]), (split, splits)
                assert got.shape == ref.shape == (3, h, 1, d) and got.dtype == dt
                assert not got.isnan().any(), split
                err = (got.float() - ref.float()).abs().max().item()
                assert err <= tol, (split, e is None, err)
        triton_attention.SPLIT["force"] = 0
        ref = gathered(q, ring, rows, positions, entries, chosen, sinks, scaling)
        for sms, split in ((132, 4), (1, None)):  # 6 programs; 7 blocks: 4 splits on 132 SMs
            availability.INTERPRETED_SMS = sms  # the interpreter's SMs
            availability._cuda_sms = lambda index: sms  # a GPU's
            splits.clear()
            got = triton_attention.decode_attention(q, ring, rows, positions, entries, chosen, sinks, scaling)
            assert splits == ([split] if split else []), (sms, splits)
            assert (got.float() - ref.float()).abs().max().item() <= tol
        print("ok")
    """)
    assert "ok" in out


def test_the_split_follows_the_batch_and_the_sms():
    """``key_splits`` from static shapes: DeepSeek-V4-Flash's attention (64 heads, a 128-key ring, 512
    entries) on 132 SMs splits batch 1 sixteen ways (four in a sliding-window layer: one split a ring block),
    batch 16 four ways, and batch 64 and 256 not at all; programs_per_sm 0 never splits; force wins; off
    CUDA the SMs are availability.INTERPRETED_SMS."""
    from evalgate.kernels.triton import availability
    from evalgate.model_adapters.fast import triton_attention as ta

    assert [ta.key_splits(b, 64, 128, 512, 132) for b in (1, 2, 16, 64, 256)] == [16, 16, 4, 1, 1]
    assert ta.key_splits(1, 64, 128, 0, 132) == 4
    assert ta.key_splits(1, 64, 128, 512, 1) == 1  # 4 programs already past 2 x 1 SM
    saved, sms = dict(ta.SPLIT), availability.INTERPRETED_SMS
    try:
        ta.SPLIT["programs_per_sm"] = 0
        assert ta.key_splits(1, 64, 128, 512, 132) == 1
        ta.SPLIT["force"] = 3
        assert ta.key_splits(256, 64, 128, 512, 132) == 3
        availability.INTERPRETED_SMS = 77
        assert availability.sm_count("cpu") == 77
    finally:
        ta.SPLIT.clear()
        ta.SPLIT.update(saved)
        availability.INTERPRETED_SMS = sms


@pytest.mark.parametrize("split", [1, 2])
def test_a_model_decodes_from_slots_with_the_kernel_as_without(split):
    """The tiny three-kind model (sliding, CSA, HCA) decoding four rows from slots for 12 steps: with the
    kernel bound (what a GPU with PyTorch's numerics runs), its keys in one program a row or split over two,
    the logits are those of the gathered form within float rounding, and the greedy tokens are the same."""
    out = _run(f"""
        triton_attention.SPLIT["force"] = {split}
        from test_attention import _model
        from test_attention_slots import agree_within_rounding, slot_logits_with_and_without

        model = _model(index_topk=3, device=DEVICE)
        logits, calls = slot_logits_with_and_without(model, "fused_attention", triton_attention, "decode_attention")
        assert not attention_slots._ATTENTION_FAILED, attention_slots._ATTENTION_FAILED
        assert len(calls) == 12 * len(model.model.layers)  # every layer of every step, in the fused run
        agree_within_rounding(logits)
        print("ok")
    """)
    assert "ok" in out


def test_an_attention_kernel_that_fails_hands_the_step_back_to_the_gathered_form(monkeypatch):
    """A Triton failure in the slot step's attention: a warning once, the gathered form's logits then and
    after, and the kernel not tried again."""
    from evalgate.model_adapters.fast import triton_attention
    from test_attention_slots import with_a_broken_kernel

    logits, calls = with_a_broken_kernel(monkeypatch, triton_attention, "decode_attention", "_ATTENTION_FAILED",
                                         "fused_attention", "no attention kernel")
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))
