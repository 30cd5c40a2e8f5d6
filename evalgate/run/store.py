"""The run store: ``<run>/manifest.json`` plus one ``<task>.jsonl`` of per-item records per task.

Records are appended and fsynced per batch, so a crash loses at most the batch in flight; a torn last line
(killed mid-write) is ignored on read and cut away on resume. The manifest is replaced atomically
(temp file + rename). ``load_run`` gives a notebook the same data as pandas DataFrames.

Both are written through the models of ``evalgate.records`` (``"schema_version": 3``) and validated through
them on read: a file of an unknown version or with a field of the wrong type is refused in one line. Reading
never changes a stored run; a version-1 run (no ``schema_version``, e.g. the committed baselines) or a
version-2 run (e.g. the packaged canary baselines) reads as is.

This is where a run's files become models, once: ``Run.meta`` is the manifest as a ``RunManifest`` (older
versions migrated here) and ``Run.items`` the records as their task's model; evalgate reads runs through them
(attributes, never string keys). ``Run.manifest`` and ``Run.records`` are the files' dicts, for notebooks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from evalgate.errors import UserError
from evalgate.files import RERUN, parse_lines, write_bytes_atomic
from evalgate.records import SCHEMA_VERSION, ItemRecord, RunManifest, json_default, load_manifest, parse
from evalgate.tasks import record_model

MANIFEST = "manifest.json"


def write_json_atomic(path: Path, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def write_manifest(run_dir: Path, manifest: RunManifest) -> None:
    """Write ``<run_dir>/manifest.json`` (``"schema_version": 3``), atomically: the model serialised once, not
    validated again (it was when it was built; the runner's changes to it are models too)."""
    text = json.dumps(manifest.to_dict(), indent=2, sort_keys=True, ensure_ascii=False, default=json_default) + "\n"
    write_bytes_atomic(Path(run_dir) / MANIFEST, text.encode("utf-8"))


def read_records(path: Path) -> tuple[list[dict], int]:
    """Complete records of a JSONL file, and the byte length they occupy (a torn tail is left out).

    The store's one JSONL reader (``parse_lines``'s rule)."""
    records, lines = _read_lines(path)
    return records, sum(len(line) for line in lines)


def _read_lines(path: Path, remedy: str = RERUN) -> tuple[list[dict], list[bytes]]:
    if not path.exists():
        return [], []
    return parse_lines(path.read_bytes(), repr(str(path)), remedy)


def _remedy(meta: RunManifest, path: Path) -> str:
    """What to do about a damaged file of this folder: a stored baseline is restored or recorded again (a new
    --out makes a run, never a baseline); a run is restored or run again."""
    if meta.baseline is None and not (path.name == "aa" and (path.parent / "aa.json").is_file()):  # an A/A run
        return RERUN
    source = getattr(meta.baseline, "source_run", None) if meta.baseline is not None else None
    again = "`evalgate calibrate` with the gate's model and tasks"
    if source and path.name != "aa":
        root = path.parents[2] if len(path.parents) > 2 else path
        again = (f"`evalgate baseline record {shlex.quote(str(source))} --baselines-root {shlex.quote(str(root))} "
                 f"--force` while the run it came from is there, else {again}")
    return f"restore the baseline folder (from git or the archive it came from), or record it again: {again}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogates(line: str) -> str:
    """A JSON line with every lone surrogate (which UTF-8 cannot hold; a program's output or exception may carry
    one) stored as the text of its escape: ``"\\ud800"`` in the file reads back as the six characters
    ``\\ud800``, never as a surrogate again, and never paired with a neighbouring one into another character."""
    return _SURROGATE.sub(lambda m: f"\\\\u{ord(m.group()):04x}", line)


class RecordWriter:
    """Appends records to ``<task>.jsonl`` through the task's record model (``"schema_version": 3``); one fsync per batch.

    The file is read once, when the writer opens it (a resumed run's records); from then on the writer keeps
    every record and its line in memory (``records``), so nothing it wrote is read back. A file never holds
    one item twice: ``append`` skips the doc_ids already stored. A Ctrl-C can land between a batch's write
    and the caller's bookkeeping, and the caller then hands the same items over again to keep them; without
    the check they would be stored twice."""

    def __init__(self, path: Path):
        self.path = path
        self.task = path.name.removesuffix(".jsonl")
        self.model = record_model(self.task)
        self.records, self._lines = _read_lines(path)
        source = repr(str(path))
        self.items = [parse(self.model, r, f"{source} line {i}") for i, r in enumerate(self.records, 1)]
        good = sum(len(line) for line in self._lines)
        if path.exists() and path.stat().st_size != good:
            with open(path, "r+b") as f:  # drop a torn tail before appending after it
                f.truncate(good)
        self.stored = {r["doc_id"] for r in self.records}
        self._f = open(path, "ab")

    def append(self, records: list[dict]) -> list[dict]:
        """Store the records not stored yet; returns them as stored (what a reader of the file gets).

        Each record is serialised once and validated once, from its line (``model_validate_json``: a wrong
        type is a bug in the writer, pydantic's ValidationError); the model is kept (``items``), and its dict is
        what the caller and the observer get, never the line parsed again."""
        lines, new, items = [], [], []
        for r in records:
            if r["doc_id"] in self.stored:
                continue
            # marked before the write: an interrupted write loses the item (a resume redoes it), never doubles it
            self.stored.add(r["doc_id"])
            line = _escape_surrogates(json.dumps({**r, "schema_version": SCHEMA_VERSION}, ensure_ascii=False,
                                                 sort_keys=True, default=json_default))
            item = self.model.model_validate_json(line)
            lines.append((line + "\n").encode("utf-8"))
            items.append(item)
            new.append(item.to_dict())  # the record as a reader of the file gets it
        if lines:
            self._f.write(b"".join(lines))
            self._f.flush()
            os.fsync(self._f.fileno())
            self.records.extend(new)
            self.items.extend(items)
            self._lines.extend(lines)
        return new

    def close(self, doc_ids: list | None = None) -> list[dict]:
        """Close the file and, given the items' order, put its records in that order (continuous dispatch and
        the reversed A/A run append them in the order they finish): the lines are moved as they are, never
        re-serialized, and the file is replaced atomically, only when out of order. Returns the records in
        file order."""
        self._f.close()
        if doc_ids is not None:
            rank = {doc_id: i for i, doc_id in enumerate(doc_ids)}
            keys = [rank.get(r["doc_id"], len(rank)) for r in self.records]
            if keys != sorted(keys):
                order = sorted(range(len(keys)), key=lambda i: keys[i])  # stable: unknown ids stay at the end
                self.records = [self.records[i] for i in order]
                self.items = [self.items[i] for i in order]
                self._lines = [self._lines[i] for i in order]
                write_bytes_atomic(self.path, b"".join(self._lines))
        return list(self.records)


class Run:
    """A stored run: its manifest and per-task records. ``evalgate.load_run(path)`` returns one.

    ``meta`` is the manifest as its model, made once (a dict given is validated here, the one time); evalgate
    reads it by attribute. ``manifest`` is its dict (the file's, for a stored run) for a notebook."""

    def __init__(self, path: str | Path, manifest: RunManifest | dict, records: dict[str, list[dict]] | None = None,
                 items: dict[str, list[ItemRecord]] | None = None):
        self.path = Path(path)
        self.meta = manifest if isinstance(manifest, RunManifest) else _parse_manifest(manifest, self.path / MANIFEST)
        self.records = records if records is not None else {}
        self._items = dict(items or {})

    @property
    def manifest(self) -> dict:
        """The manifest as a dict: the file's own for a stored run (unmigrated), else what would be written."""
        return self.meta.as_read

    def items(self, task: str) -> list[ItemRecord]:
        """Per-item records of ``task`` as typed models (the task's ``record_model``), validated once."""
        if task not in self._items:
            source = repr(str(self.path / f"{task}.jsonl"))
            model = record_model(task)
            self._items[task] = [parse(model, r, f"{source} record {i}")
                                 for i, r in enumerate(self.records.get(task, []), 1)]
        return self._items[task]

    @property
    def tasks(self) -> list[str]:
        return list(self.meta.tasks)

    @property
    def kernel(self) -> str:
        return self.meta.kernel.name

    def samples(self, task: str):
        """Per-item records of ``task`` as a pandas DataFrame, one row per item, sorted by ``doc_id``."""
        import pandas as pd

        if task not in self.records:
            raise UserError(f"run {str(self.path)!r} has no task {task!r}; it has: {', '.join(self.records) or 'none'}")
        return pd.json_normalize(self.records[task], sep=".").sort_values("doc_id", kind="stable").reset_index(drop=True)

    def __repr__(self) -> str:
        counts = ", ".join(f"{t}: {len(r)}" for t, r in self.records.items())
        return f"Run({str(self.path)!r}, kernel={self.kernel!r}, {counts})"


def _parse_manifest(manifest: dict, path: Path) -> RunManifest:
    return parse(RunManifest, manifest, repr(str(path)))


def load_run(path: str | Path, meta: RunManifest | None = None) -> Run:
    """A stored run, validated through the record models, once: its manifest and items as models (``meta``,
    ``items``), its records also as the files' dicts.

    UserError (one line) for a missing or damaged manifest, an unknown ``schema_version`` in the manifest or
    in a record line, a field of the wrong type, or one item stored twice. Nothing on disk is changed.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if meta is None:  # (a baseline lookup that matched this folder has read its manifest already)
        if not manifest_path.is_file():
            raise UserError(f"{str(path)!r} is not a run directory (no {MANIFEST}); pass the folder `evalgate run "
                            "--out` wrote")
        meta = load_manifest(manifest_path)
    records: dict[str, list[dict]] = {}
    items: dict[str, list[ItemRecord]] = {}
    remedy = _remedy(meta, path)
    for task in meta.tasks:
        jsonl = path / f"{task}.jsonl"
        records[task], _ = _read_lines(jsonl, remedy)
        model = record_model(task)
        first_line: dict = {}
        items[task] = []
        for line, record in enumerate(records[task], 1):
            items[task].append(parse(model, record, f"{str(jsonl)!r} line {line}"))
            if first_line.setdefault(record["doc_id"], line) != line:
                raise UserError(f"{str(jsonl)!r} holds item {record['doc_id']!r} twice (lines {first_line[record['doc_id']]} "
                                f"and {line}); it was not written by this evalgate — "
                                + ("rerun it into a new --out" if remedy == RERUN else remedy))
    from evalgate.run.packaged import as_installed  # a shipped baseline names this install's canary

    return Run(path=path, manifest=as_installed(path, meta), records=records, items=items)
