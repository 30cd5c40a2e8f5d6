"""Prefill in per-row slots (``attention_slots.SlotCache.prefill``) and the prompt cache over it
(``generation.PromptCache``): a shared prefix computed once and copied, then many rows' own tokens a call in
chunks. Under canonical numerics, for a tiny DeepSeek-V4 model with sliding-window, CSA and HCA layers (window
16, CSA windows of 4, HCA windows of 8; the cut points below fall inside windows, so a copied slot carries
each compressor's partly filled window), every row's logits and tokens are those of a full prefill of its
whole prompt alone, bit for bit; on a GPU too where one is present."""

from __future__ import annotations

import pytest
import torch

from evalgate.model_adapters.canonical import invariant
from evalgate.model_adapters.fast.attention_slots import SlotCache
from evalgate.model_adapters.hf import generation
from evalgate.model_adapters.hf.sampling import SampleKey
from test_attention import DEVICES, VOCAB, _model, _Tokenizer


def _canonical(device="cpu"):
    model = _model(dtype=torch.bfloat16, index_topk=3, device=device)
    invariant.install(model)
    return model


def _ids(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = 21  # inside the second HCA window and the sixth CSA one, past the sliding window


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("device", DEVICES)
def test_rows_from_a_copied_prefix_and_batched_chunks_give_the_full_prefill(device):
    """A prefix of 21 tokens prefilled once (in chunks of 5) into a spare slot and copied into four slots;
    their own tokens (3 to 30 of them) fed together in chunks of 7, at most 20 tokens a call; then 3 decoding
    steps. The prefill's logits and the last step's equal, bit for bit, the last logits of a prefill of the
    row's whole sequence alone."""
    model = _canonical(device)
    prefix = _ids(PREFIX, 1)
    rows = [prefix + _ids(n, 10 + n) for n in (30, 3, 13, 9)]
    cache = SlotCache(model, slots=5, max_length=64)
    cache.start(4)
    cache.prefill([4], [prefix], chunk=5)
    slots = [2, 0, 3, 1]
    for slot in slots:
        cache.copy(4, slot)
    logits = cache.prefill(slots, [r[PREFIX:] for r in rows], chunk=7, budget=20)
    for step in range(4):
        if step in (0, 3):
            for j, seq in enumerate(rows):
                alone = model(input_ids=torch.tensor([seq], device=device)).logits[0, -1]
                assert torch.equal(logits[j], alone), (step, j, len(seq))
        if step < 3:
            tokens = logits.argmax(-1)
            for seq, tok in zip(rows, tokens.tolist()):
                seq.append(tok)
            logits = cache.decode_step(tokens, slots)


@torch.no_grad()
def test_a_slot_prefilled_from_position_0_overwrites_what_it_held():
    """A slot that held a long row, started again and fed a short prompt in one chunk: the logits of that
    prompt alone (nothing of the old row's ring, windows or entries leaks in)."""
    model = _canonical()
    cache = SlotCache(model, slots=1, max_length=64)
    cache.start(0)
    cache.prefill([0], [_ids(45, 3)])
    prompt = _ids(11, 4)
    cache.start(0)
    got = cache.prefill([0], [prompt])[0]
    assert torch.equal(got, model(input_ids=torch.tensor([prompt])).logits[0, -1])
    with pytest.raises(ValueError, match="no room"):
        cache.prefill([0], [_ids(60, 5)])


def _prompts():
    """Six prompts sharing a few-shot-like prefix (of text), two of them the same prompt twice."""
    shared = " ".join(str(t) for t in _ids(PREFIX, 1))
    own = [" ".join(str(t) for t in _ids(n, 20 + n)) for n in (4, 17, 9, 26)]
    texts = [f"{shared} {o}" for o in own]
    return texts + [texts[1], texts[3]]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_generation_with_the_prompt_cache_gives_each_prompt_its_tokens_alone(monkeypatch, device):
    """``decode_stream`` over slots with the prefix cache and batched prefill: each prompt's tokens are those
    of the same prompt decoded alone without either (its full prefill), greedy or, for the two repeated
    prompts, sampled with their own keys; the shared prefix is computed once and a repeated prompt not again,
    so the model computes fewer prompt tokens than the prompts hold."""
    model = _canonical(device)
    prompts = _prompts()
    limits = [5, 7, 3, 6, 7, 6]
    keys = [None] * 4 + [SampleKey(11, 1.0), SampleKey(12, 0.7)]  # the repeats sample, each with its own key
    monkeypatch.setattr(generation, "PREFIX_CACHE", False)
    monkeypatch.setattr(generation, "BATCHED_PREFILL", False)
    alone = [generation.decode(model, _Tokenizer(), [p], [()], [m], device, keys=[k])[0].token_ids
             for p, m, k in zip(prompts, limits, keys)]
    monkeypatch.setattr(generation, "PREFIX_CACHE", True)
    monkeypatch.setattr(generation, "BATCHED_PREFILL", True)
    embedded = []  # tokens through the model's embedding: what the calls computed
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    stats, got = [], [None] * len(prompts)
    try:
        for finished in generation.decode_stream(model, _Tokenizer(), prompts, [()] * len(prompts), limits, device,
                                                 keys=keys, batch_size=3, refill=1, stats=stats):
            for i, g in finished:
                got[i] = g.token_ids
    finally:
        hook.remove()
    assert got == alone
    enc = [_Tokenizer()(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prefix = generation.shared_prefix(enc)
    assert prefix >= PREFIX
    spent = stats[0]
    assert spent.prompt_tokens == sum(map(len, enc))
    own = sum(len(e) - prefix for e in enc[:4])  # the two repeats come from the prompt cache
    # the embedding saw the prefill's tokens (pads included) and one token a row a decoding step
    assert sum(embedded) - spent.row_steps == spent.prefill_tokens >= prefix + own
    # the prefix once, the repeats never: less, pads and all, than every prompt's own tokens once
    assert spent.prefill_tokens < prefix + sum(len(e) - prefix for e in enc)


@pytest.mark.slow
def test_prompts_prefilled_together_get_the_tokens_they_get_alone(monkeypatch):
    """Batch invariance of the batched prefill: prompts of 5 to 40 tokens without a shared prefix, admitted
    six at a time and prefilled in calls of a few chunks, decode the tokens each decodes alone at batch 1."""
    model = _canonical()
    monkeypatch.setattr(generation, "PREFIX_CACHE", False)
    g = torch.Generator().manual_seed(9)
    lengths = torch.randint(5, 40, (6,), generator=g).tolist()
    prompts = [" ".join(str(int(x)) for x in torch.randint(3, VOCAB, (n,), generator=g)) for n in lengths]
    limits = [4] * len(prompts)
    alone = [generation.decode(model, _Tokenizer(), [p], [()], [m])[0].token_ids for p, m in zip(prompts, limits)]
    from evalgate.model_adapters.fast import attention_slots

    monkeypatch.setattr(attention_slots, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(attention_slots, "PREFILL_BUDGET", 24)
    stats, got = [], [None] * len(prompts)
    for finished in generation.decode_stream(model, _Tokenizer(), prompts, [()] * len(prompts), limits,
                                             batch_size=6, stats=stats):
        for i, gen in finished:
            got[i] = gen.token_ids
    assert got == alone
    assert stats[0].prefill_calls < len(prompts) * max(-(-n // 8) for n in lengths)  # rows shared calls


@pytest.mark.slow
def test_a_prompt_taken_several_times_in_a_padded_batch_is_prefilled_once(monkeypatch):
    """Canonical numerics without compressed layers decode from left-padded batches (``_decode_queue``): an
    item's samples, the same prompt three times beside two others, are prefilled as one row and repeated;
    each row gets the tokens it gets alone (greedy, or sampled with its own key)."""
    model = _model(layer_types=["sliding_attention"] * 2, dtype=torch.bfloat16)
    invariant.install(model)
    assert not generation._slot_decoding(model, "cpu")
    texts = [" ".join(str(t) for t in _ids(n, 40 + n)) for n in (6, 5, 7)]
    prompts = [texts[0], texts[1], texts[0], texts[2], texts[0]]
    limits = [5, 6, 5, 4, 5]
    keys = [None, None, SampleKey(3, 1.0), None, SampleKey(4, 1.0)]
    alone = [generation.decode(model, _Tokenizer(), [p], [()], [m], keys=[k])[0].token_ids
             for p, m, k in zip(prompts, limits, keys)]
    stats, got = [], [None] * len(prompts)
    for finished in generation.decode_stream(model, _Tokenizer(), prompts, [()] * len(prompts), limits, keys=keys,
                                             stats=stats):
        for i, g in finished:
            got[i] = g.token_ids
    assert got == alone
    enc = [_Tokenizer()(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert stats[0].prompt_tokens == sum(map(len, enc))
    assert stats[0].prefill_tokens <= 3 * max(map(len, enc))  # three distinct rows, padded to the longest
