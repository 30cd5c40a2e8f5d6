"""Tiled DeepSeek-V4 attention (``model_adapters/fast/attention.py``) against transformers' eager attention, and
caches of rows prefilled apart stacked into one batch (``model_adapters/hf/cache.py``), on a small model with
all three attention kinds: sliding window, CSA (compressor + indexer top-k) and HCA."""

from __future__ import annotations

import pytest
import torch

from evalgate.model_adapters.fast import attention
from evalgate.model_adapters.hf import generation
from evalgate.model_adapters.hf.cache import model_stackable, stack_rows, stackable
from evalgate.model_adapters.hf.tiny import fill_hash_routes, tiny_config

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
VOCAB = 200
# every check runs on the CPU; on a machine with a GPU also there (what a GPU load installs)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(layer_types=KINDS, dtype=torch.float32, seed=0, index_topk=5, device="cpu"):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    n = len(layer_types)
    cfg = tiny_config(VOCAB, num_hidden_layers=n, layer_types=list(layer_types),
                      mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1), sliding_window=16,
                      compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                      index_topk=index_topk)
    model = DeepseekV4ForCausalLM(cfg).eval()
    fill_hash_routes(model, seed)
    with torch.no_grad():  # the initialisation zeroes these; a zero sink or bias would hide a misplaced one
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()
            if hasattr(module, "position_bias"):
                module.position_bias.normal_()
    return model.to(dtype=dtype, device=device)


def _batch(b=3, s=40, pads=(0, 7, 13), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


@torch.no_grad()
def _logits(model, ids, mask, steps=10, after_prefill=lambda: None):
    """Prefill logits [B, S, V], then ``steps`` greedy decoding steps' logits; and the greedy tokens."""
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    after_prefill()
    logits, past, last = [out.logits], out.past_key_values, positions[:, -1:]
    tokens = []
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        tokens.append(tok)
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype, device=mask.device)], -1)
        last = last + 1
        out = model(input_ids=tok, attention_mask=mask, position_ids=last, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return logits, torch.cat(tokens, -1)


def _watch_blocks(monkeypatch):
    """Every block of scores the tiled attention computes, as (rows, heads, queries, keys)."""
    seen = []
    inner = attention._attend

    def watched(module, query, key, mask, scaling):
        seen.append((query.shape[0], query.shape[1], query.shape[2], key.shape[2]))
        return inner(module, query, key, mask, scaling)

    monkeypatch.setattr(attention, "_attend", watched)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gather", [True, False])
def test_tiled_attention_matches_eager_for_all_three_kinds(monkeypatch, device, gather):
    """Prefill of a left-padded batch and 10 decoding steps: every logit within float rounding of eager,
    the same greedy tokens; with a small budget no block of scores exceeds it (or is a single query of a
    single row), so the [B, H, S, T] tensor is never built. ``gather``: a block attends to the keys its mask
    opens (the CPU's default), or to every key, masked, where that fits (the GPU's: no host sync)."""
    model = _model(device=device)
    ids, mask = _batch()
    ref, ref_tokens = _logits(model, ids, mask)
    seen = _watch_blocks(monkeypatch)
    heads, width = model.config.num_attention_heads, ids.shape[1]
    keys = width + width // 4  # the sequence and the CSA layer's entries: more than any layer has
    for budget in (1 << 30, 20_000, 800):  # one block; query blocks; single queries of single rows
        assert attention.install(model, budget=budget, gather=gather)
        assert model.config._attn_implementation == attention.ATTENTION
        seen.clear()
        prefill = []
        got, tokens = _logits(model, ids, mask, after_prefill=lambda: prefill.extend(seen))
        assert torch.equal(tokens, ref_tokens), budget
        for a, b in zip(ref, got):
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item()), budget
        assert prefill, "prefill never reached the tiled attention"
        if budget < 1 << 30:
            assert len(ids) * heads * width * width * attention.BYTES_PER_SCORE > budget  # eager's would not fit
            for b, h, s, t in prefill:
                assert b * h * s * t * attention.BYTES_PER_SCORE <= budget or (b == 1 and s == 1), budget
            if gather:  # a block sees only the keys it may
                assert all(t < keys for _, _, _, t in prefill)
            elif budget == 20_000:  # blocks of queries over every key of their layer: the sequence, the entries
                assert {t for _, _, _, t in prefill} == {width, width + width // 8, width + width // 4}


def test_installed_without_a_budget_the_default_holds(monkeypatch):
    """``install(model)`` as a GPU load calls it: every layer's blocks within ``DEFAULT_BUDGET``."""
    model = _model()
    ids, mask = _batch()
    ref, ref_tokens = _logits(model, ids, mask, steps=2)
    seen = _watch_blocks(monkeypatch)
    monkeypatch.setattr(attention, "DEFAULT_BUDGET", 20_000)
    for gather in (True, False):
        assert attention.install(model, gather=gather)
        _, tokens = _logits(model, ids, mask, steps=2)
        assert torch.equal(tokens, ref_tokens)
    assert seen and all(b * h * s * t * attention.BYTES_PER_SCORE <= 20_000 or s == 1 for b, h, s, t in seen)


@pytest.mark.slow
def test_tiled_attention_bf16_keeps_tokens_close():
    """In BF16 (the GPU's dtype) the tiled and eager logits agree to BF16 rounding."""
    model = _model(dtype=torch.bfloat16)
    ids, mask = _batch()
    ref, _ = _logits(model, ids, mask, steps=4)
    attention.install(model, budget=20_000)
    got, _ = _logits(model, ids, mask, steps=4)
    for a, b in zip(ref, got):
        assert (a.float() - b.float()).abs().max().item() <= 0.05 * a.float().abs().max().item()


def test_indexer_scores_in_blocks_match_the_scorer():
    model = _model()
    scorer = next(m for m in model.modules() if type(m).__name__ == "DeepseekV4IndexerScorer")
    g = torch.Generator().manual_seed(3)
    b, s, h, d, t = 2, 9, model.config.index_n_heads, model.config.index_head_dim, 6
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, t, d, generator=g)
    hidden = torch.randn(b, s, model.config.hidden_size, generator=g)
    ref = scorer(q, kv, hidden)
    for budget in (1 << 30, 1000, 1):
        got = attention.tiled_indexer_scores(scorer, q, kv, hidden, budget)
        assert got.dtype == torch.float32 and got.shape == (b, s, t)
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_canonical_models_are_left_alone():
    """A model with canonical numerics keeps its own attention: install changes nothing."""
    from evalgate.model_adapters.canonical import invariant

    model = _model(layer_types=["sliding_attention"] * 2)
    invariant.install(model)
    assert not attention.install(model)
    assert model.config._attn_implementation == invariant.ATTENTION


