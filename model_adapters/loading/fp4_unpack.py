"""transformers' FP4 unpacking on load, by one table lookup per byte: the same floats, ~40x sooner.

transformers dequantizes an FP4 checkpoint's experts on a CPU load (``Fp8Dequantize._unpack_fp4``): it splits
every byte into its two nibbles and indexes its 16-entry E2M1 table with each, allocating four temporaries
per tensor. In the canary gate its load took 1.9-2.2 s of CPU with them, 0.9-1.0 s with this, on the gate's
critical path (``benchmarks/bench_canary_gate.py --ab``); more where the garbage collector runs (a library caller). A byte's two values depend on the byte alone, so a 256-row table of
(low nibble's value, high nibble's value) built from transformers' own table gives every value bit for bit
(``tests/test_fp4_unpack.py``).
"""

from __future__ import annotations

import contextlib

import torch


def pair_table(lut: tuple[float, ...]) -> torch.Tensor:
    """[256, 2] float32: byte b -> (lut[b & 0xF], lut[b >> 4]), the order transformers unpacks them in."""
    values = torch.tensor(lut, dtype=torch.float32)
    return torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)


def unpack_fp4(packed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values per byte -> float32, twice as wide on the last dim (``Fp8Dequantize._unpack_fp4``'s result)."""
    codes = packed.contiguous().view(torch.uint8).reshape(-1).long()
    pairs = table.to(packed.device).index_select(0, codes)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@contextlib.contextmanager
def fast_fp4_unpack():
    """While loading: transformers' ``Fp8Dequantize._unpack_fp4`` by ``unpack_fp4`` (restored afterwards). A
    transformers without that method (another version) loads as it does."""
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    except ImportError:
        yield
        return
    original = Fp8Dequantize.__dict__.get("_unpack_fp4")
    lut = getattr(Fp8Dequantize, "_FP4_E2M1_LUT", None)
    if original is None or lut is None or len(lut) != 16:
        yield
        return
    table = pair_table(tuple(lut))
    Fp8Dequantize._unpack_fp4 = lambda self, packed: unpack_fp4(packed, table)
    try:
        yield
    finally:
        Fp8Dequantize._unpack_fp4 = original
