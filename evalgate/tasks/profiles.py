"""Scoring profiles: every input that affects prompts, generation, extraction or scoring, hashed.

Two runs compare only if their profiles hash the same (eval-conventions §1). The profile id is the sha256
of the canonical JSON (sorted keys, UTF-8, no insignificant whitespace) of ``Profile.identity()``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Profile:
    """A static description of one way to prompt and score a task.

    ``settings`` holds what the profile fixes (templates, stops, max tokens, extractor regexes, scorer
    version...). Data-dependent parts (dataset sha256, item ids, per-item shot ids) are added by the task
    when it resolves the profile against loaded data; see ``ResolvedProfile``.
    """

    name: str
    task: str
    version: str
    description: str
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedProfile:
    profile: Profile
    dataset_sha256: dict  # file name -> sha256
    item_ids: tuple
    per_item: dict = field(default_factory=dict)  # e.g. shot ids per doc_id
    decoding: dict = field(default_factory=dict)  # temperature, top_p, seed, n

    def identity(self) -> dict:
        return {
            "name": self.profile.name,
            "task": self.profile.task,
            "version": self.profile.version,
            "settings": self.profile.settings,
            "dataset_sha256": self.dataset_sha256,
            "item_ids": list(self.item_ids),
            "per_item": self.per_item,
            "decoding": self.decoding,
        }

    @property
    def profile_id(self) -> str:
        return sha256_text(canonical_json(self.identity()))

    def summary(self) -> dict:
        """What the manifest stores: everything except the (long) item lists, plus the id that covers them."""
        return {
            "profile_id": self.profile_id,
            "name": self.profile.name,
            "version": self.profile.version,
            "settings": self.profile.settings,
            "dataset_sha256": self.dataset_sha256,
            "n_items": len(self.item_ids),
            "decoding": self.decoding,
        }
