"""DeepSeek-V4's dense FP8 linears: E4M3 weights with one UE8M0 scale per 128 x 128 block (docs/kernels.md#dense-fp8-linears).

A stored weight [N, K] is ``float8_e4m3fn`` codes; its ``.scale`` is ``float8_e8m0fnu`` [ceil(N/128),
ceil(K/128)], one power of two per block (a partial last block has its own). The weight it stands for is
code x 2^e: an E4M3 value has 4 significant bits, so every such product is exact in BF16 (and in float64),
and dequantizing is exact whatever the order.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def scale_grid(shape) -> tuple[int, int]:
    """The block-scale shape of a weight of ``shape`` [N, K]: one per 128 x 128 block, rounded up."""
    n, k = shape
    return -(-n // BLOCK), -(-k // BLOCK)


def scale_values(scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """UE8M0 bytes as the powers of two they stand for, 2^(byte - 127), built from the bits (exact; every one
    of them is an FP32 value too, 2^-127 a subnormal)."""
    byte = scale.view(torch.uint8).to(torch.int64)
    return ((byte - 127 + 1023) << 52).view(torch.float64).to(dtype)


def _expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The per-block scales as float64 powers of two, repeated over each block's elements: [n, k]."""
    s = scale_values(scale)
    return s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight of E4M3 ``codes`` [N, K] and UE8M0 block ``scale`` (exact in BF16, FP32 and float64)."""
    n, k = codes.shape
    if tuple(scale.shape) != scale_grid((n, k)):
        raise ValueError(f"scale grid {tuple(scale.shape)} for a weight of {(n, k)}; expected {scale_grid((n, k))}")
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # 2^-127 .. 2^127: exact in FP32 too
    return (codes.to(wide) * _expand(scale, n, k).to(wide)).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, UE8M0 block scales) of ``weight`` [N, K]: each block's scale is the smallest power of two
    that brings its largest magnitude within E4M3's 448 (DeepSeek's ``scale_fmt: ue8m0``), codes rounded to
    nearest even. For writing random checkpoints and tests."""
    n, k = weight.shape
    gn, gk = scale_grid((n, k))
    w = weight.float()
    padded = torch.nn.functional.pad(w.abs(), (0, gk * BLOCK - k, 0, gn * BLOCK - n))
    amax = padded.view(gn, BLOCK, gk, BLOCK).amax(dim=(1, 3)).clamp_min(2.0**-100)
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32).clamp(-127, 127)
    codes = (w * _expand((127 - e).to(torch.uint8).view(torch.float8_e8m0fnu), n, k)).to(torch.float8_e4m3fn)
    return codes, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
