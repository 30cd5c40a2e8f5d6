"""Canonical numerics for compressed attention (``model_adapters/canonical/invariant_compressed.py``): the CSA and HCA
compressors, the indexer and its scorer compute transformers' function; decoded from per-row slots a row
gives the logits of a prefill of its whole sequence bit for bit; generation is batch invariant."""

from __future__ import annotations

import pytest
import torch

from evalgate.model_adapters.canonical import invariant
from evalgate.model_adapters.hf import generation
from evalgate.model_adapters.fast.attention_slots import SlotCache
from test_attention import DEVICES, KINDS, VOCAB, _model, _Tokenizer


def _canonical(**kw):
    model = _model(**kw)
    invariant.install(model)
    return model


def _prompt(n, seed=3):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties to the lower index (what the canonical indexer does)."""
    values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@torch.no_grad()
@pytest.mark.parametrize("index_topk", [64, 3])
def test_the_canonical_forward_is_transformers_function(monkeypatch, index_topk):
    """FP32, 37 tokens (past the window of 16, 9 CSA and 4 HCA windows closed): canonical logits agree with
    transformers' eager forward within float rounding. With a top-k of 3 the indexer decides; transformers'
    topk is made to break ties to the lower index as the canonical one does (ReLU scores tie at 0)."""
    model, native = _canonical(index_topk=index_topk), _model(index_topk=index_topk)
    assert invariant.numerics(model) == invariant.NUMERICS
    ids = _prompt(37)[None]
    got = model(input_ids=ids).logits
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    ref = native(input_ids=ids).logits
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@torch.no_grad()
def test_without_its_canonical_compressor_the_forward_is_not_this_one(monkeypatch):
    """The comparison above can fail: the HCA layer's windows pooled without the position bias move the
    logits far beyond rounding."""
    from evalgate.model_adapters.canonical import invariant_compressed

    model, native = _canonical(index_topk=64), _model(index_topk=64)
    ids = _prompt(37)[None]
    ref = native(input_ids=ids).logits
    inner = invariant_compressed.pool
    monkeypatch.setattr(invariant_compressed, "pool", lambda module, kv, gate: inner(module, kv, torch.zeros_like(gate)))
    got = model(input_ids=ids).logits
    assert (got - ref).abs().max().item() > 1e-2 * ref.abs().max().item()


@torch.no_grad()
@pytest.mark.parametrize("device", DEVICES)
def test_rows_decoded_from_slots_give_the_prefill_logits_bit_for_bit(device):
    """BF16, top-3 of the indexer. Three rows admitted at different lengths into scattered slots and decoded
    together for 20 steps (windows closing at different steps per row; a row leaves and another takes its
    slot): each step's logits are, bit for bit, the last logits of a prefill of the row's whole sequence."""
    model = _canonical(dtype=torch.bfloat16, index_topk=3, device=device)
    seqs = {k: v.to(device) for k, v in {0: _prompt(40, 5), 3: _prompt(40, 6), 1: _prompt(40, 7)}.items()}
    starts = {0: 7, 3: 16, 1: 19}
    cache = SlotCache(model, slots=4, max_length=64)
    for slot, seq in seqs.items():
        cache.admit(slot, model(input_ids=seq[None, :starts[slot]], use_cache=True).past_key_values, starts[slot])
    for step in range(20):
        if step == 10:  # slot 3's row leaves; a new one of 12 tokens takes the slot
            seqs[3], starts[3] = _prompt(40, 8).to(device), 12 - step
            cache.admit(3, model(input_ids=seqs[3][None, :12], use_cache=True).past_key_values, 12)
        slots = sorted(seqs)
        at = [starts[s] + step for s in slots]
        logits = cache.decode_step(torch.stack([seqs[s][p] for s, p in zip(slots, at)]), slots)
        for row, (slot, p) in enumerate(zip(slots, at)):
            alone = model(input_ids=seqs[slot][None, :p + 1]).logits[0, -1]
            assert torch.equal(logits[row], alone), (step, slot)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_generation_is_batch_invariant_with_compressed_attention(monkeypatch, device):
    """12 prompts of 5-60 tokens, each with its own token limit: every prompt gets the same tokens alone, in
    batches of 4 and 12 (continuous batching over slots), and (on the CPU) from two forked workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # forked workers after multi-threaded work would inherit a dead thread pool
    try:
        _decode_alone_and_batched(monkeypatch, device)
    finally:
        torch.set_num_threads(threads)


