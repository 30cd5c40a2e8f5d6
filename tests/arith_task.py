"""A third task in one file, as a user writes one (docs/tasks.md): sums of two small numbers, answered after
"Answer:", scored by the first whole number of the reply. Its items are inline; its one profile is here too.

tests/test_third_task.py installs this file as a package offering it through the ``evalgate.tasks`` entry
point and gates it end to end.
"""

from __future__ import annotations

import re

from evalgate.records import ItemRecord
from evalgate.tasks.base import TaskBase
from evalgate.types import Generation, Profile, Request, ResolvedProfile, canonical_json, sha256_text

ITEMS = [(3, 4), (12, 30), (7, 8), (25, 25), (9, 1), (40, 2), (6, 6), (15, 27), (2, 98), (11, 11), (5, 13),
         (33, 44), (8, 9), (21, 0), (14, 6), (60, 7), (1, 1), (19, 23), (50, 50), (4, 17)]
NUMBER = re.compile(r"-?\d+")

PROFILE = Profile(
    name="arith-v1", task="arith", version="1", description="a + b, zero-shot, first whole number of the reply",
    settings={"item_template": "Question: What is {a} plus {b}?\nAnswer:", "stop": ["\n", "Question:"],
              "max_new_tokens": 8, "extractor": "first -?\\d+", "scorer": "arith-1"},
)


class ArithRecord(ItemRecord):
    """An arith item: the sum asked for, the number read from the reply, and its score."""

    doc_id: int
    question: str
    target: str
    extracted: str | None = None
    exact_match: float
    invalid: bool
    n_samples: int | None = None


class Arith(TaskBase):
    name = "arith"
    profiles = {PROFILE.name: PROFILE}
    default_profile = PROFILE.name
    gate_metric = "exact_match"
    record_model = ArithRecord

    def load(self, profile: Profile, data_dir, limit, dataset=None):
        items = [{"doc_id": i, "a": a, "b": b, "question": f"{a} + {b}", "target": str(a + b)}
                 for i, (a, b) in enumerate(ITEMS)][:limit]
        resolved = ResolvedProfile(
            profile=profile, dataset_sha256={"arith/inline": f"items-sha256:{sha256_text(canonical_json(ITEMS))}"},
            item_ids=tuple(item["doc_id"] for item in items), decoding={"temperature": 0.0, "do_sample": False, "n": 1})
        return items, resolved

    def requests(self, items: list[dict], resolved: ResolvedProfile) -> list[Request]:
        s = resolved.profile.settings
        return [Request(doc_id=item["doc_id"], prompt=s["item_template"].format(a=item["a"], b=item["b"]),
                        stop=tuple(s["stop"]), max_new_tokens=s["max_new_tokens"]) for item in items]

    def score_batch(self, items, requests, generations, resolved: ResolvedProfile) -> list[dict]:
        return [self._record(item, request, gens if isinstance(gens, (list, tuple)) else [gens])
                | ({} if not isinstance(gens, (list, tuple)) else {"n_samples": len(gens)})
                for item, request, gens in zip(items, requests, generations)]

    def _record(self, item: dict, request: Request, gens: list[Generation]) -> dict:
        """One record; k samples score their mean (what the gate reads), the first sample's text kept."""
        answers = [match.group() if (match := NUMBER.search(g.text)) else None for g in gens]
        first = gens[0]
        return {"doc_id": item["doc_id"], "question": item["question"], "target": item["target"],
                "prompt_hash": sha256_text(request.prompt), "resps": first.text, "extracted": answers[0],
                "exact_match": sum(a == item["target"] for a in answers) / len(gens),
                "invalid": answers[0] is None, "finish_reason": first.finish_reason, "stop_hit": first.stop_hit,
                "n_prompt_tokens": first.n_prompt_tokens, "n_tokens": first.n_tokens,
                "latency_s": round(first.latency_s, 4)}

    def item_heading(self, record: dict) -> str | None:
        return f"What is {record['question'].replace(' + ', ' plus ')}?"


TASK = Arith()
