"""What a checkpoint will weigh once loaded, from its config and safetensors headers alone (no tensor read).

Every stored tensor is assigned to a placement unit (``placement.unit_order``): ``model.layers.N.…`` to
``layer.N``, the embedding to ``prefix``, everything else (final norm, hyper-connection head, output head) to
``suffix``. Its loaded size: routed experts (``…ffn.experts.E.w1/w2/w3.weight`` and their ``.scale``) at
their stored size, since the packed E2M1 codes and UE8M0 bytes are kept as stored; other floating-point
tensors at the load dtype; integer tensors (hash routing tables) as stored.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from evalgate.errors import UserError

from .placement import PREFIX, SUFFIX

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT = re.compile(r"(?:^|\.)layers\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")
FLOAT_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class StoredTensor:
    key: str
    shard: str  # file name
    dtype: str  # safetensors dtype name (BF16, I8, F8_E8M0, ...)
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(f"{str(path)!r} is not a safetensors file (too short); the checkpoint is damaged")
        (n,) = struct.unpack("<Q", raw)
        try:
            return json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{str(path)!r} has an unreadable safetensors header; the checkpoint is damaged") from None


def stored_tensors(model_dir: str | Path) -> list[StoredTensor]:
    """Every tensor of the checkpoint's shards, in shard order then key order."""
    out = []
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        for key, info in read_header(shard).items():
            if key == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out.append(StoredTensor(key, shard.name, info["dtype"], tuple(info["shape"]), b - a))
    return out


def unit_of(key: str) -> str:
    m = LAYER.search(key)
    if m:
        return f"layer.{int(m.group(1))}"
    return PREFIX if "embed" in key else SUFFIX


def loaded_bytes(t: StoredTensor, load_dtype: str = "bfloat16") -> int:
    """Bytes of ``t`` once loaded: packed experts and integers as stored, floats at the load dtype."""
    if EXPERT.search(t.key) or t.dtype not in FLOAT_DTYPES:
        return t.nbytes
    numel = 1
    for d in t.shape:
        numel *= d
    return numel * DTYPE_BYTES[load_dtype]


def unit_bytes(tensors: list[StoredTensor], load_dtype: str = "bfloat16") -> dict[str, int]:
    """placement unit -> loaded bytes."""
    sizes: dict[str, int] = {}
    for t in tensors:
        u = unit_of(t.key)
        sizes[u] = sizes.get(u, 0) + loaded_bytes(t, load_dtype)
    return sizes


def expert_bytes(tensors: list[StoredTensor]) -> int:
    """Stored bytes of the routed experts (codes + scales)."""
    return sum(t.nbytes for t in tensors if EXPERT.search(t.key))
