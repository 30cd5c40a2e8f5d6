"""What a task is to evalgate: the ``Task`` interface, the defaults of its optional parts (``TaskBase``),
the declaration of its published data files (``DataFile``) and its profiles read from a file beside it.

A task owns its shape. Besides loading, prompting and scoring (the inspect_ai split: ``load`` reads items,
``requests`` turns them into prompts, ``score_batch`` turns responses into per-item records), it declares
what the rest of evalgate would otherwise have to know about it:

- ``record_model``: the pydantic model of its per-item records (``evalgate.records.ItemRecord`` plus its own
  fields), validated on every write and read;
- ``data_files``: the published files it reads, each with its sha256 and where evalgate finds it;
- ``item_title`` / ``item_heading`` / ``item_gold`` / ``item_answer`` / ``item_prompt``: how a report names an
  item, what it is checked against and what the scorer read from a response;
- ``comparison_notes``: lines a comparison of two runs of the task carries (HumanEval: programs run under
  different Python minors).

The runner, store, gate and reports ask the task (``evalgate.tasks.get_task``) and name none. docs/tasks.md
shows a whole task in one file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

import yaml

from evalgate.errors import UserError
from evalgate.records import ItemRecord
from evalgate.tasks.data import DataFile
from evalgate.types import Generation, Profile, Request, ResolvedProfile


class Task(Protocol):
    """What evalgate calls on a task. Every member is required (no optional hooks found by reflection);
    ``TaskBase`` gives the defaults of those a simple task does not need."""

    name: str
    profiles: dict[str, Profile]
    default_profile: str
    gate_metric: str  # record field the gate scores, e.g. "exact_match,strict-match" or "pass@1"

    @property
    def record_model(self) -> type[ItemRecord]:
        """The model of its per-item records (one line of ``<task>.jsonl``): ``ItemRecord`` and its fields."""

    @property
    def data_files(self) -> tuple[DataFile, ...]:
        """The published files its profiles may read."""

    def load(self, profile: Profile, data_dir: Path | None, limit: int | None,
             dataset: dict | None = None) -> tuple[list[dict], ResolvedProfile]:
        """Items (each with ``doc_id``) in stable order, and the profile resolved against them; ``dataset`` is
        the task's ``--dataset`` choice ({"source", "columns"}), else the data dir or the packaged data."""

    def requests(self, items: list[dict], resolved: ResolvedProfile) -> list[Request]:
        """One request per item, in item order."""

    def prepare_ahead(self, resolved: ResolvedProfile, data_dir: Path | None) -> None:
        """Start ``prepare``'s work in the background, now (before the model loads); ``prepare`` then takes its
        result. Never raises: what goes wrong is ``prepare``'s to report. A no-op when there is nothing."""

    def prepare(self, resolved: ResolvedProfile, data_dir: Path | None) -> dict:
        """What must hold before any item is scored (HumanEval: the executor self-test); stored in the
        manifest. Raises UserError to refuse the run; ``{}`` when a task needs nothing."""

    def score_batch(self, items: list[dict], requests: list[Request], generations: list[Generation],
                    resolved: ResolvedProfile) -> list[dict]:
        """One per-item record per generation, lm-eval field names where they exist (docs/runs.md)."""

    def is_invalid(self, record: dict, metric: str) -> bool:
        """An answer the scorer could not use (the validity-rate checks of the gate)."""

    def item_title(self, record: dict) -> str | None:
        """What a flip table names the item by (plain text, one line or a question)."""

    def item_heading(self, record: dict) -> str | None:
        """What the HTML report's row names the item by."""

    def item_gold(self, record: dict) -> str | None:
        """What the item is checked against."""

    def item_answer(self, record: dict) -> Any:
        """The answer the scorer read from the response; None when it read none."""

    def item_prompt(self, record: dict) -> str | None:
        """The prompt, when the record holds it (the report's expanded row shows it)."""

    def comparison_notes(self, base_summary: dict | None, cand_summary: dict | None) -> list[str]:
        """Lines a comparison of a baseline and a candidate run of this task carries (``summary``: the
        manifest's ``tasks[name]``); they never change a verdict."""


class TaskBase:
    """Defaults for a ``Task``: nothing to prepare, records of the fields every task writes, an item named by
    its ``question``, checked against its ``target``, answered by its ``extracted`` field, no notes."""

    record_model: ClassVar[type[ItemRecord]] = ItemRecord
    data_files: ClassVar[tuple[DataFile, ...]] = ()

    def prepare_ahead(self, resolved: ResolvedProfile, data_dir: Path | None) -> None:
        pass

    def prepare(self, resolved: ResolvedProfile, data_dir: Path | None) -> dict:
        return {}

    def is_invalid(self, record: dict, metric: str) -> bool:
        return bool(record.get("invalid", False))

    def item_title(self, record: dict) -> str | None:
        question = record.get("question")
        return None if question is None else str(question)

    def item_heading(self, record: dict) -> str | None:
        return self.item_title(record)

    def item_gold(self, record: dict) -> str | None:
        target = record.get("target")
        return None if target is None else str(target)

    def item_answer(self, record: dict) -> Any:
        return record.get("extracted")

    def item_prompt(self, record: dict) -> str | None:
        prompt = record.get("prompt")
        return str(prompt) if prompt else None

    def comparison_notes(self, base_summary: dict | None, cand_summary: dict | None) -> list[str]:
        return []


def load_profiles(path: Path, task: str) -> dict[str, Profile]:
    """The profiles of ``task`` in a YAML file beside it: ``NAME: {version, description, settings}`` each.

    The settings are hashed into the profile id exactly as read. A top-level key starting with ``_`` is no
    profile: it holds parts the profiles share (a YAML anchor merged with ``<<:``). A profile without one of
    the three keys, or with another, is a broken install, refused in one line.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read the profiles of task {task!r} from {str(path)!r}: {exc}") from None
    profiles = {}
    for name, entry in (data or {}).items():
        if name.startswith("_"):
            continue
        if not isinstance(entry, dict) or set(entry) != {"version", "description", "settings"}:
            raise UserError(f"{str(path)!r}: profile {name!r} must hold exactly version, description and settings")
        profiles[name] = Profile(name=name, task=task, version=str(entry["version"]),
                                 description=entry["description"], settings=entry["settings"])
    return profiles
