"""A model identity cheap enough for a 150 GB checkpoint: config plus safetensors headers, never weight bytes.

The safetensors header lists every tensor's name, dtype, shape and byte offsets, so two checkpoints that
differ in layout or precision differ here; the tokenizer and chat template are hashed whole (they are
small). Weight values are not covered: the fingerprint assumes a checkpoint directory is not edited in
place with the same shapes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

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
    for shard in sorted(d.glob("*.safetensors")):
        headers.update(shard.name.encode() + b"\0" + _safetensors_header(shard))
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            tokenizer.update(name.encode() + b"\0" + (d / name).read_bytes())
    weights_sha = headers.hexdigest()
    tokenizer_sha = tokenizer.hexdigest()
    return {
        "fingerprint": _sha(f"{config_sha}:{weights_sha}:{tokenizer_sha}".encode())[:16],
        "config_sha256": config_sha,
        "safetensors_headers_sha256": weights_sha,
        "tokenizer_sha256": tokenizer_sha,
        "model_type": config.get("model_type"),
    }
