"""The Triton kernels of ``triton_attention`` (imported where Triton is installed; the host side is there).

One step's attention in one of two forms, by the SPLIT the host picks from static shapes:

- SPLIT 1: ``decode_attention_kernel``, grid (ceil(H / BH), rows): each program runs its heads' online
  softmax over all of its row's key blocks and writes the output.
- SPLIT > 1 (flash-decoding, for grids too small to fill the GPU: 64 heads at batch 1 are 4 programs):
  ``decode_attention_split_kernel``, grid (ceil(H / BH), rows, SPLIT), each program over a share of the key
  blocks into FP32 partials (running max, denominator, unnormalised weighted sum), then
  ``merge_splits_kernel``, grid (H, rows), which joins a head's partials and the sink into the output.

A prefill chunk's attention: ``chunk_attention_kernel``, grid (ceil(H / BH), ceil(C / TOKENS), rows), each
program TOKENS tokens x BH heads of one row over the row's key blocks, a key open or shut per token.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block(q, keys, open_, m, den, acc, scaling, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys [BT, D] (those not ``open_`` shut, for every query alike) into the running max m,
    denominator den and weighted sum acc of the online softmax."""
    return _block_open(q, keys, open_[None, :], m, den, acc, scaling, UPCAST, PRECISION)


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


