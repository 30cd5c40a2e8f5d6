"""A task's rows, loaded through Hugging Face ``datasets`` whatever their source (docs/scoring.md#data).

Sources, per task, the first that applies:

1. ``--dataset TASK=SOURCE``: a ``save_to_disk`` folder (``load_from_disk``), a folder of data files or one
   file (Parquet, JSONL, JSON, CSV, Arrow; ``load_dataset``), or a hub id ``OWNER/NAME[:CONFIG][@REVISION]``
   when the hub is reachable. ``--dataset TASK.FIELD=COLUMN`` maps a column whose name differs from the task's.
2. ``--data-dir`` / ``EVALGATE_DATA_DIR``, else the packaged files (evalgate/tasks/data.py): the published
   files the task declares (``DataFile``), each checked against its sha256, then loaded through ``datasets``.

Identity: a split's rows (the task's columns, in order) hash to ``items_sha256``. Rows equal to a published
split's are named in the profile by that file's sha256, as before ``datasets`` read them, so the stored
baselines keep their profile ids whatever format the copy is in; any other rows are named by their own
hash, so a changed row gives another profile id (not comparable). The manifest records the source, the
items' hash and the sha256 of every file read.

``datasets`` is imported only when rows are loaded, and its Arrow cache for local files goes to a temporary
folder of this process (removed at exit), never to the user's cache; only a hub download uses the user's.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from evalgate.errors import UserError
from evalgate.tasks.data import DATA_DIR_ENV, DataFile, is_packaged_dir, sha256_file, verified_path
from evalgate.types import canonical_json, sha256_text

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?(@[\w./-]+)?$")
HUB_TIMEOUT_S = 3.0  # the reachability probe: an offline machine answers in this time, not after retries
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


@dataclass(frozen=True)
class DatasetChoice:
    """One task's ``--dataset`` choice: where its rows come from and which column holds each field."""

    source: str
    columns: dict = field(default_factory=dict)  # task field -> the dataset's column


def parse_dataset_options(values, tasks) -> dict[str, dict]:
    """``--dataset TASK=SOURCE`` and ``--dataset TASK.FIELD=COLUMN`` -> task -> {"source", "columns"}."""
    chosen: dict[str, dict] = {}
    for value in values:
        key, sep, rhs = value.partition("=")
        task, _, field_name = key.strip().partition(".")
        if not sep or not rhs.strip() or not task:
            raise UserError(f"--dataset {value!r}: write TASK=PATH_OR_HUB_ID or TASK.FIELD=COLUMN, "
                            "e.g. --dataset gsm8k=./my-gsm8k --dataset gsm8k.question=problem")
        if task not in tasks:
            raise UserError(f"--dataset {value!r}: unknown task {task!r}; choose from: {', '.join(tasks)}")
        entry = chosen.setdefault(task, {"source": None, "columns": {}})
        if field_name:
            entry["columns"][field_name] = rhs.strip()
        else:
            entry["source"] = rhs.strip()
    for task, entry in chosen.items():
        if entry["source"] is None:
            raise UserError(f"--dataset {task}.FIELD=COLUMN maps columns of a dataset, but no --dataset {task}=PATH "
                            "names one")
    return chosen


@dataclass(frozen=True)
class Split:
    """One split's rows (the task's fields only, in dataset order), their identity and where they came from."""

    rows: list
    identity: dict  # the profile's dataset_sha256 entry: {published file: its sha256} or {task/split: ITEMS + hash}
    record: dict  # the manifest's: source, items_sha256, rows, files

    @property
    def published(self) -> bool:
        return not any(str(v).startswith(ITEMS) for v in self.identity.values())


def items_sha256(rows: list, fields) -> str:
    return sha256_text(canonical_json([{f: row[f] for f in fields} for row in rows]))


ITEMS = "items-sha256:"  # the identity of rows no published file holds


def _identity(task: str, split: str, rows: list, fields, files, read_from: DataFile | None) -> tuple[dict, str]:
    """(the profile's dataset_sha256 entry, the items hash): rows equal to those of one of the task's published
    ``files`` are named by that file's sha256 (``read_from``: the file they were read from, when they were),
    any others by their hash."""
    digest = items_sha256(rows, fields)
    for file in files:
        if digest == file.items_sha256 and (read_from is None or file == read_from):
            return {file.path: file.sha256}, digest
    return {f"{task}/{split}": f"{ITEMS}{digest}"}, digest


