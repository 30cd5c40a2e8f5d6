"""The run store: ``<run>/manifest.json`` plus one ``<task>.jsonl`` of per-item records per task.

Records are appended and fsynced per batch, so a crash loses at most the batch in flight; a torn last line
(killed mid-write) is ignored on read and cut away on resume. The manifest is replaced atomically
(temp file + rename). ``load_run`` gives a notebook the same data as pandas DataFrames.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.errors import UserError

MANIFEST = "manifest.json"


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: Path) -> tuple[list[dict], int]:
    """Complete records of a JSONL file, and the byte length they occupy (a torn tail is left out)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # torn last line: the writer died mid-append
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good += len(line)
    return records, good


class RecordWriter:
    """Appends records to ``<task>.jsonl``; one fsync per batch."""

    def __init__(self, path: Path):
        self.path = path
        _, good = read_records(path)
        if path.exists() and path.stat().st_size != good:
            with open(path, "r+b") as f:  # drop a torn tail before appending after it
                f.truncate(good)
        self._f = open(path, "ab")

    def append(self, records: list[dict]) -> None:
        for r in records:
            self._f.write((json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


@dataclass
class Run:
    """A stored run: its manifest and per-task records. ``evalgate.load_run(path)`` returns one."""

    path: Path
    manifest: dict
    records: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return list(self.manifest.get("tasks", {}))

    @property
    def kernel(self) -> str:
        return self.manifest.get("kernel", {}).get("name", "?")

    def samples(self, task: str):
        """Per-item records of ``task`` as a pandas DataFrame, one row per item, sorted by ``doc_id``."""
        import pandas as pd

        if task not in self.records:
            raise UserError(f"run {str(self.path)!r} has no task {task!r}; it has: {', '.join(self.records) or 'none'}")
        return pd.json_normalize(self.records[task], sep=".").sort_values("doc_id", kind="stable").reset_index(drop=True)

    def __repr__(self) -> str:
        counts = ", ".join(f"{t}: {len(r)}" for t, r in self.records.items())
        return f"Run({str(self.path)!r}, kernel={self.kernel!r}, {counts})"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{str(path)!r} is not a run directory (no {MANIFEST}); pass the folder `evalgate run --out` wrote")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(manifest_path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); the run is damaged") from None
    records = {}
    for task in manifest.get("tasks", {}):
        records[task], _ = read_records(path / f"{task}.jsonl")
    return Run(path=path, manifest=manifest, records=records)
