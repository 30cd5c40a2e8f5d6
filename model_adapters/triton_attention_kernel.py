"""The Triton kernel of ``triton_attention`` (imported where Triton is installed; the host side is there)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block(q, keys, open_, m, den, acc, scaling, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys [BT, D] (those not ``open_`` shut) into the running max m, denominator den and
    weighted sum acc of the online softmax."""
    if UPCAST:  # Triton's interpreter: its BF16 dot is wrong; FP32 products of BF16 values are exact
        s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scaling
    else:
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scaling  # [BH, BT], FP32
    s = tl.where(open_[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing open yet: no NaN from -inf - -inf
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p.to(keys.dtype).to(tl.float32), keys.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return m_new, den, acc * alpha[:, None] + pv


@triton.jit
def decode_attention_kernel(q_ptr, ring_ptr, rows_ptr, pos_ptr, entries_ptr, chosen_ptr, sinks_ptr, out_ptr, scaling,
                            n_chosen_stride, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr,
                            BH: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Heads program_id(0) * BH ..., row program_id(1): the attention of its one query. A row's head blocks
    are neighbours in the launch order, so they read its keys at about the same time: once from memory,
    then from L2."""
    r = tl.program_id(1)
    heads = tl.program_id(0) * BH + tl.arange(0, BH)
    live = heads < H
    d = tl.arange(0, D)
    slot = tl.load(rows_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + r)
    q = tl.load(q_ptr + (r.to(tl.int64) * H + heads)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    sink = tl.load(sinks_ptr + heads, mask=live, other=0.0).to(tl.float32)
    m = sink  # the sink opens the running max, and adds exp(sink - m) to the denominator
    den = tl.where(sink > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    # the ring (key p at p mod W, written once p reaches it), then the entries the row selected: two loops,
    # so a tile loads from one of them
    for t0 in range(0, W, BT):
        t = t0 + tl.arange(0, BT)
        open_ = (t < W) & (t <= pos)
        keys = tl.load(ring_ptr + (slot * W + t)[:, None] * D + d[None, :], mask=open_[:, None], other=0.0)
        m, den, acc = _block(q, keys, open_, m, den, acc, scaling, UPCAST, PRECISION)
    for c0 in range(0, C, BT):
        c = c0 + tl.arange(0, BT)
        open_ = tl.load(chosen_ptr + r.to(tl.int64) * n_chosen_stride + c, mask=c < C, other=0) != 0
        keys = tl.load(entries_ptr + (slot * C + c)[:, None] * D + d[None, :], mask=open_[:, None], other=0.0)
        m, den, acc = _block(q, keys, open_, m, den, acc, scaling, UPCAST, PRECISION)
    out = acc / den[:, None]
    tl.store(out_ptr + (r.to(tl.int64) * H + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None])
