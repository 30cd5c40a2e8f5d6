"""A test double of a real kernel that silently runs another GEMM: it loads DeepGEMM (so its identity is
recorded) but computes each expert's GEMM with a PyTorch FP32 matrix product of the dequantized operands,
as a wrapper that quietly falls back would. Its numbers are within DeepGEMM's tolerance of the recipe, so
conformance cannot tell; the execution witness (kernels/witness.py) must: no DeepGEMM kernel runs in the
MoE layers and a cuBLAS GEMM does.
"""

from __future__ import annotations

import torch

from ..fp8_moe import Fp8Operand
from .deepgemm_sm90 import DEEPGEMM_SM90


def fallback_gemm(a: Fp8Operand, w: Fp8Operand, counts: torch.Tensor) -> torch.Tensor:
    """`fp8_moe.Fp8Gemm` with torch.mm per expert (FP32 values of the E4M3 operands): [S, N] BF16."""
    DEEPGEMM_SM90.load()  # what a fallback wrapper does first; its GEMM never reaches the library
    out = torch.empty(a.codes.shape[0], w.codes.shape[1], dtype=torch.bfloat16, device=a.codes.device)
    values = a.values()
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = torch.mm(values[start:start + n], w.take(e).values().T).to(torch.bfloat16)
        start += n
    return out
