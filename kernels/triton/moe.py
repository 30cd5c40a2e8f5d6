"""The routed-experts forward on the Triton kernels: docs/kernels.md#the-moe-forward, the emulator's steps.

| step | where |
|---|---|
| 1 weights | packed codes + UE8M0 bytes read inside the GEMM kernels (no dequantized copy) |
| 2 input quantization | Triton (`quantize`); fault (b)'s misread FP8 bytes: torch |
| 3 L1 GEMM, 7 L2 GEMM | Triton (`gemm`), exact; uncertified rows on the host (`certify`) |
| 4-6 BF16 round, clamp, SwiGLU, router weight | the emulator's own torch functions (correctly rounded exp) |
| 6 intermediate re-quantization | Triton; fault (c)'s w * quantize(h): torch |
| 8 combine | the emulator's `combine` (torch) |

The torch steps are the emulator's functions themselves, so the two backends share them by construction;
the Triton steps are checked against the emulator bit for bit (`check.triton_layer_check`).
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
from . import certify
from .gemm import f64_gemm, int_gemm
from .quantize import UNIT_EXP, quantize_rows, twice_from_codes, values_from_codes

STATS = {"rows": 0, "host_rows": 0}  # rows through the GEMMs, and those the host recomputed (benchmarks, tests)


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


def grouped_gemm(op: Operand, a_row, fp4: Fp4ExpertWeights, which: int, rows: ExpertRows, fault) -> torch.Tensor:
    """op's rows (a_row: the token of each sorted row; None: op is in sorted order) times W1 or W2."""
    w, w_bytes = (fp4.w1, fp4.w1_scale) if which == 1 else (fp4.w2, fp4.w2_scale)
    scale_fault = fault == "weight_scale_exponent_plus_one"
    w_range = certify.weight_ranges(fp4)[which - 1]
    k = w.shape[2] * 2
    if op.values is None:
        out = int_gemm(op.q, op.q_bytes, UNIT_EXP[op.fmt], a_row, w, w_bytes, rows.counts, scale_fault)
        hi, lo = (op.hi, op.lo) if a_row is None else (op.hi[a_row], op.lo[a_row])
        ok = certify.int_rows_ok(hi, lo, op.fmt, w_range, rows.expert, k, scale_fault)
    else:
        a = op.values if a_row is None else op.values[a_row]
        out = f64_gemm(op.values, a_row, w, w_bytes, rows.counts, scale_fault)
        ok = certify.f64_rows_ok(a, op.sig, w_range, rows.expert, scale_fault)
    STATS["rows"] += out.shape[0]
    if not bool(ok.all()):
        redo = (~ok).nonzero().flatten()
        src = redo if a_row is None else a_row[redo]
        out[redo] = certify.host_exact(op.fp32_rows(src), op.sig, fp4, which, rows.expert[redo], fault)
        STATS["host_rows"] += redo.numel()
    return out


def moe_forward(x, top_k_index, top_k_weights, fp4: Fp4ExpertWeights, recipe: Recipe, limit,
                routed_scaling: float = 1.0) -> torch.Tensor:
    """One routed-experts forward [T, H] -> BF16-valued FP32 [T, H]; the same bits as
    `emulator.MoEEmulation(...).finish()` after running every expert."""
    rows = ExpertRows(x, top_k_index, top_k_weights, fp4.num_experts)
    t, k, h = rows.shape
    w = rows.w / float(routed_scaling) if recipe.routed_scaling == "unfused" else rows.w
    fault = recipe.fault
    slot_out = torch.zeros(t * k, h, dtype=torch.float32, device=x.device)
    if rows.rows.numel():
        token = rows.token.to(torch.int32)
        acc = grouped_gemm(input_operand(x.to(torch.bfloat16), recipe), token, fp4, 1, rows, fault)
        out = grouped_gemm(intermediate_operand(acc, w, limit, recipe), None, fp4, 2, rows, fault)
        slot_out[rows.rows] = bf16_round(out)
    y = emulator.combine(slot_out.view(t, k, h), skip_last_slot=fault == "drop_last_slot")
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
