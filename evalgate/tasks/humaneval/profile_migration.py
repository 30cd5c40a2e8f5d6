"""Move stored HumanEval runs and baselines to the profile ids without the sandbox's Python version.

Until this change every HumanEval profile hashed ``settings.sandbox.python`` (the sandbox's Python minor,
e.g. ``"3.11"``), so a run on another Python found no stored baseline. The Python version is now a
recorded property of the run (the executor self-test's ``python`` in ``tasks.humaneval.prepare``), and a
comparison across minors warns instead of refusing. Records made before keep their old id; this module
rewrites them to the new one when, and only when, nothing else about them changes:

- the old id is recomputed from the manifest (name, version, settings, dataset sha256, decoding) and the
  items the records hold (in the dataset's order) and must equal the stored ``profile_id`` exactly, so the
  reconstruction is proven before anything is written;
- the new id is the same identity without ``settings.sandbox.python``;
- the manifest's ``profile_id`` and sandbox settings, every record's ``profile_id`` and, for a baseline, the
  A/A second run under ``aa/`` are rewritten (temp file + rename each); the Python version stays recorded
  in ``prepare.python`` (filled from the old settings if a manifest lacks it);
- a stored baseline folder ``<root>/<model>/<profile>-<id[:12]>/<kernel>`` is renamed to the new id's
  folder (refused if that exists).

Anything that does not verify is left untouched and reported. Run it on a folder you may write::

    python -m evalgate.tasks.humaneval.profile_migration results/baselines [--dry-run]
    python -m evalgate.tasks.humaneval.profile_migration results/runs/my-run      # one run folder

A run folder is migrated in place; a baselines root is searched for ``*/*/*/manifest.json``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.files import read_jsonl, write_bytes_atomic
from evalgate.types import canonical_json, sha256_text

TASK = "humaneval"
MANIFEST = "manifest.json"
NO_TASK = f"no {TASK} task"


@dataclass
class Migration:
    """What migrating one run folder did (or, dry, would do)."""

    path: Path
    old_id: str | None = None
    new_id: str | None = None
    python: str | None = None
    records: int = 0
    renamed_to: Path | None = None
    skipped: str | None = None  # why nothing was written
    files: list[Path] = field(default_factory=list)

    def line(self) -> str:
        if self.skipped:
            return f"{self.path}: skipped ({self.skipped})"
        where = f", moved to {self.renamed_to}" if self.renamed_to else ""
        return (f"{self.path}: {TASK} profile {self.old_id[:12]} -> {self.new_id[:12]} (sandbox Python {self.python} "
                f"now recorded, not hashed); {self.records} records{where}")


def _identity(summary: dict, item_ids: list, settings: dict) -> dict:
    """``ResolvedProfile.identity()`` rebuilt from a manifest's task summary (HumanEval has no per-item part)."""
    return {"name": summary["name"], "task": TASK, "version": summary.get("version"), "settings": settings,
            "dataset_sha256": summary.get("dataset_sha256"), "item_ids": list(item_ids), "per_item": {},
            "decoding": summary.get("decoding") or {}}


def _profile_id(identity: dict) -> str:
    return sha256_text(canonical_json(identity))


def _dataset_order(doc_ids: set) -> list:
    """The records' items in the order the task loads them (the dataset's), as hashed into the profile id."""
    from evalgate.tasks.humaneval.problems import load_problems

    order = [p["task_id"] for p in load_problems(None)]
    ranked = [d for d in order if d in doc_ids]
    if len(ranked) != len(doc_ids):
        raise ValueError(f"{len(doc_ids) - len(ranked)} item id(s) are not HumanEval problems")
    return ranked


def _read_jsonl(path: Path) -> list[dict]:
    return read_jsonl(path)


def new_settings(settings: dict) -> dict:
    """The task settings without the sandbox's Python version (what the current profiles hash)."""
    sandbox = {k: v for k, v in (settings.get("sandbox") or {}).items() if k != "python"}
    return {**settings, "sandbox": sandbox}


