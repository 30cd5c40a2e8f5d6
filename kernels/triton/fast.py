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

Decoding the weights: each 32-bit word of packed codes (8 K) becomes two
words of int8 weights, its first 4 K and its last 4 K, with two byte permutes per half (`_WORDS_ASM`);
the activations are folded in the same K order (`fold_rows`), so the sums are the same integers. A tile's
rows take the limbs its widest row needs: each GEMM is launched once per limb count and a tile runs in the
launch that matches (`plan_rows` sets the rows' needs on the device; no host sync); under split K, one
launch of the most limbs in which each tile runs the limbs it needs (`DYN`, `_launch_limbs`). L1 decodes
gate and up columns as one tile of 2 BN columns.

Split K (FAST["split_k"], `_split_k`): where the grid of (tile, column block) programs is small (few rows per
expert: decoding), each GEMM's K loop is split over SPLIT programs (a third grid axis; SPLIT from static
shapes only, so a CUDA graph replays the same launches). Each adds its int32 sums per limb into a zeroed
int32 buffer [limbs, S, N] with atomics (`_add_partials`): integers, so the totals are the same in any order;
after the GEMM's split launch one small kernel per GEMM (`_l1_split_epilogue`, `_l2_split_epilogue`) runs
the same epilogue (`_l1_epilogue`, `_l2_store`) once per tile and column block from the totals (limbs above
the tile's are 0 there: the same integer, rounded once to FP32 as before). Not with `halves` (L2 tiles of
FAST["half2"] rows, never a small grid).

Epilogues (no FP32 accumulator is ever written to memory; under split K only int32 partial sums are):

- L1 (`l1_gemm`): a program holds matching gate and up columns; BF16 rounding, the upper-only gate clamp,
  silu from a table of the emulator's own FP32 silu of every BF16 value (`silu_table`), times up, times the
  router weight, then the intermediate re-quantization per 32 columns (E2M1 or E4M3, the epilogue rule),
  written as codes + bytes, and each row's byte range (atomic max / min);
- L2 (`l2_gemm`): the BF16 rounding, stored at the row's (token, slot) place of a BF16 slot buffer. With
  tiles of FAST["half2"] rows or more (`halves`), each expert's rows are sorted widest first
  (`sort_by_need`), and a tile whose second half of rows needs one limb runs limb 0 on all its rows and
  the upper limbs on its first half only (HALF 1); the other tiles run every limb on every row (HALF 2).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .. import canonical
from ..formats import EPILOGUE, format_max
from .availability import interpreted, sm_count
from .quantize import group_codes, pow2_f32

# GPU tilings (bm 0: gemm.block_m)
# bm 0: by rows per expert (16 to bm_max)
# (bn: L1's gate + up columns per tile; bn2 / bk2: L2's columns / K step, 0 = as L1)
# 4 warps and a K step of 128 for every tile size: one DSV4-Flash layer at 4096 tokens (tiles of 128 rows)
# took 5.6-5.7 ms on the H200 where 8 warps and a K step of 256 took 7.4-7.7 ms (both replaying a CUDA graph)
FAST = {"bm": 0, "bm_max": 128, "bn": 128, "bn2": 128, "bk": 128, "bk2": 0, "warps": 4, "stages": 3,
        "half2": 128, "split_k": 8, "maxnreg": 0}
# maxnreg: the registers a thread may hold in the GEMMs' tiles of at most REGS_CAP_ROWS rows (decoding's;
# 0: as the compiler chooses): fewer registers, more programs an SM (benchmarks/gemm_sass.py counts the
# spills a cap costs; a prompt-cache tile of 128 rows holds 128 int32 sums a thread per limb and is never capped)
# split_k: a GEMM whose grid of (tile, column block) programs is small splits each program's K loop over SPLIT
# programs (a power of two), keeping the grid within split_k programs per SM (0: never split; `_split_k`):
# few rows per expert (decoding) leave a few dozen tiles x N / BN programs, each a long serial K loop; the
# int32 partial sums add into a zeroed buffer (atomics: exact in any order) and a small kernel runs the
# epilogue (`_l1_split_epilogue`, `_l2_split_epilogue`)
# half2: L2 tiles of at least this many rows (0: none) take each expert's rows widest first, and a tile
# whose second half needs one limb runs the upper limbs on its first half only (`halves`)
MAX_W_SHIFT = 3  # 12 * 2^3 = 96 fits an int8
REGS_CAP_ROWS = 32
CODE_BITS = {"e2m1": 4, "e4m3": 18}  # |code| < 2^bits
MAX_LIMBS = 3
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


# One 32-bit word of packed codes (bytes b0..b3: K 8q .. 8q+7, low nibble first) and its shift s -> two words of
# 4 int8 weights: $0 = K 8q .. 8q+3, $1 = K 8q+4 .. 8q+7. The table of twice-values (bytes 0 1 2 3 4 6 8 12) is
# shifted left by s first (<= 96: no carry between bytes). Per half, two byte permutes (prmt) of it pick each
# nibble's magnitude: one by the nibbles as they are, where a set sign bit makes prmt replicate the table byte's
# own (clear) sign bit, so the negative codes give 0 (p); one by the nibbles with their sign bits flipped, so
# the positive codes give 0 (n); n is negated per byte ((0x80 - n) ^ 0x80: no borrow) and or-ed into p.
# s = the group's byte - the column's lo, as 32 bits ($3; $4 .. $6 are copies): 0..3 wherever a code is not
# zero (the fast path's experts); a group of zero codes may have any s, as table byte 0 is 0 under any shift
# (shl.b32 clamps the amount, read unsigned, to 32), so no clamp is spent on it.
_WORDS_ASM = tl.constexpr("""{
.reg .b32 ta, tb, c, x, h, p, n;
mov.b32 ta, 0x03020100;
mov.b32 tb, 0x0C080604;
shl.b32 ta, ta, $3;
shl.b32 tb, tb, $3;
mov.b32 c, 0x80808080;
xor.b32 x, $2, 0x88888888;
prmt.b32 p, ta, tb, $2;
prmt.b32 n, ta, tb, x;
sub.u32 n, c, n;
xor.b32 n, n, c;
or.b32 $0, n, p;
shr.u32 h, $2, 16;
prmt.b32 p, ta, tb, h;
shr.u32 h, x, 16;
prmt.b32 n, ta, tb, h;
sub.u32 n, c, n;
xor.b32 n, n, c;
or.b32 $1, n, p;
}""")


