"""The emulated FP4 mega-MoE kernel: spec docs/kernels.md#the-moe-forward, step by step, vectorised over (token, slot) rows.

`experts_forward(recipe)` returns the function transformers calls for an experts module:

    fn(experts_module, hidden_states[T, H], top_k_index[T, K], top_k_weights[T, K]) -> [T, H]

It is one routed-experts forward of one MoE layer (no shared expert, which the model adds in BF16
outside the kernel, docs/kernels.md#the-moe-forward step 9). A kernel engineer holds a real kernel's BF16 output against it with
`calc_diff` (docs/kernels.md#checking-a-real-kernel): ``ALL_EXPERTS_FUNCTIONS["w4a4_packed"](experts, x, idx, w)``.

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
    """TF32 off for the duration (docs/kernels.md#the-moe-forward step 3: FP32 accumulation). CPU matmuls are FP32 already."""
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
    """Rows a[offs[g-1]:offs[g]] times w[g]^T: a [S, K], w [G, N, K] (out x in), offsets int32 [G].

    Row-major w (as dequantized) goes through one padded bmm, which BLAS reads transposed without a
    copy; w stored in-major (`weights.in_major`) through torch's grouped_mm. On CPU grouped_mm copies a
    row-major weight on every call (~3x slower). Both accumulate in FP32; their summation orders may
    differ at FP32 rounding level (spec docs/kernels.md#the-moe-forward step 3 allows it)."""
    if a.shape[0] == 0:
        return a.new_zeros(0, w.shape[1])
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is not None and w.transpose(-2, -1).is_contiguous():
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


# --- the steps of docs/kernels.md#the-moe-forward --------------------------------------------------------------------------------


def quantize_input(x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """docs/kernels.md#the-moe-forward step 2: per token, groups of 32 along H, the pre-dispatch scale rule; FP32 out (exact)."""
    rule = SCALE_RULES[recipe.input_scale_rule]
    if recipe.fault == "fp8_layout_read_as_packed_fp4":
        return fp8_layout_read_as_packed_fp4(x, rule)
    if recipe.activations == "none":
        return x
    return formats.fake_quantize(x, recipe.activations, rule, ties=recipe.input_ties)


def fp8_layout_read_as_packed_fp4(x: torch.Tensor, rule) -> torch.Tensor:
    """Fault (b), a stand-in for the docs/kernels.md#the-packed-fp4-hazard interop hazard (`DG_MEGA_MOE_FP4=1` without `DG_USE_FP4_ACTS=1`):
    the pre-dispatch writes E4M3 activations, H bytes per token, but the packed kernel reads its own
    layout, H/2 bytes per token at stride H/2, and decodes each byte as two E2M1 nibbles (low first).
    So token t gets half of token t/2's FP8 bytes, as FP4 codes. Simplification: the scale bytes (FP8
    rule) and the routing are read from the right place; on hardware they are misread as well."""
    t, h = x.shape
    codes, scale = formats.quantize(x, "e4m3", rule)
    as_read = codes.reshape(-1)[: t * h // 2].reshape(t, h // 2)
    return formats.dequantize(formats.unpack_e2m1(as_read), scale, "e2m1")


def gate_up_to_bf16(acc: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/kernels.md#the-moe-forward step 4: round the L1 accumulator to BF16, then clamp gate from above only and up on both sides."""
    i = acc.shape[-1] // 2
    g, u = bf16_round(acc[..., :i]), bf16_round(acc[..., i:])
    if limit is not None and limit != float("inf"):
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return g, u


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """docs/kernels.md#the-moe-forward step 5, FP32: silu = g / (1 + exp(-g)), then silu * u."""
    return (g / (1.0 + torch.exp(-g))) * u


def requantize_intermediate(v: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """docs/kernels.md#the-moe-forward step 6: per (token, slot), groups of 32 intermediate columns, epilogue rule (no floor), RNE."""
    if recipe.intermediate == "none":
        return v
    return formats.fake_quantize(v, recipe.intermediate, EPILOGUE, ties="even")


def intermediate(acc: torch.Tensor, w: torch.Tensor, limit: float | None, recipe: Recipe) -> torch.Tensor:
    """Steps 4-6: L1 accumulator [S, 2I] and router weights [S] -> the L2 input [S, I] in FP32."""
    g, u = gate_up_to_bf16(acc, limit)
    return weight_and_requantize(swiglu(g, u), w, recipe)


def weight_and_requantize(h: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """docs/kernels.md#the-moe-forward steps 5-6: the router weight goes in before the re-quantization: quantize(w * h) (T6)."""
    if recipe.fault == "router_weight_after_requant":  # fault (c): w * quantize(h), T6's wrong order
        return requantize_intermediate(h, recipe) * w[:, None]
    return requantize_intermediate(h * w[:, None], recipe)


def combine(slot_out: torch.Tensor, skip_last_slot: bool = False) -> torch.Tensor:
    """docs/kernels.md#the-moe-forward step 8: y = bf16(sum over slots of float(o_k)), summed in FP32 in slot order 0..K-1.
    Empty slots hold +0.0, which leaves an FP32 sum unchanged. slot_out: [T, K, H] FP32."""
    k = slot_out.shape[1] - (1 if skip_last_slot else 0)  # fault (d) skips the last slot
    acc = slot_out[:, 0].clone()
    for s in range(1, k):  # K <= 8: a loop over slots, not experts; keeps the order explicit
        acc += slot_out[:, s]
    return bf16_round(acc)


# --- one layer's routed experts ---------------------------------------------------------------------


class ExpertRows:
    """The (token, slot) rows of one layer call, sorted by expert, and the stages a chunk of experts goes
    through: `l1_input` -> L1 GEMM -> `l2_input` -> L2 GEMM -> `store`. Subclasses define the stages."""

    def __init__(self, x, top_k_index, top_k_weights, num_experts):
        t, k = top_k_index.shape
        self.shape = (t, k, x.shape[-1])
        flat_e = top_k_index.reshape(-1).long()
        valid = (flat_e >= 0) & (flat_e < num_experts)  # index E (HF) or -1 (DeepGEMM) = empty slot
        rows = torch.nonzero(valid).flatten()
        self.rows = rows[torch.argsort(flat_e[rows], stable=True)]  # flat (token, slot), by expert
        self.expert = flat_e[self.rows]
        self.token = self.rows // k
        self.counts = torch.bincount(self.expert, minlength=num_experts)
        self.starts = torch.cumsum(self.counts, 0) - self.counts
        self.w = top_k_weights.reshape(-1)[self.rows].to(torch.float32)

    @property
    def hit(self) -> torch.Tensor:
        return self.counts > 0

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Rows [begin, end) of experts lo..hi-1."""
        return int(self.starts[lo]), int(self.starts[hi - 1] + self.counts[hi - 1])

    def run_chunk(self, lo: int, hi: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Rows routed to experts lo..hi-1, with their FP32 weights w1 [n, 2I, H], w2 [n, H, I]."""
        begin, end = self.span(lo, hi)
        if end == begin:
            return
        offsets = torch.cumsum(self.counts[lo:hi], 0).to(torch.int32)
        with exact_fp32_matmul():
            acc = grouped_matmul(self.l1_input(begin, end), w1, offsets)
            self.store(begin, end, grouped_matmul(self.l2_input(begin, end, acc), w2, offsets))


class MoEEmulation(ExpertRows):
    """One emulated routed-experts forward, run in expert ranges. See the module docstring."""

    def __init__(self, x, top_k_index, top_k_weights, recipe: Recipe, num_experts: int, limit, routed_scaling_factor=1.0):
        super().__init__(x, top_k_index, top_k_weights, num_experts)
        self.recipe = recipe
        self.limit = limit
        self.rsf = float(routed_scaling_factor)
        if recipe.routed_scaling == "unfused":  # SGLang: the kernel sees unscaled weights (docs/kernels.md#open-choices)
            self.w = self.w / self.rsf
        self.xq = quantize_input(bf16_round(x.to(torch.float32)), recipe)  # the kernel's input is BF16
        self.slot_out = torch.zeros(self.shape[0] * self.shape[1], self.shape[2], device=x.device)

    def l1_input(self, begin: int, end: int) -> torch.Tensor:
        return self.xq[self.token[begin:end]]  # docs/kernels.md#the-moe-forward step 2 happened once per token, in __init__

    def l2_input(self, begin: int, end: int, acc: torch.Tensor) -> torch.Tensor:
        return intermediate(acc, self.w[begin:end], self.limit, self.recipe)  # steps 4-6

    def store(self, begin: int, end: int, out: torch.Tensor) -> None:
        self.slot_out[self.rows[begin:end]] = bf16_round(out)  # step 7

    def finish(self) -> torch.Tensor:
        t, k, h = self.shape
        y = combine(self.slot_out.view(t, k, h), skip_last_slot=self.recipe.fault == "drop_last_slot")
        if self.recipe.routed_scaling == "unfused":  # SGLang's y.mul_(1.5) on the BF16 output
            y = bf16_round(y * self.rsf)
        return y


def run_chunk_together(runners: list[ExpertRows], lo: int, hi: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """`run_chunk` for several runners that share weights, with one L1 and one L2 grouped matmul: each
    expert's rows from every runner sit together, so each weight is read once (skinny GEMMs are
    memory-bound). Row results are identical to separate `run_chunk` calls up to FP32 summation order."""
    spans = [(r, *r.span(lo, hi)) for r in runners]
    spans = [(r, b, e) for r, b, e in spans if e > b]
    if not spans:
        return
    sizes = [e - b for _, b, e in spans]
    runner = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(sizes))
    expert = torch.cat([r.expert[b:e] for r, b, e in spans]) - lo
    order = torch.argsort(expert * len(spans) + runner.to(expert.device), stable=True)
    counts = sum(r.counts[lo:hi] for r, _, _ in spans)
    offsets = torch.cumsum(counts, 0).to(torch.int32)

    def together(parts, w):
        out = grouped_matmul(torch.cat(parts)[order], w, offsets)
        back = torch.empty_like(out)
        back[order] = out
        return back.split(sizes)

    with exact_fp32_matmul():
        acc = together([r.l1_input(b, e) for r, b, e in spans], w1)
        v = [r.l2_input(b, e, a) for (r, b, e), a in zip(spans, acc)]
        for (r, b, e), o in zip(spans, together(v, w2)):
            r.store(b, e, o)


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
