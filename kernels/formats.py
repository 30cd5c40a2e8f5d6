"""Number formats of the mega-MoE kernels: E2M1 (FP4), E4M3 (FP8) and UE8M0 power-of-two scales.

Everything here follows docs/kernels.md#number-formats. Tensors are quantized in groups of 32 contiguous
elements along the last dimension (K), one UE8M0 byte per group (docs/kernels.md#groups-of-32). All arithmetic is FP32 and exact:
scales are powers of two, so x * 2^-e and code * 2^e never round (docs/kernels.md#ue8m0-scales).

Two kinds of output:
- codes: uint8 E2M1 nibbles (bit 3 sign, bits 0-2 magnitude index) or E4M3 bytes, plus scale bytes;
- fake-quantized values: FP32 tensors that hold exactly what a kernel computes with (the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # elements per UE8M0 scale, along K (docs/kernels.md#groups-of-32)

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index 0-7 (docs/kernels.md#e2m1)
# Midpoints between neighbouring magnitudes; a tie sits exactly on one of them (docs/kernels.md#tie-modes).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints whose upper neighbour has an even magnitude index (0.75->1, 1.75->2, 3.5->4): where
# ties-to-even rounds up and ties-toward-zero rounds down.
_E2M1_EVEN_UP_MIDPOINTS = (0.75, 1.75, 3.5)

TIES = ("zero", "even")
FORMATS = ("e2m1", "e4m3")


def format_max(fmt: str) -> float:
    if fmt == "e2m1":
        return E2M1_MAX
    if fmt == "e4m3":
        return E4M3_MAX
    raise ValueError(f"unknown element format {fmt!r}; expected one of {FORMATS}")


# --- UE8M0 scales: the RCEIL rule (docs/kernels.md#ue8m0-scales) -------------------------------------------------------------


@dataclass(frozen=True)
class ScaleRule:
    """How one call site turns a group's amax into a UE8M0 byte (docs/kernels.md#ue8m0-scales table)."""

    name: str
    amax_floor: float  # amax is raised to this before the division; 0 = no floor
    q_via: str  # "div": q = amax / F;  "mul": q = amax * fl(1/F)
    byte_clamp: tuple[int, int] | None  # clamp of the stored byte, None = no clamp


# DeepGEMM pre-dispatch kernel and host helpers: L1 input x of every kernel.
PRE_DISPATCH = ScaleRule("pre_dispatch", amax_floor=1e-4, q_via="div", byte_clamp=(1, 254))
# SGLang's JIT FP8 pre-dispatch (W4A8 served by SGLang). The byte clamp is not recorded in any public source; none.
SGLANG_FP8 = ScaleRule("sglang_fp8", amax_floor=1e-10, q_via="div", byte_clamp=None)
# L1 epilogue (common/math.cuh): the intermediate. No floor: an all-zero group gets byte 0.
EPILOGUE = ScaleRule("epilogue", amax_floor=0.0, q_via="mul", byte_clamp=None)
# Offline weight quantization of a BF16 checkpoint (evalgate's own choice: RCEIL, no floor, docs/kernels.md#the-moe-forward step 1).
WEIGHTS = ScaleRule("weights", amax_floor=0.0, q_via="div", byte_clamp=(0, 254))

SCALE_RULES = {r.name: r for r in (PRE_DISPATCH, SGLANG_FP8, EPILOGUE, WEIGHTS)}


