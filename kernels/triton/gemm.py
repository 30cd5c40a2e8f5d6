"""Grouped GEMMs on packed FP4 expert weights: rows sorted by expert times their expert's [N, K] matrix.

Weights stay as the checkpoint stores them: E2M1 codes two per byte (low nibble = even K) [E, N, K/2] and
UE8M0 bytes [E, N, K/32]; each program decodes the bytes it reads (a 256-entry table: byte -> the two
codes' twice-values). Two kernels, both exact on the rows `certify` clears, so each output is RN_fp32
of the exact dot product (docs/kernels.md#accumulation):

- `int_gemm`, quantized activations as integer codes (`quantize`): per 32-block one int8 dot per limb
  (exact in int32), then the block sum times both scales added in float64;
- `f64_gemm`, any FP32 activations (fault (c)'s w * quantize(h), and nothing else): products and sums
  in float64, 8 K at a time (Triton's float64 tl.dot does not compile for Hopper).

The float64 sum is exact while the row's terms span at most 53 bits, and is rounded once to FP32 at the
end. Rows are scheduled in tiles of BM rows of one expert (`tile_schedule`); a tile beyond the last is a
no-op, so the grid needs no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import GROUP
from .availability import interpreted

MAGIC = tl.constexpr(1.5 * 2.0**52 + 2.0**31)  # 2^52 + 2^51 + 2^31
SETTINGS = {"nb": 1, "warps": 4, "bn": 64}  # GPU tile settings (benchmarks sweep them)


@triton.jit
def pow2_f64(e):
    """2^e in float64 for integer e in the normal range, from the bits."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def int_as_f64(x):
    """MAGIC + x as float64 for int32 x, built from the bits: no int-to-float conversion (a slow
    instruction). fma(that, s, -MAGIC * s) is then x * s exactly, for a power of two s."""
    low = (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.uint64)  # x + 2^31, as an unsigned word
    return (low | 0x4338000000000000).to(tl.float64, bitcast=True)


@triton.jit
def decode_twice(packed, LUT, BN: tl.constexpr, HALF: tl.constexpr):
    """Packed E2M1 bytes [BN, HALF] -> twice their values, int8 [BN, 2 * HALF] (low nibble first), through
    the table LUT: int16 per byte, low byte = the low nibble's twice-value, high byte = the high one's."""
    both = tl.load(LUT + packed.to(tl.int32))
    return tl.join(both.to(tl.int8), (both >> 8).to(tl.int8)).reshape(BN, 2 * HALF)


@triton.jit
def weight_bytes(SW, e, cols, kb, N: tl.constexpr, KB: tl.constexpr, SCALE_FAULT: tl.constexpr):
    """UE8M0 bytes of group kb of rows `cols` of expert e, int32; fault (a) adds 1 to group row % KB."""
    sw = tl.load(SW + (e * N + cols) * KB + kb).to(tl.int32)
    if SCALE_FAULT:
        sw = tl.where(cols % KB == kb, tl.minimum(sw + 1, 254), sw)
    return sw


