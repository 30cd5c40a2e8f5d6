"""FP4 expert weights: where an experts module's E2M1 codes and UE8M0 bytes come from, and their cache.

Three sources, in order of preference:
1. an ``FP8Experts`` module with FP4 storage (transformers on a GPU with compute capability >= 8.9):
   ``gate_up_proj`` int8 packed nibbles + ``gate_up_proj_scale_inv`` float8_e8m0fnu, used as stored;
2. codes attached by `checkpoint.attach_stored_fp4` after a CPU load, where transformers dequantized the
   FP4 checkpoint to BF16 (spec docs/kernels.md#fp4-checkpoint step 4); used as stored;
3. a BF16 ``DeepseekV4Experts`` module: quantized once (RCEIL, ties to even, spec docs/kernels.md#the-moe-forward step 1) and cached.

The cache sits on the module (a plain attribute, not a buffer: it never reaches a state dict) and is keyed
by the weight tensors' identity and version counters, so loading or editing weights invalidates it.
Dequantized float64 and FP32 copies (`exact.GemmWeights`) are cached too (per fault variant), unless they would exceed a memory budget;
then they are dequantized per forward, a chunk of experts at a time, only for experts that are hit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from . import formats
from .formats import GROUP

_CACHE_ATTR = "_evalgate_fp4_cache"
_STORED_ATTR = "_evalgate_fp4_stored"
# Dequantized weights (float64 + FP32) bigger than this are not kept; they are rebuilt chunk by chunk per forward.
DEQUANT_CACHE_BYTES = int(os.environ.get("EVALGATE_DEQUANT_CACHE_BYTES", 8 << 30))
CHUNK_BYTES = 1 << 30  # dequantized weight bytes (float64 + FP32) at once when not cached


@dataclass
class Fp4ExpertWeights:
    """Routed-expert weights in the checkpoint's own encoding (spec docs/kernels.md#fp4-checkpoint), experts stacked on dim 0.

    w1: [gate; up] rows [E, 2I, H/2] packed E2M1 (low nibble = even K), w1_scale [E, 2I, H/32] UE8M0 bytes;
    w2: down [E, H, I/2], w2_scale [E, H, I/32]."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    source: str  # "fp8experts" | "checkpoint" | "quantized-from-bf16" | "synthetic"

    def __post_init__(self):
        for name in ("w1", "w1_scale", "w2", "w2_scale"):
            t = getattr(self, name)
            if t.dtype != torch.uint8:
                setattr(self, name, t.contiguous().view(torch.uint8))
        for name in ("w1_scale", "w2_scale"):
            if bool((getattr(self, name) == 255).any()):
                raise ValueError(f"{name} holds UE8M0 byte 255 (NaN); the checkpoint is corrupt (spec docs/kernels.md#fp4-checkpoint)")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2] * 2

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2] * 2

    def dequantize(self, lo: int = 0, hi: int | None = None, fault: str | None = None):
        """FP32 (W1 [n, 2I, H], W2 [n, H, I]) for experts lo..hi-1; exact (spec docs/kernels.md#the-moe-forward step 1)."""
        hi = self.num_experts if hi is None else hi
        s1, s2 = self.w1_scale[lo:hi], self.w2_scale[lo:hi]
        if fault == "weight_scale_exponent_plus_one":
            s1, s2 = scale_exponent_plus_one(s1), scale_exponent_plus_one(s2)
        w1 = formats.dequantize_packed_e2m1(self.w1[lo:hi], s1)
        w2 = formats.dequantize_packed_e2m1(self.w2[lo:hi], s2)
        return w1, w2

    def to(self, device) -> "Fp4ExpertWeights":
        return replace(self, **{n: getattr(self, n).to(device) for n in ("w1", "w1_scale", "w2", "w2_scale")})


