"""sgl-deep-gemm's mega-MoE kernels on SM100 (B200): the seed's W4A8 and W4A4 through the library's Python API.

sgl-deep-gemm >= 0.2.0 selects the numerics by ``mma_type``: ``fp8xfp4`` (W4A8: E4M3 activations, the
`w4a8` recipe) and ``mxf4xmxf4`` (W4A4 with ties-to-even input rounding, the `w4a4_te` recipe). The
checkpoint's FP4 experts go in as stored: E2M1 codes packed two per int8 (low nibble = even K), UE8M0
bytes packed four per int32 along K, [gate; up] rows; `transform_weights_for_mega_moe` interleaves gate
and up and lays the scales out for the tensor memory copy. One call: `mega_moe_pre_dispatch` (the input's
quantization and the routing into the symmetric buffer), then `fp8_fp4_mega_moe` (both GEMMs, SwiGLU with
the clamp, the combine). On one GPU the symmetric buffer lives in a one-rank process group.

No B200 is at hand: this path has run only against the stand-in of tests/standin_deep_gemm.py, which has
the API's signatures, checks what it is handed and computes the declared recipe.
"""

from __future__ import annotations

import torch

from ..emulator import experts_limit
from ..weights import fp4_weights
from .library import RealLibrary, sha256_of

MMA_TYPES = {"w4a8": "fp8xfp4", "w4a4_te": "mxf4xmxf4"}  # recipe -> the API's mma_type
TOKEN_ALIGN = 128  # the buffer's token capacity grows in these steps


def _build(dg) -> dict:
    from pathlib import Path

    package = Path(dg.__file__).parent
    so = next(iter(sorted(package.glob("_C*.so"))), None)
    return {"version": getattr(dg, "__version__", None), "c_module": str(so) if so else None,
            "c_module_sha256": sha256_of(so) if so else None}


SGL_DEEP_GEMM = RealLibrary("sgl-deep-gemm >= 0.2.0 (mega-MoE, SM100)", "deep_gemm", (10,), _build)


def library():
    """The loaded deep_gemm module (tests put the stand-in here)."""
    return SGL_DEEP_GEMM.load()


def pack_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes [..., K/32] -> int32 [..., K/128], four bytes per word, the first group in the low byte."""
    return scale.contiguous().view(torch.uint8).view(torch.int32)


def single_rank_group():
    """A one-rank process group for the symmetric buffer (created once)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    return dist.group.WORLD


class MegaMoE:
    """One experts module's weights in the kernel's layout, and the symmetric buffer its calls share."""

    def __init__(self, dg, module, mma_type: str):
        fp4 = fp4_weights(module)
        self.dg, self.mma_type = dg, mma_type
        self.experts, self.hidden, self.intermediate = fp4.num_experts, fp4.hidden, fp4.intermediate
        l1 = (fp4.w1.view(torch.int8), pack_scale_bytes(fp4.w1_scale))
        l2 = (fp4.w2.view(torch.int8), pack_scale_bytes(fp4.w2_scale))
        self.l1, self.l2 = dg.transform_weights_for_mega_moe(l1, l2, activation="swiglu", mma_type=mma_type)
        self.buffer, self.capacity = None, 0

    def symm_buffer(self, tokens: int, top_k: int):
        if self.buffer is None or tokens > self.capacity:
            self.capacity = -(-tokens // TOKEN_ALIGN) * TOKEN_ALIGN
            self.buffer = self.dg.get_symm_buffer_for_mega_moe(
                single_rank_group(), self.experts, self.capacity, top_k, self.hidden, self.intermediate,
                mma_type=self.mma_type, activation="swiglu")
        return self.buffer

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, limit) -> torch.Tensor:
        t, k = top_k_index.shape
        buffer = self.symm_buffer(t, k)
        # transformers marks an empty slot with index E, DeepGEMM with -1
        idx = torch.where(top_k_index >= self.experts, -1, top_k_index).to(torch.int64)
        self.dg.mega_moe_pre_dispatch(x.to(torch.bfloat16).contiguous(), idx, top_k_weights.to(torch.float32).contiguous(),
                                      buffer.x, buffer.x_sf, buffer.topk_idx, buffer.topk_weights,
                                      num_tokens=t, group_size=32, mma_type=self.mma_type)
        y = torch.empty(t, self.hidden, dtype=torch.bfloat16, device=x.device)
        self.dg.fp8_fp4_mega_moe(y, self.l1, self.l2, buffer, recipe=(1, 1, 32), activation="swiglu",
                                 activation_clamp=limit, fast_math=True)
        return y


def mega_moe_forward(recipe_name: str):
    """The transformers experts function of the mega-MoE kernel computing ``recipe_name``."""
    mma_type = MMA_TYPES[recipe_name]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        with torch.no_grad():
            key = ("_evalgate_mega_moe", mma_type)
            mega = self.__dict__.get(key)
            if mega is None:
                mega = self.__dict__[key] = MegaMoE(library(), self, mma_type)
            return mega(hidden_states, top_k_index, top_k_weights, experts_limit(self)).to(hidden_states.dtype)

    forward.__name__ = f"evalgate_mega_moe_{mma_type}_forward"
    return forward
