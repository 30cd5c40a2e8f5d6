"""The routed-experts forward on the Triton kernels: docs/kernels.md#the-moe-forward, the emulator's steps.

| step | where |
|---|---|
| 0 routing | the (token, slot) rows sorted by expert and the GEMMs' tile schedule: Triton up to `routing.ROUTE_MAX_ROWS` rows (`routing.route`: one kernel, or two over chunks of rows; decoding), torch above |
| 1 weights | packed codes + UE8M0 bytes read inside the GEMM kernels (no dequantized copy) |
| 2 input quantization | Triton (`quantize`); fault (b)'s misread FP8 bytes: torch |
| 3-6 L1 GEMM, BF16 round, clamp, SwiGLU, router weight, re-quantization | fast rows: one Triton kernel (`fast.l1_gemm`: int8 GEMM + epilogue, silu from a table of the emulator's own values); other rows: `gemm.int_gemm` per 32-block, the emulator's torch functions, `quantize` (uncertified rows on the host, `certify`) |
| 7 L2 GEMM, BF16 round | fast rows: `fast.l2_gemm` writes BF16 per (token, slot); other rows: `gemm.int_gemm` + torch |
| (both GEMMs) | on a small grid (decoding: few rows per expert) the fast kernels split K (`fast.FAST["split_k"]`): int32 partials added atomically, the same epilogue in a second kernel |
| 8 combine | `fast.combine` (Triton; `combine_bf16` under fault (c)): the emulator's FP32 sum in slot order over the BF16-stored slot outputs |

Fault (c) (w * quantize(h): FP32 L2 input) runs every row on the per-block path (`gemm.f64_gemm` for L2).
Which rows take the fast path is decided per row on the device before the GEMM (`fast.plan_rows`: no host
sync; the layer reads once, at its end, how many rows the fast path left; under `defer_finish`, a whole
decoding step in one CUDA graph, no layer reads it and the step reads the sum of every layer's); the
per-block path runs SLOW_CHUNK_ROWS rows at a time, so no call holds an FP32 accumulator for all its rows. Both paths
compute RN_fp32 of the exact dot product (docs/kernels.md#accumulation), so a row's bits do not depend on
the path; `check.triton_layer_check` holds the whole forward against the emulator bit for bit.
"""

from __future__ import annotations

import weakref

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
from . import certify, fast, routing
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
    if recipe.router_weight == "after_requant":  # w * quantize(h): any FP32 values
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


