"""The emulated kernels evalgate knows, registered on import (docs/kernels.md#kernels-at-a-glance and #selecting-a-real-kernel for names, versions, env).

Healthy kernels: `w4a8`, `w4a8_sglang`, `w4a4`, `w4a4_packed`, `w4a4_te`. Fault-injected kernels carry
the `faulty/` prefix and `faulty=True`; each names its healthy `twin`. None of them is ever a default.
"""

from __future__ import annotations

import torch

from .checkpoint import prepare_fp4_model
from .emulator import experts_forward
from .fp8_moe import Fp8Recipe, recipe_forward
from .recipe import Recipe
from .registry import Kernel, get_kernel, register_kernel

W4A8 = Recipe(activations="e4m3", intermediate="e4m3")
W4A8_SGLANG = Recipe(activations="e4m3", intermediate="e4m3", input_scale_rule="sglang_fp8")
# PR #27, PR #44, PyPI 0.1.0 and 0.1.7: the input quantizer rounds ties toward zero (docs/kernels.md#tie-modes).
W4A4 = Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1")
# sgl-deep-gemm >= 0.2.0: the input quantizer rounds ties to even (docs/kernels.md#tie-modes, docs/kernels.md#later-releases).
W4A4_TE = Recipe(activations="e2m1", input_ties="even", intermediate="e2m1")


def _emulated(name, version, description, recipe: Recipe, api=None, faulty=False, twin=None) -> Kernel:
    return register_kernel(
        Kernel(
            name=name,
            version=version,
            description=description,
            experts_forward=experts_forward(recipe),
            recipe=recipe.as_dict(),
            faulty=faulty,
            twin=twin,
            api=dict(api or {}),
            prepare_model=prepare_fp4_model,
        )
    )


_emulated(
    "w4a8", "sgl-deep-gemm 0.1.0 sm100_fp8_fp4_mega_moe (kUseFp4Acts=false)",
    "FP4 weights, FP8 E4M3 activations and intermediate (DeepGEMM 0.1.0 default; the baseline)",
    W4A8, api={"mma_type": "fp8xfp4"},
)
_emulated(
    "w4a8_sglang", "sglang JIT FP8 pre-dispatch + sgl-deep-gemm 0.1.0",
    "as w4a8, with SGLang's FP8 pre-dispatch scale rule (amax floor 1e-10)",
    W4A8_SGLANG, api={"mma_type": "fp8xfp4"},
)
_emulated(
    "w4a4", "DeepGEMM PR #27 (160e75b) sm100_fp8_fp4_mega_moe (kUseFp4Acts=true)",
    "FP4 weights, FP4 E2M1 activations (ties toward zero) and intermediate (W4A4-old)",
    W4A4,
)
# Spec docs/kernels.md#kernels-at-a-glance: W4A4-old and W4A4-packed are one function for the emulator; only identity differs.
_emulated(
    "w4a4_packed", "DeepGEMM PR #44 (e9d5329) sm100_fp4_mega_moe",
    "packed FP4xFP4 kernel: same numerics as w4a4 (kind::mxf4, K 64, packed smem)",
    W4A4,
)
_emulated(
    "w4a4_te", "sgl-deep-gemm >= 0.2.0 mma_type=mxf4xmxf4",
    "FP4 weights, FP4 activations with ties-to-even input rounding, FP4 intermediate",
    W4A4_TE, api={"mma_type": "mxf4xmxf4"},
)


def _faulty(suffix: str, fault: str, description: str) -> Kernel:
    recipe = Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1", fault=fault)
    return _emulated(
        f"faulty/w4a4_packed-{suffix}", "fault-injected (evalgate test double)",
        description, recipe, faulty=True, twin="w4a4_packed",
    )


_faulty("scale-exp", "weight_scale_exponent_plus_one",
        "w4a4_packed with one weight scale exponent +1 in one group of every row")
_faulty("fp8-layout", "fp8_layout_read_as_packed_fp4",
        "FP8-written activations read by the packed FP4 kernel (DG_MEGA_MOE_FP4 without DG_USE_FP4_ACTS)")
_faulty("weight-after-requant", "router_weight_after_requant",
        "w4a4_packed with the router weight applied after the intermediate re-quantization")
_faulty("drop-slot", "drop_last_slot",
        "w4a4_packed whose combine skips the last top-k slot (one expert output lost per token)")


# --- a fault confined to one expert (kernels/conformance.py holds every expert to its limit) ----------------

ONE_EXPERT = 1
ONE_EXPERT_FACTOR = 1 + 1 / 512


def _one_expert_fault(healthy):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        w = top_k_weights.to(torch.float32)  # the kernel computes in FP32 (a BF16 weight would round the factor away)
        return healthy(self, hidden_states, top_k_index, torch.where(top_k_index == ONE_EXPERT, w * ONE_EXPERT_FACTOR, w))

    forward.__name__ = "evalgate_one_expert_fault_forward"
    return forward


register_kernel(Kernel(
    name="faulty/w4a4_packed-one-expert", version="fault-injected (evalgate test double)",
    description=f"w4a4_packed with expert {ONE_EXPERT}'s router weight x (1 + 1/512) (one expert of all)",
    experts_forward=_one_expert_fault(get_kernel("w4a4_packed").experts_forward),
    recipe=Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1", fault="one_expert_router_weight").as_dict(),
    faulty=True, twin="w4a4_packed", prepare_model=prepare_fp4_model,
))


# --- FP8 grouped-GEMM recipes: the exact definitions of the SM90 real kernels (kernels/real/) ---------------

def _fp8_recipe(name: str, layout: str, real: str, description: str) -> Kernel:
    recipe = Fp8Recipe(layout)
    return register_kernel(Kernel(
        name=name, version=f"evalgate recipe: the exact definition of {real} (kernels/fp8_moe.py)",
        description=description, experts_forward=recipe_forward(recipe), recipe=recipe.as_dict(),
        prepare_model=prepare_fp4_model,
    ))


_fp8_recipe("fp8_block128", "block128", "deepgemm/fp8_block128",
            "FP8 grouped GEMM MoE: E4M3 activations per 1x128, weights per 128x128 block, exact accumulation")
_fp8_recipe("fp8_rowwise", "rowwise", "torch/fp8_rowwise",
            "FP8 grouped GEMM MoE: E4M3 activations and weights with one scale per row, exact accumulation")
