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

import torch

from . import canonical, formats
from .formats import EPILOGUE, SCALE_RULES, bf16_round
from .exact import SIG_BITS, GemmWeights, exact_matmul, row_span
from .recipe import Recipe
from .weights import check_shapes, expert_chunks, fp4_weights

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
    """docs/kernels.md#the-moe-forward step 5, FP32: silu = g / (1 + exp(-g)), then silu * u. exp(-g) is
    correctly rounded (`canonical.exp`): libm and SLEEF's vector exp differ in the last bit. g holds BF16
    values (step 4), so `canonical.exp_bf16` looks the same bits up in a table."""
    return (g / (1.0 + canonical.exp_bf16(-g))) * u


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
    if recipe.router_weight == "after_requant":  # w * quantize(h): fault (c), T6's wrong order
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
    through: `l1_input` -> L1 GEMM -> `l2_input` -> L2 GEMM -> `store`. Subclasses define the stages.

    Both GEMMs accumulate canonically (`exact.py`, docs/kernels.md#accumulation): the exact dot product,
    rounded once to FP32, for each row on its own, so a row's result never depends on the other rows of
    the call. `l1_sig`/`l2_sig` are the significant bits of the GEMM inputs' elements (the certificate
    needs them); references, which are not kernels, set `exact = False` and take the float64 products."""

    l1_sig = l2_sig = SIG_BITS["fp32"]
    exact = True

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

    def l1_span(self, begin: int, end: int) -> torch.Tensor | None:
        """``exact.row_span`` of ``l1_input(begin, end)`` with ``l1_sig``, if known without reading the rows
        (None: ``exact_matmul`` computes it)."""
        return None

    def run_chunk(self, lo: int, hi: int, w1, w2) -> None:
        """Rows routed to experts lo..hi-1, with their weights w1 [n, 2I, H], w2 [n, H, I]: exact values as
        tensors, or `exact.GemmWeights`."""
        begin, end = self.span(lo, hi)
        if end == begin:
            return
        w1, w2 = as_gemm_weights(w1), as_gemm_weights(w2)
        group = self.expert[begin:end] - lo
        acc = exact_matmul(self.l1_input(begin, end), self.l1_sig, w1, group, self.exact,
                           span_a=self.l1_span(begin, end))
        self.store(begin, end, exact_matmul(self.l2_input(begin, end, acc), self.l2_sig, w2, group, self.exact))


def as_gemm_weights(w) -> GemmWeights:
    return w if isinstance(w, GemmWeights) else GemmWeights.of(w, fp32=False)


def input_sig(recipe: Recipe) -> int:
    """Significant bits of the L1 input's elements (E2M1 2, E4M3 4, the BF16 input itself 8)."""
    if recipe.fault == "fp8_layout_read_as_packed_fp4":
        return SIG_BITS["e2m1"]
    return {"e2m1": SIG_BITS["e2m1"], "e4m3": SIG_BITS["e4m3"], "none": SIG_BITS["bf16"]}[recipe.activations]


def intermediate_sig(recipe: Recipe) -> int:
    """Significant bits of the L2 input's elements (w * quantize(h) under fault (c) is any FP32 value)."""
    if recipe.router_weight == "after_requant":
        return SIG_BITS["fp32"]
    return {"e2m1": SIG_BITS["e2m1"], "e4m3": SIG_BITS["e4m3"], "none": SIG_BITS["fp32"]}[recipe.intermediate]


class MoEEmulation(ExpertRows):
    """One emulated routed-experts forward, run in expert ranges. See the module docstring."""

    def __init__(self, x, top_k_index, top_k_weights, recipe: Recipe, num_experts: int, limit, routed_scaling_factor=1.0):
        super().__init__(x, top_k_index, top_k_weights, num_experts)
        self.recipe = recipe
        self.l1_sig, self.l2_sig = input_sig(recipe), intermediate_sig(recipe)
        self.limit = limit
        self.rsf = float(routed_scaling_factor)
        if recipe.routed_scaling == "unfused":  # SGLang: the kernel sees unscaled weights (docs/kernels.md#open-choices)
            self.w = self.w / self.rsf
        self.xq = quantize_input(bf16_round(x.to(torch.float32)), recipe)  # the kernel's input is BF16
        self._xq_span: torch.Tensor | None = None
        self.slot_out = torch.zeros(self.shape[0] * self.shape[1], self.shape[2], device=x.device)

    def l1_input(self, begin: int, end: int) -> torch.Tensor:
        return self.xq[self.token[begin:end]]  # docs/kernels.md#the-moe-forward step 2 happened once per token, in __init__

    def l1_span(self, begin: int, end: int) -> torch.Tensor:
        """Per token, once (a token's row is the same in each of its slots)."""
        if self._xq_span is None:
            self._xq_span = row_span(self.xq, self.l1_sig)
        return self._xq_span[self.token[begin:end]]

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


def run_chunk_together(runners: list[ExpertRows], lo: int, hi: int, w1, w2) -> None:
    """`run_chunk` for several runners that share weights, with one L1 and one L2 grouped matmul: each
    expert's rows from every runner sit together, so each weight is read once (skinny GEMMs are
    memory-bound). Row results are identical to separate `run_chunk` calls (canonical accumulation)."""
    spans = [(r, *r.span(lo, hi)) for r in runners]
    spans = [(r, b, e) for r, b, e in spans if e > b]
    if not spans:
        return
    w1, w2 = as_gemm_weights(w1), as_gemm_weights(w2)
    sizes = [e - b for _, b, e in spans]
    expert = torch.cat([r.expert[b:e] for r, b, e in spans]) - lo
    dev = expert.device  # every index tensor on the rows' device (CUDA indexing needs it)
    runner = torch.repeat_interleave(torch.arange(len(spans), device=dev), torch.tensor(sizes, device=dev))
    order = torch.argsort(expert * len(spans) + runner, stable=True)
    checked = torch.tensor([r.exact for r, _, _ in spans], device=dev)[runner][order]

    def together(parts, w, sigs, spans_a=None):
        sig = torch.tensor(sigs, device=dev)[runner][order]
        span_a = None if spans_a is None or any(x is None for x in spans_a) else torch.cat(spans_a)[order]
        out = exact_matmul(torch.cat(parts)[order], sig, w, expert[order], checked, span_a=span_a)
        back = torch.empty_like(out)
        back[order] = out
        return back.split(sizes)

    acc = together([r.l1_input(b, e) for r, b, e in spans], w1, [r.l1_sig for r, _, _ in spans],
                   [r.l1_span(b, e) for r, b, e in spans])
    v = [r.l2_input(b, e, x) for (r, b, e), x in zip(spans, acc)]
    for (r, b, e), o in zip(spans, together(v, w2, [r.l2_sig for r, _, _ in spans])):
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
