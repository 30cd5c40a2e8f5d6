"""Triton kernels for the emulated FP4 recipes (docs/kernels.md#triton-kernels).

Same outputs as the PyTorch emulator (`emulator.MoEEmulation`), bit for bit, with the expert weights read
as packed E2M1 codes and UE8M0 bytes inside the kernels. Importing this package does not import Triton:
`dispatch` decides per call whether the Triton path runs, and only then loads `moe`.

Modules: `dispatch` (backend choice), `quantize` (activations to E2M1 codes), `fast` (the fast path: one
int8 GEMM over all of K for rows whose scales fit, with the SwiGLU / re-quantization and BF16 epilogues),
`gemm` (the per-block GEMMs on packed weights, for the other rows), `routing` (rows sorted by expert and
the tile schedule, one kernel), `certify` (which rows the per-block GEMMs compute exactly; the host
fallback for the rest), `moe` (the forward, step by step).
"""

from .dispatch import (  # noqa: F401
    BACKEND_ENV,
    available,
    backend,
    unavailable_reason,
    with_backend_choice,
)
