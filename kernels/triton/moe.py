"""The routed-experts forward on the Triton kernels: docs/kernels.md#the-moe-forward, the emulator's steps.

| step | where |
|---|---|
| 1 weights | packed codes + UE8M0 bytes read inside the GEMM kernels (no dequantized copy) |
| 2 input quantization | Triton (`quantize`); fault (b)'s misread FP8 bytes: torch |
| 3-6 L1 GEMM, BF16 round, clamp, SwiGLU, router weight, re-quantization | fast rows: one Triton kernel (`fast.l1_gemm`: int8 GEMM + epilogue, silu from a table of the emulator's own values); other rows: `gemm.int_gemm` per 32-block, the emulator's torch functions, `quantize` (uncertified rows on the host, `certify`) |
| 7 L2 GEMM, BF16 round | fast rows: `fast.l2_gemm` writes BF16 per (token, slot); other rows: `gemm.int_gemm` + torch |
| 8 combine | `combine_bf16`: the emulator's FP32 sum in slot order over the BF16-stored slot outputs |

Fault (c) (w * quantize(h): FP32 L2 input) runs every row on the per-block path (`gemm.f64_gemm` for L2).
Which rows take the fast path is decided per row before the GEMM (`fast.plan_rows`); the per-block path
runs SLOW_CHUNK_ROWS rows at a time, so no call holds an FP32 accumulator for all its rows. Both paths
compute RN_fp32 of the exact dot product (docs/kernels.md#accumulation), so a row's bits do not depend on
the path; `check.triton_layer_check` holds the whole forward against the emulator bit for bit.
"""

from __future__ import annotations

import torch

from .. import emulator, formats
from ..emulator import (
    ExpertRows,
    experts_limit,
    intermediate_sig,
    routed_scaling_factor,
)
from ..exact import SIG_BITS
from ..formats import EPILOGUE, SCALE_RULES, bf16_round
from ..recipe import Recipe
from ..weights import Fp4ExpertWeights, check_shapes, fp4_weights
from . import certify, fast
from .gemm import f64_gemm, int_gemm
from .quantize import LIMBS as CODE_LIMBS, UNIT_EXP, quantize_rows, twice_from_codes, values_from_codes

STATS = {"rows": 0, "host_rows": 0, "slow_rows": 0}  # rows through the GEMMs, those the per-block path and the host computed


class Operand:
    """One GEMM's activations: integer codes + bytes of a quantized format (int_gemm), or FP32 values
    (f64_gemm, fault (c) only)."""

    def __init__(self, fmt=None, q=None, q_bytes=None, hi=None, lo=None, values=None, sig=24):
        self.fmt, self.q, self.q_bytes, self.hi, self.lo, self.values, self.sig = fmt, q, q_bytes, hi, lo, values, sig

    @classmethod
    def quantized(cls, x, fmt, rule, ties="even"):
        return cls(fmt, *quantize_rows(x, fmt, rule, ties), sig=SIG_BITS[fmt])

    def fp32_rows(self, rows):
        if self.values is not None:
            return self.values[rows]
        return values_from_codes(self.q[:, rows], self.q_bytes[rows], self.fmt)