def ue8m0_bytes(amax: torch.Tensor, fmax: float, rule: ScaleRule) -> torch.Tensor:
    """UE8M0 byte e + 127 with e = ceil(log2(amax / F)), computed from the FP32 bits of q (docs/kernels.md#ue8m0-scales):
    byte = exponent_bits(q) + (mantissa_bits(q) != 0). Exact; no log2 rounding involved."""
    amax = amax.to(torch.float32)
    if rule.amax_floor > 0:
        amax = amax.clamp(min=rule.amax_floor)
    if rule.q_via == "div":
        q = amax / fmax
    else:
        q = amax * torch.tensor(1.0 / fmax, dtype=torch.float32)  # fl(1/F), then an FP32 multiply
    bits = q.contiguous().view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    if rule.byte_clamp is not None:
        byte = byte.clamp(*rule.byte_clamp)
    return byte.clamp(0, 255).to(torch.uint8)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e in FP32 for integer e (2^128 and above: inf), built from the bits (exact on every CPU; exp2 comes from
    libm or SLEEF depending on the instruction set)."""
    from .canonical import pow2

    return pow2(e).to(torch.float32)


def scale_from_byte(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) in FP32 (exact for every byte 0-254; 255 is NaN and must not occur)."""
    return _pow2_f32(byte.to(torch.int64) - 127)


def inverse_scale_from_byte(byte: torch.Tensor) -> torch.Tensor:
    """2^(127 - byte): the sf_inv a kernel multiplies by. Byte 0 gives 2^127, as in the epilogue (docs/kernels.md#ue8m0-scales)."""
    return _pow2_f32(127 - byte.to(torch.int64))


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute maximum of each group of 32 along the last dim: [..., K] -> [..., K/32]."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the group size {GROUP}")
    return x.reshape(*x.shape[:-1], -1, GROUP).abs().amax(dim=-1)


def _per_element(scale: torch.Tensor) -> torch.Tensor:
    return scale.repeat_interleave(GROUP, dim=-1)


# --- E2M1 element rounding (docs/kernels.md#e2m1, docs/kernels.md#tie-modes) -------------------------------------------------------------


def e2m1_magnitude_index(y: torch.Tensor, ties: str) -> torch.Tensor:
    """Index 0-7 of the E2M1 magnitude nearest to |y| (clamped to 6). Ties go toward zero (strict `>`
    at every midpoint) or to the even index (`>=` at 0.75, 1.75 and 3.5) (docs/kernels.md#tie-modes)."""
    if ties not in TIES:
        raise ValueError(f"unknown tie mode {ties!r}; expected one of {TIES}")
    a = y.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=a.dtype, device=a.device)
    index = torch.bucketize(a, mids, right=False)  # = number of midpoints strictly below a
    if ties == "even":
        on_even_tie = torch.zeros_like(a, dtype=torch.bool)
        for m in _E2M1_EVEN_UP_MIDPOINTS:
            on_even_tie |= a == m
        index = index + on_even_tie.to(index.dtype)
    return index


