"""What every task provides: items, requests for the model, and a score per response.

A task keeps dataset, prompting and scoring apart (the inspect_ai split): ``load`` reads items,
``requests`` turns them into prompts with stops and token limits, ``score`` turns one response into a
per-item record. Runner, store and gate know nothing task-specific beyond this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from evalgate.tasks.profiles import Profile, ResolvedProfile


@dataclass(frozen=True)
class Request:
    doc_id: int | str
    prompt: str  # completion mode: the full prompt text
    stop: tuple[str, ...]
    max_new_tokens: int
    messages: tuple = ()  # chat mode: ({"role": ..., "content": ...}, ...); empty in completion mode


@dataclass
class Generation:
    text: str  # the response, cut before the first stop string
    finish_reason: str  # "stop" (a stop string or EOS) or "length"
    stop_hit: str | None = None
    n_prompt_tokens: int = 0
    n_tokens: int = 0  # completion tokens
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)


class Task(Protocol):
    name: str
    profiles: dict[str, Profile]
    default_profile: str
    gate_metric: str  # record field the gate scores, e.g. "exact_match,strict-match" or "pass@1"

    def load(self, profile: Profile, data_dir: Path | None, limit: int | None) -> tuple[list[dict], ResolvedProfile]:
        """Items (each with ``doc_id``) in stable order, and the profile resolved against them."""

    def requests(self, items: list[dict], resolved: ResolvedProfile) -> list[Request]:
        ...

    def score(self, item: dict, request: Request, generation: Generation, resolved: ResolvedProfile) -> dict:
        """One per-item record, lm-eval field names where they exist (see DESIGN.md Conventions)."""
