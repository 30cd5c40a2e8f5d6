"""Whole decoding steps per batch bucket (``model_adapters/fast/step_graphs.py``) on the CPU: the body a CUDA graph
captures (padding rows in the spare slot, the MoE's deferred check) decodes every row as it decodes alone;
a step run again from the same inputs (what a step whose MoE left rows does) leaves the same state; on a
GPU the graphed step gives the eager step's bits (tests/test_triton.py)."""

from __future__ import annotations

import pytest
import torch

from evalgate.kernels.triton import moe
from evalgate.model_adapters.fast.attention_slots import SlotCache
from evalgate.model_adapters.fast.step_graphs import StepGraphs, bucket_of
from test_attention import _model
from test_attention_slots import LENGTHS, _admit, _alone, _close, _prompts

pytestmark = pytest.mark.slow

STEPS = 12  # past the window (16) and several CSA (4) / HCA (8) window closes


def _state(cache: SlotCache) -> list[torch.Tensor]:
    out = [cache.positions.clone()]
    for layer in cache.layers:
        out.append(layer.keys.clone())
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                out += [t.clone() for t in (c.kv, c.gate, c.entries)]
                if c.overlap:
                    out += [c.prev_kv.clone(), c.prev_gate.clone()]
    return out


def test_buckets_are_powers_of_two_up_to_the_slots():
    assert [bucket_of(b, 6) for b in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    assert bucket_of(200, 256) == 256 and bucket_of(3, 2) == 2


@torch.no_grad()
def test_a_step_run_twice_leaves_the_state_of_one():
    """Every step of four rows (window closes at different steps per row) run twice before the rows move on:
    the same logits and the same cache, bit for bit (the CSA compressor's and indexer's overlap included: a
    top 5 of up to 17 entries keeps the indexer's state)."""
    model = _model(index_topk=5)
    cache = SlotCache(model, slots=5, max_length=64)
    slots = [4, 0, 3, 2]
    for slot, prompt in zip(slots, _prompts()):
        _admit(model, cache, slot, prompt)
    rows = torch.tensor(slots)
    tokens = torch.tensor([5, 6, 7, 8])
    for i in range(STEPS):
        once = cache.forward(tokens, rows)
        state = _state(cache)
        again = cache.forward(tokens, rows)
        assert torch.equal(once, again), i
        assert all(torch.equal(a, b) for a, b in zip(state, _state(cache))), i
        cache.advance(rows, slots)
        tokens = once.argmax(-1)


@torch.no_grad()
@pytest.mark.parametrize("rerun", [False, True])
def test_bucketed_steps_decode_each_row_as_alone(monkeypatch, rerun):
    """Rows in scattered slots, 4 then 3 (a padding row) then 1 of them per step, through the graphed body
    (and, with ``rerun``, every step run again as when the MoE's fast path left rows): each row's logits are
    its logits alone; the spare slot takes the padding and never moves."""
    model = _model(index_topk=64)
    prompts = _prompts()
    ref = [_alone(model, p, STEPS) for p in prompts]
    cache = SlotCache(model, slots=6, max_length=64, spare=1)
    steps = StepGraphs(cache, graphs=False)
    slots = [4, 0, 5, 2]
    for slot, prompt in zip(slots, prompts):
        _admit(model, cache, slot, prompt)
    if rerun:
        monkeypatch.setattr(moe.DeferredLayers, "slow_rows", lambda self, device: torch.ones((), device=device))
    for i in range(STEPS):
        live = range(4) if i < 4 else range(3) if i < 8 else range(1)
        tokens = torch.tensor([ref[j][1][i] for j in live])
        logits = steps.step(tokens, [slots[j] for j in live])
        for k, j in enumerate(live):
            assert _close(logits[k], ref[j][0][i + 1]), (i, j)
    assert sorted(steps.buckets) == [1, 4]  # 3 rows take the bucket of 4
    assert steps.stats["reruns"] == (STEPS if rerun else 0) and steps.stats["replays"] == 0
    assert cache.positions[slots].tolist() == [LENGTHS[0] + STEPS, LENGTHS[1] + 8, LENGTHS[2] + 8, LENGTHS[3] + 4]
    assert cache.positions[6] == 0 and cache.lengths[6] == 0


def test_the_cpu_steps_without_graphs():
    model = _model()
    assert StepGraphs(SlotCache(model, slots=2, max_length=32, spare=1)).reason == "not on a GPU"
    with pytest.raises(ValueError, match="not on a GPU"):
        StepGraphs(SlotCache(model, slots=2, max_length=32, spare=1), graphs=True)
