"""Blocks of the canonical forward pass shared by ``invariant.py`` (every DeepSeek-V4 module) and
``invariant_compressed.py`` (the CSA / HCA compressors and the indexer): several linear layers of one input
as one canonical matmul, and DeepSeek-V4's sink attention over fixed-point keys and values."""

from __future__ import annotations

import torch

from evalgate.kernels import canonical
from evalgate.kernels.canonical import FixedOperand, fixed_matmul, fixed_operand
from evalgate.model_adapters.canonical.fp8_linear import is_fp8, weight_sources


def weight_operand(owner, name: str, linears, build) -> FixedOperand:
    """The fixed-point operand ``build`` makes of the weights of ``linears`` (a tuple of modules), cached on
    ``owner`` and keyed on the tensors the weights are made of (an FP8 linear's codes and scales: its
    ``weight`` is dequantized when read, exactly, so the grid is built once from the same values a BF16
    load holds). Only the grid's values are kept: a weight operand is never cut or joined."""
    sources = tuple(t for m in linears for t in weight_sources(m))

    def lean(_):
        operand = build(tuple(m.weight for m in linears))
        return FixedOperand(None, operand.scale, operand.mode, operand.values)

    return canonical.cached_operand(owner, name, sources, lean)


def fused_linear(owner, name: str, x, linears):
    """Several bias-free linear layers of one input as one canonical matmul: a column's grid is its own, so
    the outputs are those of the separate layers, bit for bit."""
    b = weight_operand(owner, name, tuple(linears), lambda ws: fixed_operand(torch.cat(ws).t(), "columns"))
    out = fixed_matmul(x.reshape(-1, x.shape[-1]), b, x.dtype)
    rows = [m.weight_fp8.shape[0] if is_fp8(m) else m.weight.shape[0] for m in linears]
    return [o.reshape(*x.shape[:-1], -1) for o in out.split(rows, dim=-1)]


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
