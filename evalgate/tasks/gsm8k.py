"""GSM8K, prompted and scored as lm-evaluation-harness does (docs/scoring.md#gsm8k).

Its profiles are data, in ``gsm8k_profiles.yaml`` beside this module:
- ``gsm8k-lmeval-v3``: lm-eval ``gsm8k`` v3.0, 5 shots sampled from train with ``random.Random(1234)``;
- ``gsm8k-cot-8shot``: lm-eval ``gsm8k_cot`` v3.0, the 8 chain-of-thought exemplars of Wei et al. (2022);
- ``gsm8k-canary-v1``: the built-in canary's 200 short train items, zero-shot.

All record strict-match and flexible-extract per item; the gate scores strict-match. The numeric verdict
(``Decimal`` comparison) is recorded next to the string verdict and never changes the score.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

from pydantic import Field

from evalgate.errors import UserError
from evalgate.records import ItemRecord
from evalgate.tasks.base import TaskBase, load_profiles
from evalgate.tasks.data import DataFile
from evalgate.tasks.source import TaskData
from evalgate.types import Generation, Profile, Request, ResolvedProfile, sha256_text

PROFILES = load_profiles(Path(__file__).with_name("gsm8k_profiles.yaml"), "gsm8k")
INVALID = "[invalid]"  # lm-eval's fallback when a filter finds nothing (every profile's "fallback")
IGNORE = PROFILES["gsm8k-lmeval-v3"].settings["ignore"]  # every profile's normalisation, in order

COT_EXEMPLARS = [  # lm-eval gsm8k-cot.yaml fewshot samples, in order (sampler first_n); the profile hashes them
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8."),
]


class Gsm8kRecord(ItemRecord):
    """A GSM8K item: both filters' answers, and flat ``"exact_match,<filter>"`` / ``"invalid,<filter>"`` keys."""

    doc_id: int
    profile: str | None = None
    doc_hash: str | None = None
    question: str | None = None
    target: str | None = None
    target_hash: str | None = None
    shot_ids: list[int] | None = None
    filtered_resps: dict[str, str] | None = None
    extracted: dict[str, str | None] | None = None
    exact_match: dict[str, float] | None = None
    numeric_match: dict[str, bool] | None = None
    numeric_disagrees: bool | None = None
    exact_match_strict: float | None = Field(default=None, alias="exact_match,strict-match")
    exact_match_flexible: float | None = Field(default=None, alias="exact_match,flexible-extract")
    invalid_strict: bool | None = Field(default=None, alias="invalid,strict-match")
    invalid_flexible: bool | None = Field(default=None, alias="invalid,flexible-extract")


# ---- extraction and scoring (public: a notebook can call these) ----

def _regex_filter(text: str, regex: str, group_select: int) -> str:
    """lm-eval's RegexFilter: findall, pick a match, first non-empty group of a tuple, strip."""
    matches = re.findall(regex, text)
    if not matches:
        return INVALID
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), None)
        if match is None:
            return INVALID
    return match.strip()


def normalize(text: str) -> str:
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def extract_answer(text: str, mode: str = "strict", profile: str = "gsm8k-lmeval-v3") -> str | None:
    """The normalised answer lm-eval would score, or None when nothing matches (``[invalid]``).

    ``mode`` is ``"strict"`` (first ``#### N``, or ``The answer is N.`` under the CoT profile) or
    ``"flexible"`` (last number-like run).
    """
    if mode not in ("strict", "flexible"):
        raise ValueError(f"mode must be 'strict' or 'flexible', not {mode!r}")
    spec = PROFILES[profile].settings[mode]
    raw = _regex_filter(text, spec["regex"], spec["group_select"])
    return None if raw == INVALID else normalize(raw)


