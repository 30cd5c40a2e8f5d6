"""FP8 grouped-GEMM MoE recipes: what the real SM90 kernels compute (docs/kernels.md#real-kernels).

The way SGLang runs DeepSeek experts on Hopper: the (token, slot) rows sorted by expert, two m-grouped FP8
GEMMs (E4M3 x E4M3, FP32 scales, BF16 out) around SwiGLU and the intermediate's re-quantization, the router
weight applied in the combine. Two layouts of the scales:

- ``block128``: activations one scale per 1x128 group along K, weights one per 128x128 block (DeepGEMM's
  ``m_grouped_fp8_fp4_gemm_nt_contiguous``, legacy 1D2D recipe);
- ``rowwise``: one scale per activation row and one per weight row (``torch._scaled_grouped_mm``).

Every scale is a power of two (UE8M0, RCEIL: docs/kernels.md#ue8m0-scales), so every product is exact and
the recipe's GEMM is RN_fp32 of the exact dot product (`exact.py`), then BF16. A real kernel computes the
same pipeline with its own GEMM (`Fp8Gemm`): the glue (quantization, SwiGLU, combine) is this module's, on
the same device, so the only difference left is inside the GEMM: the order and width of its accumulation.

Weights come from the FP4 checkpoint: E2M1 x 2^(byte-127) per 32 along K, re-encoded as E4M3 under one
power-of-two scale per block (or row), chosen by RCEIL from the block's amax (6 x 2^(top byte - 127) maps
to 384 <= 448). An element whose group byte is d below the block's top byte becomes e2m1 x 2^(6 - d): exact
for d <= 14 (0.5 x 2^-8 = 2^-9 is E4M3's smallest subnormal); further down it is rounded to nearest-even
on E4M3's subnormal grid, and to 0 below 2^-10. `Fp8Weights.inexact` counts such elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from . import formats
from .emulator import experts_limit, gate_up_to_bf16, swiglu
from .exact import SIG_BITS, GemmWeights, exact_matmul
from .formats import E4M3_MAX, PRE_DISPATCH, WEIGHTS, bf16_round, inverse_scale_from_byte, scale_from_byte
from .weights import fp4_weights

BLOCK = 128
EXACT_CHUNK = 16  # experts whose float64 weights the exact GEMM holds at once
LAYOUTS = ("block128", "rowwise")


@dataclass(frozen=True)
class Fp8Recipe:
    layout: str  # "block128" | "rowwise"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"fp8 recipe layout {self.layout!r}; expected one of {LAYOUTS}")

    def act_group(self, k: int) -> int:
        return BLOCK if self.layout == "block128" else k

    def weight_block(self, n: int, k: int) -> tuple[int, int]:
        return (BLOCK, BLOCK) if self.layout == "block128" else (1, k)

    def as_dict(self) -> dict:
        """The recipe as recorded in a Kernel and a run manifest (no ``group_size``: not an FP4 mega-MoE
        recipe, so its accumulation is its own, gate/compare.py)."""
        act = "1x128" if self.layout == "block128" else "1xK (per row)"
        weight = "128x128" if self.layout == "block128" else "1xK (per row)"
        return {
            "family": "fp8 grouped gemm moe", "layout": self.layout,
            "weights": f"e4m3, one power-of-two fp32 scale per {weight} block, converted from the FP4 checkpoint",
            "activations": f"e4m3 rne saturating, one ue8m0 rceil scale per {act} group (amax floor 1e-4)",
            "intermediate": f"silu(g)*u in fp32, then e4m3 per {act} group (ue8m0 rceil, no floor)",
            "gemm": "RN_fp32 of the exact dot product, then bf16", "router_weight": "in the combine, after L2",
            "combine": "fp32 sum of w_k * o_k in slot order, then bf16",
            "accumulation": "exact (the real kernel: its own order, docs/kernels.md#real-kernels)",
        }


@dataclass
class Fp8Operand:
    """E4M3 codes [..., N, K] (torch.float8_e4m3fn) and FP32 power-of-two scales [..., N/bn, K/bk]."""

    codes: torch.Tensor
    scale: torch.Tensor

    def take(self, index) -> "Fp8Operand":
        """Rows (or experts) ``index`` along dim 0; FP8 indexing goes through bytes (not every device
        indexes float8 tensors)."""
        return Fp8Operand(self.codes.view(torch.uint8)[index].view(torch.float8_e4m3fn), self.scale[index])

    def values(self) -> torch.Tensor:
        """The exact FP32 values (codes times their block's scale)."""
        n, k = self.codes.shape[-2:]
        bn, bk = n // self.scale.shape[-2], k // self.scale.shape[-1]
        s = self.scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)
        return self.codes.to(torch.float32) * s


