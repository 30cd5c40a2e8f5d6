"""The Triton kernel that dequantizes a dense FP8 linear's weight when a GPU forward reads it
(``model_adapters/canonical/fp8_linear.py``): one pass that reads each E4M3 code once and writes its BF16 value.

PyTorch's ops take three passes over FP32 temporaries (codes to FP32, times the broadcast scale, to BF16),
about 19 bytes of traffic a weight instead of 3; at batch 1 that dequantization was most of a released-layout
decoding step. The values are the same bits: code x 2^e is exact in FP32, and the one rounding to BF16 is
exact too (4 significant bits), so any order gives ``fp8_blocks.dequantize``'s result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from evalgate.kernels.fp8_blocks import BLOCK

ROWS, COLS = 16, 128  # a program's tile: one block's columns, a slice of its rows


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, out_ptr, N, K, GK, ROWS: tl.constexpr, COLS: tl.constexpr,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (r[:, None] < N) & (c[None, :] < K)
    at = r[:, None].to(tl.int64) * K + c[None, :]
    code = tl.load(codes_ptr + at, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + (r[:, None] // BLOCK) * GK + c[None, :] // BLOCK, mask=ok, other=0.0)
    tl.store(out_ptr + at, (code * scale).to(tl.bfloat16), mask=ok)


def dequantize_bf16(codes: torch.Tensor, scale_f32: torch.Tensor) -> torch.Tensor:
    """BF16 [N, K] from E4M3 ``codes`` [N, K] and FP32 powers of two ``scale_f32`` [ceil(N/128), ceil(K/128)],
    both contiguous on one GPU."""
    n, k = codes.shape
    out = torch.empty((n, k), dtype=torch.bfloat16, device=codes.device)
    grid = (triton.cdiv(n, ROWS), triton.cdiv(k, COLS))
    _dequantize_kernel[grid](codes, scale_f32, out, n, k, scale_f32.shape[1], ROWS=ROWS, COLS=COLS, BLOCK=BLOCK)
    return out