def double_one_group_per_row(w: torch.Tensor) -> torch.Tensor:
    """Fault (a) applied to dequantized FP32 weights [n, rows, K]: x2 is exactly what byte + 1 does
    (bytes never reach the 254 clamp in real weights). Cheaper than dequantizing again."""
    n, rows, k = w.shape
    out = w.clone()
    groups = out.view(n, rows, k // GROUP, GROUP)
    r = torch.arange(rows, device=w.device)
    groups[:, r, r % (k // GROUP)] *= 2
    return out


def scale_exponent_plus_one(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Fault (a): in every row, the UE8M0 byte of one group (group row % groups, so every group column
    is hit somewhere) is one too high: that group's weights come out doubled."""
    s = scale_bytes.clone()
    rows, groups = s.shape[-2], s.shape[-1]
    r = torch.arange(rows, device=s.device)
    g = r % groups
    s[..., r, g] = (s[..., r, g].to(torch.int32) + 1).clamp(max=254).to(torch.uint8)
    return s


def quantize_expert_weights(gate_up: torch.Tensor, down: torch.Tensor, source: str = "quantized-from-bf16") -> Fp4ExpertWeights:
    """BF16/FP32 [E, 2I, H] and [E, H, I] -> FP4 codes + UE8M0 bytes (RCEIL, no floor, ties to even).
    Runs expert by expert to bound memory."""
    parts = {"w1": [], "w1_scale": [], "w2": [], "w2_scale": []}
    for e in range(gate_up.shape[0]):
        for key, w in (("w1", gate_up[e]), ("w2", down[e])):
            codes, scale = formats.quantize(w.detach(), "e2m1", formats.WEIGHTS, ties="even")
            parts[key].append(formats.pack_e2m1(codes))
            parts[key + "_scale"].append(scale)
    return Fp4ExpertWeights(**{k: torch.stack(v) for k, v in parts.items()}, source=source)


def weights_key(module) -> tuple:
    """Identity of the weights a cache entry was built from: tensor storage, version counter, shape,
    dtype, device. In-place edits bump the version counter; a reload replaces the storage."""
    key = []
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            key.append((name, t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device)))
    return tuple(key)


@dataclass
class _Cache:
    key: tuple
    fp4: Fp4ExpertWeights
    dequantized: dict = field(default_factory=dict)  # fault -> (W1, W2) exact.GemmWeights


def _is_fp4_storage(module) -> bool:
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.dtype in (torch.int8, torch.uint8) and hasattr(module, "gate_up_proj_scale_inv")


def fp4_weights(module) -> Fp4ExpertWeights:
    """The module's FP4 expert weights; built at most once per weight version (see module docstring)."""
    key = weights_key(module)
    cache = module.__dict__.get(_CACHE_ATTR)
    if cache is not None and cache.key == key:
        return cache.fp4
    if getattr(module, "has_gate", True) is False or not hasattr(module, "gate_up_proj"):
        raise NotImplementedError("emulated FP4 kernels need gated experts with a [gate; up] gate_up_proj")
    if getattr(module, "is_transposed", False):
        raise NotImplementedError("emulated FP4 kernels expect is_transposed=False experts ([E, out, in])")
    if _is_fp4_storage(module):
        fp4 = Fp4ExpertWeights(
            module.gate_up_proj.data, module.gate_up_proj_scale_inv.data,
            module.down_proj.data, module.down_proj_scale_inv.data, source="fp8experts",
        )
    else:
        stored = module.__dict__.get(_STORED_ATTR)
        if stored is not None and stored[0] == key:
            fp4 = stored[1]
        else:
            with torch.no_grad():
                fp4 = quantize_expert_weights(module.gate_up_proj.data, module.down_proj.data)
    module.__dict__[_CACHE_ATTR] = _Cache(key, fp4)
    return fp4


def attach_stored(module, fp4: Fp4ExpertWeights) -> None:
    """Make `fp4_weights(module)` return these stored codes for as long as the module's weights stay the
    ones they were loaded as."""
    module.__dict__[_STORED_ATTR] = (weights_key(module), fp4)
    module.__dict__.pop(_CACHE_ATTR, None)


def expert_chunks(module, fp4: Fp4ExpertWeights, hit: torch.Tensor, fault: str | None):
    """Yield (lo, hi, W1, W2) `exact.GemmWeights` for ranges of experts that cover every hit expert.

    With the dequantized copies cached (small models): one range, all experts, no work per forward.
    Otherwise ranges of at most CHUNK_BYTES of weights, skipping experts nobody was routed to."""
    from .exact import GemmWeights

    cache = module.__dict__.get(_CACHE_ATTR)
    e, h, i = fp4.num_experts, fp4.hidden, fp4.intermediate
    per_expert = 3 * h * i * 12  # float64 + FP32 copies
    if cache is not None and per_expert * e <= DEQUANT_CACHE_BYTES:
        if fault not in cache.dequantized:
            cache.dequantized[fault] = tuple(GemmWeights.of(w) for w in fp4.dequantize(fault=fault))
        yield (0, e, *cache.dequantized[fault])
        return
    for lo, hi, w1, w2 in dequantized_ranges(fp4, hit, fault, max(1, CHUNK_BYTES // per_expert)):
        yield (lo, hi, GemmWeights.of(w1), GemmWeights.of(w2))


def dequantized_ranges(fp4: Fp4ExpertWeights, hit: torch.Tensor, fault: str | None, experts_per_chunk: int):
    """(lo, hi, W1, W2) FP32 for consecutive ranges of up to `experts_per_chunk` experts that contain a hit."""
    hit_ids = torch.nonzero(hit).flatten().tolist()
    while hit_ids:
        lo = hit_ids[0]
        hi = min(lo + experts_per_chunk, fp4.num_experts)
        hit_ids = [x for x in hit_ids if x >= hi]
        yield (lo, hi, *fp4.dequantize(lo, hi, fault=fault))


def check_shapes(fp4: Fp4ExpertWeights, hidden: int) -> None:
    if fp4.hidden != hidden or fp4.hidden % GROUP or fp4.intermediate % GROUP:
        raise ValueError(
            f"FP4 experts need hidden and intermediate sizes that are multiples of {GROUP} "
            f"(got hidden {fp4.hidden} for input {hidden}, intermediate {fp4.intermediate})"
        )