class Fp8Gemm(Protocol):
    def __call__(self, a: Fp8Operand, w: Fp8Operand, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``a`` [S, K] sorted by expert (``counts`` rows per expert) times their expert's weights
        ``w`` [E, N, K]: [S, N] BF16."""


# --- quantization ------------------------------------------------------------------------------------


def quantize_blocks(x: torch.Tensor, bn: int, bk: int, rule) -> Fp8Operand:
    """x [..., N, K] FP32 -> E4M3 codes and one power-of-two scale per bn x bk block (RCEIL, ``rule``)."""
    *lead, n, k = x.shape
    blocks = x.reshape(*lead, n // bn, bn, k // bk, bk)
    byte = formats.ue8m0_bytes(blocks.abs().amax(dim=(-3, -1)), E4M3_MAX, rule)  # [..., N/bn, K/bk]
    inv = inverse_scale_from_byte(byte)[..., :, None, :, None]
    codes = (blocks * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(x.shape)
    return Fp8Operand(codes, scale_from_byte(byte))


def quantize_activations(x: torch.Tensor, group: int, floor: bool = True) -> Fp8Operand:
    """Rows [S, K] -> E4M3 per 1 x ``group``; the input's rule has DeepGEMM's 1e-4 amax floor, the
    intermediate's none."""
    return quantize_blocks(x.to(torch.float32), 1, group, PRE_DISPATCH if floor else formats.EPILOGUE)


@dataclass
class Fp8Weights:
    w1: Fp8Operand  # [E, 2I, H]
    w2: Fp8Operand  # [E, H, I]
    inexact: int  # weight elements the FP4 -> E4M3 conversion could not keep exactly
    elements: int


def convert_fp4_weights(module, recipe: Fp8Recipe, device) -> Fp8Weights:
    """The module's FP4 experts re-encoded for ``recipe`` (module docstring), cached per weight version."""
    fp4 = fp4_weights(module)
    key = (id(fp4), recipe.layout, str(device))
    cached = module.__dict__.get("_evalgate_fp8_weights")
    if cached is not None and cached[0] == key:
        return cached[1]
    parts, inexact, elements = [], 0, 0
    for lo in range(0, fp4.num_experts, 8):  # a few experts at a time: FP32 copies of all would not fit
        w1, w2 = (w.to(device) for w in fp4.dequantize(lo, min(lo + 8, fp4.num_experts)))
        pair = []
        for w in (w1, w2):
            q = quantize_blocks(w, *recipe.weight_block(*w.shape[-2:]), WEIGHTS)
            inexact += int((q.values() != w).sum())
            elements += w.numel()
            pair.append(q)
        parts.append(pair)
    cat = lambda i, f: torch.cat([getattr(p[i], f) for p in parts])  # noqa: E731
    weights = Fp8Weights(Fp8Operand(cat(0, "codes"), cat(0, "scale")), Fp8Operand(cat(1, "codes"), cat(1, "scale")),
                         inexact, elements)
    module.__dict__["_evalgate_fp8_weights"] = (key, weights)
    return weights


# --- the recipe's GEMM -------------------------------------------------------------------------------


def exact_gemm(a: Fp8Operand, w: Fp8Operand, counts: torch.Tensor) -> torch.Tensor:
    """The recipe's GEMM: RN_fp32 of the exact dot product (E4M3 x E4M3 products are exact), then BF16.
    Experts with rows, EXACT_CHUNK at a time (their float64 weights)."""
    out = torch.empty(a.codes.shape[0], w.codes.shape[1], dtype=torch.bfloat16, device=a.codes.device)
    ends = torch.cumsum(counts, 0).tolist()
    hit = torch.nonzero(counts).flatten().tolist()
    for c in range(0, len(hit), EXACT_CHUNK):
        experts = hit[c:c + EXACT_CHUNK]
        sub = w.take(torch.tensor(experts, device=w.codes.device))
        spans = [(ends[e] - int(counts[e]), ends[e]) for e in experts]
        rows = torch.cat([torch.arange(b, e, device=out.device) for b, e in spans])
        group = torch.repeat_interleave(torch.arange(len(experts), device=out.device),
                                        torch.tensor([e - b for b, e in spans], device=out.device))
        gw = GemmWeights.of(sub.values(), SIG_BITS["e4m3"], fp32=False)
        rows_a = a.take(rows)
        out[rows] = exact_matmul(rows_a.values(), SIG_BITS["e4m3"], gw, group, w_sig=SIG_BITS["e4m3"]).to(torch.bfloat16)
    return out


# --- the pipeline ------------------------------------------------------------------------------------


def fp8_moe_forward(module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    recipe: Fp8Recipe, gemm: Fp8Gemm, weights: Fp8Weights | None = None) -> torch.Tensor:
    """One routed-experts forward of ``recipe`` with ``gemm`` doing both GEMMs: [T, H] BF16."""
    weights = weights or convert_fp4_weights(module, recipe, x.device)
    num_experts = weights.w1.codes.shape[0]
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1).long()
    valid = torch.nonzero((flat >= 0) & (flat < num_experts)).flatten()
    rows = valid[torch.argsort(flat[valid], stable=True)]  # (token, slot) rows sorted by expert
    counts = torch.bincount(flat[rows], minlength=num_experts)
    xq = quantize_activations(bf16_round(x.to(torch.float32))[rows // k], recipe.act_group(x.shape[-1]))
    acc = gemm(xq, weights.w1, counts).to(torch.float32)  # L1: [S, 2I] BF16 values
    g, u = gate_up_to_bf16(acc, experts_limit(module))
    h = swiglu(g, u)
    o = gemm(quantize_activations(h, recipe.act_group(h.shape[-1]), floor=False), weights.w2, counts)
    slot = torch.zeros(t * k, x.shape[-1], dtype=torch.float32, device=x.device)
    slot[rows] = o.to(torch.float32) * top_k_weights.reshape(-1)[rows].to(torch.float32)[:, None]
    slot = slot.view(t, k, -1)
    y = slot[:, 0].clone()
    for s in range(1, k):  # slot order, FP32
        y += slot[:, s]
    return bf16_round(y).to(x.dtype)


def recipe_forward(recipe: Fp8Recipe, gemm: Fp8Gemm = exact_gemm, name: str = "evalgate_fp8_experts_forward") -> Callable:
    """The transformers experts function of ``recipe`` computed with ``gemm``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        with torch.no_grad():
            return fp8_moe_forward(self, hidden_states, top_k_index, top_k_weights, recipe, gemm)

    forward.__name__ = name
    return forward
