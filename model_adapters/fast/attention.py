"""DeepSeek-V4 attention without a [batch, heads, queries, keys] score tensor, for PyTorch's own numerics.

transformers' eager attention (``modeling_deepseek_v4.eager_attention_forward``) holds the scores of every
head, query and key at once: at batch 64 with 8-shot GSM8K prompts (~900 tokens) and 64 heads that is a
14.6 GiB tensor per layer, and the CSA indexer's scorer holds [batch, queries, index heads, entries] in FP32
beside it. ``install(model)`` replaces both with tiled forms that compute the same function:

- ``tiled_attention`` (registered as the attention interface ``evalgate_tiled``): queries are taken a block
  at a time, and each block attends only to the keys its mask opens for some row of the block (the sliding
  window around it plus the compressed entries of a CSA / HCA layer, gathered by index). Keys every row of
  the block masks add an exact zero to the softmax, so leaving them out changes nothing but the work; the
  block holds at most ``budget`` bytes of scores. All three attention kinds go through it, for prefill and
  decode (one query per row: a single block, no gather). On a GPU a block takes every key, masked, where that
  fits the budget: choosing the open columns waits for the device (``_blocks_over_every_key``).
- ``tiled_indexer_scores`` (bound to each CSA indexer's scorer): the lightning indexer's ReLU scores summed
  over its heads, a block of queries at a time.

The arithmetic of each score, softmax and weighted sum is eager's (the same dtypes, the sink in the
denominator, the max subtracted first); only the length of the softmax's sum changes, so results agree with
eager within float rounding, not bit for bit. This is for models that keep PyTorch's numerics (``numerics:
native``: compressed attention on a GPU by default, or ``numerics="native"``); the canonical forward pass
(``invariant.py``) has its own attention and is never routed here.
"""

from __future__ import annotations

import types

import torch

ATTENTION = "evalgate_tiled"
DEFAULT_BUDGET = 1 << 30  # bytes of scores (and their softmax temporaries) one block may hold
BYTES_PER_SCORE = 20  # bf16 score, mask sum, FP32 logits with the sink, exp, probabilities: ~20 bytes per score
QUERY_BLOCK = 256  # the largest query block tried first


def _open_columns(mask: torch.Tensor) -> torch.Tensor:
    """[S, T] bool: key t is open to query s for at least one row (an additive mask: 0 open, the dtype's
    minimum or -inf shut)."""
    return (mask > torch.finfo(mask.dtype).min / 2).any(dim=0).any(dim=0)


def _attend(module, query, key, mask, scaling):
    """eager_attention_forward for one block: query [b, H, s, D], key = value [b, 1, t, D] (shared-KV MQA),
    mask [b, 1, s, t] or None. Returns [b, H, s, D]."""
    b, h, s, d = query.shape
    # one KV head: the heads fold into the rows of one matrix product (eager repeats the key instead)
    scores = torch.matmul(query.reshape(b, 1, h * s, d), key.transpose(2, 3)).view(b, h, s, -1) * scaling
    if mask is not None:
        scores = scores + mask
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(key.dtype)
    return torch.matmul(probs.reshape(b, 1, h * s, -1), key).view(b, h, s, d)