@pytest.mark.slow
@torch.no_grad()
def test_caches_prefilled_apart_stack_into_the_one_call_cache():
    """Rows prefilled in two calls of one width, their caches stacked: the decoding steps that follow give
    the logits of one call over all rows (float rounding), for every attention kind's cache state."""
    model = _model()
    ids, mask = _batch(b=4, pads=(0, 7, 13, 2))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    whole = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
    parts = [model(input_ids=ids[r], attention_mask=mask[r], position_ids=positions[r],
                   use_cache=True).past_key_values for r in (slice(0, 1), slice(1, 4))]
    assert model_stackable(model) and all(stackable(p) for p in parts)
    stacked = stack_rows(parts)
    tok = torch.randint(3, VOCAB, (4, 1))
    last = positions[:, -1:]
    for step in range(6):  # past the HCA window of 8 and several CSA windows of 4
        mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], -1)
        last = last + 1
        a = model(input_ids=tok, attention_mask=mask, position_ids=last, past_key_values=whole, use_cache=True)
        b = model(input_ids=tok, attention_mask=mask, position_ids=last, past_key_values=stacked, use_cache=True)
        assert (a.logits - b.logits).abs().max().item() <= 1e-5, step
        tok = a.logits[:, -1].argmax(-1, keepdim=True)


def test_caches_of_different_widths_do_not_stack():
    model = _model()
    ids, mask = _batch()
    with torch.no_grad():
        a = model(input_ids=ids[:1], use_cache=True).past_key_values
        b = model(input_ids=ids[1:, 5:], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="timelines"):
        stack_rows([a, b])


class _Tokenizer:
    """Token ids as text: each id one word."""

    pad_token_id, eos_token_id = 0, 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


@pytest.mark.slow
def test_static_batch_prefilled_in_parts_gives_the_same_tokens(monkeypatch):
    """A static batch (PyTorch's numerics, compressed attention) whose prefill exceeds PREFILL_TOKENS is
    prefilled a few rows per call: the same greedy tokens as one call."""
    model = _model()
    g = torch.Generator().manual_seed(5)
    prompts = [" ".join(str(int(x)) for x in torch.randint(3, VOCAB, (n,), generator=g)) for n in (30, 23, 17, 28, 9)]
    stops = [()] * len(prompts)
    calls = []
    inner = generation._prefill

    def counted(model_, ids, pad_id, device, width=None):
        calls.append((len(ids), width))
        return inner(model_, ids, pad_id, device, width)

    monkeypatch.setattr(generation, "_prefill", counted)
    one = generation.decode(model, _Tokenizer(), prompts, stops, [8] * len(prompts))
    assert calls == [(5, None)]
    calls.clear()
    monkeypatch.setattr(generation, "PREFILL_TOKENS", 60)  # two rows of width 30 per call
    parts = generation.decode(model, _Tokenizer(), prompts, stops, [8] * len(prompts))
    assert calls == [(2, 30), (2, 30), (1, 30)]
    assert [g.token_ids for g in parts] == [g.token_ids for g in one]