class TaskData:
    """The rows of one task, from its ``--dataset`` choice, else the data dir, else the packaged files.

    ``files``: split -> the task's published file (``DataFile``); ``fields``: the task's columns, checked and
    mapped; ``splits``: every split the profile reads (a single-split source can serve only a profile that
    reads one); ``hub_configs``: a hub id's config when ``--dataset`` names none (openai/gsm8k holds two).
    """

    def __init__(self, task: str, fields, files: dict[str, DataFile], data_dir: Path | None, choice: dict | None,
                 splits, hub_configs: dict[str, str] | None = None):
        self.task, self.fields, self.files, self.data_dir = task, tuple(fields), files, data_dir
        self.hub_configs = dict(hub_configs or {})
        self.choice = DatasetChoice(choice["source"], dict(choice.get("columns") or {})) if choice else None
        self.splits = tuple(dict.fromkeys(splits))
        self._loaded: tuple[Any, dict] | None = None  # the choice's Dataset or DatasetDict and its record, loaded once

    def split(self, name: str) -> Split:
        if self.choice is None:
            return self._published_split(name)
        return self._chosen_split(name, self.choice)

    # ---- the published files (packaged, or a data dir laid out like them) ----

    def _published_split(self, name: str) -> Split:
        file = self.files[name]
        path = verified_path(self.data_dir, file)
        rows = _published_jsonl_rows(path, self.fields)
        if rows is None:
            dataset = _load_files(_builder(path), str(path), f"{file.path} ({path})")
            rows = _rows(dataset, self.task, self.fields, {}, f"{file.path} ({path})")
        identity, digest = _identity(self.task, name, rows, self.fields, self.files.values(), file)
        source = "data-dir" if self.data_dir is not None and not is_packaged_dir(self.data_dir) else "packaged"
        return Split(rows, identity, {"source": source, "path": str(path), "split": name, "rows": len(rows),
                                      "items_sha256": digest, "files": {file.path: file.sha256}})

    # ---- --dataset TASK=SOURCE ----

    def _chosen_split(self, name: str, choice: DatasetChoice) -> Split:
        where = f"--dataset {self.task}={choice.source}"
        dataset, record = self._load_choice(where, choice)
        part = _pick_split(dataset, name, self.splits, where, self.task)
        rows = _rows(part, self.task, self.fields, choice.columns, where)
        identity, digest = _identity(self.task, name, rows, self.fields, self.files.values(), None)
        return Split(rows, identity, {**record, "split": name, "rows": len(rows), "items_sha256": digest,
                                      **({"columns": choice.columns} if choice.columns else {})})

    def _load_choice(self, where: str, choice: DatasetChoice) -> tuple[Any, dict]:
        if self._loaded is None:
            source = choice.source
            path = Path(source).expanduser()
            if path.exists():
                self._loaded = (_load_local(path, where), {"source": "local", "path": str(path.resolve()),
                                                           "files": _file_hashes(path)})
            elif HUB_ID.match(source):
                self._loaded = _load_hub(source, self.task, where, self.hub_configs)
            else:
                raise UserError(f"{where}: no such file or folder, and not a hub id (OWNER/NAME[:CONFIG][@REVISION])")
        return self._loaded


def _published_jsonl_rows(path: Path, fields) -> list | None:
    """A published JSONL file's rows (its sha256 already checked), read line by line: the rows ``datasets``
    gives for these bytes (their ``items_sha256`` is the published one, ``tests/test_data_sources.py``),
    without importing ``datasets``, pandas and pyarrow and writing an Arrow cache (~1 s of every gate's
    start-up). None for another format, or a row without every field as text: ``datasets`` reads it then."""
    import gzip
    import json

    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-2:] != [".jsonl", ".gz"] and suffixes[-1:] != [".jsonl"]:
        return None
    opener = gzip.open if suffixes[-1] == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not all(isinstance(r, dict) and all(isinstance(r.get(k), str) for k in fields) for r in rows):
        return None
    return [{k: r[k] for k in fields} for r in rows]


# ---- loading through datasets ----

_cache_dir: str | None = None


def _datasets():
    """``datasets``, imported on first use (a gate that reads no rows never pays for it), quiet."""
    try:
        import datasets
    except ImportError:
        raise UserError("the datasets package is not installed; pip install 'datasets>=5.2,<6'") from None
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def cache_dir() -> str:
    """This process's Arrow cache for local files (removed at exit): never the user's ~/.cache."""
    global _cache_dir
    if _cache_dir is None:
        _cache_dir = tempfile.mkdtemp(prefix="evalgate-datasets-")
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    return _cache_dir


