"""DeepGEMM's m-grouped contiguous FP8 GEMM on SM90 (sgl-project/DeepGEMM release/v0.1.2, built from source).

``m_grouped_fp8_fp4_gemm_nt_contiguous`` with the legacy 1D2D recipe: E4M3 activations with one FP32 scale
per 1x128 group, E4M3 weights with one FP32 scale per 128x128 block, BF16 out; each expert's rows padded to
DeepGEMM's M alignment, padding rows marked -1. The tensor cores sum each 128-K block in their own
precision; the kernel adds the scaled block sums in FP32 (docs/kernels.md#real-kernels).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..fp8_moe import Fp8Operand
from .contiguous import pad_by_expert, scatter_rows
from .library import RealLibrary, sha256_of


def _build(dg) -> dict:
    package = Path(dg.__file__).parent
    source = package.parent / "EVALGATE_SOURCE"  # written when the sources were packed: repository, branch, commit
    return {"version": getattr(dg, "__version__", None),
            "source": source.read_text().strip() if source.exists() else None,
            "c_module": str(package / "_C.so"), "c_module_sha256": sha256_of(package / "_C.so")}


DEEPGEMM_SM90 = RealLibrary("DeepGEMM (sgl-project/DeepGEMM release/v0.1.2)", "deep_gemm", (9,), _build)


def deepgemm_gemm(a: Fp8Operand, w: Fp8Operand, counts: torch.Tensor) -> torch.Tensor:
    """`fp8_moe.Fp8Gemm` through DeepGEMM: [S, N] BF16."""
    dg = DEEPGEMM_SM90.load()
    padded = pad_by_expert(counts, int(dg.get_mk_alignment_for_contiguous_layout()))
    codes = scatter_rows(a.codes, padded)
    scale = scatter_rows(a.scale, padded, fill=1.0)
    out = torch.empty(padded.rows, w.codes.shape[1], dtype=torch.bfloat16, device=codes.device)
    dg.m_grouped_fp8_fp4_gemm_nt_contiguous((codes, scale), (w.codes.contiguous(), w.scale.contiguous()), out,
                                            padded.expert, disable_ue8m0_cast=True)
    return out[padded.index]
