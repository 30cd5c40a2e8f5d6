"""A stand-in for sgl-deep-gemm's mega-MoE Python API (0.2.x signatures), for the SM100 adapters' contract tests.

It has the real functions' signatures, checks every tensor it is handed (shape, dtype, contiguity, layout
and value range, and that the weights went through `transform_weights_for_mega_moe` with the buffer's
`mma_type`), lays the weights out as the transform documents (gate/up interleaved, scale rows transposed
per 128 for the tensor memory copy), and computes the declared recipe with evalgate's emulator after undoing
that layout. What it cannot stand for: the kernel's own arithmetic on a B200.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalgate.kernels.catalog import W4A4_TE, W4A8
from evalgate.kernels.check import Fp4ExpertsModule
from evalgate.kernels.emulator import experts_forward
from evalgate.kernels.weights import Fp4ExpertWeights

__version__ = "0.2.5+evalgate-standin"
RECIPES = {"fp8xfp4": W4A8, "mxf4xmxf4": W4A4_TE}
TOKEN_ALIGNMENT = 128
_TRANSFORMED: dict[int, str] = {}  # data_ptr of transformed weight data -> the mma_type it was laid out for
_BUFFERS: list = []  # the symmetric buffers handed out


class ContractError(AssertionError):
    """The caller broke the API's contract."""


def _expect(ok, message: str) -> None:
    if not ok:
        raise ContractError(message)


def _gate_up_order(n: int, mma_type: str) -> torch.Tensor:
    """Row i of the interleaved [gate; up] tensor is row order[i] of the plain one."""
    half = n // 2
    if mma_type == "fp8xfp4":  # 8 gate rows, then 8 up rows, ...
        gate, up = torch.arange(half).view(-1, 8), torch.arange(half, n).view(-1, 8)
        return torch.cat([gate, up], 1).flatten()
    gate, up = torch.arange(half).view(-1, 16), torch.arange(half, n).view(-1, 16)  # packed FP4: even, then odd rows
    return torch.cat([gate[:, 0::2], up[:, 0::2], gate[:, 1::2], up[:, 1::2]], 1).flatten()


def _utccp_order(mn: int) -> torch.Tensor:
    """Scale rows within each 128: four 32-row slices read column-wise."""
    return torch.arange(mn).view(-1, 4, 32).transpose(1, 2).flatten()


