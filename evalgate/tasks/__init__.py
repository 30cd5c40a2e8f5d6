"""Task registry: a name -> a module-level ``TASK`` object implementing ``evalgate.types.Task``."""

from __future__ import annotations

import importlib

from evalgate.errors import UserError

# name -> module; imported on first use so a GSM8K run never imports the sandbox and vice versa
TASK_MODULES = {
    "gsm8k": "evalgate.tasks.gsm8k",
    "humaneval": "evalgate.tasks.humaneval.task",
}


def get_task(name: str):
    if name not in TASK_MODULES:
        raise UserError(f"unknown task {name!r}; choose from: {', '.join(TASK_MODULES)}")
    return importlib.import_module(TASK_MODULES[name]).TASK


def resolve_profile(task, profile_name: str | None):
    name = profile_name or task.default_profile
    if name not in task.profiles:
        raise UserError(f"unknown profile {name!r} for task {task.name!r}; choose from: {', '.join(task.profiles)}")
    return task.profiles[name]