def _builder(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    builder = BUILDERS.get(suffixes[-1] if suffixes else "")
    if builder is None:
        raise UserError(f"{path}: not a data file datasets reads here (one of {', '.join(BUILDERS)}, "
                        "optionally .gz), nor a save_to_disk folder")
    return builder


def _load_files(builder: str, data_files, where: str):
    """``load_dataset(builder, data_files=...)`` -> one Dataset ("train", as datasets names a lone split)."""
    return _load(where, lambda ds: ds.load_dataset(builder, data_files=data_files, split="train",
                                                    cache_dir=cache_dir()))


def _load_local(path: Path, where: str):
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        return _load(where, lambda ds: ds.load_from_disk(str(path)))
    if path.is_dir():
        return _load(where, lambda ds: ds.load_dataset(str(path), cache_dir=cache_dir()))
    return _load_files(_builder(path), str(path), where)


def _load(where: str, load):
    datasets = _datasets()
    try:
        return load(datasets)
    except UserError:
        raise
    except Exception as e:  # datasets raises many kinds; the user gets one line naming the source
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{where}: datasets could not load it ({type(e).__name__}: {message[:300]})") from None


def _load_hub(source: str, task: str, where: str, hub_configs: dict[str, str]):
    name, _, revision = source.partition("@")
    repo, _, config = name.partition(":")
    chosen_config = config or hub_configs.get(repo)
    alternatives = (f"use the data shipped with evalgate (drop --dataset {task}=...), --data-dir DIR / "
                    f"{DATA_DIR_ENV}, or --dataset {task}=PATH with a local copy (a save_to_disk folder, Parquet "
                    "or JSONL files)")
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if offline:
        raise UserError(f"{where}: the hub is off ({offline[0]}=1), so {repo} cannot be loaded; {alternatives}")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if not _reachable(endpoint):
        raise UserError(f"{where}: the hub ({endpoint}) is not reachable from here; {alternatives}")
    dataset = _load(where, lambda ds: ds.load_dataset(repo, chosen_config, revision=revision or None))
    return dataset, {"source": "hub", "id": repo, "config": chosen_config, "revision": revision or None}


def _reachable(endpoint: str) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S):
            return True
    except OSError:
        return False


def _pick_split(dataset, name: str, needed, where: str, task: str):
    """The split ``name`` of a DatasetDict; a lone Dataset (or a one-split dict) serves a one-split profile."""
    if not hasattr(dataset, "keys"):  # a Dataset
        parts = {None: dataset}
    else:
        parts = dict(dataset)
        if name in parts:
            return parts[name]
    if len(parts) == 1 and len(needed) == 1:
        return next(iter(parts.values()))
    have = ", ".join(str(k) for k in parts if k is not None) or "one unnamed split"
    need = " and ".join(repr(s) for s in needed)
    raise UserError(f"{where}: no {name!r} split (it has {have}); this {task} profile reads the {need} split(s): "
                    "give a folder whose files or saved splits are named so")


def _rows(dataset, task: str, fields, columns: dict, where: str) -> list:
    """The dataset's rows with the task's field names, only those fields; one line naming missing columns."""
    unknown = sorted(set(columns) - set(fields))
    if unknown:
        raise UserError(f"{where}: --dataset maps {', '.join(unknown)}, which the task does not read; its fields "
                        f"are {', '.join(fields)}")
    wanted = {f: columns.get(f, f) for f in fields}
    have = list(dataset.column_names)
    missing = [f"{col!r}" + (f" (for {f})" if col != f else "") for f, col in wanted.items() if col not in have]
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)}; it has {', '.join(have)}; map a column "
                        f"to a field with --dataset {task}.FIELD=COLUMN (fields: {', '.join(fields)})")
    kinds = {col: getattr(dataset.features[col], "dtype", type(dataset.features[col]).__name__) for col in wanted.values()}
    not_text = {col: kind for col, kind in kinds.items() if kind not in ("string", "large_string")}
    if not_text:
        raise UserError(f"{where}: column(s) {', '.join(repr(c) for c in not_text)} hold "
                        f"{', '.join(map(str, not_text.values()))}, not text")
    table = dataset.select_columns(list(dict.fromkeys(wanted.values()))).to_dict()
    return [{f: table[col][i] for f, col in wanted.items()} for i in range(len(dataset))]


def _file_hashes(path: Path) -> dict:
    """sha256 of every file a local source consists of (the manifest's record)."""
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)}

