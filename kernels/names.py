"""Every kernel evalgate itself offers, declared once, without torch or transformers (as a package declares
its own kernels: kernels/contract.py).

The command line checks ``--kernel`` against these names before anything heavy loads (a typo answers in a
fraction of a second, not after the model), and the catalogs register exactly these declarations: they build
each kernel's experts function from its row here (bf16.py, catalog.py, real/catalog.py), so there is no
second list of names. Faults injected at a real kernel's boundary are named ``faulty/<real kernel>-<fault>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .recipe import Recipe

BF16 = "bf16"


@dataclass(frozen=True)
class Emulated:
    """An emulated FP4 kernel: evalgate's emulation of ``recipe`` (catalog.py)."""

    name: str
    version: str
    description: str
    recipe: Recipe
    api: tuple[tuple[str, str], ...] = ()


W4A8 = Recipe(activations="e4m3", intermediate="e4m3")
W4A8_SGLANG = Recipe(activations="e4m3", intermediate="e4m3", input_scale_rule="sglang_fp8")
# PR #27, PR #44, PyPI 0.1.0 and 0.1.7: the input quantizer rounds ties toward zero (docs/kernels.md#tie-modes).
W4A4 = Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1")
# sgl-deep-gemm >= 0.2.0: the input quantizer rounds ties to even (docs/kernels.md#tie-modes, docs/kernels.md#later-releases).
W4A4_TE = Recipe(activations="e2m1", input_ties="even", intermediate="e2m1")

EMULATED_KERNELS = (
    Emulated("w4a8", "sgl-deep-gemm 0.1.0 sm100_fp8_fp4_mega_moe (kUseFp4Acts=false)",
             "FP4 weights, FP8 E4M3 activations and intermediate (DeepGEMM 0.1.0 default; the baseline)",
             W4A8, (("mma_type", "fp8xfp4"),)),
    Emulated("w4a8_sglang", "sglang JIT FP8 pre-dispatch + sgl-deep-gemm 0.1.0",
             "as w4a8, with SGLang's FP8 pre-dispatch scale rule (amax floor 1e-10)",
             W4A8_SGLANG, (("mma_type", "fp8xfp4"),)),
    Emulated("w4a4", "DeepGEMM PR #27 (160e75b) sm100_fp8_fp4_mega_moe (kUseFp4Acts=true)",
             "FP4 weights, FP4 E2M1 activations (ties toward zero) and intermediate (W4A4-old)", W4A4),
    # Spec docs/kernels.md#kernels-at-a-glance: W4A4-old and W4A4-packed are one function for the emulator; only identity differs.
    Emulated("w4a4_packed", "DeepGEMM PR #44 (e9d5329) sm100_fp4_mega_moe",
             "packed FP4xFP4 kernel: same numerics as w4a4 (kind::mxf4, K 64, packed smem)", W4A4),
    Emulated("w4a4_te", "sgl-deep-gemm >= 0.2.0 mma_type=mxf4xmxf4",
             "FP4 weights, FP4 activations with ties-to-even input rounding, FP4 intermediate",
             W4A4_TE, (("mma_type", "mxf4xmxf4"),)),
)

# Fault-injected twins of w4a4_packed (catalog.py): suffix -> (the recipe's fault, description)
PACKED = "w4a4_packed"
PACKED_FAULTS = {
    "scale-exp": ("weight_scale_exponent_plus_one",
                  "w4a4_packed with one weight scale exponent +1 in one group of every row"),
    "fp8-layout": ("fp8_layout_read_as_packed_fp4",
                   "FP8-written activations read by the packed FP4 kernel (DG_MEGA_MOE_FP4 without DG_USE_FP4_ACTS)"),
    "weight-after-requant": ("router_weight_after_requant",
                             "w4a4_packed with the router weight applied after the intermediate re-quantization"),
    "drop-slot": ("drop_last_slot",
                  "w4a4_packed whose combine skips the last top-k slot (one expert output lost per token)"),
    "one-expert": ("one_expert_router_weight", None),  # described where its expert and factor are (catalog.py)
}


@dataclass(frozen=True)
class Real:
    """A kernel an external library computes, held against the emulated recipe it implements (real/catalog.py)."""

    name: str
    implements: str
    description: str
    faults: tuple[str, ...] = ()  # faults injected at its boundary (real/faults.py)


REAL_FAULTS = ("scale-layout", "swap-expert", "stale-scale")  # real/faults.py
FALLBACK = "fallback"  # runs torch.mm under the library's name: the execution witness's test double
# FP8 grouped-GEMM recipes (catalog.py): name -> (scale layout, the real kernel it defines, description)
FP8_RECIPES = {
    "fp8_block128": ("block128", "deepgemm/fp8_block128",
                     "FP8 grouped GEMM MoE: E4M3 activations per 1x128, weights per 128x128 block, exact accumulation"),
    "fp8_rowwise": ("rowwise", "torch/fp8_rowwise",
                    "FP8 grouped GEMM MoE: E4M3 activations and weights with one scale per row, exact accumulation"),
}
REAL_KERNELS = (
    Real("deepgemm/fp8_block128", "fp8_block128",
         "DeepGEMM m-grouped contiguous FP8 GEMMs (1x128 activations, 128x128 weight blocks) around SwiGLU, SM90",
         REAL_FAULTS + (FALLBACK,)),
    Real("torch/fp8_rowwise", "fp8_rowwise", "torch._scaled_grouped_mm FP8 rowwise GEMMs around SwiGLU, SM90",
         REAL_FAULTS),
    Real("sgl-deep-gemm/w4a8", "w4a8", "sgl-deep-gemm fp8_fp4_mega_moe, mma_type=fp8xfp4 (W4A8), SM100"),
    Real("sgl-deep-gemm/w4a4", "w4a4_te",
         "sgl-deep-gemm fp8_fp4_mega_moe, mma_type=mxf4xmxf4 (W4A4, input ties to even), SM100"),
)

EMULATED = (BF16,) + tuple(k.name for k in EMULATED_KERNELS) + tuple(FP8_RECIPES)
FAULTY_EMULATED = tuple(f"faulty/{PACKED}-{suffix}" for suffix in PACKED_FAULTS)
REAL = tuple(k.name for k in REAL_KERNELS)
FAULTY_REAL = tuple(f"faulty/{k.name}-{fault}" for k in REAL_KERNELS for fault in k.faults)

ALL = frozenset(EMULATED + FAULTY_EMULATED + REAL + FAULTY_REAL)


def listed_names() -> list[str]:
    """The names an error message offers: all but the faults of real kernels, which `evalgate kernels list`
    shows only where their library runs."""
    return sorted(ALL - set(FAULTY_REAL))
