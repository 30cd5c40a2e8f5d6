"""Task registry: a task name -> its ``Task`` object (``evalgate.types.Task``).

Each task is imported on first use, so a GSM8K run never imports the HumanEval sandbox and vice versa.
"""

from __future__ import annotations

from evalgate.errors import UserError
from evalgate.types import Profile, Task


def _gsm8k() -> Task:
    from evalgate.tasks.gsm8k import TASK

    return TASK


def _humaneval() -> Task:
    from evalgate.tasks.humaneval.task import TASK

    return TASK


TASKS = {"gsm8k": _gsm8k, "humaneval": _humaneval}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
    return TASKS[name]()


def resolve_profile(task: Task, profile_name: str | None) -> Profile:
    name = profile_name or task.default_profile
    if name not in task.profiles:
        raise UserError(f"unknown profile {name!r} for task {task.name!r}; choose from: {', '.join(task.profiles)}")
    return task.profiles[name]
