"""Canonical numerics for DeepSeek-V4's compressed attention: the CSA and HCA compressors, the lightning
indexer and its scorer (the rules are ``invariant.py``'s; docs/kernels.md#canonical-numerics).

transformers' compressors pool each window of ``compress_rate`` tokens into one entry with an FP32 softmax
over the window and a sum of the gated keys; the indexer scores every query against every entry with a
matrix product and a sum over its heads, then keeps the top k. Here:

- ``pool``: the window's softmax is ``canonical.softmax`` (each exp correctly rounded, the sum exact), the
  gated keys are added with ``canonical.fixed_sum``; an entry depends on its window alone;
- the scorer's q · k is ``canonical.fixed_matmul`` (each query row and each entry on its own grid), its sum
  over the index heads ``fixed_sum``, and the top k a stable sort (ties to the lower entry);
- projections, norms and RoPE are the modules' canonical forwards (``invariant.install`` binds them).

The cache bookkeeping (which tokens wait in a window, the previous window's overlapping half) is
transformers' own. A row's entries and choices are functions of its own tokens: decoded from per-row slots
(``attention_slots``, which calls ``pool`` and ``attend`` here) a row gives the logits, bit for bit, that a
prefill of its whole sequence gives.
"""

from __future__ import annotations

import torch

from evalgate.kernels import canonical
from evalgate.kernels.canonical import fixed_operand
from evalgate.model_adapters.canonical.blocks import attend as canonical_attend
from evalgate.model_adapters.canonical.blocks import fused_linear


def compressed_attention(model) -> bool:
    """Whether ``model`` is a DeepSeek-V4 model with CSA or HCA layers."""
    config = model.config
    return (getattr(config, "model_type", None) == "deepseek_v4"
            and any(kind != "sliding_attention" for kind in getattr(config, "layer_types", None) or ()))


