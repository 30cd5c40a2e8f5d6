"""One call's (token, slot) rows sorted by expert, and the tiles the GEMMs run over them, without a host sync.

`SortedRows.torch` and `gemm.tile_schedule` (torch) are the definition: about 45 small kernels a call (the
sort, its keys, the counts, two cumulative sums, a search, a dozen gathers and casts). A decoding step of a
DeepSeek-V4-Flash-sized model makes these calls once a layer, and at one token each kernel costs more than
its work, so up to ROUTE_MAX_ROWS rows `route` computes the same integers on its own kernels: up to
ONE_PROGRAM_ROWS in one program (`_route`: the rows sorted by (expert, row) with `tl.sort`, a stable sort
by expert; the counts with `tl.histogram`; the tiles from their cumulative sums), above that a counting
sort over chunks of rows in two kernels (`_route_chunk_counts`, `_route_chunk_place`), where one program's
sort would be slow. They also set the layer's counters and the intermediate's byte ranges to their initial
values (three fills fewer a layer). Larger calls (prefill) keep the torch definition: there the kernels are
few against the work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import tile_schedule

ROUTE_MAX_ROWS = 4096  # rows (tokens x top-k) the kernels take (a decoding step); above: the torch definition
TILE_BLOCK = 32  # tiles resolved per pass (a [TILE_BLOCK, experts] comparison): `_route` loops, the chunked path
# runs one pass a program


class SortedRows:
    """The (token, slot) rows of one call sorted by expert, as `emulator.ExpertRows`: all T * K rows, the
    empty slots (expert outside 0..E-1) last with expert E, which no tile covers. rows int64 (flat (token,
    slot)), expert int32, token int32, counts int32 [E], w FP32 (the router weight of each row)."""

    def __init__(self, rows, expert, token, counts, w, num_experts):
        self.rows, self.expert, self.token, self.counts, self.w = rows, expert, token, counts, w
        self.num_experts = num_experts

    @classmethod
    def torch(cls, top_k_index, top_k_weights, num_experts) -> "SortedRows":
        """The definition, in torch operations."""
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int32)
        order = torch.sort(key, stable=True)
        rows = order.indices
        ones = torch.ones_like(key)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device).index_add_(0, key, ones)[:-1]
        return cls(rows, order.values, (rows // k).to(torch.int32), counts,
                   top_k_weights.reshape(-1)[rows].to(torch.float32), num_experts)


def tile_bound(rows: int, num_experts: int, bm: int) -> int:
    """The tiles `gemm.tile_schedule` pads to: known from the shapes alone."""
    return -(-rows // bm) + min(num_experts, rows)


@triton.jit
def _schedule(counts, e, t0, TILE_EXPERT, TILE_BEGIN, TILE_END, E: tl.constexpr, BM: tl.constexpr,
              BOUND: tl.constexpr, TB: tl.constexpr):
    """Tiles t0 .. t0 + TB of gemm.tile_schedule, from the rows per expert (counts [EP], 0 past E): tile t
    belongs to the expert whose cumulative tiles first pass t."""
    tiles = (counts + BM - 1) // BM
    last = tl.cumsum(tiles, 0)
    first = tl.cumsum(counts, 0) - counts
    total = tl.sum(tiles, 0)
    t = t0 + tl.arange(0, TB)
    passed = (last[None, :] <= t[:, None]) & (e[None, :] < E)
    et = tl.minimum(tl.sum(passed.to(tl.int32), axis=1), E - 1)  # searchsorted(last, t, right=True)
    pick = e[None, :] == et[:, None]
    f = tl.sum(tl.where(pick, first[None, :], 0), axis=1)
    n = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
    start = tl.sum(tl.where(pick, last[None, :] - tiles[None, :], 0), axis=1)
    begin = f + (t - start) * BM
    inside = t < BOUND
    tl.store(TILE_EXPERT + t, tl.where(t < total, et, -1), mask=inside)
    tl.store(TILE_BEGIN + t, begin, mask=inside)
    tl.store(TILE_END + t, tl.minimum(begin + BM, f + n), mask=inside)


@triton.jit
def _keys(IDX, i, live, E: tl.constexpr):
    """Each row's expert, E for an empty slot (an index outside 0..E-1) and for lanes past the rows."""
    flat = tl.load(IDX + i, mask=live, other=-1)
    return tl.where((flat >= 0) & (flat < E), flat, E).to(tl.int32)


@triton.jit
def _zero_count(COUNT, NCOUNT: tl.constexpr):
    c = tl.arange(0, 8)
    tl.store(COUNT + c, tl.zeros([8], dtype=tl.int32), mask=c < NCOUNT)