def e2m1_encode(y: torch.Tensor, ties: str) -> torch.Tensor:
    """Scaled values y -> E2M1 codes (uint8 nibbles). The sign bit is set only for a non-zero magnitude,
    as the DeepGEMM helpers do: they never emit 0x8 (docs/kernels.md#e2m1)."""
    index = e2m1_magnitude_index(y, ties)
    negative = (y < 0) & (index > 0)
    return (index + 8 * negative.to(index.dtype)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> FP32 values (0x8 decodes to -0.0)."""
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=codes.device)
    return lut[codes.long() & 0xF]


def e2m1_round(y: torch.Tensor, ties: str) -> torch.Tensor:
    """Scaled values y -> the E2M1 grid value they round to, in FP32 (no codes; the hot path). Same values
    as ``e2m1_magnitude_index``, by arithmetic: the grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6,
    so |y| times 1 / spacing (a power of two: exact) is rounded to an integer, half to even (``ties="even"``:
    the even index is the even multiple at every midpoint) or half down (``"zero"``: ceil(t - 0.5), exact
    for t <= 12), and divided back."""
    if ties not in TIES:
        raise ValueError(f"unknown tie mode {ties!r}; expected one of {TIES}")
    if y.dtype == torch.float32:
        # 1 / spacing from |y|'s exponent field E (127 for [1, 2)): 2^min(128 - E, 1), i.e. 2 below 2, 1 in
        # [2, 4), 0.5 from 4; in place, a third of the passes of the comparisons below (a NaN's factor is 0:
        # it stays NaN)
        a = y.abs().clamp_(max=E2M1_MAX)
        per_step = ((a.view(torch.int32) >> 23).neg_().add_(255).clamp_(max=128) << 23).view(torch.float32)
        t = a.mul_(per_step)
        steps = t.round_() if ties == "even" else t.sub_(0.5).ceil_()
        return steps.div_(per_step).copysign_(y)
    a = y.abs().clamp(max=E2M1_MAX)
    per_step = torch.where(a < 2, 2.0, torch.where(a < 4, 1.0, 0.5))
    t = a * per_step
    steps = torch.round(t) if ties == "even" else torch.ceil(t - 0.5)
    return (steps / per_step).copysign(y)


# --- E4M3 element rounding (docs/kernels.md#e4m3) -------------------------------------------------------------------


def e4m3_encode(y: torch.Tensor) -> torch.Tensor:
    """Scaled values y -> E4M3 bytes, RNE with saturation. Clamp first: never rely on the cast (docs/kernels.md#e4m3)."""
    return y.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    return y.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


# --- Group quantization: scale bytes + codes, or fake-quantized FP32 --------------------------------


def quantize(x: torch.Tensor, fmt: str, rule: ScaleRule, ties: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes uint8 [..., K], scale bytes uint8 [..., K/32]).

    `ties` applies to E2M1 only; E4M3 is always RNE. Codes are unpacked (one per element); see
    `pack_e2m1` for the two-per-byte layout."""
    x = x.to(torch.float32)
    byte = ue8m0_bytes(group_amax(x), format_max(fmt), rule)
    y = x * _per_element(inverse_scale_from_byte(byte))
    codes = e2m1_encode(y, ties) if fmt == "e2m1" else e4m3_encode(y)
    return codes, byte


def dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor, fmt: str) -> torch.Tensor:
    """(codes [..., K], scale bytes [..., K/32]) -> FP32 values = element value * 2^(byte - 127)."""
    values = e2m1_decode(codes) if fmt == "e2m1" else e4m3_decode(codes)
    return values * _per_element(scale_from_byte(scale_bytes))


def fake_quantize(x: torch.Tensor, fmt: str, rule: ScaleRule, ties: str = "even") -> torch.Tensor:
    """Quantize and dequantize in one step: the FP32 values a kernel multiplies with. Same result as
    `dequantize(*quantize(...))`, without materialising codes (each group's scale is broadcast over it)."""
    x = x.to(torch.float32)
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the group size {GROUP}")
    groups = x.reshape(*x.shape[:-1], -1, GROUP)
    byte = ue8m0_bytes(groups.abs().amax(dim=-1), format_max(fmt), rule)
    y = groups * inverse_scale_from_byte(byte).unsqueeze(-1)
    grid = e2m1_round(y, ties) if fmt == "e2m1" else e4m3_round(y)
    return (grid * scale_from_byte(byte).unsqueeze(-1)).reshape(x.shape)


# --- Nibble packing (docs/kernels.md#e2m1): low nibble = even element -----------------------------------------------


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K] -> bytes [..., K/2]; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes ({codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] (uint8 or int8) -> E2M1 codes [..., K]."""
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def dequantize_packed_e2m1(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., K/2] + scale bytes [..., K/32] -> FP32 [..., K]. Same values as
    `dequantize(unpack_e2m1(packed), ...)`, via a 256-entry byte table (the fast path for weights)."""
    codes = torch.arange(256, dtype=torch.uint8, device=packed.device)
    pair_lut = torch.stack((e2m1_decode(codes & 0xF), e2m1_decode(codes >> 4)), dim=-1)  # [256, 2]
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    values = torch.nn.functional.embedding(p.to(torch.int32), pair_lut)  # [..., K/2, 2]
    values = values.reshape(*p.shape[:-1], -1, GROUP) * scale_from_byte(scale_bytes).unsqueeze(-1)
    return values.reshape(*p.shape[:-1], 2 * p.shape[-1])


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 to BF16 (RNE) and back to FP32."""
    return x.to(torch.bfloat16).to(torch.float32)