def input_operand(x_bf16: torch.Tensor, recipe: Recipe) -> Operand:
    """Step 2 (docs/kernels.md#the-moe-forward), per token."""
    rule = SCALE_RULES[recipe.input_scale_rule]
    if recipe.fault == "fp8_layout_read_as_packed_fp4":  # fault (b): the FP8 bytes read as packed FP4 (torch)
        t, h = x_bf16.shape
        codes, byte = formats.quantize(x_bf16.to(torch.float32), "e4m3", rule)
        as_read = formats.unpack_e2m1(codes.reshape(-1)[: t * h // 2].reshape(t, h // 2))
        q = twice_from_codes(as_read)
        nonzero = (q.view(t, -1, formats.GROUP) != 0).any(-1)
        b = byte.to(torch.int32)
        return Operand("e2m1", q[None], byte, torch.where(nonzero, b, -1).amax(-1),
                       torch.where(nonzero, b, 512).amin(-1), sig=SIG_BITS["e2m1"])
    return Operand.quantized(x_bf16, recipe.activations, rule, recipe.input_ties)


def intermediate_operand(acc: torch.Tensor, w: torch.Tensor, limit, recipe: Recipe) -> Operand:
    """Steps 4-6 on the L1 accumulator [S, 2I]: torch for the elementwise part, Triton for the codes."""
    g, u = emulator.gate_up_to_bf16(acc, limit)
    h = emulator.swiglu(g, u)
    if recipe.fault == "router_weight_after_requant":  # w * quantize(h): any FP32 values
        return Operand(values=emulator.weight_and_requantize(h, w, recipe), sig=intermediate_sig(recipe))
    return Operand.quantized(h * w[:, None], recipe.intermediate, EPILOGUE)


def grouped_gemm(op: Operand, a_row, fp4: Fp4ExpertWeights, which: int, expert: torch.Tensor, fault) -> torch.Tensor:
    """The per-block path: op's rows (a_row: the row of op for each output row; None: op's rows in order),
    sorted by `expert`, times W1 or W2 -> FP32 [rows, N]; rows the float64 certificate refuses are recomputed
    on the host."""
    w, w_bytes = (fp4.w1, fp4.w1_scale) if which == 1 else (fp4.w2, fp4.w2_scale)
    scale_fault = fault == "weight_scale_exponent_plus_one"
    w_range = certify.weight_ranges(fp4)[which - 1]
    k = w.shape[2] * 2
    counts = torch.bincount(expert, minlength=fp4.num_experts)
    if op.values is None:
        out = int_gemm(op.q, op.q_bytes, UNIT_EXP[op.fmt], a_row, w, w_bytes, counts, scale_fault)
        hi, lo = (op.hi, op.lo) if a_row is None else (op.hi[a_row], op.lo[a_row])
        ok = certify.int_rows_ok(hi, lo, op.fmt, w_range, expert, k, scale_fault)
    else:
        a = op.values if a_row is None else op.values[a_row]
        out = f64_gemm(op.values, a_row, w, w_bytes, counts, scale_fault)
        ok = certify.f64_rows_ok(a, op.sig, w_range, expert, scale_fault)
    if not bool(ok.all()):
        redo = (~ok).nonzero().flatten()
        src = redo if a_row is None else a_row[redo]
        out[redo] = certify.host_exact(op.fp32_rows(src), op.sig, fp4, which, expert[redo], fault)
        STATS["host_rows"] += redo.numel()
    return out


SLOW_CHUNK_ROWS = 2048  # rows per pass of the per-block path: bounds its FP32 temporaries (tests shrink it)


def _chunks(index: torch.Tensor):
    return index.split(SLOW_CHUNK_ROWS) if index.numel() else ()


def _per_block_layer(op, rows: ExpertRows, token, w, fp4, recipe, limit, slot) -> None:
    """Every row through the per-block path, SLOW_CHUNK_ROWS at a time (fault (c), whose L2 input is any
    FP32 value, takes this path)."""
    for chunk in _chunks(torch.arange(rows.rows.numel(), device=token.device)):
        expert = rows.expert[chunk]
        acc = grouped_gemm(op, token[chunk], fp4, 1, expert, recipe.fault)
        inter = intermediate_operand(acc, w[chunk], limit, recipe)
        del acc
        slot[rows.rows[chunk]] = grouped_gemm(inter, None, fp4, 2, expert, recipe.fault).to(torch.bfloat16)
    STATS["rows"] += 2 * rows.rows.numel()


def _fused_layer(op, rows: ExpertRows, token, w, fp4, recipe, limit, slot) -> None:
    """Both GEMMs with their epilogues: the fast path (`fast`) for the rows whose scales fit, the per-block
    path for the others; the intermediate lives only as codes + bytes."""
    s, i = rows.rows.numel(), fp4.intermediate
    fault = recipe.fault
    scale_fault = fault == "weight_scale_exponent_plus_one"
    force = fast.FORCE_SLOW_ROWS or certify.FORCE_HOST_ROWS
    b1, b2 = fast.column_bases(fp4)
    fmt2 = recipe.intermediate
    dev = token.device
    # L1 (steps 3-6) -> intermediate codes q2, bytes qb2, row byte ranges hi2 / lo2
    ok, p, limbs, slow = fast.plan_rows(op.hi[token], op.lo[token], op.fmt, b1, rows.expert, scale_fault,
                                        fp4.hidden, force)
    q2 = torch.empty(CODE_LIMBS[fmt2], s, i, dtype=torch.int8, device=dev)
    qb2 = torch.empty(s, i // formats.GROUP, dtype=torch.uint8, device=dev)
    hi2 = torch.full((s,), -1, dtype=torch.int32, device=dev)
    lo2 = torch.full((s,), 512, dtype=torch.int32, device=dev)
    if slow < s:
        a = fast.fold_rows(op.q, op.q_bytes, op.lo, op.fmt, limbs)
        fast.l1_gemm(a, token, p, ok, w, fp4, b1, rows.counts, scale_fault, fmt2, limit, q2, qb2, hi2, lo2)
        del a
    for chunk in _chunks((ok == 0).nonzero().flatten() if slow else torch.empty(0)):
        acc = grouped_gemm(op, token[chunk], fp4, 1, rows.expert[chunk], fault)
        g, u = emulator.gate_up_to_bf16(acc, limit)
        del acc
        cq, cb, chi, clo = quantize_rows(emulator.swiglu(g, u) * w[chunk][:, None], fmt2, EPILOGUE)
        q2[:, chunk], qb2[chunk], hi2[chunk], lo2[chunk] = cq, cb, chi, clo
    STATS["slow_rows"] += slow
    # L2 (step 7) -> BF16 slot outputs
    ok, p, limbs, slow = fast.plan_rows(hi2, lo2, fmt2, b2, rows.expert, scale_fault, i, force)
    if slow < s:
        a = fast.fold_rows(q2, qb2, lo2, fmt2, limbs)
        fast.l2_gemm(a, p, ok, rows.rows, fp4, b2, rows.counts, scale_fault, slot.view(torch.int16))
        del a
    inter = Operand(fmt2, q2, qb2, hi2, lo2, sig=SIG_BITS[fmt2])
    for chunk in _chunks((ok == 0).nonzero().flatten() if slow else torch.empty(0)):
        slot[rows.rows[chunk]] = grouped_gemm(inter, chunk.to(torch.int32), fp4, 2, rows.expert[chunk],
                                              fault).to(torch.bfloat16)
    STATS["rows"] += 2 * s
    STATS["slow_rows"] += slow


def combine_bf16(slot: torch.Tensor, skip_last_slot: bool = False) -> torch.Tensor:
    """`emulator.combine` on BF16-stored slot outputs [T, K, H]: the same FP32 sum in slot order 0..K-1."""
    k = slot.shape[1] - (1 if skip_last_slot else 0)
    acc = slot[:, 0].to(torch.float32)
    for s in range(1, k):
        acc += slot[:, s]
    return bf16_round(acc)


def moe_forward(x, top_k_index, top_k_weights, fp4: Fp4ExpertWeights, recipe: Recipe, limit,
                routed_scaling: float = 1.0) -> torch.Tensor:
    """One routed-experts forward [T, H] -> BF16-valued FP32 [T, H]; the same bits as
    `emulator.MoEEmulation(...).finish()` after running every expert."""
    rows = ExpertRows(x, top_k_index, top_k_weights, fp4.num_experts)
    t, k, h = rows.shape
    w = rows.w / float(routed_scaling) if recipe.routed_scaling == "unfused" else rows.w
    slot = torch.zeros(t * k, h, dtype=torch.bfloat16, device=x.device)  # step 7's BF16 per (token, slot)
    if rows.rows.numel():
        token = rows.token.to(torch.int32)
        op = input_operand(x.to(torch.bfloat16), recipe)
        layer = _per_block_layer if recipe.fault == "router_weight_after_requant" else _fused_layer
        layer(op, rows, token, w.contiguous(), fp4, recipe, limit, slot)
    y = combine_bf16(slot.view(t, k, h), skip_last_slot=recipe.fault == "drop_last_slot")
    if recipe.routed_scaling == "unfused":
        y = bf16_round(y * float(routed_scaling))
    return y


def triton_experts_forward(module, hidden_states, top_k_index, top_k_weights, recipe: Recipe):
    """The transformers experts function body on the Triton path (see `dispatch.with_backend_choice`)."""
    with torch.no_grad():
        fp4 = fp4_weights(module)
        check_shapes(fp4, hidden_states.shape[-1])
        y = moe_forward(hidden_states, top_k_index, top_k_weights, fp4, recipe, experts_limit(module),
                        routed_scaling_factor(module))
        return y.to(hidden_states.dtype)
