"""One decoding step's DeepSeek-V4 attention as one Triton kernel (two at small batches), for PyTorch's
numerics on a GPU.

A step from slots (``attention_slots``) attends each row's one query (64 heads of 512 in DeepSeek-V4-Flash,
one shared key-value head) to the row's sliding-window ring and, in a CSA / HCA layer, to the compressed
entries it selects. Done with PyTorch's operations that is about twenty kernels a layer: the ring and the
entries gathered by row and joined, a mask built, the scores, the sink joined, max, softmax, the weighted
sum; and at batch 256 the [batch, heads, keys] scores make a round trip through memory in between.
``decode_attention`` reads each row's keys once, in place, and keeps the scores in registers (a flash-style
online softmax; the sink enters the denominator only, as in eager). Where its grid of (head blocks, rows)
programs is small next to the GPU (batch 1: 4 programs on an H200's 132 SMs, each looping over every key
block), the keys are split over SPLIT programs a row (``key_splits``) whose partial softmaxes a second, small
kernel merges (flash-decoding); SPLIT comes from static shapes alone, so a CUDA graph replays the same
launches, and at SPLIT 1 (batch 256) the one kernel runs as before.

A prefill chunk's attention (``chunk_attention``, from ``attention_slots._chunk_attention``) is the same
online softmax over each row's joined keys [ring, the chunk's own, entries] for every token of the chunk, a
program holding CHUNK["tokens"] tokens x HEADS heads (they share the row's keys; each token its own open
keys): done with PyTorch's operations the [rows, heads, tokens, keys] scores went through memory five times
and the sink's join copied them, about half of a 64-prompt prefill's kernel time at 12 full-width layers.

Same function as ``attention._attend``; the scores stay FP32 (eager rounds them to the model's dtype) and
the order of the sums is the kernel's, so results agree with eager within float rounding, not bit for bit
(``tests/test_triton_attention.py``, under Triton's interpreter on a CPU). That order follows SPLIT, so a
row's bits depend on the batch it runs in (as cuBLAS's products do). Canonical numerics keep their own
attention (``invariant_compressed.attend``).
"""

from __future__ import annotations

import torch

HEADS = 16  # heads per program (tl.dot needs 16 rows); a program reads its row's keys once per 16 heads
KEYS = 32  # keys per block of the online softmax (a [32, 512] BF16 tile: 32 KiB of shared memory)
STAGES = 2  # pipelined tiles: with 64 keys and 3 stages a 512-wide head asked 400 KiB, over an H200's 227
# Splitting the keys (``key_splits``): the largest power of two SPLIT with programs x SPLIT at most
# programs_per_sm x the SMs and a key block for every split; programs_per_sm 0 never splits; force > 0 takes
# that SPLIT whatever the shapes (tests, benchmarks/bench_step_kernels.py)
SPLIT = {"programs_per_sm": 2, "force": 0}