def _check_weight(data, sf, name: str) -> None:
    _expect(data.dtype == torch.int8 and data.dim() == 3 and data.is_contiguous(),
            f"{name} data: int8 [E, N, K/2] packed E2M1, contiguous; got {data.dtype} {tuple(data.shape)}")
    _expect(sf.dtype == torch.int32 and sf.dim() == 3 and sf.is_contiguous(),
            f"{name} scales: int32 [E, N, K/128] (four UE8M0 bytes each); got {sf.dtype} {tuple(sf.shape)}")
    e, n, half_k = data.shape
    _expect(tuple(sf.shape) == (e, n, half_k * 2 // 128), f"{name} scales {tuple(sf.shape)} do not match data {tuple(data.shape)}")
    _expect(n % 128 == 0 and (half_k * 2) % 128 == 0, f"{name}: N and K must be multiples of 128")
    _expect(not bool((sf.view(torch.uint8) == 255).any()), f"{name} scales hold UE8M0 byte 255 (NaN)")


def transform_weights_for_mega_moe(l1_weights, l2_weights, activation: str = "swiglu", mma_type: str = "fp8xfp4"):
    _expect(mma_type in RECIPES, f"mma_type {mma_type!r}: the stand-in has {sorted(RECIPES)}")
    _expect(activation == "swiglu", f"activation {activation!r}: DeepSeek experts use swiglu")
    _expect(isinstance(l1_weights, tuple) and isinstance(l2_weights, tuple), "FP4 weights come as (data, scales)")
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    _check_weight(w1, sf1, "l1")
    _check_weight(w2, sf2, "l2")
    _expect(w1.shape[2] * 2 == w2.shape[1] and w2.shape[2] * 4 == w1.shape[1] and w1.shape[0] == w2.shape[0],
            f"l1 {tuple(w1.shape)} and l2 {tuple(w2.shape)} are not [E, 2I, H/2] and [E, H, I/2]")
    order = _gate_up_order(w1.shape[1], mma_type).to(w1.device)
    l1 = (w1[:, order].contiguous(), sf1[:, order][:, _utccp_order(sf1.shape[1]).to(w1.device)].contiguous())
    l2 = (w2.clone(), sf2[:, _utccp_order(sf2.shape[1]).to(w2.device)].contiguous())
    for data in (l1[0], l2[0]):
        _TRANSFORMED[data.data_ptr()] = mma_type
    return l1, l2


@dataclass
class SymmBuffer:
    group: object
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    mma_type: str
    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int = 0


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, use_fp8_dispatch=None, mma_type: str = "fp8xfp4",
                                 activation: str = "swiglu") -> SymmBuffer:
    _expect(group.size() >= 1 and 0 <= group.rank() < group.size(), "a process group")
    _expect(mma_type in RECIPES and activation == "swiglu", f"mma_type {mma_type!r}, activation {activation!r}")
    _expect(hidden % 128 == 0 and intermediate_hidden % 128 == 0, "hidden and intermediate: multiples of 128")
    cap = -(-num_max_tokens_per_rank // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT
    # the stand-in keeps the BF16 input (it quantizes as the recipe says); the real buffer holds FP8 / FP4
    buffer = SymmBuffer(group, num_experts, cap, num_topk, hidden, intermediate_hidden, mma_type,
                        torch.zeros(cap, hidden, dtype=torch.bfloat16), torch.zeros(cap, hidden // 128, dtype=torch.int32),
                        torch.zeros(cap, num_topk, dtype=torch.int64), torch.zeros(cap, num_topk, dtype=torch.float32))
    _BUFFERS.append(buffer)
    return buffer


def mega_moe_pre_dispatch(x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens: int,
                          group_size: int = 32, mma_type: str = "fp8xfp4", buf_x_scales=None, expert_scales=None) -> None:
    buffer = _buffer_of(buf_x)
    _expect(buf_x_sf is buffer.x_sf and buf_topk_idx is buffer.topk_idx and buf_topk_weights is buffer.topk_weights,
            "the buffer views must be the symmetric buffer's own")
    _expect(mma_type == buffer.mma_type, f"pre-dispatch mma_type {mma_type!r} vs the buffer's {buffer.mma_type!r}")
    _expect(group_size == 32, f"group_size {group_size}: the recipes quantize per 32")
    t, h = x.shape
    _expect(x.dtype == torch.bfloat16 and x.is_contiguous() and h == buffer.hidden, f"x: BF16 [T, {buffer.hidden}]")
    _expect(t == num_tokens <= buffer.num_max_tokens_per_rank, f"{num_tokens} tokens, buffer holds {buffer.num_max_tokens_per_rank}")
    _expect(bool(torch.isfinite(x).all()), "x holds a non-finite value")
    _expect(topk_idx.dtype == torch.int64 and tuple(topk_idx.shape) == (t, buffer.num_topk), "topk_idx: int64 [T, K]")
    _expect(bool(((topk_idx >= -1) & (topk_idx < buffer.num_experts)).all()), "topk_idx outside [-1, E)")
    routed = [[e for e in row if e >= 0] for row in topk_idx.tolist()]
    _expect(all(len(set(r)) == len(r) for r in routed), "a token routed twice to one expert")
    _expect(topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape, "topk_weights: FP32 [T, K]")
    _expect(bool(torch.isfinite(topk_weights).all() and (topk_weights >= 0).all()), "topk_weights: finite, >= 0")
    buffer.x[:t], buffer.topk_idx[:t], buffer.topk_weights[:t] = x, topk_idx, topk_weights
    buffer.num_tokens = t


def _buffer_of(buf_x) -> SymmBuffer:
    for b in _BUFFERS:
        if b.x is buf_x:
            return b
    raise ContractError("buf_x is not a symmetric buffer's x")


def _untransformed(l1, l2, mma_type: str) -> Fp4ExpertWeights:
    (w1, sf1), (w2, sf2) = l1, l2
    back = torch.argsort(_gate_up_order(w1.shape[1], mma_type))
    sf1 = sf1[:, torch.argsort(_utccp_order(sf1.shape[1]))][:, back]
    sf2 = sf2[:, torch.argsort(_utccp_order(sf2.shape[1]))]
    return Fp4ExpertWeights(w1[:, back].contiguous(), sf1.contiguous().view(torch.uint8),
                            w2.contiguous(), sf2.contiguous().view(torch.uint8), source="checkpoint")


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer: SymmBuffer, shared_l1_weights=None, shared_l2_weights=None,
                     cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32), activation: str = "swiglu",
                     activation_clamp=None, fast_math: bool = True, **rest) -> None:
    mma = sym_buffer.mma_type
    for name, w in (("l1", l1_weights), ("l2", l2_weights)):
        _expect(_TRANSFORMED.get(w[0].data_ptr()) == mma,
                f"{name} weights were not laid out by transform_weights_for_mega_moe(mma_type={mma!r})")
    _expect(shared_l1_weights is None and shared_l2_weights is None, "fused shared experts are not evalgate's recipe")
    _expect(tuple(recipe) == (1, 1, 32), f"recipe {recipe}: one scale per 32 along K")
    _expect(activation == "swiglu" and activation_clamp is not None and activation_clamp > 0, "swiglu with its clamp")
    t = sym_buffer.num_tokens
    _expect(y.dtype == torch.bfloat16 and tuple(y.shape) == (t, sym_buffer.hidden) and y.is_contiguous(), "y: BF16 [T, H]")
    weights = _untransformed(l1_weights, l2_weights, mma)
    _expect(weights.hidden == sym_buffer.hidden and weights.intermediate == sym_buffer.intermediate_hidden,
            "the weights' shapes and the buffer's differ")
    module = Fp4ExpertsModule(weights, float(activation_clamp), y.device)
    idx = sym_buffer.topk_idx[:t]
    idx = torch.where(idx < 0, sym_buffer.num_experts, idx)  # the emulator's empty slot
    y.copy_(experts_forward(RECIPES[mma])(module, sym_buffer.x[:t], idx, sym_buffer.topk_weights[:t]))