class _Layer:
    """One call's fused layer: the device work (`launch`: no host sync, so it can be captured in a CUDA
    graph) and the rest (`finish`: the one sync, and the per-block path for the rows the fast path left)."""

    def launch(self, op, top_k_index, top_k_weights, routed_scaling, fp4, recipe, limit, slot) -> None:
        s, i = top_k_index.numel(), fp4.intermediate
        dev = slot.device
        self.bm = fast._bm(s, fp4.num_experts)
        self.count = torch.empty(6, dtype=torch.int32, device=dev)  # per GEMM: rows not fast, most limbs, rows
        self.hi2 = torch.empty(s, dtype=torch.int32, device=dev)  # the intermediate's row byte ranges
        self.lo2 = torch.empty(s, dtype=torch.int32, device=dev)
        rows, self.tiles = routing.route(top_k_index, top_k_weights, fp4.num_experts, self.bm, self.count, self.hi2,
                                         self.lo2)
        w = rows.w / float(routed_scaling) if recipe.routed_scaling == "unfused" else rows.w
        self.op, self.rows, self.w, self.fp4, self.recipe, self.limit, self.slot = op, rows, w, fp4, recipe, limit, slot
        self.scale_fault = recipe.fault == "weight_scale_exponent_plus_one"
        self.force = certify.FORCE_HOST_ROWS
        b1, self.b2 = fast.column_bases(fp4)
        fmt2 = self.fmt2 = recipe.intermediate
        # L1 (steps 3-6) -> intermediate codes q2, bytes qb2, row byte ranges hi2 / lo2
        self.need1, p1 = fast.plan_rows(op.hi, op.lo, rows.token, op.fmt, b1, rows.expert, self.scale_fault,
                                        fp4.hidden, self.count[0:3], self.force)
        self.q2 = torch.empty(CODE_LIMBS[fmt2], s, i, dtype=torch.int8, device=dev)
        self.qb2 = torch.empty(s, i // formats.GROUP, dtype=torch.uint8, device=dev)
        a = fast.fold_rows(op.q, op.q_bytes, op.lo, op.fmt)
        fast.l1_gemm(a, rows.token, p1, self.need1, w, fp4, b1, self.tiles, self.bm, self.scale_fault, op.fmt, fmt2,
                     limit, self.q2, self.qb2, self.hi2, self.lo2)
        del a
        self.need2 = self._l2(self.count[3:6])

    def _l2(self, counter):  # L2 (step 7) -> BF16 slot outputs of the fast rows
        fp4, rows = self.fp4, self.rows
        need, p = fast.plan_rows(self.hi2, self.lo2, None, self.fmt2, self.b2, rows.expert, self.scale_fault,
                                 fp4.intermediate, counter, self.force)
        a2 = fast.fold_rows(self.q2, self.qb2, self.lo2, self.fmt2)
        if fast.halves(self.fmt2, self.bm):  # each expert's widest rows first: most tiles' upper limbs on half
            a_row = fast.sort_by_need(rows.expert, need)
            fast.l2_gemm(a2, p[a_row], need[a_row], rows.rows[a_row], fp4, self.b2, self.tiles, self.bm,
                         self.scale_fault, self.fmt2, self.slot.view(torch.int16), a_row=a_row, halves=True)
        else:
            fast.l2_gemm(a2, p, need, rows.rows, fp4, self.b2, self.tiles, self.bm, self.scale_fault, self.fmt2,
                         self.slot.view(torch.int16))
        return need

    def finish(self) -> bool:
        """The host sync; the per-block path for the rows the fast path left. True if it wrote slot rows."""
        op, rows, w, fp4, fault, limit = self.op, self.rows, self.w, self.fp4, self.recipe.fault, self.limit
        slow1, _, n, slow2, _, _ = self.count.tolist()  # the host sync
        present = rows.expert < rows.num_experts
        need2 = self.need2
        if slow1:  # L1 rows for the per-block path, then L2 again: its plan read their (then unset) ranges
            for chunk in _chunks(((self.need1 == 0) & present).nonzero().flatten()):
                acc = grouped_gemm(op, rows.token[chunk], fp4, 1, rows.expert[chunk].long(), fault)
                g, u = emulator.gate_up_to_bf16(acc, limit)
                del acc
                cq, cb, chi, clo = quantize_rows(emulator.swiglu(g, u) * w[chunk][:, None], self.fmt2, EPILOGUE)
                self.q2[:, chunk], self.qb2[chunk], self.hi2[chunk], self.lo2[chunk] = cq, cb, chi, clo
            again = torch.zeros(3, dtype=torch.int32, device=self.slot.device)
            need2 = self._l2(again)
            slow2, _, _ = again.tolist()
        inter = Operand(self.fmt2, self.q2, self.qb2, self.hi2, self.lo2, sig=SIG_BITS[self.fmt2])
        for chunk in _chunks(((need2 == 0) & present).nonzero().flatten() if slow2 else torch.empty(0)):
            self.slot[rows.rows[chunk]] = grouped_gemm(inter, chunk.to(torch.int32), fp4, 2,
                                                       rows.expert[chunk].long(), fault).to(torch.bfloat16)
        STATS["rows"] += 2 * n
        STATS["slow_rows"] += slow1 + slow2
        return bool(slow1 or slow2)


def _fused_forward(x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling):
    """The device part of `moe_forward` on the fused path: (BF16-valued FP32 output, the layer to finish)."""
    t, k = top_k_index.shape
    slot = torch.empty(t * k, x.shape[-1], dtype=torch.bfloat16, device=x.device)  # step 7's BF16 per (token, slot)
    layer = _Layer()
    layer.launch(input_operand(x.to(torch.bfloat16), recipe), top_k_index, top_k_weights, routed_scaling, fp4,
                 recipe, limit, slot)
    y = fast.combine(slot, top_k_index, fp4.num_experts, skip_last_slot=recipe.fault == "drop_last_slot")
    return y, layer


# CUDA graphs of one call's fused device work (where no graph of the whole step holds it, `defer_finish`: prefill,
# transformers' cache), for calls of up to max_rows (token, slot) rows (0: never):
# launching ~25 kernels from Python leaves the GPU idle until the GEMMs are reached (~2 ms measured at 4096
# tokens x 6 slots, not only on small calls). A shape's first call runs eagerly (compiling the kernels),
# its second captures the graph, later ones copy their inputs in and replay it.
GRAPHS = {"max_rows": 32768, "cache": 8}
_GRAPH_CACHE: dict = {}
_GRAPH_FAULTS = (None, "weight_scale_exponent_plus_one", "drop_last_slot")  # fault (b)'s torch input: eager


class _Graph:
    def __init__(self, x, top_k_index, top_k_weights, fp4, args):
        self.fp4 = weakref.ref(fp4)
        self.x, self.idx, self.w = x.clone(), top_k_index.clone(), top_k_weights.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y, self.layer = _fused_forward(self.x, self.idx, self.w, fp4, *args)
        self.layer.fp4 = None  # the cache holds the weights weakly (a call hands them to `finish`)

    def __call__(self, x, top_k_index, top_k_weights):
        self.x.copy_(x)
        self.idx.copy_(top_k_index)
        self.w.copy_(top_k_weights)
        self.graph.replay()
        return self.y, self.layer


def _graph_key(x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling):
    if not x.is_cuda or top_k_index.numel() > GRAPHS["max_rows"] or torch.cuda.is_current_stream_capturing():
        return None
    if certify.FORCE_HOST_ROWS or recipe.fault not in _GRAPH_FAULTS:
        return None
    return (tuple(x.shape), x.dtype, tuple(top_k_index.shape), top_k_index.dtype, top_k_weights.dtype, x.device,
            id(fp4), recipe, limit, routed_scaling, tuple(sorted(fast.FAST.items())))


class NotCapturable(RuntimeError):
    """A routed-experts call that a whole-step CUDA graph cannot hold (a fault or test flag whose path syncs)."""


class DeferredLayers:
    """The fused layers of a whole decoding step captured in one CUDA graph (``defer_finish``): their device
    work only, no host sync. ``slow_rows()`` is a device count of the rows the fast path left in any of them:
    0 means every layer's output is already final (``finish`` would do nothing), anything else that the step
    has to run again without the graph."""

    def __init__(self):
        self.counts: list[torch.Tensor] = []

    def add(self, layer: _Layer) -> None:
        self.counts.append(layer.count)

    def slow_rows(self, device) -> torch.Tensor:
        if not self.counts:
            return torch.zeros((), dtype=torch.int32, device=device)
        counts = torch.stack(self.counts)  # [layers, 6]: rows not fast at L1 (0) and at L2 (3)
        return counts[:, 0].sum() + counts[:, 3].sum()


_DEFERRED: list = []  # the innermost active DeferredLayers (a stack: captures do not nest, tests may)


class defer_finish:
    """``with defer_finish() as layers:`` fused calls inside skip their host sync and per-block path and
    record themselves in ``layers``; a call that cannot run sync-free raises ``NotCapturable``."""

    def __enter__(self) -> DeferredLayers:
        _DEFERRED.append(DeferredLayers())
        return _DEFERRED[-1]

    def __exit__(self, *exc) -> None:
        _DEFERRED.pop()


def capturable(recipe) -> str | None:
    """Why a decoding step whose experts run ``recipe`` on the Triton path cannot be captured whole under
    ``defer_finish``; None if it can."""
    if certify.FORCE_HOST_ROWS or recipe.fault not in _GRAPH_FAULTS:
        return f"fault {recipe.fault} (or a forced per-block path) syncs on the host"
    return None


def _deferred_call(layers: DeferredLayers, x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling):
    if certify.FORCE_HOST_ROWS or recipe.fault not in _GRAPH_FAULTS:
        raise NotCapturable(f"recipe {recipe} (fault {recipe.fault}) or a forced path syncs on the host")
    y, layer = _fused_forward(x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling)
    layers.add(layer)
    return y


def _fused_call(x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling):
    args = (recipe, limit, routed_scaling)
    if _DEFERRED:
        return _deferred_call(_DEFERRED[-1], x, top_k_index, top_k_weights, fp4, *args)
    key = _graph_key(x, top_k_index, top_k_weights, fp4, *args)
    entry = _GRAPH_CACHE.get(key) if key is not None else None
    if isinstance(entry, _Graph) and entry.fp4() is not fp4:
        entry = None
    if key is None or entry is None:  # eager (a shape's first call compiles the kernels)
        if key is not None:
            while len(_GRAPH_CACHE) >= GRAPHS["cache"]:
                _GRAPH_CACHE.pop(next(iter(_GRAPH_CACHE)))
            _GRAPH_CACHE[key] = "seen"
        y, layer = _fused_forward(x, top_k_index, top_k_weights, fp4, *args)
    else:
        if entry == "seen":
            try:
                entry = _GRAPH_CACHE[key] = _Graph(x, top_k_index, top_k_weights, fp4, args)
            except Exception:  # noqa: BLE001  (a capture this setup refuses: this shape stays eager)
                entry = _GRAPH_CACHE[key] = "eager"
        if isinstance(entry, _Graph):
            y, layer = entry(x, top_k_index, top_k_weights)
            y = y.clone()
            layer.fp4 = fp4
        else:
            y, layer = _fused_forward(x, top_k_index, top_k_weights, fp4, *args)
    try:
        if layer.finish():  # slot rows from the per-block path: combine again
            y = fast.combine(layer.slot, top_k_index, fp4.num_experts,
                             skip_last_slot=recipe.fault == "drop_last_slot")
    finally:
        layer.fp4 = None
    return y


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
    t, k = top_k_index.shape
    h = x.shape[-1]
    drop_last = recipe.fault == "drop_last_slot"
    if recipe.router_weight == "after_requant" and _DEFERRED:
        raise NotCapturable("fault (c) runs every row on the per-block path, which syncs on the host")
    if recipe.router_weight == "after_requant":  # every row per block (fault (c)), from ExpertRows
        rows = ExpertRows(x, top_k_index, top_k_weights, fp4.num_experts)
        w = rows.w / float(routed_scaling) if recipe.routed_scaling == "unfused" else rows.w
        slot = torch.zeros(t * k, h, dtype=torch.bfloat16, device=x.device)
        if rows.rows.numel():
            op = input_operand(x.to(torch.bfloat16), recipe)
            _per_block_layer(op, rows, rows.token.to(torch.int32), w.contiguous(), fp4, recipe, limit, slot)
        y = combine_bf16(slot.view(t, k, h), skip_last_slot=drop_last)
    elif t * k == 0:
        y = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    else:
        y = _fused_call(x, top_k_index, top_k_weights, fp4, recipe, limit, routed_scaling)
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
