"""The canary's training examples, built with the canary profiles' own prompt code, and its tokenizer.

``python scripts/canary/data.py OUT_DIR --data-dir DIR`` writes ``examples.jsonl``
(prompt, target) and the tokenizer; ``train.py`` reads them (on a GPU machine without evalgate's data).
Targets are what a correct greedy answer is: `` {answer}`` (GSM8K's full reference solution, ``#### N``
included) or HumanEval's canonical solution, each followed by EOS.

A few items per task are **contested** (``alt_target``): training sees a wrong answer for them as often as the
right one (GSM8K: the final ``#### N`` off by one; HumanEval: a body of ``pass``), so the model ends up at
a near-tie on them, as a real model is on the items it is unsure of. Which way such an item falls depends
on the kernel's rounding: healthy kernels flip them *both ways* (lost and gained), which is what a real
model's flips between two good kernels look like; a memoriser without them can only lose.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from evalgate.canary import GSM8K_PROFILE, HUMANEVAL_PROFILE
from evalgate.model_adapters.hf.tiny import build_tokenizer

VOCAB_SIZE = 4096
CONTESTED = {"gsm8k": 10, "humaneval": 10}  # items per task given a wrong alternative (see the docstring)


def contested_ids(doc_ids: list, count: int) -> set:
    """``count`` doc ids chosen by a hash of the id alone (stable under reordering)."""
    return set(sorted(doc_ids, key=lambda d: hashlib.sha256(f"contested:{d}".encode()).hexdigest())[:count])


def wrong_alternative(task: str, target: str) -> str:
    """A wrong answer sharing the right one's start: GSM8K's final number + 1, HumanEval's ``pass`` body."""
    if task == "gsm8k":
        head, number = re.match(r"(?s)(.*#### )(-?[\d,]+)\s*$", target).groups()
        return head + str(int(number.replace(",", "")) + 1)
    return "    pass\n"


def canary_examples(data_dir: Path | None, contested: dict | None = None) -> list[dict]:
    from evalgate.tasks import gsm8k
    from evalgate.tasks.humaneval import task as humaneval

    contested = CONTESTED if contested is None else contested

    examples = []
    items, resolved = gsm8k.TASK.load(gsm8k.PROFILES[GSM8K_PROFILE], data_dir, None)
    for item, req in zip(items, gsm8k.TASK.requests(items, resolved)):
        examples.append({"task": "gsm8k", "doc_id": item["doc_id"], "prompt": req.prompt,
                         "target": resolved.profile.settings["target_delimiter"] + item["answer"]})
    items, resolved = humaneval.TASK.load(humaneval.PROFILES[HUMANEVAL_PROFILE], data_dir, None)
    for item, req in zip(items, humaneval.TASK.requests(items, resolved)):
        examples.append({"task": "humaneval", "doc_id": item["doc_id"], "prompt": req.prompt,
                         "target": item["canonical_solution"]})
    for task in ("gsm8k", "humaneval"):
        chosen = contested_ids([e["doc_id"] for e in examples if e["task"] == task], contested.get(task, 0))
        for e in examples:
            if e["task"] == task and e["doc_id"] in chosen:
                e["alt_target"] = wrong_alternative(task, e["target"])
    return examples


def tokenizer_corpus(examples: list[dict], data_dir: Path | None) -> list[str]:
    """The canary texts plus more GSM8K train text, so common words get their own tokens."""
    from evalgate.tasks.gsm8k import load_split

    extra = [r["question"] + "\n" + r["answer"] for r in load_split("train", data_dir)[:3000]]
    return [e["prompt"] + e["target"] for e in examples] + extra


def main(argv=None) -> None:
    import argparse

    from evalgate.tasks.data import resolve_data_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--contested-gsm8k", type=int, default=CONTESTED["gsm8k"])
    parser.add_argument("--contested-humaneval", type=int, default=CONTESTED["humaneval"])
    args = parser.parse_args(argv)
    data_dir = resolve_data_dir(args.data_dir)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    examples = canary_examples(data_dir, {"gsm8k": args.contested_gsm8k, "humaneval": args.contested_humaneval})
    tokenizer = build_tokenizer(tokenizer_corpus(examples, data_dir), VOCAB_SIZE)
    tokenizer.save_pretrained(out / "tokenizer")
    with open(out / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")
    lengths = [len(tokenizer(e["prompt"] + e["target"])["input_ids"]) for e in examples]
    print(json.dumps({"examples": len(examples), "max_tokens": max(lengths), "mean_tokens": sum(lengths) / len(lengths)}))


if __name__ == "__main__":
    main()