def tiled_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, budget: int | None = None,
                    gather: bool | None = None, **kwargs):
    """The attention interface's call: query [B, H, S, D]; key and value the same [B, 1, T, D] tensor (V4's
    K = V); attention_mask [B, 1, S, T] additive or None. Returns ([B, S, H, D], None), as eager does.
    ``gather``: whether a block attends to the keys its mask opens only (None: on the CPU; see
    ``_blocks_over_every_key``)."""
    if value is not key:
        raise NotImplementedError("tiled attention serves DeepSeek-V4's shared key-value heads only")
    if key.shape[1] != 1:
        raise NotImplementedError("tiled attention serves one key-value head (DeepSeek-V4's MQA)")
    budget = budget or getattr(module, "_evalgate_attention_budget", None) or DEFAULT_BUDGET
    gather = getattr(module, "_evalgate_attention_gather", None) if gather is None else gather
    gather = query.device.type == "cpu" if gather is None else gather
    b, h, s, d = query.shape
    t = key.shape[2]
    if s == 1 or attention_mask is None or b * h * s * t * BYTES_PER_SCORE <= budget:
        return _attend(module, query, key, attention_mask, scaling).transpose(1, 2).contiguous(), None
    block = budget // (b * h * t * BYTES_PER_SCORE)  # queries whose scores over every key fit the budget
    if not gather and block >= 1:
        return _blocks_over_every_key(module, query, key, attention_mask, scaling, block), None
    out = query.new_empty(b, s, h, d)
    opened = _open_columns(attention_mask)  # [S, T]
    per_query_key = h * BYTES_PER_SCORE
    s0 = 0
    while s0 < s:
        block = min(QUERY_BLOCK, s - s0)
        while True:
            cols = opened[s0:s0 + block].any(dim=0).nonzero().flatten()
            rows = max(1, budget // max(1, block * len(cols) * per_query_key))
            if rows >= b or block == 1:
                break
            block = max(1, block // 2)
        mask = attention_mask[:, :, s0:s0 + block]
        if len(cols) == 0:  # every key shut: the sink takes all the weight, the output is exactly 0
            out[:, s0:s0 + block] = 0
        else:
            keys = key.index_select(2, cols) if len(cols) < t else key
            mask = mask.index_select(3, cols) if len(cols) < t else mask
            for r0 in range(0, b, rows):  # rows too, when one query's keys over the whole batch overflow
                r1 = min(b, r0 + rows)
                part = _attend(module, query[r0:r1, :, s0:s0 + block], keys[r0:r1], mask[r0:r1], scaling)
                out[r0:r1, s0:s0 + block] = part.transpose(1, 2)
        s0 += block
    return out, None


def _blocks_over_every_key(module, query, key, mask, scaling, block: int) -> torch.Tensor:
    """``tiled_attention`` a block of ``block`` queries at a time over every key, masked: no block's columns
    are chosen. Choosing them (``nonzero``) makes the host wait for the device in every block, while a GPU
    prefill's host already launches its kernels slower than the device runs them (measured at 12 full-width
    DeepSeek-V4-Flash layers: 172 ms of host time, 108 ms of device time a prompt); the shut keys' scores
    are computed instead (exact zeros in the softmax, as in the gathered form), in fewer launches."""
    b, h, s, d = query.shape
    out = query.new_empty(b, s, h, d)
    for s0 in range(0, s, block):
        s1 = min(s, s0 + block)
        out[:, s0:s1] = _attend(module, query[:, :, s0:s1], key, mask[:, :, s0:s1], scaling).transpose(1, 2)
    return out


def tiled_indexer_scores(self, q, compressed_kv, hidden_states, budget: int | None = None):
    """DeepseekV4IndexerScorer.forward a block of queries at a time: q [B, S, H, D] against the compressed
    keys [B, T, D]; returns [B, S, T] FP32, Σ_h w[b, s, h] · ReLU(q · k) · softmax_scale."""
    budget = budget or DEFAULT_BUDGET
    b, s, h, _ = q.shape
    t = compressed_kv.shape[1]
    keys = compressed_kv.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, T]
    weights = self.weights_proj(hidden_states).float() * self.weights_scaling  # [B, S, H]
    out = q.new_empty(b, s, t, dtype=torch.float32)
    block = max(1, min(s, budget // max(1, b * h * t * 12)))  # FP32 scores, ReLU, weighted: ~12 bytes each
    for s0 in range(0, s, block):
        s1 = min(s, s0 + block)
        scores = torch.matmul(q[:, s0:s1].float(), keys)  # [B, s, H, T]
        scores = torch.nn.functional.relu(scores) * self.softmax_scale
        out[:, s0:s1] = (scores * weights[:, s0:s1].unsqueeze(-1)).sum(dim=2)
    return out


def register() -> None:
    """The interface name, with transformers' eager masks (4D additive) built for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTENTION, tiled_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


def install(model, budget: int | None = None, gather: bool | None = None) -> bool:
    """Route a DeepSeek-V4 model with PyTorch's numerics through tiled attention and indexer scores (``budget``
    and ``gather``: ``tiled_attention``'s, for every layer). Returns False (and changes nothing) for a model
    with canonical numerics or of another architecture."""
    from evalgate.model_adapters.canonical.invariant import numerics

    if numerics(model) != "native" or getattr(model.config, "model_type", None) != "deepseek_v4":
        return False
    register()
    for module in model.modules():
        kind = type(module).__name__
        if kind == "DeepseekV4Attention":
            module._evalgate_attention_budget = budget
            module._evalgate_attention_gather = gather
        if kind == "DeepseekV4IndexerScorer":
            module.forward = types.MethodType(
                lambda self, q, kv, hs: tiled_indexer_scores(self, q, kv, hs, budget), module)
    model.config._attn_implementation = ATTENTION
    return True