@triton.jit
def _decode_words(W, SW, WLO, LUT, e, wcols, h0, NW: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                  BH: tl.constexpr, SCALE_FAULT: tl.constexpr, ASM: tl.constexpr):
    """Weights of rows `wcols` of expert e, packed bytes h0..h0+BH (K positions 2 h0 .. 2 (h0 + BH)): twice-
    values shifted left by (byte - the column's lo), in two int8 [BN, BH] tiles: of each 32-bit word q (K
    8q..8q+7), its first 4 K to the first tile and its last 4 to the second, in place of the word's 4
    bytes. ASM: byte permutes on 8 codes at a time (`_WORDS_ASM`); else the 4 x 16 table LUT (shift,
    nibble) -> value (the interpreter)."""
    KB: tl.constexpr = K // 32
    G: tl.constexpr = BH // 16
    g = h0 // 16 + tl.arange(0, G)
    j = tl.arange(0, 16)
    base = (e * NW + wcols).to(tl.int64)
    sw = tl.load(SW + base[:, None] * KB + g[None, :]).to(tl.int32)  # [BN, G]
    if SCALE_FAULT:
        sw = tl.where(wcols[:, None] % KB == g[None, :], tl.minimum(sw + 1, 254), sw)
    lo = tl.load(WLO + base).to(tl.int32)
    row = W + base[:, None, None] * (K // 2) + g[None, :, None] * 16  # [BN, G, 1]
    if ASM:
        packed = tl.load(row + j[None, None, :])  # [BN, G, 16]
        s32 = tl.broadcast_to((sw - lo[:, None])[:, :, None], [BN, G, 16])  # unclamped: see _WORDS_ASM
        w0, w1 = tl.inline_asm_elementwise(_WORDS_ASM, "=r,=r,r,r,r,r,r", [packed, s32], dtype=(tl.int8, tl.int8),
                                           is_pure=True, pack=4)
    else:
        shift = tl.minimum(tl.maximum(sw - lo[:, None], 0), 3)
        src = (j // 4) * 4 + (j % 4) // 2  # byte of the first 4 K of each word; +2 for the last 4
        nib = (j % 2) * 4
        lut = LUT + shift[:, :, None] * 16
        b0 = tl.load(row + src[None, None, :]).to(tl.int32)
        b1 = tl.load(row + 2 + src[None, None, :]).to(tl.int32)
        w0 = tl.load(lut + ((b0 >> nib[None, None, :]) & 15))
        w1 = tl.load(lut + ((b1 >> nib[None, None, :]) & 15))
    return w0.reshape(BN, BH), w1.reshape(BN, BH)


@triton.jit
def _pair_dot(pe, po, m, w_even, w_odd, acc):
    """acc += (the even-K half at pe) . w_even + (the odd-K half at po) . w_odd, int32."""
    acc = tl.dot(tl.load(pe, mask=m, other=0), w_even, acc, out_dtype=tl.int32)
    return tl.dot(tl.load(po, mask=m, other=0), w_odd, acc, out_dtype=tl.int32)


@triton.jit
def _limb_dot(A, arow, live, hh, w_even, w_odd, acc0, acc1, acc2, K: tl.constexpr, LSTRIDE,
              LIMBS: tl.constexpr, DYN: tl.constexpr, run):
    """acc_l += A'_l . w over the K positions of bytes hh: A' rows hold the even K in their first half and
    the odd K in their second (`fold_rows`), so each half pairs with one nibble tile. Limbs 0 .. LIMBS-1;
    DYN: only those below `run` (the tile's own count, known at run time)."""
    pe = A + arow[:, None] * K + hh[None, :]
    po = pe + K // 2
    m = live[:, None]
    acc0 = _pair_dot(pe, po, m, w_even, w_odd, acc0)
    acc1, acc2 = _upper_limb_dot(A, arow, live, hh, w_even, w_odd, acc1, acc2, K, LSTRIDE, LIMBS, DYN, run)
    return acc0, acc1, acc2


@triton.jit
def _upper_limb_dot(A, arow, live, hh, w_even, w_odd, acc1, acc2, K: tl.constexpr, LSTRIDE, LIMBS: tl.constexpr,
                    DYN: tl.constexpr, run):
    """As `_limb_dot`, limbs 1 .. LIMBS-1 only (also alone: the rows of the first half of a tile, `_l2_kernel`
    HALF 1)."""
    pe = A + LSTRIDE + arow[:, None] * K + hh[None, :]
    po = pe + K // 2
    m = live[:, None]
    if LIMBS >= 2:
        if DYN:
            if run >= 2:
                acc1 = _pair_dot(pe, po, m, w_even, w_odd, acc1)
        else:
            acc1 = _pair_dot(pe, po, m, w_even, w_odd, acc1)
    if LIMBS >= 3:
        if DYN:
            if run >= 3:
                acc2 = _pair_dot(pe + LSTRIDE, po + LSTRIDE, m, w_even, w_odd, acc2)
        else:
            acc2 = _pair_dot(pe + LSTRIDE, po + LSTRIDE, m, w_even, w_odd, acc2)
    return acc1, acc2


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
def _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, NEED, BM: tl.constexpr):
    """(expert, rows, the rows to compute, the limbs the tile needs: its widest fast row's, 0 for none,
    the limbs its second half of rows needs)."""
    t = tl.program_id(0)
    e = tl.load(TILE_EXPERT + t)
    begin = tl.load(TILE_BEGIN + t)
    end = tl.load(TILE_END + t)
    rows = begin + tl.arange(0, BM)
    live = rows < end
    need = tl.load(NEED + rows, mask=live, other=0).to(tl.int32)
    low = tl.max(tl.where(tl.arange(0, BM) >= BM // 2, need, 0), axis=0)
    return e.to(tl.int64), rows, need > 0, tl.max(need, axis=0), low


# --- L1: gate/up GEMM with the SwiGLU + re-quantization epilogue ---------------------------------------------------


@triton.jit
def _l1_kernel(A, A_ROW, LSTRIDE, P, NEED, RW, W, SW, WLO, LUT, SILU, TILE_EXPERT, TILE_BEGIN, TILE_END,
               Q, QSTRIDE, QB, HI, LO, ACC, ACC_STRIDE,
               I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               LIMBS: tl.constexpr, SCALE_FAULT: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
               SILU_LIMIT: tl.constexpr, E4M3: tl.constexpr, DIV: tl.constexpr, F: tl.constexpr, INV_F: tl.constexpr,
               CLAMP_LO: tl.constexpr, CLAMP_HI: tl.constexpr, FLOOR: tl.constexpr, ASM: tl.constexpr,
               SPLIT: tl.constexpr, DYN: tl.constexpr):
    """One tile of BM rows of one expert x BN gate (and the matching up) columns, if its widest fast row
    needs LIMBS limbs (one launch per limb count: the tiles choose, no host sync); DYN (split launches):
    every tile with fast rows, each with the limbs it needs (LIMBS: the most). SPLIT > 1: this program
    takes the K / SPLIT positions of share program_id(2) and adds its int32 sums into ACC (`_add_partials`:
    [limbs, S, 2 I], zeroed), for `_l1_split_epilogue`; SPLIT 1: all of K, and the epilogue here."""
    e, rows, keep, limbs, _ = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, NEED, BM)
    if e < 0:
        return
    if DYN:
        if limbs == 0:
            return
    else:
        if limbs != LIMBS:
            return
    arow = tl.load(A_ROW + rows, mask=keep, other=0).to(tl.int64)
    BH: tl.constexpr = BK // 2
    KS: tl.constexpr = K // SPLIT  # K positions per program
    if SPLIT == 1:
        k0s = 0
    else:
        k0s = tl.program_id(2) * KS
    # gate and up columns in one tile of 2 BN: one dot per limb and half
    r = tl.arange(0, 2 * BN)
    both = tl.program_id(1) * BN + r % BN + (r // BN) * I
    a0 = tl.zeros([BM, 2 * BN], dtype=tl.int32)
    a1 = tl.zeros([BM, 2 * BN], dtype=tl.int32)
    a2 = tl.zeros([BM, 2 * BN], dtype=tl.int32)
    hh0 = tl.arange(0, BH)
    for i in range(0, KS // 2, BH):
        h0 = k0s // 2 + i
        we, wo = _decode_words(W, SW, WLO, LUT, e, both, h0, 2 * I, K, 2 * BN, BH, SCALE_FAULT, ASM)
        a0, a1, a2 = _limb_dot(A, arow, keep, h0 + hh0, tl.trans(we), tl.trans(wo), a0, a1, a2, K, LSTRIDE,
                               LIMBS, DYN, limbs)
    if SPLIT > 1:
        _add_partials(ACC, ACC_STRIDE, rows, keep, both, 2 * I, a0, a1, a2, LIMBS, DYN, limbs)
    else:
        p = tl.load(P + rows, mask=keep, other=0)
        wlo = tl.load(WLO + e * 2 * I + both).to(tl.int32)
        gu = bf16_rne(_to_f32(a0, a1, a2, p[:, None] + wlo[None, :], LIMBS))  # step 4
        g, u = tl.split(gu.reshape(BM, 2, BN).permute(0, 2, 1))
    if SPLIT == 1:
        _l1_epilogue(g, u, rows, keep, RW, SILU, Q, QSTRIDE, QB, HI, LO, I, BM, BN, HAS_LIMIT, LIMIT, SILU_LIMIT,
                     E4M3, DIV, F, INV_F, CLAMP_LO, CLAMP_HI, FLOOR)


@triton.jit
def _l1_epilogue(g, u, rows, keep, RW, SILU, Q, QSTRIDE, QB, HI, LO, I: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, SILU_LIMIT: tl.constexpr,
                 E4M3: tl.constexpr, DIV: tl.constexpr, F: tl.constexpr, INV_F: tl.constexpr, CLAMP_LO: tl.constexpr,
                 CLAMP_HI: tl.constexpr, FLOOR: tl.constexpr):
    """Steps 5-6 of the tile's rows (`keep`) x gate columns program_id(1) * BN + [0, BN), from g and u (FP32
    [BM, BN], BF16-rounded): clamp, silu, x up, x router weight, re-quantization; codes, bytes and the rows'
    byte ranges written."""
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


@triton.jit
def _l1_split_epilogue(ACC, ACC_STRIDE, P, NEED, RW, WLO, SILU, TILE_EXPERT, TILE_BEGIN, TILE_END, Q, QSTRIDE, QB,
                       HI, LO, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       LIMIT: tl.constexpr, SILU_LIMIT: tl.constexpr, E4M3: tl.constexpr, DIV: tl.constexpr,
                       F: tl.constexpr, INV_F: tl.constexpr, CLAMP_LO: tl.constexpr, CLAMP_HI: tl.constexpr,
                       FLOOR: tl.constexpr):
    """After the split launch of `_l1_kernel` (every tile, its own limbs): per tile with fast rows x BN gate
    columns, steps 4-6 from the summed int32 limbs in ACC, as `_l1_kernel` does from its registers."""
    e, rows, keep, limbs, _ = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, NEED, BM)
    if e < 0:
        return
    if limbs == 0:
        return
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    p = tl.load(P + rows, mask=keep, other=0)
    g0, g1, g2 = _load_partials(ACC, ACC_STRIDE, rows, keep, cols, 2 * I, limbs)
    u0, u1, u2 = _load_partials(ACC, ACC_STRIDE, rows, keep, cols + I, 2 * I, limbs)
    wlo_g = tl.load(WLO + e * 2 * I + cols).to(tl.int32)
    wlo_u = tl.load(WLO + e * 2 * I + I + cols).to(tl.int32)
    g = bf16_rne(_to_f32(g0, g1, g2, p[:, None] + wlo_g[None, :], 3))  # step 4 (limbs above the tile's: 0)
    u = bf16_rne(_to_f32(u0, u1, u2, p[:, None] + wlo_u[None, :], 3))
    _l1_epilogue(g, u, rows, keep, RW, SILU, Q, QSTRIDE, QB, HI, LO, I, BM, BN, HAS_LIMIT, LIMIT, SILU_LIMIT,
                 E4M3, DIV, F, INV_F, CLAMP_LO, CLAMP_HI, FLOOR)


# --- split K: int32 partial sums -------------------------------------------------------------------------------


@triton.jit
def _add_partials(ACC, ACC_STRIDE, rows, keep, cols, NC: tl.constexpr, a0, a1, a2, LIMBS: tl.constexpr,
                  DYN: tl.constexpr, run):
    """ACC[l, row, col] += a_l for the tile's fast rows (ACC: int32 [limbs, S, NC], zeroed before the split
    launches): integer atomics, so the sums are the same integers in any order. DYN: limbs below `run`."""
    ptr = ACC + rows[:, None].to(tl.int64) * NC + cols[None, :]
    m = keep[:, None]
    tl.atomic_add(ptr, a0, mask=m, sem="relaxed")
    if DYN:
        m_up = m & (run >= 2)
        m_top = m & (run >= 3)
    else:
        m_up = m
        m_top = m
    if LIMBS >= 2:
        tl.atomic_add(ptr + ACC_STRIDE, a1, mask=m_up, sem="relaxed")
    if LIMBS >= 3:
        tl.atomic_add(ptr + 2 * ACC_STRIDE, a2, mask=m_top, sem="relaxed")


@triton.jit
def _load_partials(ACC, ACC_STRIDE, rows, keep, cols, NC: tl.constexpr, limbs):
    """The summed limbs of the tile's fast rows from ACC; those above the tile's `limbs` (never added) as 0."""
    ptr = ACC + rows[:, None].to(tl.int64) * NC + cols[None, :]
    m = keep[:, None]
    a0 = tl.load(ptr, mask=m, other=0)
    a1 = tl.load(ptr + ACC_STRIDE, mask=m & (limbs >= 2), other=0)
    a2 = tl.load(ptr + 2 * ACC_STRIDE, mask=m & (limbs >= 3), other=0)
    return a0, a1, a2


# --- L2: down GEMM with the BF16 store ---------------------------------------------------------------------------


@triton.jit
def _l2_kernel(A, LSTRIDE, P, NEED, SLOT, W, SW, WLO, LUT, TILE_EXPERT, TILE_BEGIN, TILE_END, OUT, A_ROW,
               ACC, ACC_STRIDE, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, LIMBS: tl.constexpr, SCALE_FAULT: tl.constexpr, ASM: tl.constexpr,
               GATHER: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
               DYN: tl.constexpr):
    """One tile of BM rows of one expert x BN columns, if its widest fast row needs LIMBS limbs (DYN: any
    limbs, as `_l1_kernel`). GATHER:
    sorted row s reads row A_ROW[s] of A (else row s). HALF (rows sorted widest first within each
    expert, `sort_by_need`): 1 - this launch takes the tiles whose second half of rows needs at most one
    limb, and runs the upper limbs on the first half only; 2 - it takes the others; 0 - every tile.
    SPLIT > 1 (HALF 0): this program takes the K / SPLIT positions of share program_id(2) and adds its int32
    sums into ACC ([limbs, S, N], zeroed), for `_l2_split_epilogue`; SPLIT 1: all of K, and the store here."""
    e, rows, keep, limbs, low = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, NEED, BM)
    if e < 0:
        return
    if DYN:
        if limbs == 0:
            return
    else:
        if limbs != LIMBS:
            return
    if HALF == 1:
        if low > 1:
            return
    if HALF == 2:
        if low <= 1:
            return
    if GATHER:
        arow = tl.load(A_ROW + rows, mask=keep, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    wlo = tl.load(WLO + e * N + cols).to(tl.int32)
    BH: tl.constexpr = BK // 2
    if HALF == 1:  # limb 0 on all BM rows, the upper limbs on the first BT
        BT: tl.constexpr = BM // 2
        t = tl.program_id(0)
        rows_t = tl.load(TILE_BEGIN + t) + tl.arange(0, BT)
        end = tl.load(TILE_END + t)
        keep_t = (rows_t < end) & (tl.load(NEED + rows_t, mask=rows_t < end, other=0) > 0)
        rows_b = rows_t + BT
        keep_b = (rows_b < end) & (tl.load(NEED + rows_b, mask=rows_b < end, other=0) > 0)
        if GATHER:
            arow_t = tl.load(A_ROW + rows_t, mask=keep_t, other=0).to(tl.int64)
        else:
            arow_t = rows_t.to(tl.int64)
        a0 = tl.zeros([BM, BN], dtype=tl.int32)
        a1 = tl.zeros([BT, BN], dtype=tl.int32)
        a2 = tl.zeros([BT, BN], dtype=tl.int32)
        hh0 = tl.arange(0, BH)
        for h0 in range(0, K // 2, BH):
            we, wo = _decode_words(W, SW, WLO, LUT, e, cols, h0, N, K, BN, BH, SCALE_FAULT, ASM)
            we = tl.trans(we)
            wo = tl.trans(wo)
            a0, a1, a2 = _limb_dot(A, arow, keep, h0 + hh0, we, wo, a0, a1, a2, K, LSTRIDE, 1, False, limbs)
            a1, a2 = _upper_limb_dot(A, arow_t, keep_t, h0 + hh0, we, wo, a1, a2, K, LSTRIDE, LIMBS, False, limbs)
        top, bot = tl.split(a0.reshape(2, BT, BN).permute(1, 2, 0))
        p_t = tl.load(P + rows_t, mask=keep_t, other=0)
        p_b = tl.load(P + rows_b, mask=keep_b, other=0)
        out_t = bf16_rne(_to_f32(top, a1, a2, p_t[:, None] + wlo[None, :], LIMBS))  # step 7
        out_b = bf16_rne(_to_f32(bot, bot, bot, p_b[:, None] + wlo[None, :], 1))
        slot_t = tl.load(SLOT + rows_t, mask=keep_t, other=0).to(tl.int64)
        slot_b = tl.load(SLOT + rows_b, mask=keep_b, other=0).to(tl.int64)
        tl.store(OUT + slot_t[:, None] * N + cols[None, :], (out_t.to(tl.int32, bitcast=True) >> 16).to(tl.int16),
                 mask=keep_t[:, None])
        tl.store(OUT + slot_b[:, None] * N + cols[None, :], (out_b.to(tl.int32, bitcast=True) >> 16).to(tl.int16),
                 mask=keep_b[:, None])
        return
    a0 = tl.zeros([BM, BN], dtype=tl.int32)
    a1 = tl.zeros([BM, BN], dtype=tl.int32)
    a2 = tl.zeros([BM, BN], dtype=tl.int32)
    KS: tl.constexpr = K // SPLIT  # K positions per program
    if SPLIT == 1:
        k0s = 0
    else:
        k0s = tl.program_id(2) * KS
    hh0 = tl.arange(0, BH)
    for i in range(0, KS // 2, BH):
        h0 = k0s // 2 + i
        we, wo = _decode_words(W, SW, WLO, LUT, e, cols, h0, N, K, BN, BH, SCALE_FAULT, ASM)
        a0, a1, a2 = _limb_dot(A, arow, keep, h0 + hh0, tl.trans(we), tl.trans(wo), a0, a1, a2, K, LSTRIDE,
                               LIMBS, DYN, limbs)
    if SPLIT > 1:
        _add_partials(ACC, ACC_STRIDE, rows, keep, cols, N, a0, a1, a2, LIMBS, DYN, limbs)
    else:
        p = tl.load(P + rows, mask=keep, other=0)
        out = bf16_rne(_to_f32(a0, a1, a2, p[:, None] + wlo[None, :], LIMBS))  # step 7
        _l2_store(out, rows, keep, cols, SLOT, OUT, N)


@triton.jit
def _l2_store(out, rows, keep, cols, SLOT, OUT, N: tl.constexpr):
    """The BF16 bits of out (FP32 [BM, BN], BF16-rounded) at each fast row's (token, slot) row of OUT."""
    slot = tl.load(SLOT + rows, mask=keep, other=0).to(tl.int64)
    bits = (out.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    tl.store(OUT + slot[:, None] * N + cols[None, :], bits, mask=keep[:, None])


@triton.jit
def _l2_split_epilogue(ACC, ACC_STRIDE, P, NEED, SLOT, WLO, TILE_EXPERT, TILE_BEGIN, TILE_END, OUT,
                       N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """After the split launch of `_l2_kernel` (every tile, its own limbs): per tile with fast rows x BN columns,
    step 7 from the summed int32 limbs in ACC, as `_l2_kernel` does from its registers."""
    e, rows, keep, limbs, _ = _fast_tile(TILE_EXPERT, TILE_BEGIN, TILE_END, NEED, BM)
    if e < 0:
        return
    if limbs == 0:
        return
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    a0, a1, a2 = _load_partials(ACC, ACC_STRIDE, rows, keep, cols, N, limbs)
    p = tl.load(P + rows, mask=keep, other=0)
    wlo = tl.load(WLO + e * N + cols).to(tl.int32)
    out = bf16_rne(_to_f32(a0, a1, a2, p[:, None] + wlo[None, :], 3))  # step 7 (limbs above the tile's: 0)
    _l2_store(out, rows, keep, cols, SLOT, OUT, N)


# --- activations: shifted limbs -------------------------------------------------------------------------------


@triton.jit
def _fold_rows(Q, QSTRIDE, QB, LO, OUT, OSTRIDE, R, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
               QLIMBS: tl.constexpr, LIMBS: tl.constexpr, MAX_SHIFT: tl.constexpr):
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
    # the K order the weight decode gives (`_decode_words`): each half of the row pairs with one of the two
    # weight tiles; of each 8 K (a word of packed codes), the first 4 to the first half, the last 4 to the second
    dest = rows[:, None] * K + ((ks // 8) * 4 + ks % 4 + ((ks // 4) % 2) * (K // 2))[None, :]
    tl.store(OUT + dest, ((mag & 127) * sign).to(tl.int8), mask=live[:, None])
    if LIMBS >= 2:
        tl.store(OUT + OSTRIDE + dest, (((mag >> 7) & 127) * sign).to(tl.int8), mask=live[:, None])
    if LIMBS >= 3:
        tl.store(OUT + 2 * OSTRIDE + dest, (((mag >> 14) & 127) * sign).to(tl.int8), mask=live[:, None])


def fold_rows(q: torch.Tensor, q_bytes: torch.Tensor, lo: torch.Tensor, fmt: str, limbs: int = MAX_LIMBS) -> torch.Tensor:
    """Codes q [QLIMBS, R, K] (quantize.quantize_rows) with bytes [R, K/32] -> int8 [limbs, R, K]: each code
    shifted by (its group's byte - lo of its row) (0 for groups below lo, i.e. zero groups), in limbs (all
    MAX_LIMBS by default: a tile reads as many as its widest row needs, the others' upper limbs are 0), in
    the K order of the weight decode."""
    qlimbs, r, k = q.shape
    out = torch.empty(limbs, r, k, dtype=torch.int8, device=q.device)
    if r == 0:
        return out
    br, bk = (64, min(k, 1024)) if interpreted() else (16, 256)
    while k % bk:
        bk //= 2
    _fold_rows[(triton.cdiv(r, br), k // bk)](
        q, r * k, q_bytes, lo.to(torch.int32), out, r * k, r, K=k, BR=br, BK=bk, QLIMBS=qlimbs,
        LIMBS=limbs, MAX_SHIFT=max_shift(fmt, limbs), num_warps=4)
    return out


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
        self.lo_min = self.lo.amin(1).to(torch.int32).contiguous()
        self.lo_max = self.lo.amax(1).to(torch.int32).contiguous()
        self._ok = {}

    def expert_ok(self, scale_fault: bool) -> torch.Tensor:
        """int8 [E]: 1 where every column's byte range (+1 under fault (a)) fits the int8 shift."""
        if scale_fault not in self._ok:
            self._ok[scale_fault] = (self.range_max + int(scale_fault) <= MAX_W_SHIFT).to(torch.int8).contiguous()
        return self._ok[scale_fault]


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
    """(BN, BK, warps, stages) for an N of n columns (L1: per half), K of k and tiles of bm rows; L2 on a GPU
    takes FAST["bn2"] / FAST["bk2"] where set."""
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
    if not l1 and not interpreted():
        bn = min(FAST.get("bn2") or bn, n)
        bk = min(FAST.get("bk2") or bk, k)
    return bn, bk, warps, stages


SMEM_BUDGET = 200 * 1024  # bytes of shared memory a fast kernel's pipelined tiles may plan on (H200: 227 KiB)


def _stages(stages: int, limbs: int, bm: int, cols: int, bk: int):
    """(stages, bk) for one limb count's kernel: as many stages as asked whose tiles (LIMBS activation
    tiles [bm, bk] and the packed weights [cols, bk / 2] per stage, the decoded weights [cols, bk]) fit
    SMEM_BUDGET, halving bk if even one stage does not."""
    while True:
        for st in range(stages, 0, -1):
            if st * (limbs * bm * bk + cols * bk // 2) + cols * bk <= SMEM_BUDGET:
                return st, bk
        if bk <= 64:
            return 1, bk
        bk //= 2


def _bm(rows: int, experts: int) -> int:
    """Rows per tile: FAST["bm"] if set, else about the rows an expert gets, 16 to FAST["bm_max"] (a tile
    decodes its expert's weights once: fewer tiles per expert, fewer decodes)."""
    if FAST["bm"]:
        return FAST["bm"]
    per_expert = rows / max(experts, 1)
    bm = 16
    while bm < FAST["bm_max"] and per_expert > bm:
        bm *= 2
    return bm


def _split_k(programs: int, k: int, bk: int, device) -> tuple[int, int]:
    """(SPLIT, BK) for a GEMM of `programs` (tile, column block) programs (a static bound: the tile
    schedule's padded length) over K of k: the largest power of two SPLIT with programs x SPLIT at most
    FAST["split_k"] x the SMs and K / SPLIT a multiple of the K step bk (1: no split). From static shapes
    only: no host sync, the same launches in every replay of a CUDA graph. The interpreter (no pipeline
    to keep full) lets the K step shrink to 64 for a split."""
    target = FAST.get("split_k", 0) * sm_count(device)
    step = 64 if interpreted() else bk
    split = 1
    while programs * split * 2 <= target and k % (2 * split * step) == 0:
        split *= 2
    while (k // split) % bk:
        bk //= 2
    return split, bk


def limb_counts(fmt: str):
    """The limb counts a fast row of format fmt can need (E4M3 codes, below 2^18, always take 3)."""
    return [n for n in range(1, MAX_LIMBS + 1) if max_shift(fmt, n) >= 0]


def _launch_limbs(fmt: str, split: int) -> list[int]:
    """The LIMBS of each launch of a GEMM: one per limb count a row can need, each tile running in the one
    its widest row needs; split K (small grids: decoding) one launch of the most, each tile running its own
    limbs (DYN): the launches of the other counts would be whole grids of programs that only exit."""
    counts = limb_counts(fmt)
    return counts[-1:] if split > 1 else counts


def _asm() -> bool:
    return not interpreted()


def _regs(bm: int) -> dict:
    """A GEMM launch's register cap for tiles of bm rows (FAST["maxnreg"]), a compiler option the interpreter
    has not."""
    return {"maxnreg": FAST["maxnreg"]} if FAST["maxnreg"] and bm <= REGS_CAP_ROWS and not interpreted() else {}


def l1_gemm(a_limbs, a_row, p, need, router_w, fp4, bases: ColumnBases, tiles, bm: int, scale_fault, fmt_in: str,
            fmt_out: str, limit, q, q_bytes, hi, lo):
    """Fast rows (need > 0) of the L1 GEMM with the steps 4-6 epilogue, written into q [QLIMBS, S, I] (int8
    codes of the intermediate), q_bytes [S, I/32], hi/lo [S] (atomic max / min: initialise to -1 / 512).
    a_limbs [MAX_LIMBS, T, K] (fold_rows), a_row [S] int32 (token of each sorted row), p [S] int32 (row
    base exponent: lo_a + unit - 255), need [S] int8 (plan_rows), router_w [S] FP32, tiles of bm rows
    (gemm.tile_schedule). One launch per limb count; each tile runs in the one its widest row needs."""
    _, t, k = a_limbs.shape
    s = a_row.numel()
    i = fp4.w1.shape[1] // 2
    bn, bk, warps, stages = _tiling(i, k, True, bm)
    has_limit = limit is not None and limit != float("inf")
    lim = float(np.float32(limit)) if has_limit else 0.0
    fmax = format_max(fmt_out)
    clamp = EPILOGUE.byte_clamp or (0, 255)
    dev = q.device
    epilogue = dict(I=i, BM=bm, BN=bn, HAS_LIMIT=has_limit, LIMIT=lim, SILU_LIMIT=silu_of(lim) if has_limit else 0.0,
                    E4M3=fmt_out == "e4m3", DIV=EPILOGUE.q_via == "div", FLOOR=float(EPILOGUE.amax_floor), F=fmax,
                    INV_F=float(np.float32(1.0 / fmax)), CLAMP_LO=max(clamp[0], 0), CLAMP_HI=min(clamp[1], 255))
    split, bk = _split_k(tiles[0].numel() * (i // bn), k, bk, dev)
    acc = torch.zeros(MAX_LIMBS, s, 2 * i, dtype=torch.int32, device=dev) if split > 1 else p  # (p: unused)
    bk0 = bk
    for limbs in _launch_limbs(fmt_in, split):
        if not interpreted():
            stages, bk = _stages(FAST["stages"], limbs, bm, 2 * bn, bk0)
        _l1_kernel[(tiles[0].numel(), i // bn, split)](
            a_limbs, a_row, t * k, p, need, router_w, fp4.w1, fp4.w1_scale, bases.lo, shifted_twice_table(dev),
            silu_table(dev), *tiles, q, s * i, q_bytes, hi, lo, acc, s * 2 * i,
            K=k, BK=bk, LIMBS=limbs, SCALE_FAULT=scale_fault, ASM=_asm(), SPLIT=split, **epilogue,
            DYN=split > 1, num_warps=warps, num_stages=stages, **_regs(bm))
    if split > 1:
        _l1_split_epilogue[(tiles[0].numel(), i // bn)](
            acc, s * 2 * i, p, need, router_w, bases.lo, silu_table(dev), *tiles, q, s * i, q_bytes, hi, lo,
            **epilogue, num_warps=4)


def l2_gemm(a_limbs, p, need, slot, fp4, bases: ColumnBases, tiles, bm: int, scale_fault, fmt_in: str, out_bits,
            a_row=None, halves=False):
    """Fast rows (need > 0) of the L2 GEMM: BF16 bits of the rounded output stored at row slot[s] of
    out_bits (int16 [T * top_k, H]). a_limbs [MAX_LIMBS, S, K] (a_row [S]: the row of a_limbs of each sorted
    row; None: row s). halves (rows sorted by `sort_by_need`): a tile whose second half of rows needs at
    most one limb runs the upper limbs on its first half only."""
    _, s, k = a_limbs.shape
    n = fp4.w2.shape[1]
    bn, bk, warps, stages = _tiling(n, k, False, bm)
    dev = out_bits.device
    split = 1
    if not halves:
        split, bk = _split_k(tiles[0].numel() * (n // bn), k, bk, dev)
    acc = torch.zeros(MAX_LIMBS, s, n, dtype=torch.int32, device=dev) if split > 1 else p  # (p: unused)
    bk0 = bk
    for limbs in _launch_limbs(fmt_in, split):
        if not interpreted():
            stages, bk = _stages(FAST["stages"], limbs, bm, bn, bk0)
        for half in (1, 2) if halves and limbs > 1 else (0,):
            _l2_kernel[(tiles[0].numel(), n // bn, split)](
                a_limbs, s * k, p, need, slot, fp4.w2, fp4.w2_scale, bases.lo, shifted_twice_table(dev),
                *tiles, out_bits, slot if a_row is None else a_row, acc, s * n, N=n, K=k,
                BM=bm, BN=bn, BK=bk, LIMBS=limbs, SCALE_FAULT=scale_fault, ASM=_asm(),
                GATHER=a_row is not None, HALF=half, SPLIT=split, DYN=split > 1, num_warps=warps,
                num_stages=stages, **_regs(bm))
    if split > 1:
        _l2_split_epilogue[(tiles[0].numel(), n // bn)](acc, s * n, p, need, slot, bases.lo, *tiles, out_bits, N=n,
                                                        BM=bm, BN=bn, num_warps=4)


def halves(fmt: str, bm: int) -> bool:
    """Whether L2 sorts each expert's rows by the limbs they need and runs the upper limbs on half tiles
    (FAST["half2"]: from tiles of this many rows on; 0: never; a format whose rows can need a single
    limb)."""
    return 0 < FAST["half2"] <= bm and bm >= 32 and limb_counts(fmt)[0] == 1


def sort_by_need(expert: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """The order of rows sorted by expert (expert [S], ascending) that puts each expert's rows needing the
    most limbs first (rows needing 0, for the per-block path, last): int64 [S], on the device."""
    return torch.sort(expert * 4 + (3 - need.to(torch.int32)), stable=True).indices


# --- which rows take the fast path, without a host sync ------------------------------------------------------


@triton.jit
def _plan_rows(HI, LO, SRC, EXPERT, WOK, WLOMIN, WLOMAX, NEED, P, COUNT, S, E, BR: tl.constexpr,
               UNIT: tl.constexpr, BITS: tl.constexpr, GATHER: tl.constexpr, FORCE: tl.constexpr):
    """Per sorted row: the limbs its activations need (0: not a fast row) and p; COUNT[0] += the rows of an
    expert that are not fast, COUNT[1] = max(COUNT[1], the most limbs a fast row needs), COUNT[2] += the
    rows of an expert (EXPERT outside 0..E-1: an empty slot)."""
    i = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    live = i < S
    e = tl.load(EXPERT + i, mask=live, other=-1)
    present = live & (e >= 0) & (e < E)
    ec = tl.where(present, e, 0)
    if GATHER:
        src = tl.load(SRC + i, mask=live, other=0).to(tl.int64)
    else:
        src = i
    hi = tl.load(HI + src, mask=live, other=-1)
    lo = tl.load(LO + src, mask=live, other=512)
    empty = hi < 0
    rng = tl.where(empty, 0, hi - lo)
    p = tl.where(empty, 127, lo) + (UNIT - 255)
    n = tl.maximum((rng + (BITS + 6)) // 7, 1)  # the fewest 7-bit limbs that hold codes < 2^(BITS + rng)
    ok = present & (tl.load(WOK + ec, mask=present, other=0) != 0) & (n <= 3)
    ok = ok & (p + tl.load(WLOMIN + ec, mask=present, other=0) >= -126)
    ok = ok & (p + tl.load(WLOMAX + ec, mask=present, other=0) <= 64)
    if FORCE:
        ok = ok & (n < 0)
    need = tl.where(ok, n, 0)
    tl.store(NEED + i, need.to(tl.int8), mask=live)
    tl.store(P + i, p, mask=live)
    tl.atomic_add(COUNT, tl.sum((present & (need == 0)).to(tl.int32), axis=0))
    tl.atomic_max(COUNT + 1, tl.max(need, axis=0))
    tl.atomic_add(COUNT + 2, tl.sum(present.to(tl.int32), axis=0))


def plan_rows(hi_a, lo_a, src, fmt: str, bases: ColumnBases, expert, scale_fault: bool, k: int, count,
              force_slow=False):
    """Per sorted row: (need int8: the limbs of its fast GEMM, 0 if it takes the per-block path; p int32).
    hi_a/lo_a: the byte range of each activation row; src: the activation row of each sorted row (None:
    the same); expert [S] int32 (num_experts for an empty slot); count: int32 [3] on the device, zeroed,
    for (rows not fast, the most limbs, rows) - read once at the end of the layer, the only host sync."""
    from .quantize import UNIT_EXP

    s = expert.numel()
    need = torch.empty(s, dtype=torch.int8, device=expert.device)
    p = torch.empty(s, dtype=torch.int32, device=expert.device)
    if s == 0:
        return need, p
    br = 1024
    _plan_rows[(triton.cdiv(s, br),)](
        hi_a, lo_a, expert if src is None else src, expert, bases.expert_ok(scale_fault), bases.lo_min,
        bases.lo_max, need, p, count, s, bases.lo.shape[0], BR=br, UNIT=UNIT_EXP[fmt], BITS=CODE_BITS[fmt],
        GATHER=src is not None, FORCE=bool(force_slow or k >= 2**17), num_warps=4)
    return need, p


# --- step 8: the combine ------------------------------------------------------------------------------------


@triton.jit
def _combine(SLOT, IDX, OUT, E, H: tl.constexpr, TOPK: tl.constexpr, SUM: tl.constexpr, BH: tl.constexpr):
    """OUT[t] = BF16(FP32 sum of the BF16 slot outputs 0..SUM-1 of token t, in slot order); an empty slot
    (expert outside 0..E-1) adds +0, as its zero row would."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    e = tl.load(IDX + t * TOPK)
    acc = tl.load(SLOT + t * TOPK * H + hs, mask=(e >= 0) & (e < E), other=0.0).to(tl.float32)
    for s in tl.static_range(1, SUM):
        e = tl.load(IDX + t * TOPK + s)
        acc += tl.load(SLOT + (t * TOPK + s) * H + hs, mask=(e >= 0) & (e < E), other=0.0).to(tl.float32)
    tl.store(OUT + t * H + hs, bf16_rne(acc))


def combine(slot: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, skip_last_slot: bool = False):
    """`emulator.combine` over BF16 slot outputs slot [T * K, H] (rows of empty slots: not read) ->
    BF16-valued FP32 [T, H]."""
    t, k = top_k_index.shape
    h = slot.shape[1]
    out = torch.empty(t, h, dtype=torch.float32, device=slot.device)
    if t == 0:
        return out
    bh = min(h & -h, 1024)
    _combine[(t, h // bh)](slot, top_k_index.contiguous(), out, num_experts, H=h, TOPK=k,
                           SUM=max(k - (1 if skip_last_slot else 0), 1), BH=bh, num_warps=4)
    return out
