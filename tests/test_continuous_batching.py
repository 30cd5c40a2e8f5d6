"""Continuous batching (``generation.decode_stream``): rows leave the batch when they finish, new prompts are
prefilled and joined to a running batch, and forked workers share the queue, all without changing a single
token of any row (canonical numerics make a row a function of its prompt alone)."""

from __future__ import annotations

import pytest

from evalgate.model_adapters.hf.generation import decode, decode_stream
from evalgate.model_adapters.hf.sampling import SampleKey, sample_seed

PROMPTS = [
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "Question: A train travels 60 miles in 2 hours. What is its speed?\nAnswer:",
    "Question: 7 times 8?\nAnswer:",
    "Question: Sara reads 12 pages a day for a week, then 30 pages on Sunday. How many pages did she read "
    "in total over the eight days, counting both the weekdays and the weekend?\nAnswer:",
    "Question: What is 100 minus 37?\nAnswer:",
    "Question: A box holds 24 pencils. How many boxes hold 96 pencils?\nAnswer:",
    "Question: If a shirt costs $15 and is 20% off, what is the price?\nAnswer:",
]
MAX_NEW = [9, 4, 12, 7, 1, 10, 6]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from evalgate.model_adapters.hf.adapter import load_model

    return load_model(tiny_model, "w4a8")


def _alone(model, tok, stops, keys=None):
    return [decode(model, tok, [p], [s], [m], keys=None if keys is None else [keys[i]])[0]
            for i, (p, s, m) in enumerate(zip(PROMPTS, stops, MAX_NEW))]


def _streamed(model, tok, stops, keys=None, **kw):
    out = {}
    for finished in decode_stream(model, tok, PROMPTS, stops, MAX_NEW, keys=keys, **kw):
        for i, g in finished:
            assert i not in out
            out[i] = g
    return [out[i] for i in range(len(PROMPTS))]


def test_finished_rows_leave_the_batch_together_and_change_no_token(tiny, monkeypatch):
    """A finished row decodes a pad token until enough of the batch is done (leaving copies the whole KV
    cache); waiting changes no other row's tokens."""
    from evalgate.model_adapters.hf import generation

    model, tok = tiny
    stops = [("\n\n",)] * len(PROMPTS)
    selects = []
    real = generation._select
    monkeypatch.setattr(generation, "_select", lambda state, keep: selects.append(len(keep)) or real(state, keep))
    monkeypatch.setattr(generation, "COMPACT_FRACTION", 2)  # leave once more than half the rows are done
    got = _streamed(model, tok, stops)
    for a, b in zip(_alone(model, tok, stops), got):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    finishing_steps = {len(g.token_ids) for g in got}
    assert selects and len(selects) < len(finishing_steps) - 1
    assert selects[0] <= len(PROMPTS) // 2  # the first compaction dropped several finished rows at once


@pytest.mark.parametrize("batch_size, refill, workers", [(None, None, 1), (2, 1, 1), (3, 2, 1), (3, 1, 2)])
def test_rows_leaving_and_joining_the_batch_change_no_token(tiny, batch_size, refill, workers):
    model, tok = tiny
    stops = [("\n\n",)] * len(PROMPTS)
    alone = _alone(model, tok, stops)
    got = _streamed(model, tok, stops, batch_size=batch_size, refill=refill, workers=workers)
    for a, b in zip(alone, got):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_hit, a.n_prompt_tokens) == \
               (b.token_ids, b.text, b.finish_reason, b.stop_hit, b.n_prompt_tokens)
    assert [len(g.token_ids) for g in got] == MAX_NEW or any(g.finish_reason == "stop" for g in got)