def supported(head_dim: int) -> bool:
    """The kernel holds a head in one tile: a power of two, at least 16 (tl.dot)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def key_blocks(window: int, entries: int) -> int:
    """KEYS-key blocks a row's keys make: the ring's, then the entries'."""
    return -(-window // KEYS) + -(-entries // KEYS)


def key_splits(batch: int, heads: int, window: int, entries: int, sms: int) -> int:
    """SPLIT for a step of ``batch`` rows of ``heads`` heads over a ring of ``window`` keys and ``entries``
    compressed entries (0 in a sliding-window layer) on ``sms`` SMs: see ``SPLIT``. Static shapes only (no
    positions, no chosen entries): the same launches in every replay of a CUDA graph."""
    if SPLIT["force"]:
        return SPLIT["force"]
    programs = -(-heads // HEADS) * batch
    target = SPLIT["programs_per_sm"] * sms
    blocks = key_blocks(window, entries)
    split = 1
    while programs * split * 2 <= target and split * 2 <= blocks:  # split s takes blocks s, s + SPLIT, ...
        split *= 2
    return split


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
        from evalgate.kernels.triton.availability import interpreted, sm_count
        from evalgate.model_adapters.fast.triton_attention_kernel import decode_attention_kernel
        from evalgate.model_adapters.fast.triton_layers import _on_device

        w = ring.shape[1]
        split = key_splits(b, h, w, c, sm_count(q.device))
        common = dict(H=h, D=d, W=w, C=c, BH=HEADS, BT=KEYS, UPCAST=interpreted(),
                      PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_stages=STAGES)
        with _on_device(q):
            if split == 1:
                decode_attention_kernel[(-(-h // HEADS), b)](
                    q, ring, rows, positions, entries, chosen, sinks.contiguous(), out, float(scaling),
                    chosen.stride(0), **common)
            else:
                _split_attention(q, ring, rows, positions, entries, chosen, sinks.contiguous(), out, float(scaling),
                                 split, common)
    return out


def _split_attention(q, ring, rows, positions, entries, chosen, sinks, out, scaling: float, split: int, common: dict):
    """The keys over ``split`` programs a row, into FP32 partials in one scratch buffer, then merged."""
    from evalgate.model_adapters.fast.triton_attention_kernel import decode_attention_split_kernel, merge_splits_kernel

    b, h, d = q.shape
    parts = b * h * split
    scratch = torch.empty(parts * (d + 2), dtype=torch.float32, device=q.device)
    acc, m, den = scratch[:parts * d], scratch[parts * d:parts * (d + 1)], scratch[parts * (d + 1):]
    decode_attention_split_kernel[(-(-h // HEADS), b, split)](
        q, ring, rows, positions, entries, chosen, acc, m, den, scaling, chosen.stride(0), SPLIT=split, **common)
    merge_splits_kernel[(h, b)](acc, m, den, sinks, out, H=h, D=d, SPLIT=split,
                                SPLIT_P2=1 << max(0, split - 1).bit_length())


# ``chunk_attention``: a program's queries are CHUNK["tokens"] tokens x HEADS heads, sharing each key block
CHUNK = {"tokens": 2, "warps": 4}


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, opened: torch.Tensor, sinks: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """A prefill chunk's attention (``attention_slots._chunk_attention``): query [b, H, C, D] (C tokens a row),
    keys [b, T, D] (each row's own: its ring, the chunk's keys, its entries), opened [b, C, T] bool (which keys
    each token attends to), sinks [H] -> [b, H, C, D] in the query's dtype: eager's attention with the sink
    in the denominator, the [b, H, C, T] scores kept in registers a key block at a time."""
    b, h, c, d = query.shape
    t = keys.shape[1]
    if not supported(d) or keys.shape != (b, t, d) or opened.shape != (b, c, t):
        raise ValueError(f"chunk_attention takes query [b, H, C, D], keys [b, T, D] and opened [b, C, T] of a "
                         f"power-of-two D, not {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(opened.shape)}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    opened = (opened if opened.stride(-1) == 1 else opened.contiguous()).view(torch.uint8)
    out = torch.empty(b, c, h, d, dtype=query.dtype, device=query.device).transpose(1, 2)  # [b, H, C, D] view
    if b and c:
        from evalgate.kernels.triton.availability import interpreted
        from evalgate.model_adapters.fast.triton_attention_kernel import chunk_attention_kernel
        from evalgate.model_adapters.fast.triton_layers import _on_device

        tokens = CHUNK["tokens"]
        with _on_device(query):
            chunk_attention_kernel[(-(-h // HEADS), -(-c // tokens), b)](
                query, keys, opened, sinks.contiguous(), out, float(scaling), c, t,
                query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1),
                opened.stride(0), opened.stride(1), out.stride(0), out.stride(1), out.stride(2),
                H=h, D=d, BH=HEADS, TOKENS=tokens, BT=KEYS, UPCAST=interpreted(),
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32", T_INTERPRETED=t if interpreted() else 0,
                num_warps=CHUNK["warps"], num_stages=STAGES)
    return out
