"""The tasks evalgate knows, by name: its own two, those installed packages offer and those registered here.

- evalgate's own, ``gsm8k`` and ``humaneval``, each imported on first use (a GSM8K run never imports the
  HumanEval sandbox);
- an installed package's, through the entry-point group ``evalgate.tasks``: each entry point is named as
  the task and points at its ``Task`` object (``package.module:TASK``), imported when the task is used;
- a notebook's or a test's, by ``register_task(task)`` (this process only).

A name evalgate uses stays evalgate's. What a task is: ``evalgate.tasks.base`` (docs/tasks.md).
"""

from __future__ import annotations

import importlib.metadata
import re
from functools import cache, lru_cache

from evalgate.errors import UserError
from evalgate.records import ItemRecord, RunManifest, TaskSummary
from evalgate.tasks.base import Task
from evalgate.types import Profile

GROUP = "evalgate.tasks"
NAME = re.compile(r"^[a-z][a-z0-9_]*$")  # a task name is a policy key (thresholds.yaml) and a file name


def _gsm8k() -> Task:
    from evalgate.tasks.gsm8k import TASK

    return TASK


def _humaneval() -> Task:
    from evalgate.tasks.humaneval.task import TASK

    return TASK


BUILTIN = {"gsm8k": _gsm8k, "humaneval": _humaneval}
_registered: dict[str, Task] = {}


@lru_cache(maxsize=1)
def _entry_points() -> dict:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name not in BUILTIN:
            found.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return found


def task_names() -> list[str]:
    """Every task this process can run: evalgate's, then the registered and installed ones (no plugin is
    imported to list them)."""
    return [*BUILTIN, *_registered, *(n for n in _entry_points() if n not in _registered)]


def register_task(task: Task) -> Task:
    """Make ``task`` known to this process by its name (a notebook's or a test's own task); returns it."""
    if getattr(task, "name", None) in BUILTIN:
        raise UserError(f"register_task: {task.name!r} is evalgate's own task; give yours another name")
    _check(task, "register_task")
    _registered[task.name] = task
    return task


def unregister_task(name: str) -> None:
    """Forget a task ``register_task`` made known (evalgate's own and installed ones stay)."""
    _registered.pop(name, None)


@cache
def _installed(name: str) -> Task:
    ep = _entry_points()[name]
    where = f"task {name!r} (entry point {ep.value})"
    try:
        task = ep.load()
    except Exception as exc:  # a plugin's own bug: any exception, one line
        lines = str(exc).strip().splitlines()
        raise UserError(f"{where}: loading it failed ({type(exc).__name__}: {lines[0] if lines else ''}); fix or "
                        "uninstall the package that offers it") from None
    _check(task, where)
    if task.name != name:
        raise UserError(f"{where}: the object is named {task.name!r}; an entry point is named as its task")
    return task


def _check(task, where: str) -> None:
    """What a task must declare before evalgate runs it, each problem in one line."""
    name = getattr(task, "name", None)
    if not isinstance(name, str) or not NAME.match(name):
        raise UserError(f"{where}: a task's name must be lower-case letters, digits and _ (got {name!r})")
    missing = [m for m in ("profiles", "default_profile", "gate_metric", "record_model", "data_files", "load",
                           "requests", "prepare_ahead", "prepare", "score_batch", "is_invalid", "item_title",
                           "item_heading", "item_gold", "item_answer", "item_prompt", "comparison_notes")
               if not hasattr(task, m)]
    if missing:
        raise UserError(f"{where}: task {name!r} lacks {', '.join(missing)} (subclass evalgate.tasks.base.TaskBase "
                        "for the defaults)")
    if not isinstance(task.record_model, type) or not issubclass(task.record_model, ItemRecord):
        raise UserError(f"{where}: task {name!r}'s record_model must subclass evalgate.records.ItemRecord")
    wrong = [p for p, profile in task.profiles.items() if profile.name != p or profile.task != name]
    if wrong or task.default_profile not in task.profiles:
        raise UserError(f"{where}: task {name!r}'s profiles must be keyed by their name, name the task, and hold "
                        f"its default profile {task.default_profile!r}")


def get_task(name: str) -> Task:
    if name in BUILTIN:
        return BUILTIN[name]()
    if name in _registered:
        return _registered[name]
    if name in _entry_points():
        return _installed(name)
    raise UserError(f"unknown task {name!r}; choose from: {', '.join(task_names())}")


def resolve_profile(task: Task, profile_name: str | None) -> Profile:
    name = profile_name or task.default_profile
    if name not in task.profiles:
        raise UserError(f"unknown profile {name!r} for task {task.name!r}; choose from: {', '.join(task.profiles)}")
    return task.profiles[name]


def record_model(name: str) -> type[ItemRecord]:
    """The model of ``name``'s per-item records; a task this install does not know is read with the fields
    every task writes (its other fields kept as they are)."""
    known = name in BUILTIN or name in _registered or name in _entry_points()  # evalgate's own: no metadata read
    return get_task(name).record_model if known else ItemRecord


def comparison_notes(base_manifest: RunManifest, cand_manifest: RunManifest, tasks=None) -> list[str]:
    """Every note the tasks both runs hold (or ``tasks``) attach to their comparison, task by task (each task
    reads its own summaries as dicts: their settings are the task's)."""
    bt, ct = base_manifest.tasks, cand_manifest.tasks
    names = tasks if tasks is not None else [t for t in ct if t in bt]
    return [note for t in names for note in get_task(t).comparison_notes(_plain(bt.get(t)), _plain(ct.get(t)))]


def _plain(summary: TaskSummary | None) -> dict | None:
    return summary.to_dict() if summary is not None else None