@triton.jit
def _fill_ranges(HI, LO, i, live):
    """HI[i] = -1, LO[i] = 512 (no byte yet) for the live lanes i."""
    tl.store(HI + i, tl.full(i.shape, -1, dtype=tl.int32), mask=live)
    tl.store(LO + i, tl.full(i.shape, 512, dtype=tl.int32), mask=live)


@triton.jit
def _route(IDX, TW, ROWS, EXPERT, TOKEN, W, COUNTS, TILE_EXPERT, TILE_BEGIN, TILE_END, COUNT, HI, LO, S,
           E: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BOUND: tl.constexpr, SP: tl.constexpr,
           EP: tl.constexpr, TB: tl.constexpr, NCOUNT: tl.constexpr):
    """One program: SortedRows.torch and gemm.tile_schedule for S <= SP rows of E experts (EP: E rounded up
    to a power of two), then COUNT[0:NCOUNT] = 0, HI[0:S] = -1, LO[0:S] = 512."""
    i = tl.arange(0, SP)
    live = i < S
    key = _keys(IDX, i, live, E)  # lanes past S: E too, sorted after the empty slots by i
    order = tl.sort(key * SP + i)  # distinct keys: sorting them is the stable sort by expert
    row = order % SP
    expert = order // SP
    tl.store(ROWS + i, row.to(tl.int64), mask=live)
    tl.store(EXPERT + i, expert, mask=live)
    tl.store(TOKEN + i, row // TOPK, mask=live)
    tl.store(W + i, tl.load(TW + row, mask=live, other=0).to(tl.float32), mask=live)
    # rows per expert: the lanes of expert E (empty slots, padding) go to bin 0 and are taken off again
    e = tl.arange(0, EP)
    hist = tl.histogram(tl.where(expert < E, expert, 0), EP)
    outside = tl.sum((expert >= E).to(tl.int32), axis=0)
    counts = tl.where(e == 0, hist - outside, hist)
    counts = tl.where(e < E, counts, 0)
    tl.store(COUNTS + e, counts, mask=e < E)
    for t0 in range(0, BOUND, TB):
        _schedule(counts, e, t0, TILE_EXPERT, TILE_BEGIN, TILE_END, E, BM, BOUND, TB)
    _zero_count(COUNT, NCOUNT)
    _fill_ranges(HI, LO, i, live)


# Above ONE_PROGRAM_ROWS a single program's sort is slow (70 µs for 1,536 rows on an H200): two kernels over
# chunks of CHUNK rows instead, a counting sort. The first counts each chunk's rows per key (expert, or E for
# the empty slots); the second places each row at its key's first row + the rows of that key in earlier
# chunks + those before it in its chunk, and more programs of its grid make the tiles, TILE_BLOCK each (one
# program making all 352 tiles of 1,536 rows took 51 µs on an H200).
ONE_PROGRAM_ROWS = 128
CHUNK = 128


@triton.jit
def _route_chunk_counts(IDX, HIST, S, E: tl.constexpr, EP1: tl.constexpr, CH: tl.constexpr):
    """HIST[c, k] = the rows of chunk c with key k (0 <= k <= E < EP1 - 1, a power of two)."""
    c = tl.program_id(0)
    i = c * CH + tl.arange(0, CH)
    live = i < S
    key = tl.where(live, _keys(IDX, i, live, E), EP1 - 1)  # lanes past S: the last bin, then taken off
    hist = tl.histogram(key, EP1)
    hist = tl.where(tl.arange(0, EP1) == EP1 - 1, hist - tl.sum((~live).to(tl.int32), axis=0), hist)
    tl.store(HIST + c * EP1 + tl.arange(0, EP1), hist)


@triton.jit
def _route_chunk_place(IDX, TW, HIST, BASE, ROWS, EXPERT, TOKEN, W, COUNTS, TILE_EXPERT, TILE_BEGIN, TILE_END,
                       COUNT, HI, LO, S, NCH, E: tl.constexpr, EP1: tl.constexpr, TOPK: tl.constexpr,
                       BM: tl.constexpr, BOUND: tl.constexpr, TB: tl.constexpr, NCOUNT: tl.constexpr,
                       CH: tl.constexpr, NCH_P: tl.constexpr):
    """Program c < NCH: chunk c's rows to their sorted places; program NCH + b: tiles b * TB ..; program NCH
    also the counts."""
    c = tl.program_id(0)
    e = tl.arange(0, EP1)
    chunks = tl.arange(0, NCH_P)
    hist = tl.load(HIST + chunks[:, None] * EP1 + e[None, :], mask=(chunks < NCH)[:, None], other=0)  # [NCH_P, EP1]
    per_key = tl.sum(hist, axis=0)
    if c >= NCH:
        counts = tl.where(e < E, per_key, 0)
        _schedule(counts, e, (c - NCH) * TB, TILE_EXPERT, TILE_BEGIN, TILE_END, E, BM, BOUND, TB)
        if c == NCH:
            tl.store(COUNTS + e, counts, mask=e < E)
            _zero_count(COUNT, NCOUNT)
    else:
        before = tl.sum(tl.where((chunks < c)[:, None], hist, 0), axis=0)
        base = tl.cumsum(per_key, 0) - per_key + before  # key k's first row + its rows in earlier chunks
        tl.store(BASE + c * EP1 + e, base)
        tl.debug_barrier()  # the whole block's stores of BASE before any lane reads them
        j = tl.arange(0, CH)
        i = c * CH + j
        live = i < S
        key = _keys(IDX, i, live, E)
        same_before = (key[None, :] == key[:, None]) & (j[None, :] < j[:, None])  # [this row, other row]
        place = tl.load(BASE + c * EP1 + key, mask=live, other=0, volatile=True)  # this block's stores
        place += tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(ROWS + place, i.to(tl.int64), mask=live)
        tl.store(EXPERT + place, key, mask=live)
        tl.store(TOKEN + place, i // TOPK, mask=live)
        tl.store(W + place, tl.load(TW + i, mask=live, other=0).to(tl.float32), mask=live)
        _fill_ranges(HI, LO, i, live)


def fits(rows: int, num_experts: int) -> bool:
    """Whether `route` runs these rows on its kernels (else on the torch definition)."""
    return 0 < rows <= ROUTE_MAX_ROWS


def _one_program(rows: int, num_experts: int) -> bool:
    """Whether `_route` takes these rows: few enough, and its sort keys (expert x SP + row) fit an int32."""
    return rows <= ONE_PROGRAM_ROWS and (num_experts + 1) * max(16, triton.next_power_of_2(rows)) < 2**31


def route(top_k_index, top_k_weights, num_experts: int, bm: int, count: torch.Tensor, hi: torch.Tensor,
          lo: torch.Tensor):
    """(SortedRows, tiles (expert, begin, end) as `gemm.tile_schedule`) for one call, and count zeroed,
    hi / lo (int32 [T * K]) set to -1 / 512: one kernel up to ONE_PROGRAM_ROWS rows, two up to
    ROUTE_MAX_ROWS, torch above."""
    t, k = top_k_index.shape
    s = t * k
    if count.numel() > 8:
        raise ValueError("route zeroes at most 8 counters")
    if not fits(s, num_experts):
        rows = SortedRows.torch(top_k_index, top_k_weights, num_experts)
        count.zero_()
        hi.fill_(-1)
        lo.fill_(512)
        return rows, tile_schedule(rows.counts, s, bm)
    dev = top_k_index.device
    bound = tile_bound(s, num_experts, bm)
    rows = SortedRows(torch.empty(s, dtype=torch.int64, device=dev), torch.empty(s, dtype=torch.int32, device=dev),
                      torch.empty(s, dtype=torch.int32, device=dev),
                      torch.empty(num_experts, dtype=torch.int32, device=dev),
                      torch.empty(s, dtype=torch.float32, device=dev), num_experts)
    tiles = tuple(torch.empty(bound, dtype=torch.int32, device=dev) for _ in range(3))
    idx, tw = top_k_index.contiguous(), top_k_weights.contiguous()
    shared = dict(E=num_experts, TOPK=k, BM=bm, BOUND=bound, TB=min(TILE_BLOCK, triton.next_power_of_2(bound)),
                  NCOUNT=count.numel())
    if _one_program(s, num_experts):
        sp = max(16, triton.next_power_of_2(s))
        _route[(1,)](idx, tw, rows.rows, rows.expert, rows.token, rows.w, rows.counts, *tiles, count, hi, lo, s,
                     SP=sp, EP=max(16, triton.next_power_of_2(num_experts)), **shared, num_warps=4)
        return rows, tiles
    chunks = -(-s // CHUNK)
    ep1 = triton.next_power_of_2(num_experts + 2)  # the keys 0..E and a bin for the lanes past the rows
    hist = torch.empty(2, chunks, ep1, dtype=torch.int32, device=dev)  # per chunk: counts, then bases
    _route_chunk_counts[(chunks,)](idx, hist[0], s, E=num_experts, EP1=ep1, CH=CHUNK, num_warps=4)
    tile_programs = -(-bound // shared["TB"])
    _route_chunk_place[(chunks + tile_programs,)](idx, tw, hist[0], hist[1], rows.rows, rows.expert, rows.token,
                                                  rows.w, rows.counts, *tiles, count, hi, lo, s, chunks, EP1=ep1,
                                                  CH=CHUNK, NCH_P=max(2, triton.next_power_of_2(chunks)), **shared,
                                                  num_warps=8)
    return rows, tiles