def plan(run_dir: Path) -> Migration:
    """Check one run folder and work out its new id; writes nothing."""
    run_dir = Path(run_dir)
    m = Migration(run_dir)
    manifest_path = run_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        m.skipped = f"no readable {MANIFEST}: {exc}"
        return m
    summary = (manifest.get("tasks") or {}).get(TASK)
    if not summary:
        m.skipped = NO_TASK
        return m
    settings = summary.get("settings") or {}
    python = (settings.get("sandbox") or {}).get("python")
    if python is None:
        m.skipped = "already without the sandbox's Python in its profile"
        return m
    records_path = run_dir / f"{TASK}.jsonl"
    try:
        records = _read_jsonl(records_path)
        item_ids = _dataset_order({r["doc_id"] for r in records})
    except (OSError, ValueError, KeyError) as exc:
        m.skipped = f"records unreadable: {exc}"
        return m
    old = _profile_id(_identity(summary, item_ids, settings))
    if old != summary.get("profile_id"):
        m.skipped = (f"its profile id {str(summary.get('profile_id'))[:12]} is not what its manifest and items "
                     f"hash to ({old[:12]}): not a plain pre-migration record, left as it is")
        return m
    stray = [r["doc_id"] for r in records if r.get("profile_id") not in (None, old)]
    if stray:
        m.skipped = f"record {stray[0]!r} carries another profile id"
        return m
    m.old_id, m.python, m.records = old, python, len(records)
    m.new_id = _profile_id(_identity(summary, item_ids, new_settings(settings)))
    return m


def _json_text(obj) -> str:
    """The run store's manifest format (``evalgate.run.store.write_json_atomic``)."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _rewrite(run_dir: Path, m: Migration) -> None:
    manifest_path = run_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    summary = manifest["tasks"][TASK]
    summary["settings"] = new_settings(summary["settings"])
    summary["profile_id"] = m.new_id
    prepare = summary.get("prepare")
    if isinstance(prepare, dict) and "python" not in prepare:
        prepare["python"] = m.python
    records_path = run_dir / f"{TASK}.jsonl"
    # records: only the id string changes, byte for byte (every other field stays as written)
    text = records_path.read_text(encoding="utf-8")
    needle = f'"profile_id": "{m.old_id}"'
    write_bytes_atomic(records_path, text.replace(needle, f'"profile_id": "{m.new_id}"').encode("utf-8"))
    write_bytes_atomic(manifest_path, _json_text(manifest).encode("utf-8"))
    m.files += [records_path, manifest_path]


def migrate_run(run_dir: str | Path, dry_run: bool = False) -> Migration:
    """Migrate one run folder in place (and its ``aa/`` second run, if it holds one); no rename."""
    run_dir = Path(run_dir)
    m = plan(run_dir)
    aa = plan(run_dir / "aa") if (run_dir / "aa" / MANIFEST).is_file() else None
    if m.skipped is None and aa is not None and aa.skipped is None and aa.new_id != m.new_id:
        m.skipped = "its A/A second run would get another id than the baseline"
        return m
    if dry_run:
        return m
    # the A/A second run holds every task it ran (a GSM8K baseline's aa/ has HumanEval records too); it moves
    # with its baseline, or on its own beside a baseline of another task, never without a baseline that failed
    if aa is not None and aa.skipped is None and (m.skipped is None or m.skipped == NO_TASK):
        _rewrite(run_dir / "aa", aa)
    if m.skipped is None:
        _rewrite(run_dir, m)
    return m


def migrate_baselines(root: str | Path, dry_run: bool = False) -> list[Migration]:
    """Every stored HumanEval baseline under ``root`` (``<model>/<profile>-<id>/<kernel>``), renamed to its new id."""
    root = Path(root)
    out = []
    for manifest_path in sorted(root.glob(f"*/*/*/{MANIFEST}")):
        d = manifest_path.parent
        if any(part.startswith(".tmp-") for part in d.relative_to(root).parts):
            continue
        m = migrate_run(d, dry_run=True)
        out.append(m)
        if m.skipped:
            if not dry_run:
                migrate_run(d)  # a GSM8K baseline's aa/ still holds the second run's HumanEval records
            continue
        profile_dir = d.parent
        name = profile_dir.name
        target = None
        if name.endswith(m.old_id[:12]):  # named by its id: renamed to the new one
            target = profile_dir.parent / (name[: -12] + m.new_id[:12]) / d.name
            if target.exists():
                m.skipped = f"{target} already exists: left as it is"
                continue
        m.renamed_to = target
        if dry_run:
            continue
        migrate_run(d)
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(d, target)
            if not any(profile_dir.iterdir()):
                profile_dir.rmdir()
    return out


def migrate(path: str | Path, dry_run: bool = False) -> list[Migration]:
    """A run folder (it has a manifest) or a baselines root."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return [migrate_run(path, dry_run=dry_run)]
    return migrate_baselines(path, dry_run=dry_run)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in args
    paths = [a for a in args if a != "--dry-run"]
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m evalgate.tasks.humaneval.profile_migration PATH... [--dry-run]", file=sys.stderr)
        return 2
    for p in paths:
        if not Path(p).is_dir():
            print(f"{p}: not a folder", file=sys.stderr)
            return 2
        for m in migrate(p, dry_run=dry):
            print(("(dry run) " if dry else "") + m.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
