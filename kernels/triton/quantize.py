"""Activations to integer codes in Triton: docs/kernels.md#the-moe-forward steps 2 and 6.

Per row, groups of 32: the UE8M0 byte by RCEIL from the FP32 bits of amax / F (the recipe's scale rule),
the scaled values rounded to E2M1 (the recipe's tie mode) or E4M3 (RNE, saturating). Every operation is
exact or one IEEE rounding (the division uses div_rn: Triton's plain `/` is an approximation on a GPU),
so codes and bytes equal `formats.quantize`'s.

Codes come out as integers that an int8 dot multiplies exactly: E2M1 as twice its value (-12..12);
E4M3 as its value times 2^9 (below 2^18), split into three signed 7-bit limbs. Each row also gets the
smallest and largest byte of its non-zero groups, for the certificate (`certify`).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats import GROUP, ScaleRule, format_max
from .availability import interpreted

NO_GROUP_HI, NO_GROUP_LO = -1, 512  # byte range of a row without a non-zero group


@triton.jit
def pow2_f32(e):
    """2^e in FP32 for integer e in [-149, 127], from the bits (2^-127 and below are subnormal)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def e2m1_twice(y, TIES_EVEN: tl.constexpr):
    """Scaled FP32 values -> twice their E2M1 value, int32 in -12..12 (formats.e2m1_magnitude_index)."""
    a = tl.minimum(tl.abs(y), 6.0)
    idx = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    if TIES_EVEN:  # at 0.75, 1.75 and 3.5 the even neighbour is the upper one
        idx += ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(tl.int32)
    mag = tl.where(idx < 5, idx, tl.where(idx == 5, 6, tl.where(idx == 6, 8, 12)))
    return tl.where(y < 0, -mag, mag)


@triton.jit
def e4m3_integer(y):
    """Scaled FP32 values -> their E4M3 value (RNE, saturating at 448) times 2^9, as int32: integers below
    2^18 (the smallest subnormal is 2^-9). Same rounding as formats.e4m3_round, from the bits."""
    yc = tl.minimum(tl.maximum(y, -448.0), 448.0)
    e = ((yc.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2|yc|) for normal yc
    ulp = tl.maximum(e, -6) - 3  # 4 significant bits; subnormals: spacing 2^-9
    t = yc * pow2_f32(-ulp)  # exact, |t| <= 16
    r = (t + 12582912.0) - 12582912.0  # round half to even at integers (1.5 * 2^23 trick, |t| < 2^22)
    return r.to(tl.int32) << (ulp + 9)


@triton.jit
def group_codes(x, E4M3: tl.constexpr, FLOOR: tl.constexpr, DIV: tl.constexpr, F: tl.constexpr,
                INV_F: tl.constexpr, CLAMP_LO: tl.constexpr, CLAMP_HI: tl.constexpr, TIES_EVEN: tl.constexpr):
    """FP32 groups x [BR, NG, 32] -> (integer codes int32 [BR, NG, 32]: E2M1 twice-values or E4M3 x 2^9,
    UE8M0 bytes int32 [BR, NG]) by the scale rule (module docstring)."""
    amax = tl.max(tl.abs(x), axis=2)
    if FLOOR > 0:
        amax = tl.maximum(amax, FLOOR)
    if DIV:
        q = tl.math.div_rn(amax, F)
    else:
        q = amax * INV_F
    bits = q.to(tl.int32, bitcast=True)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, CLAMP_LO), CLAMP_HI)
    y = x * pow2_f32(127 - byte)[:, :, None]
    if E4M3:
        v = e4m3_integer(y)
    else:
        v = e2m1_twice(y, TIES_EVEN)
    return v, byte