def numeric_value(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except (InvalidOperation, AttributeError):
        return None


def gold_answer(answer: str) -> str:
    return normalize(answer)  # the "(?s).*#### " pattern keeps only what follows the last "#### "


# ---- data ----

FIELDS = ("question", "answer")  # the columns every GSM8K source must hold (or map: --dataset gsm8k.FIELD=COLUMN)
# the published splits, shipped with evalgate (MIT licence); their sha256 is part of every profile id
FILES = {
    "test": DataFile("gsm8k/test.jsonl", packaged=True,
                     sha256="3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
                     items_sha256="b6c9d9547ec974d3c064a2f101ebf67e74257536d8c5e22a9758f2893a9e03a4"),
    "train": DataFile("gsm8k/train.jsonl", packaged=True,
                      sha256="17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
                      items_sha256="419386f7702aae71e33d2ce12db2170fc893004227b082354443fa5873b378bb"),
}
HUB_CONFIGS = {"openai/gsm8k": "main"}  # the hub copy holds two configs; "main" is the one lm-eval reads


def task_data(splits, data_dir: Path | None, dataset: dict | None = None) -> TaskData:
    return TaskData("gsm8k", FIELDS, FILES, data_dir, dataset, splits, HUB_CONFIGS)


def load_split(split: str, data_dir: Path | None, dataset: dict | None = None) -> list[dict]:
    """A GSM8K split's rows: from ``dataset`` (a --dataset choice), else ``data_dir`` (an override), else the
    copy shipped with evalgate; loaded through ``datasets`` (evalgate.tasks.source)."""
    return task_data([split], data_dir, dataset).split(split).rows


# ---- the task ----

class GSM8K(TaskBase):
    name = "gsm8k"
    profiles = PROFILES
    default_profile = "gsm8k-lmeval-v3"
    gate_metric = "exact_match,strict-match"
    record_model = Gsm8kRecord
    data_files = tuple(FILES.values())

    def is_invalid(self, record: dict, metric: str = "exact_match,strict-match") -> bool:
        """No answer under the gated filter (lm-eval's ``[invalid]``)."""
        return bool(record.get(f"invalid,{metric.split(',', 1)[-1]}", False))

    def load(self, profile: Profile, data_dir: Path | None, limit: int | None, dataset: dict | None = None):
        split = profile.settings.get("split", "test")
        shots_from_train = profile.settings.get("shot_split") == "train"
        data = task_data([split] + (["train"] if shots_from_train else []), data_dir, dataset)
        main = data.split(split)
        rows = main.rows
        subset = profile.settings.get("items")
        if subset is not None:  # a named subset of the split, by index (e.g. the canary's memorised items)
            if subset not in ITEM_SUBSETS:
                raise UserError(f"profile {profile.name!r} names an unknown item subset {subset!r}")
            try:
                chosen = ITEM_SUBSETS[subset](rows)
            except ValueError:  # a dataset too small to hold the subset (it picks GSM8K's own items by index)
                source = f"--dataset gsm8k={dataset.get('source')}" if dataset else f"the {split} split"
                raise UserError(f"{source}: profile {profile.name!r} scores a fixed subset of GSM8K's own {split} "
                                f"items (the canary's), which these {len(rows)} rows cannot hold; score your "
                                "dataset with --profile gsm8k=gsm8k-cot-8shot (its shots are fixed: a test split is "
                                "enough)") from None
            items = [{"doc_id": i, **rows[i]} for i in chosen]
        else:
            items = [{"doc_id": i, **row} for i, row in enumerate(rows)]
        if limit is not None:
            items = items[:limit]  # the first N: shots of the first N docs are those of a full run
        per_item: dict = {}
        sha, record = dict(main.identity), {split: main.record}
        if shots_from_train:
            shots = data.split("train")
            train = shots.rows
            sha.update(shots.identity)
            record["train"] = shots.record
            rnd = random.Random(profile.settings["shot_seed"])
            for item in items:
                shot_ids = _sample_positions(rnd, len(train), profile.settings["num_shots"])
                item["shots"] = [train[j] for j in shot_ids]
                per_item[str(item["doc_id"])] = shot_ids
        else:
            exemplars = COT_EXEMPLARS if profile.settings.get("shot_sampler") == "first_n" else []
            for item in items:
                item["shots"] = [{"question": q, "answer": a} for q, a in exemplars]
        resolved = ResolvedProfile(profile=profile, dataset_sha256=sha, item_ids=tuple(i["doc_id"] for i in items),
                                   per_item=per_item, decoding={"temperature": 0.0, "do_sample": False, "n": 1},
                                   data=record)
        return items, resolved

    def prompt(self, item: dict, profile: Profile) -> str:
        s = profile.settings
        parts = [s["item_template"].format(question=shot["question"]) + s["target_delimiter"] + shot["answer"]
                 for shot in item["shots"]]
        parts.append(s["item_template"].format(question=item["question"]))
        return s["fewshot_delimiter"].join(parts)

    def requests(self, items: list[dict], resolved: ResolvedProfile) -> list[Request]:
        s = resolved.profile.settings
        return [Request(doc_id=item["doc_id"], prompt=self.prompt(item, resolved.profile), stop=tuple(s["stop"]),
                        max_new_tokens=s["max_new_tokens"]) for item in items]

    def item_answer(self, record: dict):
        """The strict-match filter's answer (the gated one); None when it found none."""
        extracted = record.get("extracted")
        if isinstance(extracted, dict):
            return extracted.get("strict-match", next(iter(extracted.values()), None))
        return extracted

    def score_batch(self, items: list[dict], requests: list[Request], generations: list,
                    resolved: ResolvedProfile) -> list[dict]:
        """One record per item. An entry of ``generations`` that is a list holds the item's k samples (a
        sampled run): the record then scores their mean (``score_samples``)."""
        return [self.score_samples(i, r, g, resolved) if isinstance(g, (list, tuple)) else self.score(i, r, g, resolved)
                for i, r, g in zip(items, requests, generations)]

    def score_samples(self, item: dict, request: Request, generations: Sequence[Generation],
                      resolved: ResolvedProfile) -> dict:
        """The record of an item with k samples (docs/scoring.md#k-samples): ``exact_match`` and its flat
        ``"exact_match,<filter>"`` keys are the mean over the samples (what the gate scores), ``n_samples``
        is k, ``samples`` holds each sample's own answer, score, validity and finish reason, ``resps`` every
        response; the other per-response fields (extraction, finish reason, tokens) are sample 0's."""
        per = [self.score(item, request, g, resolved) for g in generations]
        k = len(per)
        record = {**per[0], "exact_match": dict(per[0]["exact_match"])}
        for name in record["exact_match"]:
            mean = sum(p["exact_match"][name] for p in per) / k
            record["exact_match"][name] = mean
            record[f"exact_match,{name}"] = mean
        record["numeric_disagrees"] = any(p["numeric_disagrees"] for p in per)
        record["resps"] = [p["resps"] for p in per]
        record["n_samples"] = k
        record["samples"] = [{key: p[key] for key in SAMPLE_FIELDS} for p in per]
        return record

    def score(self, item: dict, request: Request, generation: Generation, resolved: ResolvedProfile) -> dict:
        name = resolved.profile.name
        target = gold_answer(item["answer"])
        record = {
            "doc_id": item["doc_id"],
            "doc_hash": sha256_text(item["question"]),
            "target": target,
            "target_hash": sha256_text(item["answer"]),
            "question": item["question"],
            "shot_ids": resolved.per_item.get(str(item["doc_id"])),
            "prompt_hash": sha256_text(request.prompt),
            "resps": generation.text,
            "filtered_resps": {},
            "extracted": {},
            "exact_match": {},
            "numeric_match": {},
        }
        for mode, filter_name in (("strict", "strict-match"), ("flexible", "flexible-extract")):
            spec = resolved.profile.settings[mode]
            raw = _regex_filter(generation.text, spec["regex"], spec["group_select"])
            pred = normalize(raw)
            string_ok = pred == target
            num_pred, num_gold = numeric_value(raw) if raw != INVALID else None, numeric_value(target)
            record["filtered_resps"][filter_name] = raw
            record["extracted"][filter_name] = None if raw == INVALID else pred
            record["exact_match"][filter_name] = float(string_ok)
            record["numeric_match"][filter_name] = num_pred is not None and num_gold is not None and num_pred == num_gold
            record[f"invalid,{filter_name}"] = raw == INVALID
        record["numeric_disagrees"] = any(record["numeric_match"][f] != bool(record["exact_match"][f])
                                          for f in record["exact_match"])
        # flat copies of the gated metrics, so records read like lm-eval's "exact_match,strict-match"
        for filter_name, value in record["exact_match"].items():
            record[f"exact_match,{filter_name}"] = value
        record.update(_generation_fields(generation))
        record["profile"] = name
        return record


def short_train_items(train_rows: list[dict], n: int = 200, max_answer_chars: int = 160,
                      seed: int = 20261129) -> list[int]:
    """A fixed, seeded choice of ``n`` train items among those with short solutions (fast CPU runs).

    The built-in canary memorised exactly these; the list is computed from the sha256-checked data, so it
    can never drift, and the profile id covers the ids.
    """
    short = [i for i, row in enumerate(train_rows) if len(row["answer"]) <= max_answer_chars]
    return sorted(random.Random(seed).sample(short, n))


# Item subsets a profile may name in settings["items"]; the name is a label hashed into the profile id.
ITEM_SUBSETS = {"canary: evalgate.model_adapters.canary.items": short_train_items}


def _sample_positions(rnd: random.Random, population: int, k: int) -> list[int]:
    """``rnd.sample(train_docs, k)`` as lm-eval calls it, returning positions instead of docs (same RNG draws)."""
    return rnd.sample(range(population), k)


# what each entry of a sampled record's ``samples`` keeps (the gate reads the gated metric, the invalid flag
# and finish_reason per sample: evalgate.gate.compare)
SAMPLE_FIELDS = ("resps", "filtered_resps", "extracted", "exact_match,strict-match", "exact_match,flexible-extract",
                 "invalid,strict-match", "invalid,flexible-extract", "numeric_match", "finish_reason", "stop_hit",
                 "n_tokens", "latency_s")


def _generation_fields(g: Generation) -> dict:
    return {"finish_reason": g.finish_reason, "stop_hit": g.stop_hit, "n_prompt_tokens": g.n_prompt_tokens,
            "n_tokens": g.n_tokens, "latency_s": round(g.latency_s, 4)}


TASK = GSM8K()