@triton.jit
def _tile(TILE_EXPERT, TILE_BEGIN, TILE_END, BM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(TILE_EXPERT + t)
    begin = tl.load(TILE_BEGIN + t)
    end = tl.load(TILE_END + t)
    rows = begin + tl.arange(0, BM)
    return e.to(tl.int64), rows, rows < end


@triton.jit
def _block_sum(A, arow, live, kk, w, K: tl.constexpr, R: tl.constexpr, LIMBS: tl.constexpr):
    """Exact int32 block sums of the integer codes (limbs recombined) with w: [BM, BN]."""
    a = tl.load(A + arow[:, None] * K + kk[None, :], mask=live[:, None], other=0)
    block = tl.dot(a, tl.trans(w), out_dtype=tl.int32)
    if LIMBS == 3:  # E4M3 x 2^9 in 7-bit limbs: |block| < 32 * 2^18 * 12 < 2^27
        a1 = tl.load(A + R * K + arow[:, None] * K + kk[None, :], mask=live[:, None], other=0)
        a2 = tl.load(A + 2 * R * K + arow[:, None] * K + kk[None, :], mask=live[:, None], other=0)
        block += tl.dot(a1, tl.trans(w), out_dtype=tl.int32) << 7
        block += tl.dot(a2, tl.trans(w), out_dtype=tl.int32) << 14
    return block


@triton.jit
def _int_gemm(A, SA, A_ROW, W, SW, LUT, OUT, TILE_EXPERT, TILE_BEGIN, TILE_END, R,
              N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
              LIMBS: tl.constexpr, UNIT: tl.constexpr, GATHER: tl.constexpr, SCALE_FAULT: tl.constexpr):
    """NB 32-blocks per step: 1 on a GPU; many under the interpreter, which pays per operation."""
    e, rows, live = _tile(TILE_EXPERT, TILE_BEGIN, TILE_END, BM)
    if e < 0:
        return
    KB: tl.constexpr = K // 32
    if GATHER:
        arow = tl.load(A_ROW + rows, mask=live, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, NB * 32)
    h = tl.arange(0, NB * 16)
    b = tl.arange(0, NB)
    w_base = W + (e * N + cols[:, None]) * (K // 2) + h[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float64)
    for kb in range(0, KB, NB):
        w = decode_twice(tl.load(w_base + kb * 16), LUT, BN, NB * 16)
        if NB == 1:
            block = _block_sum(A, arow, live, kb * 32 + j, w, K, R, LIMBS)  # exact
            sa = tl.load(SA + arow * KB + kb, mask=live, other=127).to(tl.int32)
            sw = weight_bytes(SW, e, cols, kb, N, KB, SCALE_FAULT)
            # code * 2^UNIT * 2^(byte_a - 127) times twice_w * 2^-1 * 2^(byte_w - 127)
            pa = pow2_f64(sa + (UNIT - 127))
            minus = pa * -MAGIC
            acc = tl.fma(tl.fma(int_as_f64(block), pa[:, None], minus[:, None]), pow2_f64(sw - 128)[None, :], acc)
        else:
            a = tl.load(A + arow[:, None] * K + kb * 32 + j[None, :], mask=live[:, None], other=0)
            block = tl.dot(a.reshape(BM, NB, 32).permute(1, 0, 2), w.reshape(BN, NB, 32).permute(1, 2, 0),
                           out_dtype=tl.int32)  # [NB, BM, BN]
            if LIMBS == 3:
                for limb in tl.static_range(1, 3):
                    al = tl.load(A + limb * R * K + arow[:, None] * K + kb * 32 + j[None, :], mask=live[:, None],
                                 other=0)
                    block += tl.dot(al.reshape(BM, NB, 32).permute(1, 0, 2),
                                    w.reshape(BN, NB, 32).permute(1, 2, 0), out_dtype=tl.int32) << (7 * limb)
            sa = tl.load(SA + arow[None, :] * KB + kb + b[:, None], mask=live[None, :], other=127).to(tl.int32)
            sw = weight_bytes(SW, e, cols[None, :], kb + b[:, None], N, KB, SCALE_FAULT)
            pa = pow2_f64(sa + (UNIT - 127))
            minus = pa * -MAGIC
            terms = tl.fma(int_as_f64(block), pa[:, :, None], minus[:, :, None]) * pow2_f64(sw - 128)[:, None, :]
            acc += tl.sum(terms, axis=0)  # exact terms: any order gives the exact sum (certify)
    tl.store(OUT + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.float32), mask=live[:, None])


@triton.jit
def _f64_gemm(A, A_ROW, W, SW, LUT, OUT, TILE_EXPERT, TILE_BEGIN, TILE_END,
              N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GATHER: tl.constexpr, SCALE_FAULT: tl.constexpr):
    e, rows, live = _tile(TILE_EXPERT, TILE_BEGIN, TILE_END, BM)
    if e < 0:
        return
    KB: tl.constexpr = K // 32
    if GATHER:
        arow = tl.load(A_ROW + rows, mask=live, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, BK)
    h = tl.arange(0, BK // 2)
    w_base = W + (e * N + cols[:, None]) * (K // 2) + h[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float64)
    for k0 in range(0, K, BK):
        a = tl.load(A + arow[:, None] * K + k0 + j[None, :], mask=live[:, None], other=0.0).to(tl.float64)
        sw = weight_bytes(SW, e, cols, k0 // 32, N, KB, SCALE_FAULT)
        w = decode_twice(tl.load(w_base + k0 // 2), LUT, BN, BK // 2).to(tl.float64) * pow2_f64(sw - 128)[:, None]
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)  # exact products, exact sums (certify)
    tl.store(OUT + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.float32), mask=live[:, None])


def tile_schedule(counts: torch.Tensor, rows: int, bm: int):
    """Tiles of at most `bm` rows of one expert, for rows sorted by expert with `counts` per expert:
    (expert, begin, end) int32 each, padded with expert -1 to an upper bound known without a sync."""
    device = counts.device
    counts = counts.to(torch.int64)
    tiles = (counts + bm - 1) // bm
    last = torch.cumsum(tiles, 0)
    first_row = torch.cumsum(counts, 0) - counts
    bound = -(-rows // bm) + min(counts.numel(), rows)
    t = torch.arange(bound, device=device)
    e = torch.searchsorted(last, t, right=True).clamp(max=counts.numel() - 1)
    used = t < last[-1]
    begin = first_row[e] + (t - (last[e] - tiles[e])) * bm
    end = torch.minimum(begin + bm, first_row[e] + counts[e])
    expert = torch.where(used, e, -1)
    return expert.to(torch.int32), begin.to(torch.int32), end.to(torch.int32)


def block_m(rows: int, experts: int) -> int:
    """Rows per tile: about the rows an expert gets, 16 to 64 (tl.dot needs 16)."""
    per_expert = rows / max(experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


_LUTS: dict = {}


def twice_table(device) -> torch.Tensor:
    """int16 [256]: byte -> twice-value of its low nibble (low byte) and high nibble (high byte)."""
    key = str(device)
    if key not in _LUTS:
        twice = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int32)
        byte = torch.arange(256)
        table = (twice[byte & 15] & 0xFF) | (twice[byte >> 4] << 8)
        _LUTS[key] = table.to(torch.int16).to(device)
    return _LUTS[key]


def _grid(counts, rows, n, bn):
    """(rows per tile, the tile schedule, the launch grid)."""
    if n % bn:
        raise ValueError(f"GEMM output size N={n} is not a multiple of {bn}")
    bm = block_m(rows, counts.numel())
    tiles = tile_schedule(counts, rows, bm)
    return bm, tiles, (tiles[0].numel(), n // bn)


def int_gemm(q, q_bytes, unit: int, a_row, w, w_bytes, counts, scale_fault=False):
    """Rows `a_row` of integer codes q [LIMBS, R, K] (int8; `quantize.quantize_rows`) with bytes [R, K/32]
    (a_row None: rows in order), sorted by expert with `counts` per expert, times packed weights
    w [E, N, K/2] / w_bytes [E, N, K/32] -> FP32 [S, N]. A code stands for code * 2^unit * scale."""
    limbs, r, k = q.shape
    rows = r if a_row is None else a_row.numel()
    n = w.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    if k % GROUP or w.shape[2] * 2 != k:
        raise ValueError(f"activations K={k} do not match the weights' {w.shape[2] * 2}")
    # the interpreter pays per operation, not per element: few wide programs, all of K at once
    bn = min(triton.next_power_of_2(n), 1024) if interpreted() else SETTINGS["bn"]
    nb = min(triton.next_power_of_2(k // GROUP), 64) if interpreted() else SETTINGS["nb"]
    while (k // GROUP) % nb:
        nb //= 2
    bm, tiles, grid = _grid(counts, rows, n, bn)
    gather = a_row is not None
    _int_gemm[grid](q, q_bytes, a_row if gather else q, w, w_bytes, twice_table(q.device), out, *tiles, r,
                    N=n, K=k, BM=bm, BN=bn, NB=nb, LIMBS=limbs, UNIT=unit, GATHER=gather,
                    SCALE_FAULT=scale_fault, num_warps=SETTINGS["warps"])
    return out


def f64_gemm(a, a_row, w, w_bytes, counts, scale_fault=False):
    """As `int_gemm` for FP32 activation values a [R, K]."""
    rows = a.shape[0] if a_row is None else a_row.numel()
    n, k = w.shape[1], w.shape[2] * 2
    out = torch.empty(rows, n, dtype=torch.float32, device=a.device)
    if rows == 0:
        return out
    bn, bk = (min(triton.next_power_of_2(n), 256), 32) if interpreted() else (32, 8)
    bm, tiles, grid = _grid(counts, rows, n, bn)
    gather = a_row is not None
    _f64_gemm[grid](a.contiguous(), a_row if gather else a, w, w_bytes, twice_table(a.device), out, *tiles,
                    N=n, K=k, BM=bm, BN=bn, BK=bk, GATHER=gather, SCALE_FAULT=scale_fault,
                    num_warps=4)
    return out