@triton.jit
def _quantize_rows(X, Q, B, HI, LO, R, K: tl.constexpr, BR: tl.constexpr, NG: tl.constexpr, E4M3: tl.constexpr,
                   FLOOR: tl.constexpr, DIV: tl.constexpr, F: tl.constexpr, INV_F: tl.constexpr,
                   CLAMP_LO: tl.constexpr, CLAMP_HI: tl.constexpr, TIES_EVEN: tl.constexpr):
    """BR rows per program, NG groups of 32 per step: tiles [BR, NG, 32]. Q: [1, R, K] E2M1 twice-values,
    or [3, R, K] E4M3 integers (x 2^9) as three signed 7-bit limbs, low first."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    live = rows < R
    g = tl.arange(0, NG)
    j = tl.arange(0, 32)
    hi = tl.full([BR, NG], -1, tl.int32)
    lo = tl.full([BR, NG], 512, tl.int32)
    for g0 in range(0, K // 32, NG):
        groups = g0 + g
        ok = live[:, None] & (groups < K // 32)[None, :]  # [BR, NG]
        offs = rows[:, None, None] * K + groups[None, :, None] * 32 + j[None, None, :]
        x = tl.load(X + offs, mask=ok[:, :, None], other=0.0).to(tl.float32)
        v, byte = group_codes(x, E4M3, FLOOR, DIV, F, INV_F, CLAMP_LO, CLAMP_HI, TIES_EVEN)
        if E4M3:
            m = tl.abs(v)
            sign = tl.where(v < 0, -1, 1)
            tl.store(Q + offs, ((m & 127) * sign).to(tl.int8), mask=ok[:, :, None])
            tl.store(Q + R * K + offs, (((m >> 7) & 127) * sign).to(tl.int8), mask=ok[:, :, None])
            tl.store(Q + 2 * R * K + offs, ((m >> 14) * sign).to(tl.int8), mask=ok[:, :, None])
        else:
            tl.store(Q + offs, v.to(tl.int8), mask=ok[:, :, None])
        tl.store(B + rows[:, None] * (K // 32) + groups[None, :], byte.to(tl.uint8), mask=ok)
        nonzero = (tl.max(tl.abs(v), axis=2) > 0) & ok
        hi = tl.maximum(hi, tl.where(nonzero, byte, -1))
        lo = tl.minimum(lo, tl.where(nonzero, byte, 512))
    tl.store(HI + rows, tl.max(hi, axis=1), mask=live)
    tl.store(LO + rows, tl.min(lo, axis=1), mask=live)


LIMBS = {"e2m1": 1, "e4m3": 3}
UNIT_EXP = {"e2m1": -1, "e4m3": -9}  # an integer code q stands for q * 2^UNIT_EXP * scale


def quantize_rows(x: torch.Tensor, fmt: str, rule: ScaleRule, ties: str = "even"):
    """x [R, K] (BF16 or FP32) -> (integer codes int8 [LIMBS, R, K], scale bytes uint8 [R, K/32], hi int32
    [R], lo int32 [R]): exactly `formats.quantize(x, fmt, rule, ties)`, as integers (module docstring)."""
    r, k = x.shape
    if k % GROUP:
        raise ValueError(f"last dim {k} is not a multiple of {GROUP}")
    x = x.contiguous()
    q = torch.empty(LIMBS[fmt], r, k, dtype=torch.int8, device=x.device)
    b = torch.empty(r, k // GROUP, dtype=torch.uint8, device=x.device)
    hi = torch.empty(r, dtype=torch.int32, device=x.device)
    lo = torch.empty(r, dtype=torch.int32, device=x.device)
    if r == 0:
        return q, b, hi, lo
    clamp = rule.byte_clamp or (0, 255)
    fmax = format_max(fmt)
    groups = triton.next_power_of_2(k // GROUP)
    # the interpreter pays per operation: many rows and all groups at once; a GPU: one row, 16 groups a step
    br, ng = (64, min(groups, 128)) if interpreted() else (1, min(groups, 16))
    _quantize_rows[(triton.cdiv(r, br),)](
        x, q, b, hi, lo, r, K=k, BR=br, NG=ng, E4M3=fmt == "e4m3", FLOOR=float(rule.amax_floor),
        DIV=rule.q_via == "div", F=fmax, INV_F=float(np.float32(1.0 / fmax)), CLAMP_LO=max(clamp[0], 0),
        CLAMP_HI=min(clamp[1], 255), TIES_EVEN=ties == "even", num_warps=4,
    )
    return q, b, hi, lo


def twice_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 nibbles) -> twice their value as int8 (0x8, -0, gives 0)."""
    lut = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8, device=codes.device)
    return lut[codes.long() & 0xF]


def values_from_codes(q: torch.Tensor, byte: torch.Tensor, fmt: str) -> torch.Tensor:
    """The FP32 values integer codes q [LIMBS, R, K] stand for (exact; the host fallback reads these)."""
    from ..formats import scale_from_byte

    whole = q[0].to(torch.int32)
    for limb in range(1, q.shape[0]):
        whole = whole + (q[limb].to(torch.int32) << (7 * limb))
    unit = whole.to(torch.float32) * 2.0 ** UNIT_EXP[fmt]
    return unit.view(*whole.shape[:-1], -1, GROUP).mul(scale_from_byte(byte).unsqueeze(-1)).reshape(whole.shape)
