"""One call's (token, slot) rows sorted by expert, and the tiles the GEMMs run over them, without a host sync.

`SortedRows` (torch) and `gemm.tile_schedule` (torch) are the definition: about 45 small kernels a call
(the sort, its keys, the counts, two cumulative sums, a search, a dozen gathers and casts). A decoding step
of a DeepSeek-V4-Flash-sized model makes these calls once a layer, and at one token each kernel costs more
than its work, so where the rows fit one program (`ROUTE_MAX_ROWS`) one Triton kernel (`_route`) computes
the same integers: the rows sorted by (expert, row) with `tl.sort` (a stable sort by expert), the counts
per expert with `tl.histogram`, the tiles from their cumulative sums. It also sets the layer's counters and
the intermediate's byte ranges to their initial values (three fills fewer a layer). Larger calls (prefill)
keep the torch definition: there the kernels are few against the work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import tile_schedule

ROUTE_MAX_ROWS = 4096  # rows (tokens x top-k) one program sorts in registers; above: the torch definition
TILE_BLOCK = 64  # tiles resolved per pass of `_route` (a [TILE_BLOCK, experts] comparison)


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
def _route(IDX, TW, ROWS, EXPERT, TOKEN, W, COUNTS, TILE_EXPERT, TILE_BEGIN, TILE_END, COUNT, HI, LO, S,
           E: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BOUND: tl.constexpr, SP: tl.constexpr,
           EP: tl.constexpr, TB: tl.constexpr, NCOUNT: tl.constexpr):
    """One program: SortedRows.torch and gemm.tile_schedule for S <= SP rows of E experts (EP: E rounded up
    to a power of two), then COUNT[0:NCOUNT] = 0, HI[0:S] = -1, LO[0:S] = 512."""
    i = tl.arange(0, SP)
    live = i < S
    flat = tl.load(IDX + i, mask=live, other=-1)
    key = tl.where((flat >= 0) & (flat < E), flat, E).to(tl.int32)  # lanes past S: E too, sorted after by i
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
    # tile_schedule: tile t belongs to the expert whose cumulative tiles first pass t
    tiles = (counts + BM - 1) // BM
    last = tl.cumsum(tiles, 0)
    first = tl.cumsum(counts, 0) - counts
    total = tl.sum(tiles, 0)
    for t0 in range(0, BOUND, TB):
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
    c = tl.arange(0, 8)
    tl.store(COUNT + c, tl.zeros([8], dtype=tl.int32), mask=c < NCOUNT)
    tl.store(HI + i, tl.full([SP], -1, dtype=tl.int32), mask=live)
    tl.store(LO + i, tl.full([SP], 512, dtype=tl.int32), mask=live)


def fits_one_program(rows: int, num_experts: int) -> bool:
    return 0 < rows <= ROUTE_MAX_ROWS and (num_experts + 1) * triton.next_power_of_2(rows) < 2**31


def route(top_k_index, top_k_weights, num_experts: int, bm: int, count: torch.Tensor, hi: torch.Tensor,
          lo: torch.Tensor):
    """(SortedRows, tiles (expert, begin, end) as `gemm.tile_schedule`) for one call, and count zeroed,
    hi / lo (int32 [T * K]) set to -1 / 512: one kernel where the rows fit one program, else torch."""
    t, k = top_k_index.shape
    s = t * k
    if not fits_one_program(s, num_experts):
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
    if count.numel() > 8:
        raise ValueError("route zeroes at most 8 counters")
    sp = max(16, triton.next_power_of_2(s))
    _route[(1,)](top_k_index.contiguous(), top_k_weights.contiguous(), rows.rows, rows.expert, rows.token, rows.w,
                 rows.counts, *tiles, count, hi, lo, s, E=num_experts, TOPK=k, BM=bm, BOUND=bound, SP=sp,
                 EP=max(16, triton.next_power_of_2(num_experts)), TB=min(TILE_BLOCK, triton.next_power_of_2(bound)),
                 NCOUNT=count.numel(), num_warps=4 if sp <= 1024 else 8)
    return rows, tiles
