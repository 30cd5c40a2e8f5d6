"""The canonical accumulation of every emulated kernel: exact dot products, rounded once to FP32.

Both GEMMs of the mega-MoE kernel multiply quantized operands: E2M1 or E4M3 elements times a power-of-two
scale per 32 along K, against E2M1 weights times their own scales. Every product is exact, and so is every
block sum. The emulation defines the FP32 accumulator as

    acc = RN_fp32( sum over k of a_k * w_k )      (the exact sum, rounded once to nearest-even)

which does not depend on the order of the terms, on the block size, on how many tokens share the call or
on the machine (docs/kernels.md#accumulation). Each row gets a certificate before anything is multiplied:
every term is a multiple of 2^(lo_a + lo_w) and below 2^(hi_a + hi_w) in magnitude (bounds of the row's
elements and of its expert's), so every partial sum of the K terms, in any order, is an integer multiple of
2^(lo_a + lo_w) below 2^(hi_a + hi_w + ceil(log2 K)). With ``span`` that exponent difference:

1. span <= 24: an FP32 matrix product is exact, whatever BLAS does (typical for E2M1 x E2M1, W4A4);
2. span <= 53: a float64 matrix product is exact (typical for E4M3 x E2M1, W4A8: 28-38 on the canary);
3. otherwise (rare: blocks whose scales differ by 2^20 or more): the exact block sums of 32 terms (certified
   the same way, always true for FP4/FP8 operands) are added exactly with Python's ``math.fsum`` and the
   sign of the remainder, which gives the correctly rounded FP32 value; where even a block is not
   certified (unquantized operands only) the K products themselves are summed that way.

The exact sum rounded once is what all three compute, so a row's result is the same whichever tier its
neighbours put the call in. Element bounds come from the values: an element with ``sig`` significant bits
(E2M1 2, E4M3 4, BF16 8, FP32 24) is a multiple of 2^(exponent - sig).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .canonical import exponent

NONE = 1 << 20  # bound of an all-zero row: no term, nothing to certify
SIG_BITS = {"e2m1": 2, "e4m3": 4, "bf16": 8, "fp32": 24}
BLOCK = 32
FP32_BITS, FP64_BITS = 24, 53
STATS = {"rows": 0, "fp32_rows": 0, "fp64_rows": 0, "slow_rows": 0}  # tiers taken (benchmarks, tests)
FORCE_TIER: int | None = None  # tests: 1 (float64) or 2 (exact Python) for every certified row


def row_bounds(x: torch.Tensor, sig, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) per slice along ``dim``: every element is below 2^hi in magnitude and a multiple of 2^lo.
    int64; an all-zero slice gets (-NONE, NONE). ``sig``: an int, or a tensor shaped like the result
    (one value per slice)."""
    mag = x.abs()
    top = mag.amax(dim=dim)
    smallest = torch.where(mag > 0, mag, torch.inf).amin(dim=dim)  # every nonzero element is >= this
    hi = torch.where(top > 0, exponent(top).to(torch.int64), -NONE)
    lo = torch.where(top > 0, exponent(smallest).to(torch.int64) - sig, NONE)
    return hi, lo


def row_span(x: torch.Tensor, sig, dim: int = -1) -> torch.Tensor:
    """An upper bound on hi - lo (``row_bounds``) per slice, with fewer operations: every nonzero element is
    a multiple of 2^(e(smallest) - sig) and below 2^e(top), and e(top) - e(smallest) <= e(top / smallest) + 1.
    -NONE for an all-zero slice."""
    mag = x.abs()
    top = mag.amax(dim=dim)
    smallest = torch.where(mag > 0, mag, torch.inf).amin(dim=dim)
    ratio = top.to(torch.float64) / smallest.to(torch.float64)  # float64: no overflow for FP32 values
    return torch.where(top > 0, exponent(ratio).to(torch.int64) + 1 + sig, -NONE)


