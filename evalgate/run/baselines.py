"""Stored baselines: ``results/baselines/<model>/<profile>/<kernel>/``, committed to git, immutable.

Each baseline folder is a run folder for one task (``manifest.json`` + ``<task>.jsonl``), so
``load_run`` reads it like any run. ``record`` writes into a temporary sibling folder and renames it into
place, so a killed ``record`` leaves no baseline (only a ``.tmp-*`` folder that lookups ignore and the next
``record`` removes). An A/A calibration lives next to the records (``aa.json`` and ``aa/``).
An aggregate-only baseline (a published score and an item count) has ``"aggregate_only": true`` in its
manifest and no records; everything that shows it says so.

Where baselines are looked up (``lookup_roots``): first the user's root (``--baselines-root``, else the
``EVALGATE_BASELINES`` environment variable, else ``./results/baselines`` in the current directory), then the
built-in canary's baselines shipped inside the package (``evalgate.canary.BASELINES``). The packaged ones are
read-only: everything that writes (``record``, ``write_aa``, ``import_aggregate``, ``evalgate calibrate``) writes
to the user's root, and refuses a packaged folder inside an installed (site-packages) copy.

Manifests and ``aa.json`` are written through ``evalgate.records`` (``"schema_version": 3``) and validated on
read; the committed version-1 baselines (no ``schema_version``) are read as they are, never rewritten.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from evalgate.errors import UserError
from evalgate.records import (AARecord, BaselineInfo, KernelInfo, ModelInfo, RunManifest, TaskSummary, dump_aa, load_aa,
                              load_manifest)
from evalgate.run.store import MANIFEST, Run, load_run, write_json_atomic, write_manifest

DEFAULT_ROOT = Path("results/baselines")  # relative: the current directory's
ROOT_ENV = "EVALGATE_BASELINES"
AA_FILE = "aa.json"
AA_DIR = "aa"


def user_root(root: str | Path | None = None) -> Path:
    """The user's baselines root: ``root`` if given, else ``$EVALGATE_BASELINES``, else ./results/baselines."""
    if root:
        return Path(root)
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def packaged_root() -> Path:
    """The built-in canary's baselines, shipped with the package (read-only)."""
    from evalgate.canary import BASELINES

    return BASELINES


def lookup_roots(root: str | Path | None = None) -> list[Path]:
    """Where the gate looks for a stored baseline, first match wins: the user's root, then the packaged one."""
    roots = [user_root(root)]
    packaged = packaged_root()
    if packaged.is_dir() and not any(_same(packaged, r) for r in roots):
        roots.append(packaged)
    return roots


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_writable(root: str | Path) -> None:
    """Refuse to write into the packaged baselines of an installed copy (they change with the package only;
    in a source checkout they are recorded on purpose, with --baselines-root pointing there)."""
    target = Path(root).resolve()
    packaged = packaged_root().resolve()
    inside = target == packaged or packaged in target.parents
    if inside and any(part in ("site-packages", "dist-packages") for part in packaged.parts):
        raise UserError(f"{root} holds the canary's packaged baselines of an installed evalgate, which are read-only; "
                        f"write to another --baselines-root (default ./results/baselines, or ${ROOT_ENV})")


def _slug(text: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in str(text))
    return keep.strip("-") or "unnamed"


def model_slug(model: ModelInfo) -> str:
    return _slug(f"{model.model_type or 'model'}-{model.fingerprint or 'unknown'}")


def profile_slug(task_summary: TaskSummary) -> str:
    return _slug(f"{task_summary.name}-{task_summary.profile_id[:12]}")


def baseline_dir(root: Path, model: ModelInfo, task_summary: TaskSummary, kernel: str) -> Path:
    return Path(root) / model_slug(model) / profile_slug(task_summary) / _slug(kernel)


def _refuse_stopped_early(run: Run) -> None:
    """A run the gate stopped early is never a baseline (docs/gate.md#stopping-early)."""
    if run.meta.status != "stopped_early":
        return
    info = run.meta.early_stop
    ran = f" after {info.items_run} of {info.items_total} items" if info is not None else ""
    raise UserError(f"{run.path} is a run the gate stopped early{ran} (its FAIL was certain), not a complete run; "
                    "a baseline needs every item: complete it first (`evalgate gate --no-early-stop --out "
                    f"{run.path}` with the same settings, or `evalgate run --resume --out {run.path}`)")


