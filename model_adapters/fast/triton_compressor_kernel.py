"""The Triton kernel of ``triton_compressor`` (imported where Triton is installed; the host side is there)."""

from __future__ import annotations

import triton
import triton.language as tl

from evalgate.kernels.triton.fast import bf16_rne


@triton.jit
def _round(x, KIND: tl.constexpr):
    """x (FP32) rounded to nearest even in 0 FP32 (as it is), 1 BF16, 2 FP16, as an FP32 value. BF16 from the
    bits: Triton's interpreter truncates a conversion to BF16."""
    if KIND == 1:
        y = bf16_rne(x)
    elif KIND == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _round_as(x, PTR):
    """x rounded to the element type of PTR (FP32, BF16 or FP16), as an FP32 value."""
    if PTR.dtype.element_ty == tl.bfloat16:
        y = _round(x, 1)
    elif PTR.dtype.element_ty == tl.float16:
        y = _round(x, 2)
    else:
        y = x
    return y


@triton.jit
def _window_rows(RING, PREV, NEW, BIAS, r, slot, read, at, i, c, R: tl.constexpr, FEED: tl.constexpr,
                 D: tl.constexpr, OVERLAP: tl.constexpr, OFF: tl.constexpr, BIASED: tl.constexpr,
                 ROUND: tl.constexpr):
    """Rows i [WB] of the window at channels OFF + c [P], FP32. OVERLAP: rows below R are the previous window's
    Ca (PREV[slot, read], as stored), the others the ring's rows i - R; else the ring's rows i. The ring's row
    ``at`` is this step's token, read from NEW (what the kernel has just stored there: no thread reads
    another's store). BIASED: ring rows plus the position bias, in the promoted dtype (ROUND)."""
    if OVERLAP:
        j = i - R
    else:
        j = i
    in_ring = (j >= 0) & (j < R)
    jr = tl.where(in_ring, j, 0)
    m = in_ring[:, None]
    ring = tl.load(RING + (slot * R + jr)[:, None] * FEED + OFF + c[None, :], mask=m, other=0.0)
    new = _round_as(tl.load(NEW + r.to(tl.int64) * FEED + OFF + c).to(tl.float32), RING).to(RING.dtype.element_ty)
    val = tl.where((jr == at)[:, None], new[None, :], ring).to(tl.float32)
    if BIASED:
        bias = tl.load(BIAS + jr[:, None] * FEED + OFF + c[None, :], mask=m, other=0.0).to(tl.float32)
        val = _round(val + bias, ROUND)
    if OVERLAP:
        ip = tl.where(in_ring, 0, i)
        prev = tl.load(PREV + ((slot * 2 + read) * R + ip)[:, None] * D + c[None, :], mask=(i < R)[:, None],
                       other=0.0).to(tl.float32)
        val = tl.where(m, val, prev)
    return val


@triton.jit
def _pool(RING_KV, RING_GATE, PREV_KV, PREV_GATE, KV_NEW, GATE_NEW, BIAS, ENTRIES, r, slot, read, at, c,
          R: tl.constexpr, FEED: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, OFF: tl.constexpr,
          WB: tl.constexpr, WINDOW: tl.constexpr, ROUND_GATE: tl.constexpr):
    """transformers' pooling of the row's window at channels c: Σ_w kv_w · softmax_w(gate_w + bias_w), the
    softmax in FP32 rounded to the keys' dtype, each product rounded to it, the sum rounded once. FP32 [P]."""
    m = tl.full(c.shape, float("-inf"), tl.float32)
    for w0 in range(0, WINDOW, WB):
        i = w0 + tl.arange(0, WB)
        g = _window_rows(RING_GATE, PREV_GATE, GATE_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, OVERLAP, OFF,
                         True, ROUND_GATE)
        m = tl.maximum(m, tl.max(g, axis=0))
    den = tl.zeros(c.shape, tl.float32)
    for w0 in range(0, WINDOW, WB):
        i = w0 + tl.arange(0, WB)
        g = _window_rows(RING_GATE, PREV_GATE, GATE_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, OVERLAP, OFF,
                         True, ROUND_GATE)
        den += tl.sum(tl.exp(g - m[None, :]), axis=0)
    acc = tl.zeros(c.shape, tl.float32)
    for w0 in range(0, WINDOW, WB):
        i = w0 + tl.arange(0, WB)
        g = _window_rows(RING_GATE, PREV_GATE, GATE_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, OVERLAP, OFF,
                         True, ROUND_GATE)
        kv = _window_rows(RING_KV, PREV_KV, KV_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, OVERLAP, OFF,
                          False, 0)
        prob = _round_as(tl.exp(g - m[None, :]) / den[None, :], ENTRIES)
        acc += tl.sum(_round_as(kv * prob, ENTRIES), axis=0)
    return _round_as(acc, ENTRIES)


