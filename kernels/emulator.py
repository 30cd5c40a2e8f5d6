"""The emulated FP4 mega-MoE kernel: spec §3, step by step, vectorised over (token, slot) rows.

`experts_forward(recipe)` returns the function transformers calls for an experts module:

    fn(experts_module, hidden_states[T, H], top_k_index[T, K], top_k_weights[T, K]) -> [T, H]

It is one routed-experts forward of one MoE layer (no shared expert, which the model adds in BF16
outside the kernel, §3 step 9). A kernel engineer holds a real kernel's BF16 output against it with
`calc_diff` (§9): ``ALL_EXPERTS_FUNCTIONS["w4a4_packed"](experts, x, idx, w)``.

The work is split so that the layer-level check can share dequantized weights between kernels:
`MoEEmulation` quantizes the input and sorts rows by expert once; `run_chunk` computes the rows of a
contiguous range of experts with grouped matmuls (no Python loop over experts); `finish` combines.
"""

from __future__ import annotations

import contextlib

import torch

from . import formats
from .formats import EPILOGUE, SCALE_RULES, bf16_round
from .recipe import Recipe
from .weights import check_shapes, expert_chunks, fp4_weights

# --- exact FP32 matmuls -----------------------------------------------------------------------------


@contextlib.contextmanager
def exact_fp32_matmul():
    """TF32 off for the duration (§3 step 3: FP32 accumulation). CPU matmuls are FP32 already."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[g-1]:offs[g]] times w[g]^T: a [S, K], w [G, N, K] (out x in), offsets int32 [G]."""
    if a.shape[0] == 0:
        return a.new_zeros(0, w.shape[1])
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is not None:
        try:
            return fn(a, w.transpose(-2, -1), offs=offsets)
        except (RuntimeError, NotImplementedError):  # e.g. a CUDA build without FP32 grouped_mm
            pass
    return _padded_bmm(a, w, offsets)