@pytest.mark.parametrize("workers", [1, 2])
def test_each_decoding_loop_says_what_it_spent(tiny, workers):
    """``stats``: one DecodeStats per decoding loop (per forked worker), counting every prefill call and
    decoding step; asking for them changes no token."""
    model, tok = tiny
    stops = [("\n\n",)] * len(PROMPTS)
    plain = _streamed(model, tok, stops, batch_size=3, refill=1, workers=workers)
    stats = []
    got = _streamed(model, tok, stops, batch_size=3, refill=1, workers=workers, stats=stats)
    assert [g.token_ids for g in got] == [g.token_ids for g in plain]
    assert len(stats) == workers
    prompt_tokens = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS)
    assert sum(s.prefill_tokens for s in stats) >= prompt_tokens  # every prompt prefilled once, pads on top
    assert sum(s.prefill_calls for s in stats) >= -(-len(PROMPTS) // 3)
    # a row's first token comes from its prefill, each further one from a decoding step it was part of
    assert sum(s.row_steps for s in stats) >= sum(len(g.token_ids) - 1 for g in got)
    assert max(s.steps for s in stats) >= max(len(g.token_ids) for g in got) - 1
    for s in stats:
        assert s.steps_with_few_rows == s.steps  # batches of 3: always fewer than 8 rows
        assert s.prefill_cpu_s > 0 and s.decode_cpu_s > 0


def test_sampled_rows_draw_at_their_own_positions_when_they_join_late(tiny):
    model, tok = tiny
    keys = [SampleKey(sample_seed(5, i), 0.8) if i % 2 else None for i in range(len(PROMPTS))]
    stops = [()] * len(PROMPTS)
    alone = _alone(model, tok, stops, keys)
    got = _streamed(model, tok, stops, keys=keys, batch_size=2, refill=1)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]


def test_a_native_model_keeps_static_batches(tiny_model):
    """PyTorch's own numerics are batch-dependent: its rows never leave or join a running batch."""
    from evalgate.model_adapters.hf.generation import _dynamic
    from evalgate.model_adapters.hf.adapter import load_model

    model, tok = load_model(tiny_model, "w4a8", numerics="native")
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert not _dynamic(model, enc, MAX_NEW)
    got = _streamed(model, tok, [()] * len(PROMPTS), batch_size=3, workers=2)
    assert [len(g.token_ids) for g in got] == MAX_NEW


def _kept(kv):
    from evalgate.kernels.canonical import fixed_operand
    from evalgate.model_adapters.canonical.invariant import KeptOperands

    return KeptOperands(fixed_operand(kv.transpose(-1, -2), "columns"), fixed_operand(kv, "rows"))


def test_kept_operands_select_and_join_hold_exactly_the_rows_and_keys_they_keep():
    """``select`` (rows leave, leading keys cut) and ``join`` (rows of a new prefill, left-padded) write each
    kept key once into new buffers; what they hold is what the operands of those keys are, the padding keys
    are q = 0 with scale 1, and a key appended afterwards lands after them."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 1, 9, 8, generator=gen).to(torch.bfloat16)
    kept = _kept(kv)
    kept.select(torch.tensor([0, 2, 4]), 3)
    fresh = _kept(kv[[0, 2, 4]][:, :, 3:])
    assert kept.length == 6 and all(torch.equal(a, b) for a, b in zip(kept._views(), fresh._views()))

    new_key = torch.randn(3, 1, 1, 8, generator=gen).to(torch.bfloat16)
    kept.append(*_kept(new_key).operands())
    grown = _kept(torch.cat([kv[[0, 2, 4]][:, :, 3:], new_key], 2))
    assert all(torch.equal(a, b) for a, b in zip(kept._views(), grown._views()))

    other = torch.randn(2, 1, 4, 8, generator=gen).to(torch.bfloat16)
    kept.join(_kept(other), 0, 3)
    assert kept.length == 7 and kept.batch == 5
    views, theirs = kept._views(), _kept(other)._views()
    for j, (mine, ref, their) in enumerate(zip(views, grown._views(), theirs)):
        fill = 1.0 if j in (1, 4) else 0.0
        assert torch.equal(mine[:3], ref)
        assert torch.equal(mine[3:, :, 3:], their) and bool((mine[3:, :, :3] == fill).all())