def _check_complete(run: Run) -> None:
    _refuse_stopped_early(run)
    status = run.meta.status
    if status != "complete":
        raise UserError(f"{run.path} is not a complete run (status {status!r}); finish it with `evalgate run --resume --out {run.path}` first")
    for task, summary in run.meta.tasks.items():
        have = len({r["doc_id"] for r in run.records.get(task, [])})
        if have != summary.n_items:
            raise UserError(f"{run.path}: {task} has {have} of {summary.n_items} items; a baseline needs every item")


def _task_manifest(manifest: RunManifest, task: str, extra: BaselineInfo) -> RunManifest:
    """One task's baseline manifest: the run's, with that task, its timings and where it came from."""
    timings = {k: v for k, v in (manifest.timings or {}).items() if k in (task, "load_model_s")}
    return manifest.updated(tasks={task: manifest.tasks[task]}, timings=timings, baseline=extra)


def _clean_stale(parent: Path) -> None:
    for stale in parent.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _install(tmp: Path, final: Path, force: bool) -> None:
    """Rename ``tmp`` onto ``final``; with ``force`` an existing baseline is moved aside first, then removed."""
    if final.exists():
        if not force:
            raise UserError(f"a baseline already exists at {final}; baselines are immutable — pass --force to replace it")
        trash = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)


def record(run_path: str | Path, root: str | Path = DEFAULT_ROOT, force: bool = False,
           tasks: list[str] | None = None) -> list[Path]:
    """Store a complete run as the baseline for its model, each task's profile and its kernel."""
    check_writable(root)
    run = load_run(run_path)
    _check_complete(run)
    tasks = tasks or run.tasks
    root = Path(root)
    targets = []
    for task in tasks:
        if task not in run.meta.tasks:
            raise UserError(f"{run.path} has no task {task!r}")
        final = baseline_dir(root, run.meta.model, run.meta.tasks[task], run.kernel)
        if final.exists() and not force:
            raise UserError(f"a baseline already exists at {final}; baselines are immutable — pass --force to replace it")
        targets.append((task, final))
    written = []
    for task, final in targets:
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        extra = BaselineInfo(source_run=str(run.path), task=task, kernel=run.kernel)
        write_manifest(tmp, _task_manifest(run.meta, task, extra))
        shutil.copyfile(run.path / f"{task}.jsonl", tmp / f"{task}.jsonl")
        for f in (tmp / f"{task}.jsonl",):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _install(tmp, final, force)
        written.append(final)
    return written


def import_aggregate(task: str, score: float, n_items: int, model_id: str, profile: str, kernel: str = "w4a8",
                     source: str = "", root: str | Path = DEFAULT_ROOT, force: bool = False) -> Path:
    """A published score with no per-item records, stored as an aggregate-only baseline."""
    check_writable(root)
    if not 0.0 <= score <= 1.0:
        raise UserError(f"--score must be a fraction in [0, 1], got {score}")
    if n_items <= 0:
        raise UserError(f"--n must be a positive item count, got {n_items}")
    manifest = RunManifest(
        aggregate_only=True,
        status="complete",
        model=ModelInfo(model_id=model_id, fingerprint=_slug(model_id)),
        kernel=KernelInfo(name=kernel, id=kernel),
        tasks={task: TaskSummary(name=profile, profile_id="aggregate-only", score=float(score), n_items=n_items)},
        baseline=BaselineInfo(task=task, kernel=kernel, source=source, aggregate_only=True),
    )
    final = Path(root) / _slug(model_id) / _slug(f"{profile}-aggregate") / _slug(kernel)
    final.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    write_manifest(tmp, manifest)
    _install(tmp, final, force)
    return final


_MANIFESTS: dict[Path, tuple[tuple[int, int], RunManifest]] = {}  # path -> (mtime, size), manifest


def _manifest(path: Path) -> RunManifest:
    """A baseline's manifest, read once per process while the file is unchanged (a gate's later looks search
    the same roots again)."""
    stat = path.stat()
    key = (stat.st_mtime_ns, stat.st_size)
    cached = _MANIFESTS.get(path)
    if cached is None or cached[0] != key:
        cached = _MANIFESTS[path] = (key, load_manifest(path))
    return cached[1]