@dataclass
class GemmWeights:
    """One GEMM's expert weights [G, N, K] (exact values) as the tiers read them: float64 row-major, FP32
    transposed [G, K, N] (contiguous, what torch's grouped_mm reads fastest; optional), and (hi, lo)
    bounds per expert."""

    w64: torch.Tensor
    wt32: torch.Tensor | None
    hi: torch.Tensor
    lo: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor, sig: int = SIG_BITS["e2m1"], fp32: bool = True) -> "GemmWeights":
        hi, lo = row_bounds(w.flatten(1), sig)
        wt32 = w.to(torch.float32).transpose(-2, -1).contiguous() if fp32 else None
        return cls(w.to(torch.float64), wt32, hi, lo)

    @property
    def groups(self) -> int:
        return self.w64.shape[0]

    @property
    def blocks64(self) -> list:
        """The float64 weights of each expert, as views (split once)."""
        if "_blocks64" not in self.__dict__:
            self.__dict__["_blocks64"] = list(self.w64.unbind(0))
        return self.__dict__["_blocks64"]

    @property
    def span(self) -> torch.Tensor:
        """hi - lo per expert (an all-zero expert: -NONE)."""
        return torch.where(self.hi == -NONE, -NONE, self.hi - self.lo)


def _fp32_grouped(a: torch.Tensor, w: GemmWeights, group: torch.Tensor) -> torch.Tensor:
    """Rows a [S, K] FP32 sorted by group, times their group's weights, FP32 accumulation (TF32 off)."""
    counts = torch.bincount(group, minlength=w.groups)
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    tf32 = a.is_cuda and torch.backends.cuda.matmul.allow_tf32
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        if fn is not None:
            try:
                return fn(a, w.wt32, offs=torch.cumsum(counts, 0).to(torch.int32))
            except (RuntimeError, NotImplementedError):  # e.g. a CUDA build without FP32 grouped_mm
                pass
        return _looped(a, w.wt32, counts, transposed=True)
    finally:
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True


def _looped(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, transposed: bool,
            blocks: list | None = None) -> torch.Tensor:
    """One matrix product per group with rows (faster on a CPU than a padded batched product).
    ``blocks``: w's per-group views, if already split."""
    sizes = counts.tolist()
    blocks = blocks if blocks is not None else list(w.unbind(0))
    parts = a.to(w.dtype).split(sizes)
    outs = [torch.mm(p, blocks[g] if transposed else blocks[g].t()) for g, p in enumerate(parts) if sizes[g]]
    if not outs:
        return a.new_zeros(0, w.shape[2] if transposed else w.shape[1], dtype=w.dtype)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _fp64_grouped(a: torch.Tensor, w: GemmWeights, group: torch.Tensor) -> torch.Tensor:
    return _looped(a, w.w64, torch.bincount(group, minlength=w.groups), transposed=False, blocks=w.blocks64)


def exact_matmul(a: torch.Tensor, sig, w: GemmWeights, group: torch.Tensor, checked=True,
                 w_sig: int = SIG_BITS["e2m1"], span_a: torch.Tensor | None = None) -> torch.Tensor:
    """RN_fp32 of the exact dot products of each row of a [S, K] (FP32 values, sorted by ``group``) with the
    rows of its group's weights: [S, N] FP32. ``sig``: significant bits of a's elements, an int or one per
    row (LongTensor [S]). Rows where ``checked`` is False (references, not kernels) get the float64
    products rounded to FP32, without a certificate. ``span_a``: ``row_span(a, sig)``, where the caller has
    it already (the L1 input repeats each token's row once per slot: its span is computed per token)."""
    if not isinstance(sig, int):
        sig = torch.as_tensor(sig, device=a.device)
    if span_a is None:
        span_a = row_span(a, sig)
    # every term is a multiple of the product of the units and below the product of the bounds (docstring);
    # an all-zero row (span -NONE) sums to 0 in any tier
    span = span_a + w.span.to(a.device)[group] + math.ceil(math.log2(max(a.shape[1], 1)))
    tier = (span > FP32_BITS).to(torch.int64) + (span > FP64_BITS).to(torch.int64)
    if w.wt32 is None:
        tier = tier.clamp(min=1)
    if FORCE_TIER is not None:
        tier = tier.clamp(min=FORCE_TIER)
    if checked is not True:
        tier = torch.where(torch.as_tensor(checked, device=a.device), tier, 1)
    counts = torch.bincount(tier, minlength=3).tolist()
    STATS["rows"] += a.shape[0]
    for t, name in enumerate(("fp32_rows", "fp64_rows", "slow_rows")):
        STATS[name] += counts[t]

    def run(t, rows):
        x, g = (a, group) if rows is None else (a[rows], group[rows])
        if t == 0:
            return _fp32_grouped(x, w, g)
        if t == 1:
            return _fp64_grouped(x, w, g).to(torch.float32)
        return exact_rows(x, sig if rows is None or isinstance(sig, int) else sig[rows], w.w64[g], w_sig)

    only = [t for t in range(3) if counts[t] == a.shape[0]]
    if only:
        return run(only[0], None)
    out = a.new_empty(a.shape[0], w.w64.shape[1], dtype=torch.float32)
    for t in range(3):
        if counts[t]:
            rows = (tier == t).nonzero().flatten()
            out[rows] = run(t, rows)
    return out


