"""torch._scaled_grouped_mm, FP8 rowwise, on SM90: the second real implementation (CUTLASS inside PyTorch).

E4M3 activations with one FP32 scale per row, E4M3 weights with one FP32 scale per output row (the
`fp8_rowwise` recipe), BF16 out; the experts' row blocks given as cumulative ``offs``, each padded to 16
rows. Accumulation: the library's own (docs/kernels.md#real-kernels).
"""

from __future__ import annotations

import torch

from ..fp8_moe import Fp8Operand
from .contiguous import pad_by_expert, scatter_rows
from .library import RealLibrary

ALIGN = 16


def _build(torch_module) -> dict:
    return {"version": torch_module.__version__, "cuda": torch_module.version.cuda,
            "git": getattr(torch_module.version, "git_version", None), "function": "torch._scaled_grouped_mm"}


TORCH_SCALED_GROUPED_MM = RealLibrary("PyTorch torch._scaled_grouped_mm", "torch", (9,), _build)


def scaled_grouped_gemm(a: Fp8Operand, w: Fp8Operand, counts: torch.Tensor) -> torch.Tensor:
    """`fp8_moe.Fp8Gemm` through torch._scaled_grouped_mm (rowwise scales): [S, N] BF16."""
    TORCH_SCALED_GROUPED_MM.require()
    padded = pad_by_expert(counts, ALIGN)
    codes = scatter_rows(a.codes, padded)
    scale_a = scatter_rows(a.scale.reshape(-1, 1), padded, fill=1.0).reshape(-1)
    e, n, _ = w.codes.shape
    out = torch._scaled_grouped_mm(codes, w.codes.transpose(-2, -1), scale_a, w.scale.reshape(e, n).contiguous(),
                                   offs=padded.ends, out_dtype=torch.bfloat16)
    return out[padded.index]
