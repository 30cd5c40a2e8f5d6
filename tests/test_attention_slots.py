"""Decoding from a KV cache preallocated per row (``model_adapters/fast/attention_slots.py``): every row decodes
what it decodes alone through transformers (batch 1, no padding), whatever the other slots hold, for all
three DeepSeek-V4 attention kinds; slots are written in place and reused."""

from __future__ import annotations

import pytest
import torch

from evalgate.model_adapters.fast.attention_slots import SlotCache, top_entries
from test_attention import DEVICES, VOCAB, _model

pytestmark = pytest.mark.slow

# window 16, CSA windows of 4, HCA windows of 8: these lengths start inside, at the edge of and past them
LENGTHS = (23, 9, 30, 16)
STEPS = 12


def _prompts(seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


@torch.no_grad()
def _alone(model, prompt, steps):
    """transformers on one row: logits [steps + 1, V] (the prefill's last, then each step's) and the greedy
    tokens it fed."""
    out = model(input_ids=prompt[None].to(model.device), use_cache=True)
    past, logits, n = out.past_key_values, [out.logits[0, -1]], len(prompt)
    tokens = [int(out.logits[0, -1].argmax())]
    for i in range(steps):
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=model.device),
                    position_ids=torch.tensor([[n + i]], device=model.device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1])
        tokens.append(int(out.logits[0, -1].argmax()))
    return torch.stack(logits), tokens


@torch.no_grad()
def _admit(model, cache, slot, prompt):
    cache.admit(slot, model(input_ids=prompt[None].to(model.device), use_cache=True).past_key_values, len(prompt))


@torch.no_grad()
def slot_logits_with_and_without(model, switch: str, module, kernel: str, steps: int = 12):
    """Four rows in scattered slots decoded greedily for ``steps`` steps, with the ``SlotCache`` flag ``switch``
    off and on: ({False: logits [steps, 4, V], True: ...}, how often ``module.kernel`` was called)."""
    calls = []
    wrapped = getattr(module, kernel)
    setattr(module, kernel, lambda *a: calls.append(1) or wrapped(*a))
    logits = {}
    for on in (False, True):
        cache = SlotCache(model, slots=6, max_length=64)
        setattr(cache, switch, on)
        slots = [4, 0, 5, 2]
        for slot, prompt in zip(slots, _prompts()):
            _admit(model, cache, slot, prompt)
        rows = torch.tensor(slots, device=model.device)
        tokens = torch.tensor([5, 6, 7, 8], device=model.device)
        out = []
        for _ in range(steps):
            step = cache.decode_step(tokens, rows)
            out.append(step)
            tokens = step.argmax(-1)
        logits[on] = torch.stack(out)
    setattr(module, kernel, wrapped)
    return logits, calls


def agree_within_rounding(logits: dict) -> None:
    """The on run's logits within float rounding of the off run's, and the same greedy tokens."""
    a, b = logits[False], logits[True]
    err = (a - b).abs().max().item()
    assert err <= 1e-4 * max(1.0, a.abs().max().item()), err
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@torch.no_grad()
def with_a_broken_kernel(monkeypatch, module, kernel: str, failed: str, switch: str, message: str):
    """Two rows decoded two steps from slots with ``switch`` (a ``SlotCache`` flag) off, then on with
    ``module.kernel`` raising ``message``: (the logits of each run, how often the kernel was called). The on
    run must warn once with the message."""
    from evalgate.model_adapters.fast import attention_slots

    monkeypatch.setattr(attention_slots, failed, [])
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError(message)

    monkeypatch.setattr(module, kernel, broken)
    model = _model(index_topk=3)
    logits = {}
    for on in (False, True):
        cache = SlotCache(model, slots=2, max_length=64)
        setattr(cache, switch, on)
        for slot, prompt in enumerate(_prompts()[:2]):
            _admit(model, cache, slot, prompt)
        rows, tokens = torch.tensor([0, 1]), torch.tensor([5, 6])
        if on:
            with pytest.warns(UserWarning, match=message):
                first = cache.decode_step(tokens, rows)
        else:
            first = cache.decode_step(tokens, rows)
        logits[on] = (first, cache.decode_step(first.argmax(-1), rows))
    return logits, calls


