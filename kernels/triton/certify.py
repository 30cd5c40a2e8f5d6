"""Which rows the Triton GEMMs compute exactly, and the exact host path for the others.

A GEMM's float64 accumulation is exact when every partial sum of the row's terms is a float64 number:
all terms are multiples of one power of two and their sum is bounded, within 53 bits
(docs/kernels.md#accumulation, the same argument as `exact.py`). Bounds per row:

- `int_gemm`: a block term is an integer below 2^13 (E2M1: 32 products of twice-values <= 12) or 2^27
  (E4M3 times 2^9, below 2^18) times a power of two set by the two scale bytes, so span = (byte range of
  the row's non-zero groups) + (byte range of the expert's non-zero groups, +1 under fault (a)) + 13 or
  27 + ceil(log2 blocks);
- `f64_gemm`: `exact.row_span` of the activation row, plus the weights' span (byte range + 4: E2M1
  values are multiples of 0.5 and below 2^3), plus ceil(log2 K).

Rows above 53 bits (rare: groups whose scales differ by about 2^20) are recomputed on the host with
`exact.exact_matmul` from the FP32 values, and the weights of just their experts.
"""

from __future__ import annotations

import math

import torch

from .. import exact
from ..formats import GROUP
from ..weights import Fp4ExpertWeights

FP64_BITS = exact.FP64_BITS
# |block sum of 32 integer products| < 2^bits: E2M1 twice-values 32 * 12 * 12; E4M3 x 2^9: 32 * 2^18 * 12
BLOCK_TERM_BITS = {"e2m1": 13, "e4m3": 27}
FORCE_HOST_ROWS = False  # tests: send every row through the host path
_RANGES_ATTR = "_evalgate_triton_byte_ranges"


def expert_byte_ranges(w: torch.Tensor, w_bytes: torch.Tensor, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and smallest UE8M0 byte over each expert's groups with a non-zero code: int32 [E] each
    (an expert without one: -1 and 512). Read from the packed codes, a few experts at a time."""
    e, n, half = w.shape
    hi = torch.empty(e, dtype=torch.int32, device=w.device)
    lo = torch.empty(e, dtype=torch.int32, device=w.device)
    for s in range(0, e, chunk):
        codes = w[s:s + chunk].reshape(-1, n, half // 16, 2, 8).view(torch.int64)  # one group = 16 bytes
        nonzero = ((codes & 0x7777777777777777) != 0).flatten(-2).any(-1)  # magnitude bits; 0x8 is -0
        b = w_bytes[s:s + chunk].to(torch.int32)
        hi[s:s + chunk] = torch.where(nonzero, b, -1).flatten(1).amax(1)
        lo[s:s + chunk] = torch.where(nonzero, b, 512).flatten(1).amin(1)
    return hi, lo


def weight_ranges(fp4: Fp4ExpertWeights):
    """((hi1, lo1), (hi2, lo2)) of W1 and W2, cached on the weights object (computed once per load)."""
    cached = fp4.__dict__.get(_RANGES_ATTR)
    if cached is None:
        cached = (expert_byte_ranges(fp4.w1, fp4.w1_scale), expert_byte_ranges(fp4.w2, fp4.w2_scale))
        fp4.__dict__[_RANGES_ATTR] = cached
    return cached


def _range(hi, lo):
    return torch.where(hi >= 0, hi - lo, -(1 << 20))  # no non-zero group: no term at all


def int_rows_ok(a_hi, a_lo, fmt: str, w_range, expert, k: int, scale_fault: bool) -> torch.Tensor:
    """Bool [S]: int_gemm is exact for each row (its activation byte range a_hi/a_lo, its expert)."""
    w_hi, w_lo = w_range
    span = (_range(a_hi, a_lo).to(torch.int64) + _range(w_hi, w_lo).to(torch.int64)[expert] + int(scale_fault)
            + BLOCK_TERM_BITS[fmt] + math.ceil(math.log2(max(k // GROUP, 1))))
    return (span <= FP64_BITS) & (not FORCE_HOST_ROWS)


def f64_rows_ok(a: torch.Tensor, sig, w_range, expert, scale_fault: bool) -> torch.Tensor:
    """Bool [S]: f64_gemm is exact for each row of the FP32 activations a [S, K]."""
    w_hi, w_lo = w_range
    w_span = torch.where(w_hi >= 0, w_hi - w_lo + 4 + int(scale_fault), -(1 << 20)).to(torch.int64)
    span = exact.row_span(a, sig) + w_span[expert] + math.ceil(math.log2(max(a.shape[1], 1)))
    return (span <= FP64_BITS) & (not FORCE_HOST_ROWS)


def host_exact(a: torch.Tensor, sig: int, fp4: Fp4ExpertWeights, which: int, expert: torch.Tensor,
               fault: str | None) -> torch.Tensor:
    """RN_fp32 of the exact products of rows a [R, K] (FP32 values, sorted by expert) with their experts'
    W1 (which=1) or W2 (which=2), on the CPU: `exact.exact_matmul`, weights of these experts only."""
    ids, group = torch.unique_consecutive(expert.cpu(), return_inverse=True)
    mats = []
    for e in ids.tolist():
        one = Fp4ExpertWeights(fp4.w1[e:e + 1].cpu(), fp4.w1_scale[e:e + 1].cpu(), fp4.w2[e:e + 1].cpu(),
                               fp4.w2_scale[e:e + 1].cpu(), source=fp4.source)
        mats.append(one.dequantize(fault=fault)[which - 1][0])
    weights = exact.GemmWeights.of(torch.stack(mats))
    return exact.exact_matmul(a.cpu().to(torch.float32), sig, weights, group).to(a.device)
