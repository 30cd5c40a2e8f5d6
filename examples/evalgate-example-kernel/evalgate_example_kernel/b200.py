"""The packed W4A4 mega-MoE kernel of a local sgl-deep-gemm build on a B200 (SM100).

No released sgl-deep-gemm ships the packed FP4 x FP4 kernel; a build of DeepGEMM PR #44 selects it with
``DG_MEGA_MOE_FP4=1`` (and ``DG_USE_FP4_ACTS=1``, without which it reads FP8-written activations as FP4:
docs/kernels.md#the-packed-fp4-hazard). Both are set here before the library is imported, and the call
goes through the mega-MoE API evalgate drives for its own SM100 kernels
(``evalgate.kernels.real.sm100_mega_moe.MegaMoE``: the weights transformed once per module, the
pre-dispatch, the fused kernel, a one-rank symmetric buffer). evalgate's capability check keeps this path
off machines without ``deep_gemm`` or an SM100 GPU.
"""

from __future__ import annotations

import os

import torch

ENVIRONMENT = {"DG_MEGA_MOE_FP4": "1", "DG_USE_FP4_ACTS": "1"}


def library():
    os.environ.update(ENVIRONMENT)  # read when deep_gemm builds its kernels
    import deep_gemm

    return deep_gemm


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    from evalgate.kernels.emulator import experts_limit
    from evalgate.kernels.real.sm100_mega_moe import MegaMoE

    with torch.no_grad():
        mega = module.__dict__.get("_example_packed_mega_moe")
        if mega is None:
            mega = module.__dict__["_example_packed_mega_moe"] = MegaMoE(library(), module, "mxf4xmxf4")
        return mega(hidden_states, top_k_index, top_k_weights, experts_limit(module)).to(hidden_states.dtype)
