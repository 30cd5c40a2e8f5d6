"""Coupled sampling: a keyed Gumbel-max sampler whose randomness depends on its keys alone.

Sample j of item i draws, at generated position t, one Gumbel variable per vocabulary entry v from a
counter-based generator keyed by (stream seed, t, v); the stream seed is ``sample_seed(run seed, doc id, j)``.
The next token is argmax(logits / T + g), ties to the lower index. Nothing depends on the batch, the order
of the items, the thread count or the kernel, so two kernels produce the same sample unless the kernel's
perturbation of the logits moves the argmax: paired samples (docs/scoring.md#k-samples).

Bit-identical everywhere:

- the generator is integer arithmetic only: ``mix32`` (Wellons' lowbias32 finaliser, a bijection with full
  avalanche) on 32-bit values held in int64 tensors, every product kept below 2^63 (no overflow, so no
  platform-dependent wrap-around);
- the uniform is u = (2m + 1) / 2^53 for a 52-bit integer m: exact in float64, strictly inside (0, 1);
- the Gumbel value -log(-log u) is rounded once to float32, correctly: float64 decides wherever it is far
  from a float32 rounding boundary (PyTorch's log differs between instruction sets in the last float64 bit
  only), mpmath decides the rest (as ``evalgate.kernels.canonical.correctly_rounded`` does);
- logits / T + g is computed in float64 from float32 inputs (exact conversions, correctly rounded IEEE ops).

The server path reaches the same sampler: the client sends the stream seed as the request's ``seed``, and
``evalgate serve`` keys its sampler with it (docs/serving.md#per-request-seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from evalgate.model_adapters.sample_seeds import MAX_SEED, SAMPLER, SEED_RULE, sample_seed  # noqa: F401

MASK32 = 0xFFFFFFFF
_DOMAIN = 0x5EED5A3D  # first word of every counter: keeps this generator's streams apart from any other use
_LANES = 2  # two 32-bit words per uniform (52 bits used)
CR_MARGIN = 2.0**-46  # float64 error bound of -log(-log u), relative and absolute, with a wide safety factor


@dataclass(frozen=True)
class SampleKey:
    """How one sequence draws its tokens: its stream seed and temperature (> 0)."""

    seed: int
    temperature: float

    def __post_init__(self):
        if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature!r}")


# --- the counter-based generator ---------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for 32-bit x (int64 tensor) and a 32-bit constant, in 16-bit halves of c: every
    intermediate stays below 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32: a bijection of 32-bit integers with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def absorb(state: torch.Tensor, word) -> torch.Tensor:
    """The state after one more 32-bit counter word (sponge-style: xor, then mix)."""
    return mix32(state ^ (word & MASK32 if isinstance(word, torch.Tensor) else torch.tensor(word & MASK32)))


def counter_words(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> list[torch.Tensor]:
    """For each row (stream seed, position) and each vocabulary index, ``_LANES`` uniform 32-bit words: a pure
    function of (seed, position, index, lane). int64 tensors [rows, vocab] with values in [0, 2^32)."""
    seeds = seeds.to(torch.int64)
    state = torch.full_like(seeds, _DOMAIN)
    state = absorb(state, seeds & MASK32)
    state = absorb(state, seeds >> 32)
    state = absorb(state, positions.to(torch.int64))[:, None]
    index = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    return [mix32(absorb(state, index * _LANES + lane) ^ 0x9E3779B9) for lane in range(_LANES)]


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u = (2m + 1) / 2^53 in float64 (exact), m the 52-bit integer of a row's two words."""
    hi, lo = counter_words(seeds, positions, vocab)
    m = (hi << 20) | (lo >> 12)
    return (2 * m + 1).to(torch.float64) * 2.0**-53


# --- Gumbel noise, correctly rounded to float32 --------------------------------------------------------------


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """RN_fp32(-log(-log u)) for float64 u in (0, 1): the same bits on every instruction set."""
    y = -torch.log(-torch.log(u))
    out = y.to(torch.float32)
    margin = (y.abs() + 1.0) * CR_MARGIN
    unsure = (y - margin).to(torch.float32) != (y + margin).to(torch.float32)
    if bool(unsure.any()):
        where = unsure.nonzero(as_tuple=True)
        out = out.clone()
        out[where] = torch.tensor(_exact_gumbel(u[where].tolist()), dtype=torch.float32, device=out.device)
    return out


def _exact_gumbel(us: list[float]) -> list[float]:
    """-log(-log u) rounded to the nearest float32, with mpmath at growing precision until that is certain."""
    import mpmath
    import numpy as np

    out = []
    for u in us:
        for prec in (128, 256, 1024):
            with mpmath.workprec(prec):
                y = -mpmath.log(-mpmath.log(mpmath.mpf(u)))  # u is exact in float64
                f = np.float32(float(y))
                candidates = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
                dist = sorted((abs(y - mpmath.mpf(float(c))), float(c)) for c in candidates)
                certain = dist[1][0] - dist[0][0] > abs(y) * mpmath.ldexp(1, -prec + 8)
            if certain:
                break
        out.append(dist[0][1])
    return out


def noise(keys: list[SampleKey], positions: torch.Tensor, vocab: int, device="cpu") -> torch.Tensor:
    """Gumbel noise [rows, vocab] (float32) for each row's stream at its position."""
    seeds = torch.tensor([k.seed for k in keys], dtype=torch.int64, device=device)
    return gumbel(uniforms(seeds, positions.to(device), vocab))


# --- choosing the next token -------------------------------------------------------------------------------


def next_tokens(logits: torch.Tensor, keys: list[SampleKey | None] | None, position: int) -> torch.Tensor:
    """The next token of each row: argmax(logits) for a row without a key (greedy, today's path exactly),
    argmax(logits / T + g) for a sampled row, ties to the lower index either way. ``logits`` [rows, vocab]
    float32; ``position`` the index of the token being generated (0 for the first)."""
    greedy = logits.argmax(-1)
    if not keys or all(k is None for k in keys):
        return greedy
    rows = [i for i, k in enumerate(keys) if k is not None]
    sampled = [keys[i] for i in rows]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    positions = torch.full((len(rows),), position, dtype=torch.int64)
    g = noise(sampled, positions, logits.shape[-1], logits.device)
    temps = torch.tensor([k.temperature for k in sampled], dtype=torch.float64, device=logits.device)[:, None]
    scores = logits.index_select(0, index).to(torch.float64) / temps + g.to(torch.float64)
    out = greedy.clone()
    out[index] = scores.argmax(-1)
    return out