def baseline_folders(root: Path, depth: int) -> list[Path]:
    """Folders ``depth`` levels under ``root`` holding a manifest, except an A/A run's (``<baseline>/aa``) and a
    killed ``record``'s leftovers (``.tmp-*``)."""
    found = []
    for manifest_path in sorted(root.glob("*/" * depth + MANIFEST)):
        parts = manifest_path.parent.relative_to(root).parts
        if AA_DIR not in parts and not any(part.startswith(".tmp-") for part in parts):
            found.append(manifest_path.parent)
    return found


def _stored(root: str | Path) -> list[tuple[Path, RunManifest]]:
    """Every baseline folder under ``root`` with its manifest. ``root``: a baselines root
    (``<model>/<profile>/<kernel>/``), or a model or profile folder under one (as ``--baseline`` offers them:
    their baselines, recognised by the ``baseline`` entry ``record`` writes in each manifest)."""
    root = Path(root)
    folders = baseline_folders(root, 3)
    for depth in (2, 1):  # a model folder, a profile folder
        if folders:
            break
        folders = [d for d in baseline_folders(root, depth) if _manifest(d / MANIFEST).baseline is not None]
    return [(d, _manifest(d / MANIFEST)) for d in folders]


def list_baselines(root: str | Path = DEFAULT_ROOT) -> list[dict]:
    rows = []
    for d, m in _stored(root):
        (task, summary), = m.tasks.items()
        aa = read_aa_record(d)
        aa_task = aa.tasks.get(task) if aa else None
        rows.append({"path": str(d), "task": task, "profile": summary.name, "profile_id": summary.profile_id,
                     "kernel": m.kernel.name, "model": m.model.fingerprint, "n_items": summary.n_items,
                     "aggregate_only": bool(m.aggregate_only), "aa_psi0": aa_task.psi0 if aa_task else None})
    return rows


def _find(roots: list[Path], fingerprint: str | None, profile_id: str, kernel: str,
          profile_name: str | None = None) -> tuple[Path, RunManifest] | None:
    """The first root's matching baseline folder and its manifest (a user's own baseline wins): by profile id,
    else (``profile_name`` given: a candidate on a subset of the items, checked item by item afterwards) by
    profile name."""
    for root in roots:
        for d, m in _stored(root):
            (summary,) = m.tasks.values()
            if m.model.fingerprint == fingerprint and summary.profile_id == profile_id and m.kernel.name == kernel:
                return d, m
    if profile_name is not None:
        for root in roots:
            for d, m in _stored(root):
                (summary,) = m.tasks.values()
                if m.model.fingerprint == fingerprint and summary.name == profile_name and m.kernel.name == kernel:
                    return d, m
    return None


def find_stored_baseline(roots: list[Path], fingerprint: str, profile_id: str, kernel: str) -> Path | None:
    """The first root's baseline (``lookup_roots`` order: a user's own baseline wins over the packaged one)."""
    found = _find(roots, fingerprint, profile_id, kernel)
    return found[0] if found else None


def load_stored_baseline(roots: list[Path], fingerprint: str | None, profile_ids: dict[str, str], kernel: str,
                         profile_names: dict[str, str] | None = None) -> tuple["StoredBaseline | None", list[str]]:
    """The stored ``kernel`` baseline of every task (``lookup_roots`` order), each file read once; or None
    and the tasks that have none. ``profile_names``: match by name where no id matches (a subset candidate)."""
    names = profile_names or {}
    found = {task: _find(roots, fingerprint, pid, kernel, names.get(task)) for task, pid in profile_ids.items()}
    missing = [t for t, f in found.items() if f is None]
    hits = [f for f in found.values() if f is not None]
    if missing:
        return None, missing
    return load_baseline([d for d, _ in hits], dict(hits)), []


def answer_lengths(run: Run) -> dict[str, dict]:
    """{task: {doc_id: tokens}}: how long a stored baseline's answers are (records without a length, and
    aggregate-only baselines, give none). A candidate's answers are expected to be about as long, which is
    what the in-process model schedules its decoding workers by (``Request.expected_tokens``)."""
    return {task: {r["doc_id"]: r["n_tokens"] for r in records if isinstance(r.get("n_tokens"), int)}
            for task, records in run.records.items()}


