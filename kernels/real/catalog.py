"""The real kernels evalgate can run in-process, registered beside the emulated ones from their declarations in
names.py (docs/kernels.md#real-kernels).

Each is named after its library, names the emulated recipe it must compute (`implements`), carries the
tolerance measured against that recipe on the hardware, and records its library's identity with its
conformance. Faults injected at a real kernel's boundary (`faults.py`) are listed only where the library
can run.
"""

from __future__ import annotations

import torch

from .. import names
from ..checkpoint import prepare_fp4_model
from ..fp8_moe import Fp8Recipe, convert_fp4_weights, fp8_moe_forward
from ..recipe import LibraryCall
from ..registry import Kernel, register_kernel
from ..tolerance import Tolerance
from .deepgemm_sm90 import DEEPGEMM_SM90, deepgemm_gemm
from .fallback import fallback_gemm
from .faults import DESCRIPTIONS, FAULTS
from .library import RealLibrary
from .sm100_mega_moe import MMA_TYPES, SGL_DEEP_GEMM, mega_moe_forward
from .torch_grouped import TORCH_SCALED_GROUPED_MM, scaled_grouped_gemm

# Four times the worst measured on one H200 (docs/kernels.md#real-kernels): one DSV4-Flash layer, 512
# tokens (`python benchmarks/bench_real_kernels.py --steps dsv4`): worst expert / worst token calc_diff
# 2.97e-5 / 5.40e-5 for DeepGEMM, 5.83e-5 / 7.83e-5 for torch._scaled_grouped_mm.
DEEPGEMM_TOLERANCE = Tolerance(expert_calc_diff=1.2e-4, token_calc_diff=1.2e-3,
                               measured="4x the worst expert / token calc_diff on an H200, DSV4-Flash layer, 512 tokens")
ROWWISE_TOLERANCE = Tolerance(expert_calc_diff=2.4e-4, token_calc_diff=1.2e-3,
                              measured="4x the worst expert / token calc_diff on an H200, DSV4-Flash layer, 512 tokens")


def real_forward(recipe: Fp8Recipe, gemm, fault=None):
    """The transformers experts function: the recipe's pipeline with the library's GEMM, weights (after
    ``fault``, if any) converted once per module."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        with torch.no_grad():
            weights = convert_fp4_weights(self, recipe, hidden_states.device)
            if fault is not None:
                key = (id(weights), fault.__name__)
                cached = self.__dict__.get("_evalgate_faulty_fp8_weights")
                if cached is None or cached[0] != key:
                    cached = (key, fault(weights))
                    self.__dict__["_evalgate_faulty_fp8_weights"] = cached
                weights = cached[1]
            return fp8_moe_forward(self, hidden_states, top_k_index, top_k_weights, recipe, gemm, weights)

    forward.__name__ = "evalgate_real_experts_forward"
    return forward


def _prepare(library: RealLibrary):
    def prepare(model, path) -> None:
        library.require()  # one line, exit 2, before anything is generated
        prepare_fp4_model(model, path)
    return prepare


def _real(name: str, implements: str, layout: str, gemm, library: RealLibrary, tolerance: Tolerance,
          description: str, faults: tuple[str, ...]) -> None:
    recipe = Fp8Recipe(layout)
    common = dict(declared=recipe, implements=implements, library=library, tolerance=tolerance,
                  prepare_model=_prepare(library))
    register_kernel(Kernel(name=name, version=library.name, description=description,
                           experts_forward=real_forward(recipe, gemm), **common))
    for suffix in faults:
        if suffix == names.FALLBACK:  # the execution witness's test double (kernels/witness.py)
            register_kernel(Kernel(name=f"faulty/{name}-{suffix}", version=f"{library.name}, fault-injected",
                                   description=f"{name} that silently computes its GEMMs with torch.mm instead",
                                   experts_forward=real_forward(recipe, fallback_gemm), faulty=True, twin=name,
                                   **common))
            continue
        register_kernel(Kernel(name=f"faulty/{name}-{suffix}", version=f"{library.name}, fault-injected",
                               description=f"{name} with {DESCRIPTIONS[suffix]}",
                               experts_forward=real_forward(recipe, gemm, FAULTS[suffix]), faulty=True, twin=name,
                               **common))


# What runs each real kernel that names.REAL_KERNELS declares: SM90 (layout, GEMM, library, tolerance), SM100 mma
SM90 = {"deepgemm/fp8_block128": ("block128", deepgemm_gemm, DEEPGEMM_SM90, DEEPGEMM_TOLERANCE),
        "torch/fp8_rowwise": ("rowwise", scaled_grouped_gemm, TORCH_SCALED_GROUPED_MM, ROWWISE_TOLERANCE)}
# SM100 (B200): the seed's mega-MoE kernels through sgl-deep-gemm's API, run here only against the stand-in of
# tests/standin_deep_gemm.py. W4A4's FP4 x FP4 sums are exact: bit-identity. W4A8 is not measured on SM100:
# it carries the SM90 FP8 kernel's limits until a B200 measures its own.
SM100_TOLERANCE = {"w4a8": DEEPGEMM_TOLERANCE, "w4a4_te": None}


def _sm100(k: names.Real) -> None:
    mma_type = MMA_TYPES[k.implements]
    what = k.description.removeprefix("sgl-deep-gemm ").removesuffix(", SM100")
    register_kernel(Kernel(
        name=k.name, version=SGL_DEEP_GEMM.name, description=k.description,
        experts_forward=mega_moe_forward(k.implements), declared=LibraryCall(k.implements, what),
        implements=k.implements, library=SGL_DEEP_GEMM, tolerance=SM100_TOLERANCE[k.implements],
        prepare_model=_prepare(SGL_DEEP_GEMM), api={"mma_type": mma_type}))


for _k in names.REAL_KERNELS:
    if _k.name in SM90:
        _real(_k.name, _k.implements, *SM90[_k.name], _k.description, _k.faults)
    else:
        _sm100(_k)