def _decode_alone_and_batched(monkeypatch, device):
    model = _canonical(dtype=torch.bfloat16, index_topk=3, device=device)
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(5, 60, (12,), generator=g).tolist()
    prompts = [" ".join(str(int(x)) for x in torch.randint(3, VOCAB, (n,), generator=g)) for n in lengths]
    limits = torch.randint(4, 30, (12,), generator=g).tolist()
    stops = [()] * len(prompts)
    alone = [generation.decode(model, _Tokenizer(), [p], [()], [m], device)[0].token_ids
             for p, m in zip(prompts, limits)]
    used = []
    inner = generation._decode_slots
    monkeypatch.setattr(generation, "_decode_slots", lambda *a: used.append(1) or inner(*a))
    for batch, workers in ((4, 1), (12, 1)) + (((5, 2),) if device == "cpu" else ()):
        got = [None] * len(prompts)
        for finished in generation.decode_stream(model, _Tokenizer(), prompts, stops, limits, device,
                                                 batch_size=batch, workers=workers):
            for i, gen in finished:
                got[i] = gen.token_ids
        assert got == alone, (batch, workers)
    assert used  # the parent's own loops (the workers' are in their processes)


def test_a_sliding_window_model_keeps_its_padded_batches():
    """Canonical numerics without compressed layers decode as they always did (left-padded batches)."""
    model = _canonical(layer_types=["sliding_attention"] * 2)
    assert not generation._slot_decoding(model, "cpu")
    assert generation._slot_decoding(_canonical(), "cpu") and not generation._slot_decoding(_model(), "cpu")


def test_yarn_frequencies_are_transformers_correctly_rounded():
    """DeepSeek-V4-Flash's compressed layers use YaRN RoPE: the canonical inverse frequencies agree with
    transformers' to the last bits, and a model with them installs."""
    from transformers import DeepseekV4ForCausalLM

    from evalgate.model_adapters.canonical.invariant_compressed import yarn_inv_freq
    from evalgate.model_adapters.hf.tiny import tiny_config

    yarn = {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5, "factor": 16.0,
            "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1}
    cfg = tiny_config(VOCAB, num_hidden_layers=3, layer_types=list(KINDS), mlp_layer_types=["hash_moe", "moe", "moe"],
                      sliding_window=16, compress_rates={"compressed_sparse_attention": 4,
                                                         "heavily_compressed_attention": 8},
                      rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}, "compress": yarn})
    model = DeepseekV4ForCausalLM(cfg).eval()
    rotary = model.model.rotary_emb
    assert rotary.rope_type["compress"] == "yarn"
    ref = rotary.compress_inv_freq.clone()
    ours = yarn_inv_freq(cfg, "compress")
    assert ours.shape == ref.shape and torch.allclose(ours, ref, rtol=2e-7, atol=0)
    plain = 1.0 / 160000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)
    assert (ours < plain * 0.99).any() and torch.allclose(ours[0], plain[0])  # interpolated low frequencies only
    invariant.install(model)
    assert torch.equal(rotary.compress_inv_freq, ours)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_prompt(20)[None]).logits).all()


def test_auto_numerics_keep_the_graphed_path_for_compressed_attention_on_a_gpu(capsys):
    """``numerics="auto"`` (the default): canonical on the CPU for every kind of layer; on a GPU a model with
    compressed attention keeps PyTorch's numerics (its CUDA-graphed steps), saying so; an explicit choice
    is kept."""
    from types import SimpleNamespace

    from evalgate.model_adapters.hf.adapter import resolved_numerics

    compressed, sliding = _model(), _model(layer_types=["sliding_attention"] * 2)
    assert resolved_numerics(compressed, "auto") == "canonical"
    assert resolved_numerics(sliding, "auto") == "canonical"

    def on_gpu(model):
        return SimpleNamespace(config=model.config, parameters=lambda: [SimpleNamespace(device=torch.device("cuda"))])

    assert capsys.readouterr().err == ""
    assert resolved_numerics(on_gpu(compressed), "auto") == "native"
    assert "compressed attention on a GPU" in capsys.readouterr().err
    assert resolved_numerics(on_gpu(sliding), "auto") == "canonical"
    assert resolved_numerics(on_gpu(compressed), "canonical") == "canonical"
    assert resolved_numerics(compressed, "native") == "native"
