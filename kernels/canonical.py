"""Canonical numerics: one result per input, whatever the batch, the thread count or the CPU's instruction set.

On a CPU, PyTorch computes three kinds of operation in a way that depends on more than the input:

- sums (ATen reductions add in an order that follows the tensor's shape, the thread split and the vector
  width, which is 8 floats on AVX2 and 16 on AVX-512);
- matrix products (BLAS blocks K by the matrix shape, the thread count and the instruction set, with FMA);
- elementary functions (exp, cos, log1p, ... come from SLEEF's vector code on AVX2/AVX-512 and from libm
  with ``ATEN_CPU_CAPABILITY=default``; they differ in the last bit).

Elementwise +, -, *, /, comparisons, max/min, rounding and dtype conversions are correctly rounded IEEE
operations and are reproducible already; sqrt and rsqrt are not on every build (``sqrt``, ``rsqrt`` below). This module gives each of the three a definition that every
order, thread split and instruction set computes bit for bit (docs/kernels.md#canonical-numerics):

- ``fixed_matmul``: each row of A and each column of B is put on a power-of-two fixed-point grid, A_BITS and
  53 - A_BITS - ceil(log2 K) bits below its own largest element, and rounded to integers (half to even).
  Their dot products are then exact in float64 whatever the order BLAS adds in, and are rounded once to
  FP32, then to the output dtype. An output element depends on its own row of A and column of B only,
  never on the other rows in the batch. Where K is not fixed by the model (attention values: one term per
  key, and padding adds keys) B is scaled per row instead (per key) with fixed budgets ROWS_A_BITS and
  ROWS_B_BITS, and sums of more than ROWS_CHUNK terms are added chunk by chunk in int64.
- ``fixed_sum``: every element on a grid SUM_BITS bits below the slice's largest, added in int64 (exact,
  any order). Zeros, e.g. padding, change nothing. ``ordered_sum`` adds a short structural dimension
  (hyper-connection streams, top-k slots) one element after the other.
- ``exp``, ``softplus``, ``cos``, ``sin``, ``sqrt``, ``rsqrt``: the exact value rounded once to FP32 (correctly
  rounded). A float64
  evaluation decides the rounding wherever it is more than 2^-46 (relative) away from a rounding boundary,
  which holds for all but about one element in 10^6; mpmath decides the rest. ``sigmoid`` and ``silu`` are
  PyTorch's own FP32 formulas, 1 / (1 + exp(-x)) and x / (1 + exp(-x)), over that exp.
- ``topk``: a stable sort, ties to the lower index.

Nothing here depends on transformers; ``evalgate.model_adapters.canonical.invariant`` builds the model's forward pass
from these, and the emulated kernels (``exact.py``) use exact dot products of their quantized operands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

VERSION = "canonical-v1"

A_BITS = 24  # left operand (activations): integers of at most 2^24 per row
ROWS_A_BITS, ROWS_B_BITS = 22, 17  # "rows" operands (attention values) and their left operand
ROWS_CHUNK = 2 ** (53 - ROWS_A_BITS - ROWS_B_BITS)  # 16384 terms per exact float64 partial sum
SUM_BITS = 40  # fixed_sum: int64 holds 2^22 such terms without overflow
CR_MARGIN = 2.0**-46  # relative half-width of the float64 interval that must round to one FP32 value


# --- exact powers of two and exponents --------------------------------------------------------------


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e in float64 for an integer tensor, built from the bits (exact; no pow or exp2 library call).
    Exponents are clamped to the normal float64 range [-1022, 1023]."""
    return ((e.to(torch.int64).clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


def exponent(x: torch.Tensor) -> torch.Tensor:
    """Integer e with |x| < 2^e (and >= 2^(e-1) for normal x), 0 for zeros (torch.frexp: exact)."""
    return torch.frexp(x).exponent


SMALL = 4096  # elements: below this, a chain of elementwise steps on a CPU tensor runs in NumPy (``_small``)


def _small(t: torch.Tensor) -> bool:
    """Whether ``t`` is a small CPU tensor outside autograd, which the exact integer and IEEE steps below
    compute in NumPy: the same operations, bit for bit, for a fraction of torch's dispatch cost per call
    (these run on per-row maxima and norms, [B, 1, 1], dozens of times per decoding step)."""
    return t.dim() > 0 and t.numel() <= SMALL and t.device.type == "cpu" and not t.requires_grad


def grid_scales(top: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1/s) for non-negative float64 maxima ``top``: s = 2^(bits - e) with top < 2^e, so |x * s| < 2^bits
    for every |x| <= top. Read from the float64 exponent field (exact; a zero maximum gets some finite s)."""
    if _small(top):  # the same integer steps in NumPy; 1 / s is exact (a power of two)
        biased = np.maximum((2045 + bits) - (top.numpy().view(np.int64) >> 52), 1)  # (np.clip: slow on tiny arrays)
        s = (np.minimum(biased, 2046, out=biased) << 52).view(np.float64)
        return torch.from_numpy(s), torch.from_numpy(1.0 / s)
    biased = top.view(torch.int64) >> 52  # e + 1022 for a normal top
    s = (((2045 + bits) - biased).clamp_(1, 2046) << 52).view(torch.float64)
    return s, 1.0 / s


def _scaled64(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x * s in float64 (exact: s is a power of two), in place on the float64 copy where x has another dtype.
    ``s`` has x's shape but for dimensions of 1 (a slice's own scale), so the product has x's shape."""
    return x * s if x.dtype == torch.float64 else x.to(torch.float64).mul_(s)


def _top64(x: torch.Tensor, dim: int, nonnegative: bool = False) -> torch.Tensor:
    """The largest magnitude of each slice along ``dim`` (keepdim), as float64. abs and max are exact in any
    dtype, so they run on x as it is (a BF16 input moves a quarter of the bytes of its float64 copy)."""
    return (x if nonnegative else x.abs()).amax(dim=dim, keepdim=True).to(torch.float64)


def _to_grid(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x on the fixed-point grid of each slice along ``dim``: (integers |q| <= 2^bits as float64, 1/s) with
    x ~ q / s, s the power of two that puts the slice's largest magnitude just below 2^bits."""
    s, inv = grid_scales(_top64(x, dim), bits)
    return _scaled64(x, s).round_(), inv


# --- matrix products --------------------------------------------------------------------------------


def columns_bits(k: int) -> int:
    """Bits of a "columns" right operand with K terms per dot product: A_BITS + bits + ceil(log2 K) = 53."""
    return 53 - A_BITS - max(1, math.ceil(math.log2(max(k, 1))))


@dataclass
class FixedOperand:
    """A right operand B [..., K, N] on its fixed-point grid: ``q`` float64 integers, ``scale`` the power of
    two with B ~ q * scale (per column or per row), ``values`` = q * scale.

    mode "columns": one scale per column (over K), the usual case (a linear layer's output rows, attention
    keys). mode "rows": one per row (over N), folded into A's columns before A is put on its grid; used when
    the columns run over a dimension that padding lengthens (attention values: a column is one channel of
    every key, a row is one key)."""

    q: torch.Tensor
    scale: torch.Tensor
    mode: str
    values: torch.Tensor | None = None

    def __post_init__(self):
        if self.values is None and self.mode == "columns":
            self.values = self.q * self.scale  # exact: integers times a power of two per column

    def cat(self, other: "FixedOperand", dim: int) -> "FixedOperand":
        """Two operands side by side (keys of a cache and the new ones): each column or row keeps its grid."""
        values = None if self.values is None else torch.cat([self.values, other.values], dim)
        return FixedOperand(torch.cat([self.q, other.q], dim), torch.cat([self.scale, other.scale], dim), self.mode,
                            values)

    def narrow(self, dim: int, start: int, length: int) -> "FixedOperand":
        values = None if self.values is None else self.values.narrow(dim, start, length)
        return FixedOperand(self.q.narrow(dim, start, length), self.scale.narrow(dim, start, length), self.mode,
                            values)


def fixed_operand(b: torch.Tensor, mode: str = "columns") -> FixedOperand:
    if mode not in ("columns", "rows"):
        raise ValueError(f"mode {mode!r}; expected 'columns' or 'rows'")
    if mode == "columns":
        q, inv = _to_grid(b, columns_bits(b.shape[-2]), -2)
    else:
        q, inv = _to_grid(b, ROWS_B_BITS, -1)
    return FixedOperand(q, inv, mode)


def _chunked_integer_matmul(aq: torch.Tensor, bq: torch.Tensor) -> torch.Tensor:
    """aq @ bq for float64 integers (rows budgets): exact in any order, ROWS_CHUNK terms per float64 product,
    chunks added in int64. Returns float64 (the int64 total rounded once where it exceeds 2^53)."""
    k = aq.shape[-1]
    if k <= ROWS_CHUNK:
        return torch.matmul(aq, bq)
    n_chunks = -(-k // ROWS_CHUNK)
    pad = n_chunks * ROWS_CHUNK - k
    if pad:
        aq = torch.nn.functional.pad(aq, (0, pad))
        bq = torch.nn.functional.pad(bq, (0, 0, 0, pad))
    a = aq.unflatten(-1, (n_chunks, ROWS_CHUNK)).movedim(-2, -3)  # [..., c, M, ROWS_CHUNK]
    b = bq.unflatten(-2, (n_chunks, ROWS_CHUNK))  # [..., c, ROWS_CHUNK, N]
    return torch.matmul(a, b).to(torch.int64).sum(dim=-3).to(torch.float64)


def _integer_matmul(aq: torch.Tensor, bq: torch.Tensor) -> torch.Tensor:
    """aq @ bq for float64 integers whose every partial sum is exact (any order gives the same result). A
    batched right operand stored key-major (attention keys, ``KeptOperands``: the transpose of a contiguous
    tensor) is multiplied as (bq^T aq^T)^T, which BLAS runs several times faster for few rows of aq."""
    if bq.dim() > 2 and bq.stride(-2) == 1 and bq.stride(-1) != 1 and aq.shape[-2] < bq.shape[-1]:
        return torch.matmul(bq.transpose(-1, -2), aq.transpose(-1, -2)).transpose(-1, -2)
    return torch.matmul(aq, bq)


def fixed_matmul(a: torch.Tensor, b: FixedOperand, out_dtype: torch.dtype | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """A [..., M, K] @ B [..., K, N] with canonical accumulation (module docstring); batch dims broadcast.
    Rounded once to FP32 (+ bias in FP32), then to ``out_dtype`` (default: a's dtype)."""
    if b.mode == "columns":
        s, inv = grid_scales(_top64(a, -1), A_BITS)
        # every term of an output is an integer multiple of its row's and column's units: exact in any order
        total = _integer_matmul(_scaled64(a, s).round_(), b.values).mul_(inv)
    else:
        a64 = a.to(torch.float64) * b.scale.transpose(-1, -2)  # A·diag(s) · diag(1/s)·B = A·B, exactly (and
        # a new tensor of the broadcast shape, which the grid below may overwrite)
        s, inv = grid_scales(_top64(a64, -1), ROWS_A_BITS)
        total = _chunked_integer_matmul(a64.mul_(s).round_(), b.q).mul_(inv)
    out = total.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    dtype = out_dtype or a.dtype
    return out if dtype == torch.float32 else out.to(dtype)


def cached_operand(owner, name: str, tensors, build) -> FixedOperand:
    """``build(tensors)`` cached on ``owner`` (a module) until a tensor's storage or version changes.
    ``tensors``: one tensor or a tuple of them."""
    key = tuple((t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
                for t in (tensors if isinstance(tensors, tuple) else (tensors,)))
    cache = owner.__dict__.setdefault("_evalgate_canonical_cache", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = build(tensors)
    cache[name] = (key, value)
    return value


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, owner=None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Canonical ``F.linear``: x [..., K] @ weight[N, K]^T (+ bias). ``owner`` caches the weight's grid."""
    build = lambda w: fixed_operand(w.t(), "columns")  # noqa: E731
    b = cached_operand(owner, f"linear:{id(weight)}", weight, build) if owner is not None else build(weight)
    lead = x.shape[:-1]
    out = fixed_matmul(x.reshape(-1, x.shape[-1]), b, out_dtype or torch.promote_types(x.dtype, weight.dtype), bias)
    return out.reshape(*lead, weight.shape[0])


# --- sums -------------------------------------------------------------------------------------------


def fixed_sum(x: torch.Tensor, dim: int, keepdim: bool = False, nonnegative: bool = False) -> torch.Tensor:
    """Canonical sum along ``dim`` (module docstring), as float64; round it to the dtype you need."""
    s, inv = grid_scales(_top64(x, dim, nonnegative), SUM_BITS)
    q = _scaled64(x, s).round_()
    if x.shape[dim] <= 2 ** (53 - SUM_BITS):  # every partial sum is an integer below 2^53: exact in float64
        total = q.sum(dim=dim, keepdim=True)
    else:
        total = q.to(torch.int64).sum(dim=dim, keepdim=True).to(torch.float64)
    total = total * inv
    return total if keepdim else total.squeeze(dim)


def fixed_mean(x: torch.Tensor, dim: int, keepdim: bool = False, nonnegative: bool = False) -> torch.Tensor:
    """fixed_sum / n in float64."""
    return fixed_sum(x, dim, keepdim, nonnegative) / x.shape[dim]


def ordered_sum(x: torch.Tensor, dim: int, keepdim: bool = False, acc_dtype=torch.float32) -> torch.Tensor:
    """Sum along a short structural dimension, one element after the other (index 0, 1, ...), in
    ``acc_dtype``; for dimensions fixed by the model (streams, slots), not by the batch. Two terms have one
    correctly rounded sum in any order, so PyTorch's own sum computes that case."""
    if x.shape[dim] <= 2 and x.dtype == acc_dtype:
        return x.sum(dim=dim, keepdim=keepdim)
    parts = x.to(acc_dtype).unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.unsqueeze(dim) if keepdim else acc


# --- correctly rounded elementary functions ----------------------------------------------------------


def _mp_functions():
    import mpmath

    return {
        "exp": mpmath.exp,
        "softplus": lambda x: mpmath.log1p(mpmath.exp(x)),
        "cos": mpmath.cos,
        "sin": mpmath.sin,
        "sqrt": mpmath.sqrt,
        "rsqrt": lambda x: 1 / mpmath.sqrt(x),
    }


def _round_to_f32(v, prec: int) -> tuple[float, bool]:
    """(RN_fp32(v), whether v is too close to a rounding boundary for the working precision to tell)."""
    import mpmath

    if v == 0:
        return 0.0, False
    sign = -1.0 if v < 0 else 1.0
    a = abs(v)
    _, e = mpmath.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    quantum = max(int(e) - 1, -126) - 23  # FP32 spacing at a (subnormals: 2^-149)
    t = mpmath.ldexp(a, -quantum)
    n = int(mpmath.floor(t))
    frac = t - n
    close = abs(frac - mpmath.mpf(0.5)) <= t * mpmath.ldexp(1, -prec + 8)
    n += 1 if frac > 0.5 else 0
    value = math.ldexp(float(n), quantum) if quantum + n.bit_length() <= 128 else math.inf
    return sign * value, bool(close)


def _exact_f32(name: str, xs: list[float]) -> list[float]:
    """RN_fp32(f(x)) for each x, with mpmath at growing precision until the rounding is certain."""
    import mpmath

    fn = _mp_functions()[name]
    out = []
    for x in xs:
        if math.isnan(x):
            out.append(math.nan)
            continue
        for prec in (128, 256, 1024, 4096):
            with mpmath.workprec(prec):
                r, close = _round_to_f32(fn(mpmath.mpf(x)), prec)
            if not close:
                break
        out.append(r)
    return out


def _native_f64(name: str, x: torch.Tensor) -> torch.Tensor:
    """f(x) in float64 with PyTorch's own functions: within a float64 ulp or two on every instruction set
    (SLEEF u10 and libm are within 1 ulp; log1p(exp) adds at most 2), far inside CR_MARGIN."""
    if name == "exp":
        return torch.exp(x)
    if name == "softplus":
        return torch.log1p(torch.exp(x))
    if name == "cos":
        return torch.cos(x)
    if name == "sin":
        return torch.sin(x)
    if name == "sqrt":
        return torch.sqrt(x)
    if name == "rsqrt":
        return 1.0 / torch.sqrt(x)
    raise ValueError(name)


FORCE_EXACT = False  # tests: decide every element with mpmath, to check the fast path against it


def correctly_rounded(name: str, x: torch.Tensor) -> torch.Tensor:
    """RN_fp32(f(x)) for f in exp, softplus, cos, sin, sqrt, rsqrt; float32 out (same shape)."""
    x64 = x.to(torch.float64)
    if name in ("sqrt", "rsqrt") and _small(x64) and not FORCE_EXACT:  # the norms' [B, 1, 1]
        return _correctly_rounded_small(name, x64)
    y = _native_f64(name, x64)
    out = y.to(torch.float32)
    margin = y.abs().mul_(CR_MARGIN)
    below = (y - margin).to(torch.float32)
    unsure = below != margin.add_(y).to(torch.float32)  # RN(y - margin) != RN(y + margin)
    if FORCE_EXACT:
        unsure = torch.ones_like(unsure)
    if bool(unsure.any()):
        where = unsure.nonzero(as_tuple=True)
        fixed = _exact_f32(name, x64[where].tolist())
        out = out.clone()
        out[where] = torch.tensor(fixed, dtype=torch.float32, device=out.device)
    return out


def _correctly_rounded_small(name: str, x64: torch.Tensor) -> torch.Tensor:
    """``correctly_rounded`` of sqrt or rsqrt for a small CPU tensor (``_small``), all in NumPy: sqrt and
    1 / sqrt in float64 are IEEE operations (the same bits as PyTorch's), and so are the rounding and the
    margin test (the same elements are decided by mpmath)."""
    with np.errstate(all="ignore"):  # NaN and infinities pass through silently, as in torch
        y = np.sqrt(x64.numpy())
        if name == "rsqrt":
            y = 1.0 / y
        out = y.astype(np.float32)
        margin = np.abs(y) * CR_MARGIN
        unsure = (y - margin).astype(np.float32) != (y + margin).astype(np.float32)
    if unsure.any():
        where = unsure.nonzero()
        out[where] = _exact_f32(name, x64.numpy()[where].tolist())
    return torch.from_numpy(out)


def power(base: float, t: torch.Tensor) -> torch.Tensor:
    """RN_fp32(base ** t) for a float base and each element of t (mpmath throughout: for constants such as
    RoPE frequencies, computed once)."""
    import mpmath

    out = []
    for x in t.to(torch.float64).tolist():
        for prec in (128, 256, 1024, 4096):
            with mpmath.workprec(prec):
                r, close = _round_to_f32(mpmath.power(mpmath.mpf(base), mpmath.mpf(x)), prec)
            if not close:
                break
        out.append(r)
    return torch.tensor(out, dtype=torch.float32, device=t.device).view(t.shape)


def exp(x):
    return correctly_rounded("exp", x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in FP32 with exp correctly rounded: PyTorch's own CPU formula, made canonical."""
    return 1.0 / (1.0 + exp(-x.to(torch.float32)))


_BF16_EXP: dict = {}  # device -> exp of every BF16 value, indexed by its 16 bits (``exp_bf16``)


def _bf16_exp_table(device) -> torch.Tensor:
    """``exp`` of all 65536 BF16 bit patterns as FP32 [65536], computed once by ``exp`` itself. NaNs give
    the NaN ``exp`` gives them; from 89 on (and at +inf) exp(x) > 2^128, whose FP32 rounding is inf (what
    ``exp`` finds there, after mpmath: float64 overflows from 710 on)."""
    table = _BF16_EXP.get(device)
    if table is None:
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)
        table = torch.full((65536,), math.nan)
        ok = x < 89.0  # not NaN either
        table[ok] = exp(x[ok])
        table[x >= 89.0] = math.inf
        table = _BF16_EXP[device] = table.to(device)
    return table


def exp_bf16(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` (FP32 out) by table lookup where ``x`` is BF16, or FP32 holding BF16 values only (the MoE's
    gates, rounded to BF16 before SwiGLU; attention scores): the same bits as ``exp``, whose results the
    table holds, for a gather instead of ~12 passes over the data (float64 exp, rounding, margin test).
    Other inputs go to ``exp``."""
    index = None
    if FORCE_EXACT:  # tests: every element through exp's mpmath path
        pass
    elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
        index = x.view(torch.int16).to(torch.int32) & 0xFFFF
    elif x.device.type == "cpu" and x.dtype == torch.float32:  # FP32 holding BF16 values only
        bits = x.view(torch.int32)
        if not bool((bits & 0xFFFF).any()):
            index = (bits >> 16) & 0xFFFF
    if index is None:
        return exp(x)
    return _bf16_exp_table(x.device).index_select(0, index.reshape(-1)).view(index.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in FP32 with exp correctly rounded (PyTorch's own CPU formula)."""
    x32 = x.to(torch.float32)
    return x32 / (1.0 + exp_bf16(-x32))


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1): x itself above the threshold, else RN_fp32(log1p(exp(x)))."""
    x32 = x.to(torch.float32)
    return torch.where(x32 > threshold, x32, correctly_rounded("softplus", x32))


def sqrt(x):
    """Correctly rounded: PyTorch's own FP32 sqrt and rsqrt are approximations on some builds (2.13's CPU
    kernels are off by an ulp for about one input in six), and differ between builds."""
    return correctly_rounded("sqrt", x)


def rsqrt(x):
    return correctly_rounded("rsqrt", x)


def cos(x):
    return correctly_rounded("cos", x)


def sin(x):
    return correctly_rounded("sin", x)


# --- softmax, top-k ---------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1, structural: bool = False) -> torch.Tensor:
    """exp(x - max) / sum, in FP32 like ``F.softmax(x, dtype=float32)``: each exp correctly rounded, the sum
    canonical (``ordered_sum`` over a structural dimension, else ``fixed_sum``), one FP32 division. exp goes
    through ``exp_bf16``: BF16 inputs minus their maximum are often BF16 values still (attention scores after
    their own maximum was taken off: x - 0 = x), whose exp the table holds."""
    x32 = x.to(torch.float32)
    z = x32 - x32.amax(dim=dim, keepdim=True)
    e = exp_bf16(z)
    if structural:
        s = ordered_sum(e, dim, keepdim=True)
    else:
        s = fixed_sum(e, dim, keepdim=True).to(torch.float32)
    return e / s


def topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along ``dim``, largest first, ties to the lower index (a stable sort)."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
