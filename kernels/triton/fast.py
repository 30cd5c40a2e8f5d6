"""The fast path of the Triton GEMMs: one plain int8 GEMM over all of K, with int32 accumulators, for the rows
whose scales fit (docs/kernels.md#triton-kernels, "fast path").

Both operands are quantized to integer codes with a power-of-two scale per 32 along K. Relative to a base
exponent per activation row (its smallest non-zero group byte, `lo_a`) and per weight row (output column,
`lo_w`), every element is an integer: the activation code shifted left by (its group's byte - lo_a), the
weight's twice-value shifted by (its byte - lo_w). When those integers fit the int8 operands of a tensor-core
dot, the whole dot product is one integer sum, exact in int32 per limb:

- weights: twice-values |tw| <= 12, shifted by at most 3 (the column's byte range, +1 under fault (a)):
  |w'| <= 96, one int8;
- activations: E2M1 codes |q| <= 12 (E4M3 x 2^9: below 2^18) shifted by the row's byte range, split into
  LIMBS signed 7-bit limbs (|limb| <= 127), one int8 dot each; per limb |sum| <= K * 127 * 96 < 2^31 for
  K < 2^17.

The limbs recombine exactly in int64, the integer is rounded once to FP32 (the conversion rounds to nearest
even) and multiplied by 2^(lo_a + lo_w + unit - 255), which is exact while that power keeps the result normal
and finite: RN_fp32 of the exact dot product, as the canonical accumulation defines it. Rows that do not fit
(a row's byte range above 7 * LIMBS - 4 for E2M1, an expert whose columns span more than 3 binades, the
exponent out of range) are left to the per-block path (`gemm.int_gemm`) by the caller.

Epilogues (no FP32 accumulator is ever written to memory):

- L1 (`l1_gemm`): a program holds matching gate and up columns; BF16 rounding, the upper-only gate clamp,
  silu from a table of the emulator's own FP32 silu of every BF16 value (`silu_table`), times up, times the
  router weight, then the intermediate re-quantization per 32 columns (E2M1 or E4M3, the epilogue rule),
  written as codes + bytes, and each row's byte range (atomic max / min);
- L2 (`l2_gemm`): the BF16 rounding, stored at the row's (token, slot) place of a BF16 slot buffer.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .. import canonical
from ..formats import EPILOGUE, format_max
from .availability import interpreted
from .quantize import group_codes, pow2_f32

# GPU tilings (bm 0: gemm.block_m; split: the nibble-split decode, else the joined one); benchmarks sweep them
FAST = {"bm": 0, "bn": 128, "bk": 128, "warps": 4, "stages": 3, "split": False}
MAX_W_SHIFT = 3  # 12 * 2^3 = 96 fits an int8
CODE_BITS = {"e2m1": 4, "e4m3": 18}  # |code| < 2^bits
MAX_LIMBS = 3
LIMB_LAUNCHES = {1: 0, 2: 0, 3: 0}  # GEMMs planned with each limb count (tests, benchmarks)
FORCE_SLOW_ROWS = False  # tests: send every row through the per-block path (gemm.int_gemm)
_COLS_ATTR = "_evalgate_triton_column_ranges"


# --- helpers ----------------------------------------------------------------------------------------


@triton.jit
def bf16_rne(x):
    """FP32 -> the FP32 value of its BF16 rounding (nearest even), from the bits: same as x.to(bfloat16)
    for every finite x and infinities (NaNs with a payload only in the low bits would become infinities;
    none arise here)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _decode_shifted(W, SW, WLO, LUT, e, wcols, h0, NW: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                    BH: tl.constexpr, SCALE_FAULT: tl.constexpr):
    """Weights of rows `wcols` of expert e, packed bytes h0..h0+BH (K positions 2 h0 .. 2 (h0 + BH)): twice-
    values shifted left by (byte - the column's lo), as two int8 [BN, BH] tiles, the low nibbles (even K)
    and the high nibbles (odd K), from the 4 x 16 table LUT (shift, nibble) -> value."""
    KB: tl.constexpr = K // 32
    h = h0 + tl.arange(0, BH)
    grp = h // 16  # 16 bytes per group of 32
    base = (e * NW + wcols).to(tl.int64)
    packed = tl.load(W + base[:, None] * (K // 2) + h[None, :]).to(tl.int32)  # [BN, BH]
    sw = tl.load(SW + base[:, None] * KB + grp[None, :]).to(tl.int32)
    if SCALE_FAULT:
        sw = tl.where(wcols[:, None] % KB == grp[None, :], tl.minimum(sw + 1, 254), sw)
    lo = tl.load(WLO + base).to(tl.int32)
    row = tl.minimum(tl.maximum(sw - lo[:, None], 0), 3) * 16
    return tl.load(LUT + row + (packed & 15)), tl.load(LUT + row + (packed >> 4))


@triton.jit
def _decode_joined(W, SW, WLO, LUT2, e, wcols, k0, NW: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, SCALE_FAULT: tl.constexpr):
    """As `_decode_shifted`, K positions k0..k0+BK in their natural order: int8 [BN, BK], from the 4 x 256
    table LUT2 (shift, byte) -> both nibbles' values (int16: low byte = low nibble)."""
    KB: tl.constexpr = K // 32
    h = tl.arange(0, BK // 2)
    g = k0 // 32 + tl.arange(0, BK // 32)
    base = (e * NW + wcols).to(tl.int64)
    packed = tl.load(W + base[:, None] * (K // 2) + k0 // 2 + h[None, :]).to(tl.int32)
    sw = tl.load(SW + base[:, None] * KB + g[None, :]).to(tl.int32)
    if SCALE_FAULT:
        sw = tl.where(wcols[:, None] % KB == g[None, :], tl.minimum(sw + 1, 254), sw)
    lo = tl.load(WLO + base).to(tl.int32)
    shift = tl.minimum(tl.maximum(sw - lo[:, None], 0), 3)
    idx = packed.reshape(BN, BK // 32, 16) + (shift * 256)[:, :, None]
    both = tl.load(LUT2 + idx.reshape(BN, BK // 2))
    return tl.join(both.to(tl.int8), (both >> 8).to(tl.int8)).reshape(BN, BK)


@triton.jit
def _limb_dot_joined(A, arow, live, kk, wt, acc0, acc1, acc2, K: tl.constexpr, LSTRIDE, LIMBS: tl.constexpr):
    p = A + arow[:, None] * K + kk[None, :]
    m = live[:, None]
    acc0 = tl.dot(tl.load(p, mask=m, other=0), wt, acc0, out_dtype=tl.int32)
    if LIMBS >= 2:
        acc1 = tl.dot(tl.load(p + LSTRIDE, mask=m, other=0), wt, acc1, out_dtype=tl.int32)
    if LIMBS >= 3:
        acc2 = tl.dot(tl.load(p + 2 * LSTRIDE, mask=m, other=0), wt, acc2, out_dtype=tl.int32)
    return acc0, acc1, acc2


@triton.jit
def _limb_dot(A, arow, live, hh, w_even, w_odd, acc0, acc1, acc2, K: tl.constexpr, LSTRIDE,
              LIMBS: tl.constexpr):
    """acc_l += A'_l . w over the K positions of bytes hh: A' rows hold the even K in their first half and
    the odd K in their second (`fold_rows`), so each half pairs with one nibble tile."""
    pe = A + arow[:, None] * K + hh[None, :]
    po = pe + K // 2
    m = live[:, None]
    acc0 = tl.dot(tl.load(pe, mask=m, other=0), w_even, acc0, out_dtype=tl.int32)
    acc0 = tl.dot(tl.load(po, mask=m, other=0), w_odd, acc0, out_dtype=tl.int32)
    if LIMBS >= 2:
        acc1 = tl.dot(tl.load(pe + LSTRIDE, mask=m, other=0), w_even, acc1, out_dtype=tl.int32)
        acc1 = tl.dot(tl.load(po + LSTRIDE, mask=m, other=0), w_odd, acc1, out_dtype=tl.int32)
    if LIMBS >= 3:
        acc2 = tl.dot(tl.load(pe + 2 * LSTRIDE, mask=m, other=0), w_even, acc2, out_dtype=tl.int32)
        acc2 = tl.dot(tl.load(po + 2 * LSTRIDE, mask=m, other=0), w_odd, acc2, out_dtype=tl.int32)
    return acc0, acc1, acc2


@triton.jit
def _to_f32(acc0, acc1, acc2, p, LIMBS: tl.constexpr):
    """RN_fp32(acc0 + acc1 * 2^7 + acc2 * 2^14) * 2^p (p: int32, broadcast; exact for the rows cleared)."""
    if LIMBS == 1:
        v = acc0.to(tl.float32)
    else:
        whole = acc0.to(tl.int64) + (acc1.to(tl.int64) << 7)
        if LIMBS == 3:
            whole += acc2.to(tl.int64) << 14
        v = whole.to(tl.float32)
    return v * pow2_f32(p)


@triton.jit
def _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, OK, BM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(TILE_EXPERT + t)
    begin = tl.load(TILE_BEGIN + t)
    end = tl.load(TILE_END + t)
    rows = begin + tl.arange(0, BM)
    live = rows < end
    ok = tl.load(OK + rows, mask=live, other=0) != 0
    return e.to(tl.int64), rows, live & ok


# --- L1: gate/up GEMM with the SwiGLU + re-quantization epilogue ---------------------------------------------------


@triton.jit
def _l1_kernel(A, A_ROW, LSTRIDE, P, OK, RW, W, SW, WLO, LUT, LUT2, SILU, TILE_EXPERT, TILE_BEGIN, TILE_END,
               Q, QSTRIDE, QB, HI, LO,
               I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               LIMBS: tl.constexpr, SCALE_FAULT: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
               SILU_LIMIT: tl.constexpr, E4M3: tl.constexpr, DIV: tl.constexpr, F: tl.constexpr, INV_F: tl.constexpr,
               CLAMP_LO: tl.constexpr, CLAMP_HI: tl.constexpr, FLOOR: tl.constexpr, SPLIT: tl.constexpr):
    e, rows, keep = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, OK, BM)
    if e < 0:
        return
    if tl.max(keep.to(tl.int32), axis=0) == 0:
        return
    arow = tl.load(A_ROW + rows, mask=keep, other=0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # gate columns; up = cols + I
    g0 = tl.zeros([BM, BN], dtype=tl.int32)
    g1 = tl.zeros([BM, BN], dtype=tl.int32)
    g2 = tl.zeros([BM, BN], dtype=tl.int32)
    u0 = tl.zeros([BM, BN], dtype=tl.int32)
    u1 = tl.zeros([BM, BN], dtype=tl.int32)
    u2 = tl.zeros([BM, BN], dtype=tl.int32)
    BH: tl.constexpr = BK // 2
    if SPLIT:
        hh0 = tl.arange(0, BH)
        for h0 in range(0, K // 2, BH):
            ge, go = _decode_shifted(W, SW, WLO, LUT, e, cols, h0, 2 * I, K, BN, BH, SCALE_FAULT)
            g0, g1, g2 = _limb_dot(A, arow, keep, h0 + hh0, tl.trans(ge), tl.trans(go), g0, g1, g2, K, LSTRIDE,
                                   LIMBS)
            ue, uo = _decode_shifted(W, SW, WLO, LUT, e, cols + I, h0, 2 * I, K, BN, BH, SCALE_FAULT)
            u0, u1, u2 = _limb_dot(A, arow, keep, h0 + hh0, tl.trans(ue), tl.trans(uo), u0, u1, u2, K, LSTRIDE,
                                   LIMBS)
    else:
        kk0 = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            wg = tl.trans(_decode_joined(W, SW, WLO, LUT2, e, cols, k0, 2 * I, K, BN, BK, SCALE_FAULT))
            wu = tl.trans(_decode_joined(W, SW, WLO, LUT2, e, cols + I, k0, 2 * I, K, BN, BK, SCALE_FAULT))
            g0, g1, g2 = _limb_dot_joined(A, arow, keep, k0 + kk0, wg, g0, g1, g2, K, LSTRIDE, LIMBS)
            u0, u1, u2 = _limb_dot_joined(A, arow, keep, k0 + kk0, wu, u0, u1, u2, K, LSTRIDE, LIMBS)
    p = tl.load(P + rows, mask=keep, other=0)
    wlo_g = tl.load(WLO + e * 2 * I + cols).to(tl.int32)
    wlo_u = tl.load(WLO + e * 2 * I + I + cols).to(tl.int32)
    g = bf16_rne(_to_f32(g0, g1, g2, p[:, None] + wlo_g[None, :], LIMBS))  # step 4
    u = bf16_rne(_to_f32(u0, u1, u2, p[:, None] + wlo_u[None, :], LIMBS))
    silu = tl.load(SILU + ((g.to(tl.int32, bitcast=True) >> 16) & 0xFFFF))  # step 5: the emulator's silu(g)
    if HAS_LIMIT:
        silu = tl.where(g > LIMIT, SILU_LIMIT, silu)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    v = (silu * u) * tl.load(RW + rows, mask=keep, other=0.0)[:, None]  # step 6: router weight first
    NG: tl.constexpr = BN // 32
    x = v.reshape(BM, NG, 32)
    codes, byte = group_codes(x, E4M3, FLOOR, DIV, F, INV_F, CLAMP_LO, CLAMP_HI, True)  # RNE
    j = tl.arange(0, 32)
    grp = tl.program_id(1) * NG + tl.arange(0, NG)
    offs = rows[:, None, None].to(tl.int64) * I + grp[None, :, None] * 32 + j[None, None, :]
    m3 = keep[:, None, None]
    if E4M3:
        mag = tl.abs(codes)
        sign = tl.where(codes < 0, -1, 1)
        tl.store(Q + offs, ((mag & 127) * sign).to(tl.int8), mask=m3)
        tl.store(Q + QSTRIDE + offs, (((mag >> 7) & 127) * sign).to(tl.int8), mask=m3)
        tl.store(Q + 2 * QSTRIDE + offs, ((mag >> 14) * sign).to(tl.int8), mask=m3)
    else:
        tl.store(Q + offs, codes.to(tl.int8), mask=m3)
    tl.store(QB + rows[:, None].to(tl.int64) * (I // 32) + grp[None, :], byte.to(tl.uint8), mask=keep[:, None])
    nonzero = tl.max(tl.abs(codes), axis=2) > 0
    hi = tl.max(tl.where(nonzero, byte, -1), axis=1)
    lo = tl.min(tl.where(nonzero, byte, 512), axis=1)
    tl.atomic_max(HI + rows, hi, mask=keep)
    tl.atomic_min(LO + rows, lo, mask=keep)


# --- L2: down GEMM with the BF16 store ---------------------------------------------------------------------------


@triton.jit
def _l2_kernel(A, LSTRIDE, P, OK, SLOT, W, SW, WLO, LUT, LUT2, TILE_EXPERT, TILE_BEGIN, TILE_END, OUT,
               N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               LIMBS: tl.constexpr, SCALE_FAULT: tl.constexpr, SPLIT: tl.constexpr):
    e, rows, keep = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, OK, BM)
    if e < 0:
        return
    if tl.max(keep.to(tl.int32), axis=0) == 0:
        return
    arow = rows.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    a0 = tl.zeros([BM, BN], dtype=tl.int32)
    a1 = tl.zeros([BM, BN], dtype=tl.int32)
    a2 = tl.zeros([BM, BN], dtype=tl.int32)
    BH: tl.constexpr = BK // 2
    if SPLIT:
        hh0 = tl.arange(0, BH)
        for h0 in range(0, K // 2, BH):
            we, wo = _decode_shifted(W, SW, WLO, LUT, e, cols, h0, N, K, BN, BH, SCALE_FAULT)
            a0, a1, a2 = _limb_dot(A, arow, keep, h0 + hh0, tl.trans(we), tl.trans(wo), a0, a1, a2, K, LSTRIDE,
                                   LIMBS)
    else:
        kk0 = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            wt = tl.trans(_decode_joined(W, SW, WLO, LUT2, e, cols, k0, N, K, BN, BK, SCALE_FAULT))
            a0, a1, a2 = _limb_dot_joined(A, arow, keep, k0 + kk0, wt, a0, a1, a2, K, LSTRIDE, LIMBS)
    p = tl.load(P + rows, mask=keep, other=0)
    wlo = tl.load(WLO + e * N + cols).to(tl.int32)
    out = bf16_rne(_to_f32(a0, a1, a2, p[:, None] + wlo[None, :], LIMBS))  # step 7
    slot = tl.load(SLOT + rows, mask=keep, other=0).to(tl.int64)
    bits = (out.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    tl.store(OUT + slot[:, None] * N + cols[None, :], bits, mask=keep[:, None])


# --- activations: shifted limbs -------------------------------------------------------------------------------


@triton.jit
def _fold_rows(Q, QSTRIDE, QB, LO, OUT, OSTRIDE, R, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
               QLIMBS: tl.constexpr, LIMBS: tl.constexpr, MAX_SHIFT: tl.constexpr, SPLIT: tl.constexpr):
    """Integer codes (QLIMBS 7-bit limbs) shifted left by (group byte - the row's lo), as LIMBS limbs."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    live = rows < R
    offs = rows[:, None] * K + ks[None, :]
    v = tl.load(Q + offs, mask=live[:, None], other=0).to(tl.int32)
    if QLIMBS == 3:
        v += tl.load(Q + QSTRIDE + offs, mask=live[:, None], other=0).to(tl.int32) << 7
        v += tl.load(Q + 2 * QSTRIDE + offs, mask=live[:, None], other=0).to(tl.int32) << 14
    sb = tl.load(QB + rows[:, None] * (K // 32) + (ks // 32)[None, :], mask=live[:, None], other=0).to(tl.int32)
    lo = tl.load(LO + rows, mask=live, other=0)
    shift = tl.minimum(tl.maximum(sb - lo[:, None], 0), MAX_SHIFT)
    mag = tl.abs(v) << shift
    sign = tl.where(v < 0, -1, 1)
    # even K to the first half of the row, odd K to the second: the order the packed nibbles decode in
    if SPLIT:
        dest = rows[:, None] * K + (ks // 2 + (ks % 2) * (K // 2))[None, :]
    else:
        dest = offs
    tl.store(OUT + dest, ((mag & 127) * sign).to(tl.int8), mask=live[:, None])
    if LIMBS >= 2:
        tl.store(OUT + OSTRIDE + dest, (((mag >> 7) & 127) * sign).to(tl.int8), mask=live[:, None])
    if LIMBS >= 3:
        tl.store(OUT + 2 * OSTRIDE + dest, (((mag >> 14) & 127) * sign).to(tl.int8), mask=live[:, None])


def fold_rows(q: torch.Tensor, q_bytes: torch.Tensor, lo: torch.Tensor, fmt: str, limbs: int) -> torch.Tensor:
    """Codes q [QLIMBS, R, K] (quantize.quantize_rows) with bytes [R, K/32] -> int8 [limbs, R, K]: each code
    shifted by (its group's byte - lo of its row) (0 for groups below lo, i.e. zero groups), in limbs."""
    qlimbs, r, k = q.shape
    out = torch.empty(limbs, r, k, dtype=torch.int8, device=q.device)
    if r == 0:
        return out
    br, bk = (64, min(k, 1024)) if interpreted() else (16, 256)
    while k % bk:
        bk //= 2
    _fold_rows[(triton.cdiv(r, br), k // bk)](
        q, r * k, q_bytes, lo.to(torch.int32).contiguous(), out, r * k, r, K=k, BR=br, BK=bk, QLIMBS=qlimbs,
        LIMBS=limbs, MAX_SHIFT=max_shift(fmt, limbs), SPLIT=split(), num_warps=4)
    return out


def split() -> bool:
    """Whether the fast kernels decode the nibbles into two tiles (even and odd K: A' rows permuted to
    match) or into one joined tile. Either gives the same sums: an integer dot product in any K order."""
    return bool(FAST["split"])


def max_shift(fmt: str, limbs: int) -> int:
    """The largest byte range of an activation row that `limbs` 7-bit limbs hold (codes below 2^CODE_BITS)."""
    return 7 * limbs - CODE_BITS[fmt]


# --- the weights' per-column bases ------------------------------------------------------------------------------


def column_byte_ranges(w: torch.Tensor, w_bytes: torch.Tensor, chunk: int = 16):
    """Per weight row (output column) of each expert, the largest and smallest UE8M0 byte of its groups with
    a non-zero code: int32 [E, N] each (a row without one: -1 and 512)."""
    e, n, half = w.shape
    hi = torch.empty(e, n, dtype=torch.int32, device=w.device)
    lo = torch.empty(e, n, dtype=torch.int32, device=w.device)
    for s in range(0, e, chunk):
        codes = w[s:s + chunk].reshape(-1, n, half // 16, 2, 8).view(torch.int64)
        nonzero = ((codes & 0x7777777777777777) != 0).flatten(-2).any(-1)
        b = w_bytes[s:s + chunk].to(torch.int32)
        hi[s:s + chunk] = torch.where(nonzero, b, -1).amax(-1)
        lo[s:s + chunk] = torch.where(nonzero, b, 512).amin(-1)
    return hi, lo


class ColumnBases:
    """One GEMM's weights as the fast path reads them: the base byte of each column (`lo`, 127 for a
    column without a non-zero group), and per expert whether every column's range fits the int8 shift
    (`ok`, per scale fault) and the smallest and largest base (the exponent check)."""

    def __init__(self, w, w_bytes):
        hi, lo = column_byte_ranges(w, w_bytes)
        empty = hi < 0
        self.lo = torch.where(empty, 127, lo).contiguous()
        rng = torch.where(empty, 0, hi - lo)
        self.range_max = rng.amax(1)  # [E]
        self.lo_min = self.lo.amin(1)
        self.lo_max = self.lo.amax(1)

    def expert_ok(self, scale_fault: bool) -> torch.Tensor:
        return self.range_max + int(scale_fault) <= MAX_W_SHIFT


def column_bases(fp4) -> tuple[ColumnBases, ColumnBases]:
    """(W1, W2) bases, cached on the weights object (computed once per load)."""
    cached = fp4.__dict__.get(_COLS_ATTR)
    if cached is None:
        cached = (ColumnBases(fp4.w1, fp4.w1_scale), ColumnBases(fp4.w2, fp4.w2_scale))
        fp4.__dict__[_COLS_ATTR] = cached
    return cached


# --- tables -------------------------------------------------------------------------------------------------

_TABLES: dict = {}


def shifted_twice_table(device) -> torch.Tensor:
    """int8 [4 * 16]: (shift s, E2M1 code) -> twice the code's value, shifted left by s (|.| <= 96)."""
    key = ("lut", str(device))
    if key not in _TABLES:
        twice = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int32)
        _TABLES[key] = torch.cat([twice << s for s in range(4)]).to(torch.int8).to(device)
    return _TABLES[key]


def shifted_pair_table(device) -> torch.Tensor:
    """int16 [4 * 256]: (shift s, byte) -> the low nibble's value (low byte) and the high nibble's (high
    byte), each twice the E2M1 value shifted left by s."""
    key = ("pairs", str(device))
    if key not in _TABLES:
        twice = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int32)
        byte = torch.arange(256)
        parts = [((twice[byte & 15] << s) & 0xFF) | ((twice[byte >> 4] << s) << 8) for s in range(4)]
        _TABLES[key] = torch.cat(parts).to(torch.int16).to(device)
    return _TABLES[key]


def silu_table(device) -> torch.Tensor:
    """FP32 [65536]: the emulator's silu, g / (1 + exp(-g)) with exp correctly rounded, of the BF16 value
    with each bit pattern (index = the BF16 bits)."""
    key = ("silu", str(device))
    if key not in _TABLES:
        g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)
        finite = g.isfinite()
        e = torch.exp(-g)  # exact for +-inf and NaN
        e[finite] = canonical.exp(-g[finite])
        _TABLES[key] = (g / (1.0 + e)).to(device)
    return _TABLES[key]


@functools.lru_cache(maxsize=None)
def silu_of(value: float) -> float:
    g = torch.tensor([value], dtype=torch.float32)
    return float((g / (1.0 + canonical.exp(-g)))[0])


# --- launches ---------------------------------------------------------------------------------------------------


def _tiling(n: int, k: int, l1: bool, bm: int):
    """(BN, BK, warps, stages) for an N of n columns (L1: per half), K of k and tiles of bm rows."""
    if interpreted():
        bn, bk, warps, stages = min(triton.next_power_of_2(n), 256), min(k, 512), 4, 1
    else:
        bn = FAST["bn"] // (2 if l1 else 1)
        bk, warps, stages = FAST["bk"], FAST["warps"], FAST["stages"]
    bn = max(32, min(bn, n))
    while n % bn:
        bn //= 2
    while k % bk:
        bk //= 2
    if bn < 32 or bk < 64:
        raise ValueError(f"fast GEMM: N={n}, K={k} need multiples of 32 and 64")
    return bn, bk, warps, stages


def _bm(rows: int, experts: int) -> int:
    """Rows per tile: FAST["bm"] if set, else `gemm.block_m` (16 to 64, by rows per expert). 128-row
    tiles measured no faster at 4096 tokens on the H200 (docs/kernels.md#triton-kernels)."""
    from .gemm import block_m

    return FAST["bm"] or block_m(rows, experts)


def l1_gemm(a_limbs, a_row, p, ok, router_w, fp4, bases: ColumnBases, counts, scale_fault, fmt_out: str,
            limit, q, q_bytes, hi, lo):
    """Fast rows (ok) of the L1 GEMM with the steps 4-6 epilogue, written into q [QLIMBS, S, I] (int8
    codes of the intermediate), q_bytes [S, I/32], hi/lo [S] (atomic max / min: initialise to -1 / 512).
    a_limbs [L, T, K] (fold_rows), a_row [S] int32 (token of each sorted row), p [S] int32 (row base
    exponent: lo_a + unit - 255), router_w [S] FP32."""
    from .gemm import tile_schedule

    limbs, t, k = a_limbs.shape
    s = a_row.numel()
    i = fp4.w1.shape[1] // 2
    bm = _bm(s, counts.numel())
    bn, bk, warps, stages = _tiling(i, k, True, bm)
    tiles = tile_schedule(counts, s, bm)
    has_limit = limit is not None and limit != float("inf")
    lim = float(np.float32(limit)) if has_limit else 0.0
    fmax = format_max(fmt_out)
    clamp = EPILOGUE.byte_clamp or (0, 255)
    _l1_kernel[(tiles[0].numel(), i // bn)](
        a_limbs, a_row, t * k, p, ok, router_w, fp4.w1, fp4.w1_scale, bases.lo, shifted_twice_table(q.device),
        shifted_pair_table(q.device), silu_table(q.device), *tiles, q, s * i, q_bytes, hi, lo,
        I=i, K=k, BM=bm, BN=bn, BK=bk, LIMBS=limbs, SCALE_FAULT=scale_fault, HAS_LIMIT=has_limit, LIMIT=lim,
        SILU_LIMIT=silu_of(lim) if has_limit else 0.0, E4M3=fmt_out == "e4m3", DIV=EPILOGUE.q_via == "div",
        FLOOR=float(EPILOGUE.amax_floor), F=fmax,
        INV_F=float(np.float32(1.0 / fmax)), CLAMP_LO=max(clamp[0], 0), CLAMP_HI=min(clamp[1], 255),
        SPLIT=split(), num_warps=warps, num_stages=stages)


def l2_gemm(a_limbs, p, ok, slot, fp4, bases: ColumnBases, counts, scale_fault, out_bits):
    """Fast rows (ok) of the L2 GEMM: BF16 bits of the rounded output stored at row slot[s] of out_bits
    (int16 [T * top_k, H]). a_limbs [L, S, K] in sorted order."""
    from .gemm import tile_schedule

    limbs, s, k = a_limbs.shape
    n = fp4.w2.shape[1]
    bm = _bm(s, counts.numel())
    bn, bk, warps, stages = _tiling(n, k, False, bm)
    tiles = tile_schedule(counts, s, bm)
    _l2_kernel[(tiles[0].numel(), n // bn)](
        a_limbs, s * k, p, ok, slot, fp4.w2, fp4.w2_scale, bases.lo, shifted_twice_table(out_bits.device),
        shifted_pair_table(out_bits.device), *tiles, out_bits, N=n, K=k, BM=bm, BN=bn, BK=bk, LIMBS=limbs,
        SCALE_FAULT=scale_fault, SPLIT=split(), num_warps=warps, num_stages=stages)


def plan_rows(hi_a, lo_a, fmt: str, bases: ColumnBases, expert, scale_fault: bool, k: int, force_slow=False):
    """Per sorted row: (ok int8, p int32, the limbs the widest ok row needs, how many rows are not ok).
    hi_a/lo_a: the byte range of each row's activations (per sorted row). One host sync."""
    from .quantize import UNIT_EXP

    empty = hi_a < 0
    lo_eff = torch.where(empty, 127, lo_a).to(torch.int64)
    rng = torch.where(empty, 0, hi_a - lo_a).to(torch.int64)
    p = lo_eff + UNIT_EXP[fmt] - 255
    ok = bases.expert_ok(scale_fault)[expert] & (rng <= max_shift(fmt, MAX_LIMBS))
    ok &= (p + bases.lo_min.to(torch.int64)[expert] >= -126) & (p + bases.lo_max.to(torch.int64)[expert] <= 64)
    if force_slow or k >= 2**17:
        ok &= False
    need, slow = torch.stack([torch.where(ok, rng, 0).amax(), (~ok).sum()]).tolist() if ok.numel() else (0, 0)
    limbs = next(n for n in range(1, MAX_LIMBS + 1) if need <= max_shift(fmt, n))
    LIMB_LAUNCHES[limbs] += 1
    return ok.to(torch.int8), p.to(torch.int32), limbs, slow