def read_aa_record(baseline: str | Path) -> AARecord | None:
    """The baseline's A/A record as a typed model (a version-1 file migrated), or None if it has none."""
    path = Path(baseline) / AA_FILE
    return load_aa(path) if path.is_file() else None


def read_aa(baseline: str | Path) -> dict | None:
    """The baseline's ``aa.json`` as it is on disk (validated), or None if it has none."""
    aa = read_aa_record(baseline)
    return aa.as_read if aa is not None else None


def write_aa(baseline: str | Path, aa: dict, second_run: str | Path) -> None:
    """Attach an A/A calibration: the statistics (``aa.json``) and the second run's records (``aa/``)."""
    baseline, second = Path(baseline), Path(second_run)
    check_writable(baseline)
    aa_json = dump_aa(aa)  # validated before anything is touched
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-aa-", dir=baseline))
    for f in second.iterdir():
        if f.is_file():
            shutil.copyfile(f, tmp / f.name)
    old = baseline / AA_DIR
    if old.exists():
        shutil.rmtree(old)
    os.rename(tmp, old)
    write_json_atomic(baseline / AA_FILE, aa_json)


def assemble(baselines: list[str | Path], manifests: dict[Path, RunManifest] | None = None) -> Run:
    """One Run over several single-task baseline folders (or run folders), for pairing with a candidate."""
    runs = [load_run(b, (manifests or {}).get(Path(b))) for b in baselines]
    for run in runs:
        _refuse_stopped_early(run)
    if len(runs) == 1:
        return runs[0]
    tasks, records, items = {}, {}, {}
    for run in runs:
        tasks.update(run.meta.tasks)
        records.update(run.records)
        items.update({task: run.items(task) for task in run.records})
    return Run(path=Path(runs[0].path), manifest=runs[0].meta.updated(tasks=tasks), records=records, items=items)


def aa_for_baseline(baseline_dirs: list[Path]) -> dict:
    """task -> {"psi0", "n", "flips", "verdict"} from the baselines' A/A records; empty for plain runs."""
    found = {}
    for d in baseline_dirs:
        aa = read_aa(d)
        if aa:
            for task, entry in aa.get("tasks", {}).items():
                found[task] = {**entry, "flips": set(entry.get("flips", []))}
    return found


@dataclass(frozen=True)
class StoredBaseline:
    """The baseline a gate compares with, read once: its folders (one per task), the runs assembled into
    one, and their A/A records."""

    dirs: tuple[Path, ...]
    run: Run
    aa: dict  # task -> {"psi0", "n", "flips", "verdict", ...}

    @property
    def answer_lengths(self) -> dict[str, dict]:
        return answer_lengths(self.run)


def load_baseline(dirs: list[str | Path] | str | Path, manifests: dict[Path, RunManifest] | None = None) -> StoredBaseline:
    """Read the baseline folder(s) once: manifests (unless a lookup already read them), records and A/A
    records (UserError when unreadable)."""
    folders = tuple(Path(d) for d in (dirs if isinstance(dirs, (list, tuple)) else [dirs]))
    return StoredBaseline(folders, assemble(list(folders), manifests), aa_for_baseline(list(folders)))


def could_be_stored(roots: list[Path], fingerprint: str, kernel: str, task: str, profile, limit: int | None,
                    sampling) -> bool:
    """Whether a stored ``kernel`` baseline could match a run of ``profile`` (overrides folded in) before its
    data are read: same model, task, profile name, version and settings, at most ``limit`` items, decoded the
    way ``sampling`` decodes. False is certain (no profile id can match), so a gate refuses in a second
    instead of after reading the task data; True still leaves the profile id to decide."""
    for root in roots:
        for _, m in _stored(root):
            ((name, summary),) = m.tasks.items()
            decoding = summary.decoding or {}
            if sampling.greedy:
                same_decoding = not decoding.get("do_sample") and decoding.get("n", 1) == 1
            else:
                same_decoding = (decoding.get("do_sample") is True and decoding.get("n") == sampling.samples
                                 and decoding.get("temperature") == float(sampling.temperature)
                                 and decoding.get("seed") == sampling.seed)
            if (m.model.fingerprint == fingerprint and m.kernel.name == kernel and name == task
                    and summary.name == profile.name and summary.version == profile.version
                    and summary.settings == profile.settings and same_decoding
                    and (limit is None or summary.n_items <= limit)):
                return True
    return False
