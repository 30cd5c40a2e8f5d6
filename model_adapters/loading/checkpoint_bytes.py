"""What a checkpoint will weigh once loaded, from its config and safetensors headers alone (no tensor read).

Every stored tensor is assigned to a placement unit (``placement.unit_order``): ``model.layers.N.…`` to
``layer.N``, the embedding to ``prefix``, everything else (final norm, hyper-connection head, output head) to
``suffix``; the MTP layer (``mtp.N.…``) to no unit: it is never loaded. Its loaded size: routed experts
(``…ffn.experts.E.w1/w2/w3.weight`` and their ``.scale``) at their stored size, since the packed E2M1 codes
and UE8M0 bytes are kept as stored; FP8 dense weights and their block scales as stored where they are kept
FP8 (a GPU), else the weight at the load dtype and no scale (dequantized); other floating-point tensors at
the load dtype, except those transformers keeps in FP32 (``FP32_KEPT``); integer tensors (hash routing
tables) as stored.
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
MTP = re.compile(r"^(?:model\.)?mtp\.")
# tensors transformers' DeepseekV4 keeps in FP32 whatever the load dtype (hyper-connections, attention sinks,
# compressor position biases, the router's score-correction bias), in the checkpoint's names and transformers' own
FP32_KEPT = re.compile(r"(?:hc_(?:attn|ffn)_(?:base|fn|scale)|hc_head[._](?:hc_)?(?:base|fn|scale)|(?:attn|ffn)_hc\."
                       r"|attn_sink|\.sinks|\.ape|position_bias|gate\.bias|e_score_correction_bias)")
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


def unit_of(key: str) -> str | None:
    """The placement unit of a checkpoint key; None for the MTP layer, which is not loaded."""
    if MTP.match(key):
        return None
    m = LAYER.search(key)
    if m:
        return f"layer.{int(m.group(1))}"
    return PREFIX if "embed" in key else SUFFIX


def fp8_dense_keys(tensors: list[StoredTensor]) -> set[str]:
    """Keys of the FP8 dense weights and their block scales."""
    weights = {t.key for t in tensors if t.dtype == "F8_E4M3" and not EXPERT.search(t.key)}
    return weights | {k[: -len("weight")] + "scale" for k in weights if k.endswith(".weight")}


def loaded_bytes(t: StoredTensor, load_dtype: str = "bfloat16", fp8_dense: bool = False,
                 keep_fp8: bool = False) -> int:
    """Bytes of ``t`` once loaded: packed experts and integers as stored, an FP8 dense weight (``fp8_dense``)
    and its scale as stored when ``keep_fp8``, else the weight at the load dtype and no scale; other floats at
    the load dtype, or FP32 (``FP32_KEPT``)."""
    if fp8_dense:
        if keep_fp8:
            return t.nbytes
        return 0 if t.key.endswith(".scale") else _numel(t) * DTYPE_BYTES[load_dtype]
    if EXPERT.search(t.key) or t.dtype not in FLOAT_DTYPES:
        return t.nbytes
    if FP32_KEPT.search(t.key):
        return _numel(t) * 4
    return _numel(t) * DTYPE_BYTES[load_dtype]


def _numel(t: StoredTensor) -> int:
    numel = 1
    for d in t.shape:
        numel *= d
    return numel


def unit_bytes(tensors: list[StoredTensor], load_dtype: str = "bfloat16", keep_fp8: bool = False) -> dict[str, int]:
    """placement unit -> loaded bytes (the MTP layer in none). ``keep_fp8``: FP8 dense weights stay FP8 (a
    GPU load), else they are dequantized to the load dtype."""
    fp8 = fp8_dense_keys(tensors)
    sizes: dict[str, int] = {}
    for t in tensors:
        u = unit_of(t.key)
        if u is not None:
            sizes[u] = sizes.get(u, 0) + loaded_bytes(t, load_dtype, t.key in fp8, keep_fp8)
    return sizes


def mtp_bytes(tensors: list[StoredTensor]) -> int:
    """Stored bytes of the MTP layer: on disk, never loaded."""
    return sum(t.nbytes for t in tensors if MTP.match(t.key))