@triton.jit
def compressor_step_kernel(KV_NEW, GATE_NEW, ROWS, POS, RING_KV, RING_GATE, PREV_KV, PREV_GATE, ENTRIES, BIAS,
                           NORM_W, COS, SIN, COUNT, eps, R: tl.constexpr, FEED: tl.constexpr, D: tl.constexpr,
                           CAP1: tl.constexpr, HALF: tl.constexpr, OVERLAP: tl.constexpr, WB: tl.constexpr,
                           WINDOW: tl.constexpr, ROUND_GATE: tl.constexpr, PAIRS: tl.constexpr,
                           OFF: tl.constexpr, CA_ROWS: tl.constexpr):
    """Row program_id(0): its token into the ring; if it closes a window, the window's entry (pooled, normed,
    rotated) at index count - 1, and for CSA the window's Ca (with its bias) for the next entry. OFF: where
    the window's own channels start in the ring (CSA: its Cb half, D)."""
    r = tl.program_id(0)
    slot = tl.load(ROWS + r).to(tl.int64)
    p = tl.load(POS + r).to(tl.int64)
    at = p % R
    count = (p + 1) // R
    tl.store(COUNT + r, count)
    f = tl.arange(0, FEED)
    kv_new = tl.load(KV_NEW + r.to(tl.int64) * FEED + f).to(tl.float32)
    gate_new = tl.load(GATE_NEW + r.to(tl.int64) * FEED + f).to(tl.float32)
    tl.store(RING_KV + (slot * R + at) * FEED + f, _round_as(kv_new, RING_KV).to(RING_KV.dtype.element_ty))
    tl.store(RING_GATE + (slot * R + at) * FEED + f, _round_as(gate_new, RING_GATE).to(RING_GATE.dtype.element_ty))
    if (p + 1) % R == 0:
        ty = ENTRIES.dtype.element_ty
        read = count % 2  # window count - 1 closes: the Ca of window count - 2 in, its own out
        write = 1 - read
        ce = 2 * tl.arange(0, PAIRS)  # even and odd channels apart: RoPE rotates each pair
        co = ce + 1
        pe = _pool(RING_KV, RING_GATE, PREV_KV, PREV_GATE, KV_NEW, GATE_NEW, BIAS, ENTRIES, r, slot, read, at, ce,
                   R, FEED, D, OVERLAP, OFF, WB, WINDOW, ROUND_GATE)
        po = _pool(RING_KV, RING_GATE, PREV_KV, PREV_GATE, KV_NEW, GATE_NEW, BIAS, ENTRIES, r, slot, read, at, co,
                   R, FEED, D, OVERLAP, OFF, WB, WINDOW, ROUND_GATE)
        # kv_norm: FP32, x · rsqrt(mean x² + eps) times the FP32 weight, rounded once
        inv = 1.0 / tl.sqrt_rn((tl.sum(pe * pe, axis=0) + tl.sum(po * po, axis=0)) / D + eps)
        ye = _round_as(tl.load(NORM_W + ce).to(tl.float32) * (pe * inv), ENTRIES)
        yo = _round_as(tl.load(NORM_W + co).to(tl.float32) * (po * inv), ENTRIES)
        # RoPE on the trailing HALF pairs at the window's first position: (x_e, x_o) -> (x_e c - x_o s, x_o c + x_e s)
        k = tl.arange(0, PAIRS) - (PAIRS - HALF)
        rope = k >= 0
        kk = tl.where(rope, k, 0)
        cs = tl.load(COS + (count - 1) * HALF + kk, mask=rope, other=1.0).to(tl.float32)
        sn = tl.load(SIN + (count - 1) * HALF + kk, mask=rope, other=0.0).to(tl.float32)
        out_e = tl.where(rope, _round_as(ye * cs - yo * sn, ENTRIES), ye)
        out_o = tl.where(rope, _round_as(yo * cs + ye * sn, ENTRIES), yo)
        base = ENTRIES + (slot * CAP1 + count - 1) * D
        tl.store(base + ce, out_e.to(ty))
        tl.store(base + co, out_o.to(ty))
        if OVERLAP:  # the window's Ca (keys, and gates with their bias) for the next window's entry
            c = tl.arange(0, D)
            for w0 in range(0, R, CA_ROWS):
                i = w0 + tl.arange(0, CA_ROWS)
                kv = _window_rows(RING_KV, PREV_KV, KV_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, False, 0,
                                  False, 0)
                g = _window_rows(RING_GATE, PREV_GATE, GATE_NEW, BIAS, r, slot, read, at, i, c, R, FEED, D, False, 0,
                                 True, ROUND_GATE)
                dest = ((slot * 2 + write) * R + i)[:, None] * D + c[None, :]
                tl.store(PREV_KV + dest, kv.to(PREV_KV.dtype.element_ty))  # ring values: exact
                tl.store(PREV_GATE + dest, _round_as(g, PREV_GATE).to(PREV_GATE.dtype.element_ty))
