"""A model identity cheap enough for a 150 GB checkpoint: config plus safetensors headers, never weight bytes.

The safetensors header lists every tensor's name, dtype, shape and byte offsets, so two checkpoints that
differ in layout or precision differ here; the tokenizer and chat template are hashed whole (they are
small). A checkpoint up to ``WEIGHT_BYTES_LIMIT`` (the canary, test models) is hashed whole, weight values
included, so a retrained model of the same shapes never matches a baseline recorded for the old one; a larger
one by its headers only (``weights_hashed``), which assumes its directory is not edited in place with the same
shapes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from evalgate.errors import UserError

WEIGHT_BYTES_LIMIT = 1 << 30  # about a second of sha256; a 150 GB checkpoint would take minutes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_fingerprint(model_dir: str | Path) -> dict:
    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    config_sha = _sha(json.dumps(config, sort_keys=True).encode())
    headers = hashlib.sha256()
    shards = sorted(d.glob("*.safetensors"))
    whole = sum(shard.stat().st_size for shard in shards) <= WEIGHT_BYTES_LIMIT
    for shard in shards:
        headers.update(shard.name.encode() + b"\0" + (shard.read_bytes() if whole else _safetensors_header(shard)))
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            tokenizer.update(name.encode() + b"\0" + (d / name).read_bytes())
    weights_sha = headers.hexdigest()
    tokenizer_sha = tokenizer.hexdigest()
    return {
        "fingerprint": _sha(f"{config_sha}:{weights_sha}:{tokenizer_sha}".encode())[:16],
        "config_sha256": config_sha,
        "safetensors_headers_sha256": weights_sha,  # the name predates whole-file hashing of small checkpoints
        "weights_hashed": "bytes" if whole else "headers",
        "tokenizer_sha256": tokenizer_sha,
        "model_type": config.get("model_type"),
    }


def check_model_dir(path: str | Path) -> Path:
    d = Path(path).expanduser()
    if not d.is_dir():
        raise UserError(f"model dir {str(d)!r} does not exist; pass --model a local transformers checkpoint folder")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise UserError(f"{str(d)!r} has no config.json; pass --model a transformers checkpoint folder")
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{str(cfg)!r} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{str(cfg)!r} has no model_type; it is not a transformers config")
    if not any(d.glob("*.safetensors")):
        raise UserError(f"{str(d)!r} has no *.safetensors weights")
    return d
