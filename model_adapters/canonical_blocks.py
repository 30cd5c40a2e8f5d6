"""Blocks of the canonical forward pass shared by ``invariant.py`` (every DeepSeek-V4 module) and
``invariant_compressed.py`` (the CSA / HCA compressors and the indexer): several linear layers of one input
as one canonical matmul, and DeepSeek-V4's sink attention over fixed-point keys and values."""

from __future__ import annotations

import torch

from evalgate.kernels import canonical
from evalgate.kernels.canonical import fixed_matmul, fixed_operand


def fused_linear(owner, name: str, x, linears):
    """Several bias-free linear layers of one input as one canonical matmul: a column's grid is its own, so
    the outputs are those of the separate layers, bit for bit."""
    weights = tuple(m.weight for m in linears)
    b = canonical.cached_operand(owner, name, weights, lambda ws: fixed_operand(torch.cat(ws).t(), "columns"))
    out = fixed_matmul(x.reshape(-1, x.shape[-1]), b, x.dtype)
    return [o.reshape(*x.shape[:-1], -1) for o in out.split([w.shape[0] for w in weights], dim=-1)]


def attend(query, keys, values, mask, sinks, scaling):
    """DeepSeek-V4's eager attention (sinks, FP32 softmax) with canonical numerics. query [b, H, s, D]; keys
    and values one KV head [b, 1, ...], so the heads are folded into the rows of one matrix product."""
    b, h, s, d = query.shape
    scores = fixed_matmul(query.reshape(b, 1, h * s, d), keys, query.dtype).view(b, h, s, -1) * scaling
    if mask is not None:
        scores = scores + mask
    sink = sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = canonical.softmax(combined, dim=-1)[..., :-1].to(query.dtype)
    return fixed_matmul(probs.reshape(b, 1, h * s, -1), values, query.dtype).view(b, h, s, d)
