"""The project's small shared vocabulary: profiles, requests and generations, and the interface of a model
that generates (``ModelAdapter``). What a task is lives with the tasks (``evalgate.tasks.base.Task``).

Scoring profiles hold every input that affects prompts, generation, extraction or scoring, hashed: two runs
compare only if their profiles hash the same (docs/scoring.md#profiles-and-profile-ids). The profile id is
the sha256 of the canonical JSON (sorted keys, UTF-8, no insignificant whitespace) of
``ResolvedProfile.identity()``.
"""

from __future__ import annotations

import functools

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Protocol


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def sha256_text(text: str) -> str:
    # surrogatepass: a model's text may hold a lone surrogate; any other text hashes as strict UTF-8 would
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


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
    data: dict = field(default_factory=dict)  # where the items came from (split -> source, files, items sha256); recorded, not hashed

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

    @functools.cached_property
    def profile_id(self) -> str:
        # computed once: it hashes the whole profile (few-shot examples included), and every record carries it
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
            "data": self.data,
        }


@dataclass(frozen=True)
class Request:
    doc_id: int | str
    prompt: str  # completion mode: the full prompt text
    stop: tuple[str, ...]
    max_new_tokens: int
    messages: tuple = ()  # chat mode: ({"role": ..., "content": ...}, ...); empty in completion mode
    # sampled runs (docs/scoring.md#k-samples): sample j of the item, at temperature > 0, drawing from the
    # stream ``seed`` = sample_seed(run seed, doc_id, j); greedy requests keep 0, 0.0 and None
    sample: int = 0
    temperature: float = 0.0
    seed: int | None = None
    # how many tokens the answer is expected to have (the stored baseline's, in a gate): the in-process model
    # schedules its decoding workers by it; nothing any item produces depends on it (and it is never stored)
    expected_tokens: int | None = None


@dataclass
class Generation:
    text: str  # the response, cut before the first stop string
    finish_reason: str  # "stop" (a stop string or EOS) or "length"
    stop_hit: str | None = None
    n_prompt_tokens: int = 0
    n_tokens: int = 0  # completion tokens
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)


Serving = Literal["batches", "stream", "dispatch"]


class ModelAdapter(Protocol):
    """A model that answers requests: in-process transformers, or an OpenAI-compatible server.

    Everything the runner calls is declared here (no optional hooks found by reflection). ``serving`` says
    which of the three ways to generate the runner drives; ``AdapterBase`` gives the defaults of the two an
    adapter does not serve by."""

    kernel: Any  # the ``evalgate.kernels.Kernel`` it runs (or a server was started with)
    load_s: float  # seconds spent loading the model (0 for a server)
    serving: Serving  # "batches": generate(); "stream": generate_stream(); "dispatch": dispatch()

    def info(self) -> dict:
        """The model's identity and serving settings for the run manifest (fingerprint, dtype, adapter...)."""

    def conformance(self, prompts: list[str]) -> dict | None:
        """The kernel checked against the kernel it declares (kernels/conformance.py) on the hidden states of
        the run's first ``prompts``, for the run manifest; None where the kernel is out of reach (a server)."""

    def generate(self, requests: list[Request]) -> list[Generation]:
        """One generation per request, in request order."""

    def generate_stream(self, requests: list[Request], batch_size: int | None = None) -> Iterator[list[tuple[int, Generation]]]:
        """Continuous batching (``serving == "stream"``): yields (request index, Generation) lists as items
        finish, at most ``batch_size`` in flight; closing the generator ends its workers."""

    def dispatch(self, requests: list[Request]) -> Any:
        """Continuous dispatch to a server (``serving == "dispatch"``): iterate the result for lists of
        (request, Generation) in the order they finish; its ``close()`` returns those finished and not yet
        handed over, ``stats()`` what the pool measured."""


class AdapterBase:
    """Defaults for a ``ModelAdapter``: served one batch at a time, no conformance record; the ways it does
    not serve by say so when called."""

    serving: Serving = "batches"
    load_s: float = 0.0

    def conformance(self, prompts: list[str]) -> dict | None:
        return None

    def generate_stream(self, requests: list[Request], batch_size: int | None = None):
        raise NotImplementedError(f"{type(self).__name__} serves by {self.serving!r}, not by a stream")

    def dispatch(self, requests: list[Request]):
        raise NotImplementedError(f"{type(self).__name__} serves by {self.serving!r}, not by dispatch")
