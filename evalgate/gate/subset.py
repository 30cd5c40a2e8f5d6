"""Two runs cut to a subset of their items (a ``--limit`` candidate against a full baseline), after checking
item by item that each was asked the same way: what a profile id would have covered for the whole set."""

from __future__ import annotations

from evalgate.errors import NotComparable, UserError
from evalgate.records import RunManifest, TaskSummary
from evalgate.run.store import Run
from evalgate.types import canonical_json, sha256_text


def _settings_key(settings: dict | None) -> dict:
    """A profile's settings as compared on a subset: the sandbox's Python aside (a recorded property of the
    run, warned about, not part of the profile: evalgate/tasks/humaneval/runtime.py)."""
    settings = dict(settings or {})
    if isinstance(settings.get("sandbox"), dict):
        settings["sandbox"] = {k: v for k, v in settings["sandbox"].items() if k != "python"}
    return settings


def item_lists(items, base: Run, cand: Run, tasks: list[str] | None) -> dict[str, list]:
    """``items`` as task -> doc_ids: "candidate" (the candidate's items), one list for every task, or a dict."""
    names = tasks or [t for t in cand.tasks if t in cand.records]
    if isinstance(items, str):
        if items != "candidate":
            raise UserError(f'items must be "candidate", a list of item ids or a dict task -> ids, not {items!r}')
        return {t: [r["doc_id"] for r in cand.records.get(t, [])] for t in names}
    if isinstance(items, dict):
        unknown = [t for t in items if t not in cand.meta.tasks]
        if unknown:
            raise UserError(f"items names task(s) the candidate did not run: {', '.join(unknown)}")
        return {t: list(ids) for t, ids in items.items() if t in names}
    return {t: list(items) for t in names}


def restrict(base: Run, cand: Run, items: dict[str, list]) -> tuple[Run, Run, list[str]]:
    """Both runs cut down to the given items of each task, after checking item by item what the profile id
    would have covered: the same profile (name, version, settings, dataset sha256, decoding) and, for every
    item, present on both sides and prompted identically (``prompt_hash``). Refuses (``NotComparable``) on
    any mismatch, so a subset never pairs items that were asked differently. Returns (baseline, candidate,
    notes)."""
    problems, notes = [], []
    base_tasks, cand_tasks = dict(base.meta.tasks), dict(cand.meta.tasks)
    base_records, cand_records = dict(base.records), dict(cand.records)
    for task, ids in items.items():
        bt, ct = base_tasks.get(task), cand_tasks.get(task)
        if bt is None or ct is None:
            problems.append(f"task {task} is missing from the {'baseline' if bt is None else 'candidate'}")
            continue
        if not ids:
            problems.append(f"{task}: no items given")
            continue
        if len(set(map(str, ids))) != len(ids):
            problems.append(f"{task}: an item is listed twice")
            continue
        for key in ("name", "version", "dataset_sha256", "decoding"):
            if getattr(bt, key) != getattr(ct, key):
                problems.append(f"{task} profile {key} differs ({getattr(bt, key)!r} vs {getattr(ct, key)!r})")
        if _settings_key(bt.settings) != _settings_key(ct.settings):
            changed = sorted(k for k in set(_settings_key(bt.settings)) | set(_settings_key(ct.settings))
                             if _settings_key(bt.settings).get(k) != _settings_key(ct.settings).get(k))
            problems.append(f"{task} profile settings differ ({', '.join(changed)})")
        b = {str(r["doc_id"]): r for r in base.records.get(task, [])}
        c = {str(r["doc_id"]): r for r in cand.records.get(task, [])}
        for label, side in (("baseline", b), ("candidate", c)):
            missing = [i for i in ids if str(i) not in side]
            if missing:
                problems.append(f"{task}: {len(missing)} of the {len(ids)} items are not in the {label} "
                                f"(first: {missing[0]!r})")
        shared = [str(i) for i in ids if str(i) in b and str(i) in c]
        unchecked = [i for i in shared if not b[i].get("prompt_hash") or not c[i].get("prompt_hash")]
        asked = [i for i in shared if i not in unchecked and b[i]["prompt_hash"] != c[i]["prompt_hash"]]
        if unchecked:
            problems.append(f"{task}: item {unchecked[0]!r} has no prompt_hash on one side; cannot check it was "
                            "asked the same way")
        if asked:
            problems.append(f"{task}: {len(asked)} item(s) were prompted differently in the two runs (first: "
                            f"{asked[0]!r}, prompt_hash differs)")
        if problems:
            continue
        subset_id = sha256_text(canonical_json({"subset_of": bt.name, "version": bt.version,
                                                "settings": _settings_key(bt.settings),
                                                "dataset_sha256": bt.dataset_sha256,
                                                "decoding": bt.decoding, "items": shared}))
        for summaries, summary in ((base_tasks, bt), (cand_tasks, ct)):
            summaries[task] = summary.model_copy(update={
                "profile_id": subset_id, "n_items": len(shared),
                "subset": {"n_items": summary.n_items, "profile_id": summary.profile_id}})
        keep = set(shared)
        base_records[task] = [r for r in base.records[task] if str(r["doc_id"]) in keep]
        cand_records[task] = [r for r in cand.records[task] if str(r["doc_id"]) in keep]
        if len(shared) < bt.n_items:
            notes.append(f"{task}: {len(shared)} of the baseline's {bt.n_items} items, checked item by item "
                         "(same profile settings, dataset, decoding and prompts): a subset shows less than every item "
                         "would (wider intervals)")
        elif bt.profile_id != ct.profile_id:
            notes.append(f"{task}: the profile ids differ ({bt.profile_id[:12]} vs "
                         f"{ct.profile_id[:12]}) but what they cover matches, item by item (the sandbox's "
                         "Python version is compared on its own)")
    if problems:
        raise NotComparable("runs are not comparable on these items: " + "; ".join(problems))
    return (Run(base.path, _with_tasks(base.meta, base_tasks), base_records),
            Run(cand.path, _with_tasks(cand.meta, cand_tasks), cand_records), notes)


def _with_tasks(manifest: RunManifest, tasks: dict[str, TaskSummary]) -> RunManifest:
    return manifest.updated(tasks=tasks)