def _padded_bmm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Fallback: scatter rows into a [G, max_rows, K] block, one bmm, gather back."""
    offsets = offsets.long()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(len(counts), device=a.device), counts)
    pos = torch.arange(a.shape[0], device=a.device) - (offsets - counts)[group]
    block = a.new_zeros(len(counts), int(counts.max()), a.shape[1])
    block[group, pos] = a
    return torch.bmm(block, w.transpose(-2, -1))[group, pos]


# --- the steps of §3 --------------------------------------------------------------------------------


def quantize_input(x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """§3 step 2: per token, groups of 32 along H, the pre-dispatch scale rule; FP32 out (exact)."""
    rule = SCALE_RULES[recipe.input_scale_rule]
    if recipe.fault == "fp8_layout_read_as_packed_fp4":
        return fp8_layout_read_as_packed_fp4(x, rule)
    if recipe.activations == "none":
        return x
    return formats.fake_quantize(x, recipe.activations, rule, ties=recipe.input_ties)


def fp8_layout_read_as_packed_fp4(x: torch.Tensor, rule) -> torch.Tensor:
    """Fault (b), a stand-in for the §5 interop hazard (`DG_MEGA_MOE_FP4=1` without `DG_USE_FP4_ACTS=1`):
    the pre-dispatch writes E4M3 activations, H bytes per token, but the packed kernel reads its own
    layout, H/2 bytes per token at stride H/2, and decodes each byte as two E2M1 nibbles (low first).
    So token t gets half of token t/2's FP8 bytes, as FP4 codes. Simplification: the scale bytes (FP8
    rule) and the routing are read from the right place; on hardware they are misread as well."""
    t, h = x.shape
    codes, scale = formats.quantize(x, "e4m3", rule)
    as_read = codes.reshape(-1)[: t * h // 2].reshape(t, h // 2)
    return formats.dequantize(formats.unpack_e2m1(as_read), scale, "e2m1")


def gate_up_to_bf16(acc: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """§3 step 4: round the L1 accumulator to BF16, then clamp gate from above only and up on both sides."""
    i = acc.shape[-1] // 2
    g, u = bf16_round(acc[..., :i]), bf16_round(acc[..., i:])
    if limit is not None and limit != float("inf"):
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return g, u


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """§3 step 5, FP32: silu = g / (1 + exp(-g)), then silu * u."""
    return (g / (1.0 + torch.exp(-g))) * u


def requantize_intermediate(v: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """§3 step 6: per (token, slot), groups of 32 intermediate columns, epilogue rule (no floor), RNE."""
    if recipe.intermediate == "none":
        return v
    return formats.fake_quantize(v, recipe.intermediate, EPILOGUE, ties="even")


def intermediate(acc: torch.Tensor, w: torch.Tensor, limit: float | None, recipe: Recipe) -> torch.Tensor:
    """Steps 4-6: L1 accumulator [S, 2I] and router weights [S] -> the L2 input [S, I] in FP32."""
    g, u = gate_up_to_bf16(acc, limit)
    return weight_and_requantize(swiglu(g, u), w, recipe)


def weight_and_requantize(h: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """§3 steps 5-6: the router weight goes in before the re-quantization: quantize(w * h) (T6)."""
    if recipe.fault == "router_weight_after_requant":  # fault (c): w * quantize(h), T6's wrong order
        return requantize_intermediate(h, recipe) * w[:, None]
    return requantize_intermediate(h * w[:, None], recipe)


def combine(slot_out: torch.Tensor, skip_last_slot: bool = False) -> torch.Tensor:
    """§3 step 8: y = bf16(sum over slots of float(o_k)), summed in FP32 in slot order 0..K-1.
    Empty slots hold +0.0, which leaves an FP32 sum unchanged. slot_out: [T, K, H] FP32."""
    k = slot_out.shape[1] - (1 if skip_last_slot else 0)  # fault (d) skips the last slot
    acc = slot_out[:, 0].clone()
    for s in range(1, k):  # K <= 8: a loop over slots, not experts; keeps the order explicit
        acc += slot_out[:, s]
    return bf16_round(acc)


# --- one layer's routed experts ---------------------------------------------------------------------


class MoEEmulation:
    """One emulated routed-experts forward, run in expert ranges. See the module docstring."""

    def __init__(self, x, top_k_index, top_k_weights, recipe: Recipe, num_experts: int, limit, routed_scaling_factor=1.0):
        self.recipe = recipe
        self.limit = limit
        self.rsf = float(routed_scaling_factor)
        t, k = top_k_index.shape
        self.shape = (t, k, x.shape[-1])
        w = top_k_weights.to(torch.float32)
        if recipe.routed_scaling == "unfused":  # SGLang: the kernel sees unscaled weights (§11.5)
            w = w / self.rsf
        xq = quantize_input(bf16_round(x.to(torch.float32)), recipe)  # the kernel's input is BF16
        flat_e = top_k_index.reshape(-1).long()
        valid = (flat_e >= 0) & (flat_e < num_experts)  # index E (HF) or -1 (DeepGEMM) = empty slot
        rows = torch.nonzero(valid).flatten()
        order = torch.argsort(flat_e[rows], stable=True)
        self.rows = rows[order]  # flat (token, slot) positions sorted by expert
        self.expert = flat_e[self.rows]
        self.counts = torch.bincount(self.expert, minlength=num_experts)
        self.starts = torch.cumsum(self.counts, 0) - self.counts
        self.a = xq[self.rows // k]  # L1 input rows, FP32
        self.w = w.reshape(-1)[self.rows]
        self.slot_out = x.new_zeros(t * k, x.shape[-1], dtype=torch.float32)

    @property
    def hit(self) -> torch.Tensor:
        return self.counts > 0

    def run_chunk(self, lo: int, hi: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Rows routed to experts lo..hi-1, with their FP32 weights w1 [n, 2I, H], w2 [n, H, I]."""
        begin = int(self.starts[lo])
        end = int(self.starts[hi - 1] + self.counts[hi - 1])
        if end == begin:
            return
        offsets = torch.cumsum(self.counts[lo:hi], 0).to(torch.int32)
        with exact_fp32_matmul():
            acc = grouped_matmul(self.a[begin:end], w1, offsets)  # §3 step 3
            v = intermediate(acc, self.w[begin:end], self.limit, self.recipe)  # steps 4-6
            o = bf16_round(grouped_matmul(v, w2, offsets))  # step 7
        self.slot_out[self.rows[begin:end]] = o

    def finish(self) -> torch.Tensor:
        t, k, h = self.shape
        y = combine(self.slot_out.view(t, k, h), skip_last_slot=self.recipe.fault == "drop_last_slot")
        if self.recipe.routed_scaling == "unfused":  # SGLang's y.mul_(1.5) on the BF16 output
            y = bf16_round(y * self.rsf)
        return y


def experts_limit(module) -> float | None:
    limit = getattr(module, "limit", None)
    return getattr(module, "swiglu_limit", None) if limit is None else limit


def routed_scaling_factor(module) -> float:
    return float(getattr(getattr(module, "config", None), "routed_scaling_factor", 1.0) or 1.0)


def weight_fault(recipe: Recipe) -> str | None:
    """The part of a fault that lives in the dequantized weights (only fault (a))."""
    return recipe.fault if recipe.fault == "weight_scale_exponent_plus_one" else None


def experts_forward(recipe: Recipe):
    """The transformers experts function for `recipe` (see the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            fp4 = fp4_weights(self)
            check_shapes(fp4, hidden_states.shape[-1])
            em = MoEEmulation(
                hidden_states, top_k_index, top_k_weights, recipe, fp4.num_experts,
                experts_limit(self), routed_scaling_factor(self),
            )
            for lo, hi, w1, w2 in expert_chunks(self, fp4, em.hit, weight_fault(recipe)):
                em.run_chunk(lo, hi, w1, w2)
            return em.finish().to(hidden_states.dtype)

    forward.__name__ = "evalgate_emulated_experts_forward"
    forward.recipe = recipe
    return forward