@triton.jit
def decode_attention_split_kernel(q_ptr, ring_ptr, rows_ptr, pos_ptr, entries_ptr, chosen_ptr, acc_ptr, m_ptr, den_ptr,
                                  scaling, n_chosen_stride, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                                  C: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr,
                                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Heads program_id(0) * BH ..., row program_id(1), split program_id(2) of SPLIT: the online softmax over
    the split's share of the row's key blocks, without the sink, into partials for ``merge_splits_kernel``:
    acc [rows, H, SPLIT, D] (the unnormalised weighted sum), m and den [rows, H, SPLIT], FP32. The ring's
    blocks then the entries' make one sequence; split s takes blocks s, s + SPLIT, ... (a block past the
    last, or with no open key, leaves m = -inf, den = 0, acc = 0)."""
    r = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.program_id(0) * BH + tl.arange(0, BH)
    live = heads < H
    d = tl.arange(0, D)
    slot = tl.load(rows_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + r)
    q = tl.load(q_ptr + (r.to(tl.int64) * H + heads)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    RING_BLOCKS: tl.constexpr = (W + BT - 1) // BT
    BLOCKS: tl.constexpr = RING_BLOCKS + (C + BT - 1) // BT
    PER_SPLIT: tl.constexpr = (BLOCKS + SPLIT - 1) // SPLIT
    for i in range(0, PER_SPLIT):  # a constexpr trip count, the same in every split (no runtime-bounded loop)
        block = split + i * SPLIT
        in_ring = block < RING_BLOCKS
        t = block * BT + tl.arange(0, BT)  # ring index, in a ring block
        c = (block - RING_BLOCKS) * BT + tl.arange(0, BT)  # entry index, in an entry block
        ring_open = in_ring & (t < W) & (t <= pos)
        entry_here = (block >= RING_BLOCKS) & (c < C)  # false past the last block (c >= C) and in ring blocks
        entry_open = tl.load(chosen_ptr + r.to(tl.int64) * n_chosen_stride + c, mask=entry_here, other=0) != 0
        open_ = ring_open | entry_open
        # one load a block, from the ring or the entries: the base and the index picked by the block's kind
        base = tl.where(in_ring, ring_ptr + slot * W * D, entries_ptr + slot * C * D)
        index = tl.where(in_ring, t, c)
        keys = tl.load(base + index[:, None] * D + d[None, :], mask=open_[:, None], other=0.0)
        m, den, acc = _block(q, keys, open_, m, den, acc, scaling, UPCAST, PRECISION)
    part = (r.to(tl.int64) * H + heads) * SPLIT + split  # [BH]: this split's partial of each head
    tl.store(m_ptr + part, m, mask=live)
    tl.store(den_ptr + part, den, mask=live)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=live[:, None])


@triton.jit
def merge_splits_kernel(acc_ptr, m_ptr, den_ptr, sinks_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr,
                        SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """Head program_id(0), row program_id(1): its SPLIT partials and the sink into the output, as the one-kernel
    form does it (the sink in the max and the denominator only; a split with no open key weighs 0)."""
    h = tl.program_id(0)
    r = tl.program_id(1)
    row_head = r.to(tl.int64) * H + h
    s = tl.arange(0, SPLIT_P2)
    here = s < SPLIT
    m = tl.load(m_ptr + row_head * SPLIT + s, mask=here, other=float("-inf"))
    den = tl.load(den_ptr + row_head * SPLIT + s, mask=here, other=0.0)
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    top = tl.maximum(sink, tl.max(m, axis=0))
    top_use = tl.where(top > float("-inf"), top, 0.0)  # nothing open, no sink: no NaN from -inf - -inf here
    weight = tl.exp(m - top_use)  # [SPLIT_P2]; 0 for an empty split (m = -inf)
    total = tl.where(sink > float("-inf"), tl.exp(sink - top_use), 0.0) + tl.sum(den * weight, axis=0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (row_head * SPLIT + s)[:, None] * D + d[None, :], mask=here[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + row_head * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def chunk_attention_kernel(q_ptr, keys_ptr, open_ptr, sinks_ptr, out_ptr, scaling, C, T,
                           q_sb, q_sh, q_sc, k_sb, k_st, open_sb, open_sc, o_sb, o_sh, o_sc,
                           H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                           TOKENS: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                           T_INTERPRETED: tl.constexpr):
    """Row program_id(2); queries of tokens program_id(1) * TOKENS ... and heads program_id(0) * BH ..., token
    major (TOKENS * BH of them): each attends to the keys of its row (``keys`` [b, T, D]) its token opens
    (``open`` [b, C, T]), key block by key block; a block no query of the program opens is not read. The sink
    opens the running max and adds to the denominator only, as in ``decode_attention_kernel``. C and T are
    not constexpr: a prefill's chunks come in many widths, and each constexpr value would compile anew (Triton's
    interpreter cannot loop to a runtime bound: there T_INTERPRETED is T)."""
    r = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, TOKENS * BH)
    tok = tl.program_id(1) * TOKENS + i // BH
    head = tl.program_id(0) * BH + i % BH
    live = (tok < C) & (head < H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * q_sb + head[:, None] * q_sh + tok[:, None] * q_sc + d[None, :], mask=live[:, None],
                other=0.0)
    sink = tl.load(sinks_ptr + head, mask=live, other=0.0).to(tl.float32)
    m = sink
    den = tl.where(sink > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([TOKENS * BH, D], dtype=tl.float32)
    if T_INTERPRETED:
        for t0 in range(0, T_INTERPRETED, BT):
            m, den, acc = _chunk_block(q, keys_ptr + r * k_sb, open_ptr + r * open_sb, t0, T, tok, live, d, k_st,
                                       open_sc, m, den, acc, scaling, BT, UPCAST, PRECISION)
    else:
        for t0 in range(0, T, BT):
            m, den, acc = _chunk_block(q, keys_ptr + r * k_sb, open_ptr + r * open_sb, t0, T, tok, live, d, k_st,
                                       open_sc, m, den, acc, scaling, BT, UPCAST, PRECISION)
    out = acc / den[:, None]
    tl.store(out_ptr + r * o_sb + head[:, None] * o_sh + tok[:, None] * o_sc + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _chunk_block(q, keys_ptr, open_ptr, t0, T, tok, live, d, k_st, open_sc, m, den, acc, scaling, BT: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Key block t0 of one row's keys into its queries' online softmax, each query's own keys open; a block
    none of them opens is not read."""
    t = t0 + tl.arange(0, BT)
    opened = tl.load(open_ptr + tok[:, None] * open_sc + t[None, :], mask=live[:, None] & (t < T)[None, :],
                     other=0) != 0
    if tl.sum(tl.sum(opened.to(tl.int32), axis=1), axis=0) > 0:
        keys = tl.load(keys_ptr + t[:, None] * k_st + d[None, :], mask=(t < T)[:, None], other=0.0)
        m, den, acc = _block_open(q, keys, opened, m, den, acc, scaling, UPCAST, PRECISION)
    return m, den, acc


@triton.jit
def _block_open(q, keys, opened, m, den, acc, scaling, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys [BT, D] into the online softmax of queries q [rows, D], key j shut for query i where
    not opened[i, j] (opened broadcasts: [1, BT] shuts a key for every query)."""
    if UPCAST:  # Triton's interpreter: its BF16 dot is wrong; FP32 products of BF16 values are exact
        s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scaling
    else:
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scaling
    s = tl.where(opened, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p.to(keys.dtype).to(tl.float32), keys.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return m_new, den, acc * alpha[:, None] + pv
