"""Stored runs without a model: a baseline and a candidate in the run store's format, with chosen flips.

For tests of what reads stored runs (comparison, notebook views, report.html) at sizes a real CPU run
cannot reach. Records carry the fields real GSM8K and HumanEval records carry, and some completions are
hostile HTML, so escaping is exercised everywhere.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HOSTILE = ['<script>alert("x")</script>', '</script><img src=x onerror=alert(1)>', "<b>bold</b> &amp; &lt;",
           "{{ jinja }} {% raw %}", "\u2028line separator\u2029"]
GSM8K_PROFILE = "gsm8k-lmeval-v3"
HUMANEVAL_PROFILE = "humaneval-completion-codex"


def manifest(kernel: str, run_id: str, n_gsm8k: int, n_humaneval: int) -> dict:
    tasks = {}
    if n_gsm8k:
        tasks["gsm8k"] = {"complete": True, "n_items": n_gsm8k, "name": GSM8K_PROFILE, "profile_id": "a" * 64,
                          "dataset_sha256": {"gsm8k/test.jsonl": "b" * 64},
                          "decoding": {"do_sample": False, "n": 1, "temperature": 0.0}}
    if n_humaneval:
        tasks["humaneval"] = {"complete": True, "n_items": n_humaneval, "name": HUMANEVAL_PROFILE,
                              "profile_id": "c" * 64, "dataset_sha256": {"humaneval/HumanEval.jsonl.gz": "d" * 64},
                              "decoding": {"do_sample": False, "n": 1, "temperature": 0.0},
                              "prepare": {"ok": True}}
    return {
        "evalgate_version": "0.1.0", "run_id": run_id, "created": "2026-01-02T03:04:05+00:00",
        "finished": "2026-01-02T04:05:06+00:00", "status": "complete", "dg_env": {},
        "kernel": {"name": kernel, "id": f"{kernel}@synthetic 1.0", "version": "synthetic 1.0",
                   "description": f"synthetic {kernel} <i>not a real kernel</i>", "faulty": False},
        "model": {"adapter": "hf", "dtype": "bfloat16", "device": "cpu", "batch_size": 8,
                  "fingerprint": "feedc0ffee123456", "config_sha256": "e" * 64,
                  "safetensors_headers_sha256": "f" * 64, "tokenizer_sha256": "0" * 64,
                  "model_type": "deepseek_v4", "path": "/models/synthetic-dsv4", "torch": "2.13.0+cpu",
                  "transformers": "5.23.0", "machine": {"platform": "Linux-x86_64", "python": "3.11.7", "cuda": None}},
        "tasks": tasks,
    }


def gsm8k_record(i: int, right: bool, rnd: random.Random, variant: str) -> dict:
    gold = str(10 + i)
    answer = gold if right else str(rnd.randint(0, 9999))
    hostile = HOSTILE[i % len(HOSTILE)] if i % 7 == 0 else ""
    steps = f"She has {i} apples and buys {variant} more {hostile}. {i} + 10 = {answer}"
    text = f" {steps}\n#### {answer}" if right or i % 3 else f" {steps} and then it keeps going"
    strict = answer if "####" in text else None
    return {"doc_id": i, "question": f"Question {i}: how many apples {'<em>exactly</em>' if i % 11 == 0 else ''} "
                                     f"does she have? {hostile}",
            "target": gold, "resps": text, "finish_reason": "stop" if strict else "length",
            "n_tokens": len(text.split()), "exact_match,strict-match": 1.0 if right else 0.0,
            "exact_match": {"strict-match": 1.0 if right else 0.0, "flexible-extract": 1.0 if right else 0.0},
            "invalid,strict-match": strict is None, "extracted": {"strict-match": strict, "flexible-extract": answer},
            "filtered_resps": {"strict-match": strict or "[invalid]"}, "prompt_hash": f"{i:064d}",
            "profile": GSM8K_PROFILE}


def humaneval_record(i: int, right: bool, failure: str, variant: str) -> dict:
    prompt = f'def f_{i}(xs: list) -> int:\n    """Sum of xs. <script>doc</script>"""\n'
    body = f"    return sum(xs)  # {variant}\n" if right else f"    return sum(xs) + {1 + i % 3}  # {variant}\n"
    if not right and failure == "failed:syntax":
        body = f"    return sum(xs +  # {variant}\n"
    stderr = "" if right else ("Traceback (most recent call last):\n  File \"program.py\", line 9, in <module>\n"
                               f"    check(f_{i})\nAssertionError: <got {i}>\n")
    return {"doc_id": f"HumanEval/{i}", "task_id": f"HumanEval/{i}", "entry_point": f"f_{i}", "resps": body,
            "program": prompt + body + f"\n\ndef check(candidate):\n    assert candidate([1]) == 1\n\ncheck(f_{i})",
            "pass@1": 1.0 if right else 0.0, "passed": right, "failure_class": "passed" if right else failure,
            "result": "passed" if right else f"failed: {failure}", "stderr": stderr,
            "exception": None if right else "AssertionError", "finish_reason": "stop", "n_tokens": 12,
            "invalid": failure == "failed:syntax" and not right, "n": 1, "c": int(right)}


def write_run(path: Path, kernel: str, gsm8k: list[bool], humaneval: list[bool], failures: list[str],
              seed: int) -> Path:
    rnd = random.Random(seed)
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(manifest(kernel, path.name, len(gsm8k), len(humaneval))))
    variant = "base" if kernel == "w4a8" else "cand"
    with open(path / "gsm8k.jsonl", "w", encoding="utf-8") as f:
        for i, ok in enumerate(gsm8k):
            f.write(json.dumps(gsm8k_record(i, ok, rnd, variant if i % 2 else "same"), ensure_ascii=False) + "\n")
    if humaneval:
        with open(path / "humaneval.jsonl", "w", encoding="utf-8") as f:
            for i, (ok, failure) in enumerate(zip(humaneval, failures)):
                f.write(json.dumps(humaneval_record(i, ok, failure, variant)) + "\n")
    return path


def write_pair(root: Path, n_gsm8k: int = 200, n_humaneval: int = 40, lost_every: int = 9, gained_every: int = 23,
               seed: int = 0) -> tuple[Path, Path]:
    """Baseline (w4a8) and candidate (w4a4_packed): the candidate loses every ``lost_every``-th item the
    baseline got right and gains every ``gained_every``-th item the baseline got wrong."""
    rnd = random.Random(seed)
    outcomes = {}
    for task, n in (("gsm8k", n_gsm8k), ("humaneval", n_humaneval)):
        base = [rnd.random() < 0.8 for _ in range(n)]
        cand = [(b and i % lost_every != 1) or (not b and i % gained_every == 2) for i, b in enumerate(base)]
        outcomes[task] = (base, cand)
    classes = ["failed:assertion", "failed:syntax", "timed_out", "failed:name"]
    fails = [classes[i % len(classes)] for i in range(n_humaneval)]
    base = write_run(root / "base", "w4a8", outcomes["gsm8k"][0], outcomes["humaneval"][0], fails, seed)
    cand = write_run(root / "cand", "w4a4_packed", outcomes["gsm8k"][1], outcomes["humaneval"][1],
                     fails[1:] + fails[:1], seed + 1)
    return base, cand


def expected_flips(root: Path) -> dict[str, tuple[int, int]]:
    """task -> (lost, gained), read back from the written records."""
    out = {}
    for task, metric in (("gsm8k", "exact_match,strict-match"), ("humaneval", "pass@1")):
        path_b, path_c = root / "base" / f"{task}.jsonl", root / "cand" / f"{task}.jsonl"
        if not path_b.exists():
            continue
        b = [json.loads(l)[metric] for l in path_b.read_text(encoding="utf-8").split("\n") if l]
        c = [json.loads(l)[metric] for l in path_c.read_text(encoding="utf-8").split("\n") if l]
        out[task] = (sum(x > y for x, y in zip(b, c)), sum(y > x for x, y in zip(b, c)))
    return out
