"""One decoding step's DeepSeek-V4 attention as one Triton kernel, for PyTorch's numerics on a GPU.

A step from slots (``attention_slots``) attends each row's one query (64 heads of 512 in DeepSeek-V4-Flash,
one shared key-value head) to the row's sliding-window ring and, in a CSA / HCA layer, to the compressed
entries it selects. Done with PyTorch's operations that is about twenty kernels a layer: the ring and the
entries gathered by row and joined, a mask built, the scores, the sink joined, max, softmax, the weighted
sum; and at batch 256 the [batch, heads, keys] scores make a round trip through memory in between.
``decode_attention`` reads each row's keys once, in place, and keeps the scores in registers (a flash-style
online softmax; the sink enters the denominator only, as in eager).

Same function as ``attention._attend``; the scores stay FP32 (eager rounds them to the model's dtype) and
the order of the sums is the kernel's, so results agree with eager within float rounding, not bit for bit
(``tests/test_triton_attention.py``, under Triton's interpreter on a CPU). Canonical numerics keep their
own attention (``invariant_compressed.attend``).
"""

from __future__ import annotations

import torch

HEADS = 16  # heads per program (tl.dot needs 16 rows); a program reads its row's keys once per 16 heads
KEYS = 32  # keys per block of the online softmax (a [32, 512] BF16 tile: 32 KiB of shared memory)
STAGES = 2  # pipelined tiles: with 64 keys and 3 stages a 512-wide head asked 400 KiB, over an H200's 227
_KERNEL: list = []


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, ring_ptr, rows_ptr, pos_ptr, entries_ptr, chosen_ptr, sinks_ptr, out_ptr,
                                scaling, n_chosen_stride, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                                C: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr,
                                PRECISION: tl.constexpr):
        r = tl.program_id(0)
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
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
        # so a block loads one tile of keys (the same online-softmax update, written out in each)
        for t0 in range(0, W, BT):
            t = t0 + tl.arange(0, BT)
            open_ = (t < W) & (t <= pos)
            keys = tl.load(ring_ptr + (slot * W + t)[:, None] * D + d[None, :], mask=open_[:, None], other=0.0)
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
            acc = acc * alpha[:, None] + pv
            m = m_new
        for c0 in range(0, C, BT):
            c = c0 + tl.arange(0, BT)
            open_ = tl.load(chosen_ptr + r.to(tl.int64) * n_chosen_stride + c, mask=c < C, other=0) != 0
            keys = tl.load(entries_ptr + (slot * C + c)[:, None] * D + d[None, :], mask=open_[:, None], other=0.0)
            if UPCAST:
                s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scaling
            else:
                s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scaling
            s = tl.where(open_[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            if UPCAST:
                pv = tl.dot(p.to(keys.dtype).to(tl.float32), keys.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / den[:, None]
        tl.store(out_ptr + (r.to(tl.int64) * H + heads)[:, None] * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    return decode_attention_kernel


def supported(head_dim: int) -> bool:
    """The kernel holds a head in one tile: a power of two, at least 16 (tl.dot)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention(query: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                     entries: torch.Tensor | None, chosen: torch.Tensor | None, sinks: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """query [b, H, 1, D] (one position per row), ring [slots, W, D] (row i's key of position p at
    ring[rows[i], p mod W], open for ring index <= positions[i]), entries [slots, C, D] with chosen [b, C]
    bool (which of row i's entries it attends to; None for a sliding-window layer), sinks [H]: eager's
    attention with the sink in the denominator -> [b, H, 1, D] in the query's dtype."""
    if not _KERNEL:
        _KERNEL.append(_kernel())
    b, h, s, d = query.shape
    if s != 1 or not supported(d):
        raise ValueError(f"decode_attention takes one query per row of a power-of-two head_dim, not {tuple(query.shape)}")
    q = query.reshape(b, h, d).contiguous()
    out = torch.empty(b, h, 1, d, dtype=query.dtype, device=query.device)
    if entries is None:
        entries, chosen, c = ring, rows.new_zeros(b, 1, dtype=torch.uint8), 0  # never read
    else:
        c = entries.shape[1]
        chosen = chosen.contiguous().view(torch.uint8) if chosen.dtype == torch.bool else chosen.contiguous()
    if b:
        from evalgate.kernels.triton.availability import interpreted
        from evalgate.model_adapters.triton_layers import _on_device

        with _on_device(q):
            _KERNEL[0][(b, -(-h // HEADS))](q, ring, rows, positions, entries, chosen, sinks.contiguous(), out,
                                           float(scaling), chosen.stride(0), H=h, D=d, W=ring.shape[1], C=c,
                                           BH=HEADS, BT=KEYS, UPCAST=interpreted(),
                                           PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                           num_stages=STAGES)
    return out
