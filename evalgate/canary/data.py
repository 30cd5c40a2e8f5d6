"""The canary's training examples, built with the canary profiles' own prompt code, and its tokenizer.

``python -m evalgate.canary.data OUT_DIR --data-dir DIR`` writes ``examples.jsonl``
(prompt, target) and the tokenizer; ``train.py`` reads them (on a GPU machine without evalgate's data).
Targets are what a correct greedy answer is: `` {answer}`` (GSM8K's full reference solution, ``#### N``
included) or HumanEval's canonical solution, each followed by EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

from evalgate.canary import GSM8K_PROFILE, HUMANEVAL_PROFILE
from evalgate.model_adapters.tiny import build_tokenizer

VOCAB_SIZE = 4096


def canary_examples(data_dir: Path | None) -> list[dict]:
    from evalgate.tasks import gsm8k, humaneval

    examples = []
    items, resolved = gsm8k.TASK.load(gsm8k.PROFILES[GSM8K_PROFILE], data_dir, None)
    for item, req in zip(items, gsm8k.TASK.requests(items, resolved)):
        examples.append({"task": "gsm8k", "doc_id": item["doc_id"], "prompt": req.prompt,
                         "target": resolved.profile.settings["target_delimiter"] + item["answer"]})
    items, resolved = humaneval.TASK.load(humaneval.PROFILES[HUMANEVAL_PROFILE], data_dir, None)
    for item, req in zip(items, humaneval.TASK.requests(items, resolved)):
        examples.append({"task": "humaneval", "doc_id": item["doc_id"], "prompt": req.prompt,
                         "target": item["canonical_solution"]})
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
    args = parser.parse_args(argv)
    data_dir = resolve_data_dir(args.data_dir)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    examples = canary_examples(data_dir)
    tokenizer = build_tokenizer(tokenizer_corpus(examples, data_dir), VOCAB_SIZE)
    tokenizer.save_pretrained(out / "tokenizer")
    with open(out / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")
    lengths = [len(tokenizer(e["prompt"] + e["target"])["input_ids"]) for e in examples]
    print(json.dumps({"examples": len(examples), "max_tokens": max(lengths), "mean_tokens": sum(lengths) / len(lengths)}))


if __name__ == "__main__":
    main()