def exact_grouped_matmul(a: torch.Tensor, a_sig, w, counts: torch.Tensor, w_sig: int = SIG_BITS["e2m1"]):
    """Rows a [S, K] sorted by group (``counts`` per group) times weights [G, N, K] (a tensor or
    ``GemmWeights``), exactly rounded (``exact_matmul``)."""
    w = w if isinstance(w, GemmWeights) else GemmWeights.of(w, w_sig)
    group = torch.repeat_interleave(torch.arange(len(counts), device=a.device), counts)
    return exact_matmul(a, a_sig, w, group, w_sig=w_sig)


def round_sums_f32(rows: list[list[float]], device=None) -> torch.Tensor:
    """RN_fp32 of the exact sum of each list of float64 values. ``math.fsum`` gives s = RN_fp64(sum);
    RN_fp32(s) is RN_fp32(sum) unless s sits exactly on an FP32 rounding midpoint (a float64 number, so no
    value strictly between s and the sum can be one), and there the sign of sum - s decides."""
    s = torch.tensor([math.fsum(v) for v in rows], dtype=torch.float64)
    out = s.to(torch.float32)
    toward = torch.where(s > out.to(torch.float64), math.inf, -math.inf).to(torch.float32)
    other = torch.nextafter(out, toward)
    tie = (s != out.to(torch.float64)) & (s == (out.to(torch.float64) + other.to(torch.float64)) / 2) & out.isfinite()
    for i in tie.nonzero().flatten().tolist():
        rest = math.fsum(rows[i] + [-float(s[i])])
        if rest != 0 and (rest > 0) == (float(other[i]) > float(out[i])):
            out[i] = other[i]
    return out.to(device) if device is not None else out


def exact_rows(a: torch.Tensor, a_sig, w: torch.Tensor, w_sig: int = SIG_BITS["e2m1"]) -> torch.Tensor:
    """The exact path (tier 3) for rows a [R, K] against their own weights w [R, N, K] (module docstring).
    ``a_sig``: an int or one per row."""
    r, k = a.shape
    n = w.shape[1]
    if r == 0:
        return a.new_zeros(0, n, dtype=torch.float32)
    a64, w64 = a.to(torch.float64), w.to(torch.float64)
    ok = False
    if k % BLOCK == 0:
        blocks = k // BLOCK
        terms = (a64.view(r, 1, blocks, BLOCK) * w64.view(r, n, blocks, BLOCK)).sum(-1)  # [R, N, blocks]
        sig = torch.as_tensor(a_sig, device=a.device)
        hi_a, lo_a = row_bounds(a.view(r, blocks, BLOCK), sig.view(-1, 1) if sig.dim() else sig)  # [R, blocks]
        hi_w, lo_w = row_bounds(w.view(r, n, blocks, BLOCK).transpose(1, 2).reshape(r, blocks, -1), w_sig)
        empty = (hi_a == -NONE) | (hi_w == -NONE)
        ok = bool(((hi_a + hi_w + 5 - lo_a - lo_w <= FP64_BITS) | empty).all())  # every block sum exact
    if not ok:
        terms = a64[:, None, :] * w64  # [R, N, K]: a product of two FP32 values is exact in float64
    return round_sums_f32(terms.reshape(r * n, -1).tolist(), a.device).view(r, n)
