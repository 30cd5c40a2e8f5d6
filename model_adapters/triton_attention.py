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
    b, h, s, d = query.shape
    if s != 1 or not supported(d):
        raise ValueError(f"decode_attention takes one query per row of a power-of-two head_dim, not "
                         f"{tuple(query.shape)}")
    q = query.reshape(b, h, d).contiguous()
    out = torch.empty(b, h, 1, d, dtype=query.dtype, device=query.device)
    if entries is None:
        entries, chosen, c = ring, rows.new_zeros(b, 1, dtype=torch.uint8), 0  # never read
    else:
        c = entries.shape[1]
        chosen = chosen.contiguous().view(torch.uint8) if chosen.dtype == torch.bool else chosen.contiguous()
    if b:
        from evalgate.kernels.triton.availability import interpreted
        from evalgate.model_adapters.triton_attention_kernel import decode_attention_kernel
        from evalgate.model_adapters.triton_layers import _on_device

        with _on_device(q):
            decode_attention_kernel[(-(-h // HEADS), b)](
                q, ring, rows, positions, entries, chosen, sinks.contiguous(), out, float(scaling), chosen.stride(0),
                H=h, D=d, W=ring.shape[1], C=c, BH=HEADS, BT=KEYS, UPCAST=interpreted(),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_stages=STAGES)
    return out
