"""The Triton kernels of the hyper-connections' stream mixing (imported where Triton is installed; the host
side is ``triton_layers.hyper_collapse`` / ``hyper_mix``).

transformers writes both as broadcasts and a batched matmul over [tokens, hc, hidden]: the collapse
``(pre[..., None] * streams).sum(-2)`` (a product tensor in FP32, a sum, a cast) and the layer's mixing
``post * output + comb^T @ streams`` (two casts, a product, a [hc, hc] x [hc, hidden] matmul per token,
an add). On a GPU the matmul runs as a generic batched GEMM: at 256 tokens 55 µs a call, for 4 x 4 x 4096
multiply-adds a token. One program here reads a token's streams once, for a block of the hidden width.
The roundings are transformers': each cast to the streams' dtype where it casts (BF16: ``BF16`` below;
FP32: none), the products and the sums in FP32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from evalgate.kernels.triton.fast import bf16_rne


@triton.jit
def _cast(x, BF16: tl.constexpr):
    """x (FP32) rounded to the streams' dtype, as an FP32 value."""
    if BF16:
        x = bf16_rne(x)
    return x


@triton.jit
def hyper_collapse_kernel(pre_ptr, streams_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                          BF16: tl.constexpr):
    """out[t, d] = BF16(sum_j pre[t, j] * streams[t, j, d]), the sum in FP32."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HC)
    ok = d < D
    h = tl.load(streams_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + t * HC + j)
    total = tl.sum(pre[:, None] * h, axis=0)
    tl.store(out_ptr + t * D + d, _cast(total, BF16).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def hyper_mix_kernel(post_ptr, comb_ptr, output_ptr, streams_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr,
                     BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """out[t, k, d] = BF16(BF16(BF16(post[t, k]) * output[t, d]) + BF16(sum_j BF16(comb[t, j, k]) *
    streams[t, j, d])): transformers' ``post.to(dtype) * output + comb.to(dtype)^T @ streams`` in BF16."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HC)
    ok = d < D
    h = tl.load(streams_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    comb = _cast(tl.load(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :]), BF16)  # [j, k]
    mixed = _cast(tl.sum(comb[:, :, None] * h[:, None, :], axis=0), BF16)  # [k, d]: FP32 sum
    post = _cast(tl.load(post_ptr + t * HC + j), BF16)
    x = tl.load(output_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
    out = _cast(_cast(post[:, None] * x[None, :], BF16) + mixed, BF16)
    tl.store(out_ptr + (t * HC + j[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok[None, :])


@triton.jit
def hyper_mixes_kernel(streams_ptr, fn_ptr, out_ptr, n_rows, eps, K: tl.constexpr, N: tl.constexpr,
                       NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """out[t] = fn @ (x / rms(x)) for x = the token's flattened streams [K] (any float dtype, read as FP32)
    and fn [N, K] FP32: transformers' UnweightedRMSNorm then F.linear in FP32, the norm's per-token factor
    applied once to the product's sums instead of to each of the K inputs (one read of the streams). The
    streams' BF16 values are exact in TF32; PRECISION tf32x3 splits fn into two TF32 parts, so the products
    run on tensor cores within FP32's rounding (ieee: FP32 multiply-adds, about 8x slower)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = rows < n_rows
    n = tl.arange(0, NP)
    acc = tl.zeros([BM, NP], dtype=tl.float32)
    squares = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(streams_ptr + rows[:, None].to(tl.int64) * K + k[None, :], mask=ok[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + n[:, None] * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        squares += tl.sum(x * x, axis=1)
    factor = 1.0 / tl.sqrt_rn(squares / K + eps)
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc * factor[:, None], mask=ok[:, None] & (n < N)[None, :])