def _close(a, b):
    return (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


@torch.no_grad()
@pytest.mark.parametrize("device", DEVICES)
def test_rows_in_slots_decode_as_each_row_alone(device):
    """Four rows of different lengths in scattered slots of one cache, decoded together for 12 steps (past
    the window and several CSA / HCA window closes, at different steps per row): each row's logits are its
    logits alone (float rounding; the indexer keeps every closed entry here, so no top-k tie decides)."""
    model = _model(index_topk=64, device=device)
    prompts = _prompts()
    ref = [_alone(model, p, STEPS) for p in prompts]
    cache = SlotCache(model, slots=6, max_length=64)
    slots = [4, 0, 5, 2]
    for slot, prompt in zip(slots, prompts):
        _admit(model, cache, slot, prompt)
    buffers = [t.data_ptr() for layer in cache.layers for t in (layer.keys,)]
    rows = torch.tensor(slots, device=device)
    for i in range(STEPS):
        tokens = torch.tensor([r[1][i] for r in ref], device=device)
        logits = cache.decode_step(tokens, rows)
        for j in range(len(prompts)):
            assert _close(logits[j], ref[j][0][i + 1]), (i, j)
    assert [t.data_ptr() for layer in cache.layers for t in (layer.keys,)] == buffers  # written in place
    assert cache.positions[rows].tolist() == [n + STEPS for n in LENGTHS]


@torch.no_grad()
def test_a_finished_rows_slot_takes_the_next_prompt():
    """A slot reused mid-run: the new prompt decodes as it does alone, its neighbour is undisturbed."""
    model = _model(index_topk=64)
    a, b, c = _prompts()[:3]
    ref_a, ref_c = _alone(model, a, 10), _alone(model, c, 6)
    cache = SlotCache(model, slots=2, max_length=64)
    _admit(model, cache, 0, a)
    _admit(model, cache, 1, b)
    rows = torch.tensor([0, 1])
    for i in range(4):  # b decodes 4 steps and finishes
        cache.decode_step(torch.tensor([ref_a[1][i], 5]), rows)
    _admit(model, cache, 1, c)  # c takes b's slot
    for i in range(6):
        logits = cache.decode_step(torch.tensor([ref_a[1][4 + i], ref_c[1][i]]), rows)
        assert _close(logits[0], ref_a[0][5 + i]), i
        assert _close(logits[1], ref_c[0][1 + i]), i


def test_top_entries_ties_to_the_lower_index():
    scores = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0, 9.0, 9.0]])
    closed = torch.tensor([[True] * 5 + [False], [True] * 6])
    chosen = top_entries(scores, closed, 3)
    assert chosen.tolist() == [[True, True, True, False, False, False], [False, True, False, False, True, True]]
    assert top_entries(scores, closed, 10).tolist() == closed.tolist()  # k beyond the closed: all of them


@torch.no_grad()
def test_an_indexer_whose_top_k_covers_every_entry_keeps_no_state():
    """A CSA layer whose indexer's top k covers every entry a slot can hold (17 entries of 64 tokens, top 17)
    keeps no indexer state and selects every closed entry: its rows decode as the rows of a cache one entry
    larger (top 17 of 18), whose indexer runs and also selects them all while a row holds at most 17, bit
    for bit (canonical numerics: the entries beyond a row's closed ones change no bit)."""
    from evalgate.model_adapters.canonical import invariant

    model = _model(index_topk=17)
    invariant.install(model)
    prompts = _prompts()
    logits = []
    for max_length in (64, 68):
        cache = SlotCache(model, slots=4, max_length=max_length)
        kept = [layer.indexer is not None for layer, attn in zip(cache.layers, model.model.layers)
                if getattr(attn.self_attn.compressor, "indexer", None) is not None]
        assert kept and all(k == (max_length == 68) for k in kept)
        for slot, prompt in enumerate(prompts):
            _admit(model, cache, slot, prompt)
        rows, tokens, steps = torch.arange(4), torch.tensor([5, 6, 7, 8]), []
        for _ in range(STEPS):
            steps.append(cache.decode_step(tokens, rows))
            tokens = steps[-1].argmax(-1)
        logits.append(torch.stack(steps))
    assert torch.equal(logits[0], logits[1])


def test_a_prompt_too_long_for_the_slots_is_refused():
    model = _model()
    cache = SlotCache(model, slots=1, max_length=20)
    with pytest.raises(ValueError, match="no room"):
        _admit(model, cache, 0, _prompts()[2])


def test_decoding_from_slots_gives_each_prompt_its_tokens_alone(monkeypatch):
    """``generation.decode_stream`` over slots (what a GPU does for a DeepSeek-V4 model with PyTorch's
    numerics; forced here on the CPU): 5 prompts through 2 slots, refilled as rows finish, each with its own
    token limit: every prompt gets the tokens transformers gives it alone."""
    from evalgate.model_adapters.hf import generation
    from test_attention import _Tokenizer

    model = _model(index_topk=64)
    prompts = [" ".join(str(int(t)) for t in p) for p in _prompts(seed=4)] + ["7 8 9 10 11"]
    limits = [6, 3, 9, 4, 5]
    stops = [()] * len(prompts)
    alone = [generation.decode(model, _Tokenizer(), [p], [()], [m])[0].token_ids for p, m in zip(prompts, limits)]
    monkeypatch.setattr(generation, "_slot_decoding", lambda model, device: True)
    calls = []
    inner = generation._decode_slots
    monkeypatch.setattr(generation, "_decode_slots", lambda *a: calls.append(1) or inner(*a))
    stats = []
    got = [None] * len(prompts)
    for finished in generation.decode_stream(model, _Tokenizer(), prompts, stops, limits, batch_size=2, refill=1,
                                             stats=stats):
        for i, g in finished:
            got[i] = g.token_ids
    assert calls and got == alone
    # a take's prompts are prefilled together (generation.BATCHED_PREFILL): at most a call a prompt
    assert 0 < stats[0].prefill_calls <= len(prompts) and stats[0].steps < sum(limits)  # rows shared steps