def pool(module, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """One entry per window: kv, gate [..., W, D] (gate with the position bias added, -inf where a slot is
    empty) -> the normalised entry [..., D] in kv's dtype, before RoPE."""
    probs = canonical.softmax(gate, dim=-2).to(kv.dtype)
    total = canonical.fixed_sum(kv * probs, -2).to(torch.float32).to(kv.dtype)
    return module.kv_norm(total)


def attend(attn, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per row over its own keys: query [b, H, 1, D], keys (K = V) [b, 1, T, D], mask [b, 1, 1, T]
    additive. Returns [b, H, 1, D] (``canonical_blocks.attend``: canonical scores, softmax and weighted sum)."""
    operands = fixed_operand(keys.transpose(-1, -2), "columns"), fixed_operand(keys, "rows")
    return canonical_attend(query, *operands, mask, attn.sinks, attn.scaling)


def _entries(module, cache_layer, name: str, hidden_states: torch.Tensor, overlap: bool) -> torch.Tensor:
    """transformers' compressor body (HCA, CSA, or the CSA's indexer) with ``pool``: the entries emitted so
    far [B, T, D] (with a cache, every entry of the row's history)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch = hidden_states.shape[0]
    rate, width = module.compress_rate, module.head_dim
    kv, gate = fused_linear(module, "kv_gate", hidden_states, (module.kv_proj, module.gate_proj))
    if cache_layer is None:
        usable = (kv.shape[1] // rate) * rate
        chunk_kv, chunk_gate, first_position = kv[:, :usable], gate[:, :usable], 0
    else:
        chunk_kv, chunk_gate, first_position = cache_layer.store_compression_weights(name, kv, gate)
    if chunk_kv.shape[1] == 0:
        compressed = chunk_kv.new_zeros((batch, 0, width))
    else:
        n = chunk_kv.shape[1] // rate
        chunk_kv = chunk_kv.view(batch, n, rate, -1)
        chunk_gate = chunk_gate.view(batch, n, rate, -1) + module.position_bias
        if overlap:  # the previous window's first half (Ca), then this window's second half (Cb)
            window_kv = chunk_kv.new_zeros((batch, n, 2 * rate, width))
            window_gate = chunk_gate.new_full((batch, n, 2 * rate, width), float("-inf"))
            window_kv[:, :, rate:] = chunk_kv[..., width:]
            window_gate[:, :, rate:] = chunk_gate[..., width:]
            if n > 1:
                window_kv[:, 1:, :rate] = chunk_kv[:, :-1, :, :width]
                window_gate[:, 1:, :rate] = chunk_gate[:, :-1, :, :width]
            if cache_layer is not None:
                prior_kv, prior_gate = cache_layer.update_overlap_state(name, chunk_kv, chunk_gate, width)
                if prior_kv is not None:
                    window_kv[:, 0, :rate] = prior_kv.to(window_kv.dtype)
                    window_gate[:, 0, :rate] = prior_gate.to(window_gate.dtype)
            chunk_kv, chunk_gate = window_kv, window_gate
        compressed = pool(module, chunk_kv, chunk_gate)
        positions = torch.arange(n, device=compressed.device) * rate + first_position
        cos, sin = module.rotary_emb(compressed, position_ids=positions.unsqueeze(0).expand(batch, -1),
                                     layer_type=module.rope_layer_type)
        compressed = apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    if cache_layer is not None:
        compressed = cache_layer.update_compressor_states(name, compressed)
    return compressed


def _cache_layer(past_key_values, layer_idx: int):
    return past_key_values.layers[layer_idx] if past_key_values is not None else None


def _causal_bias(entries: torch.Tensor, position_ids: torch.Tensor, rate: int) -> torch.Tensor:
    """[B, 1, S, T]: 0 where query s may see entry t (its window closed at or before s), else -inf."""
    threshold = (position_ids + 1) // rate  # [B, S]
    index = torch.arange(entries.shape[2], device=entries.device)
    shut = index.view(1, 1, 1, -1) >= threshold.unsqueeze(1).unsqueeze(-1)
    bias = entries.new_zeros((entries.shape[0], 1, position_ids.shape[1], entries.shape[2]))
    return bias.masked_fill(shut, float("-inf"))


def hca_compressor_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    """DeepseekV4HCACompressor.forward: (entries [B, 1, T, D], block bias [B, 1, S, T] or None)."""
    entries = _entries(self, _cache_layer(past_key_values, layer_idx), "compressor", hidden_states,
                       overlap=False).unsqueeze(1)
    if position_ids.shape[1] == 1 or entries.shape[2] == 0:
        return entries, None
    return entries, _causal_bias(entries, position_ids, self.compress_rate)


def csa_compressor_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    """DeepseekV4CSACompressor.forward: the entries, and a block bias that opens each query's top-k of them."""
    entries = _entries(self, _cache_layer(past_key_values, layer_idx), "compressor", hidden_states,
                       overlap=True).unsqueeze(1)
    top = self.indexer(hidden_states, q_residual, position_ids, past_key_values, layer_idx)  # [B, S, k]
    batch, seq_len, count = hidden_states.shape[0], hidden_states.shape[1], entries.shape[2]
    safe = torch.where(top >= 0, top, torch.full_like(top, count))  # -1 (no pick) lands in a dropped column
    bias = entries.new_full((batch, 1, seq_len, count + 1), float("-inf"))
    bias.scatter_(-1, safe.unsqueeze(1), 0.0)
    return entries, bias[..., :count]


def indexer_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    """DeepseekV4Indexer.forward: each query's top ``index_topk`` entries [B, S, k] among those its position
    has closed (-1 where fewer are)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch, seq_len, _ = hidden_states.shape
    keys = _entries(self, _cache_layer(past_key_values, layer_idx), "indexer", hidden_states, overlap=True)
    cos, sin = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
    scores = self.scorer(q, keys, hidden_states)  # [B, S, T]
    count = keys.shape[1]
    k = min(self.index_topk, count)
    if count == 0:
        return canonical.topk(scores, k)[1]
    threshold = ((position_ids + 1) // self.compress_rate).unsqueeze(-1)  # [B, S, 1]
    future = torch.arange(count, device=scores.device).view(1, 1, -1) >= threshold
    top = canonical.topk(scores.masked_fill(future, float("-inf")), k)[1]
    return torch.where(top >= threshold, torch.full_like(top, -1), top)


def indexer_scorer_forward(self, q, compressed_kv, hidden_states):
    """DeepseekV4IndexerScorer.forward: Σ_h w[b, s, h] · ReLU(q[b, s, h] · k[b, t]) · softmax_scale, [B, S, T]
    in FP32. q [B, S, H, D], compressed_kv [B, T, D]."""
    keys = fixed_operand(compressed_kv.transpose(-1, -2).unsqueeze(1), "columns")  # [B, 1, D, T]
    scores = torch.relu(canonical.fixed_matmul(q, keys, torch.float32)) * self.softmax_scale  # [B, S, H, T]
    weights = self.weights_proj(hidden_states).float() * self.weights_scaling  # [B, S, H]
    return canonical.fixed_sum(scores * weights.unsqueeze(-1), 2).to(torch.float32)


def yarn_inv_freq(config, layer_type: str) -> torch.Tensor:
    """transformers' YaRN inverse frequencies (``_compute_yarn_parameters``) with base^t correctly rounded:
    the other operations are elementwise IEEE ones, the correction range a floor / ceil of Python floats."""
    import math

    params = config.rope_parameters[layer_type]
    base = float(params["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    factor = params.get("factor") or config.max_position_embeddings / params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(params["original_max_position_embeddings"] / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = canonical.power(base, torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
