"""evalgate's own tasks declare their shape (evalgate/tasks/base.py): profiles as data beside the task, the
published files with their sha256, the record model; the rest of evalgate asks the task and imports none."""

from __future__ import annotations

import ast
import fnmatch
import json
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.records import ItemRecord
from evalgate.tasks import BUILTIN, get_task
from evalgate.tasks.base import TaskBase, load_profiles
from evalgate.types import sha256_text

REPO = Path(__file__).resolve().parents[1]
TASK_MODULES = ("evalgate.tasks.gsm8k", "evalgate.tasks.humaneval")
# the one command that is a task's own: `evalgate selftest humaneval`
TASK_COMMANDS = {REPO / "evalgate" / "cli" / "selftest.py"}


def test_outside_the_tasks_no_module_imports_a_task():
    found = []
    for path in sorted((REPO / "evalgate").rglob("*.py")):
        if (REPO / "evalgate" / "tasks") in path.parents or path in TASK_COMMANDS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith(TASK_MODULES)]
    assert found == []


@pytest.mark.parametrize("name", list(BUILTIN))
def test_a_builtin_task_declares_its_shape(name):
    task = get_task(name)
    assert isinstance(task, TaskBase) and issubclass(task.record_model, ItemRecord)
    assert task.record_model is not ItemRecord  # its own fields, typed
    assert task.default_profile in task.profiles and all(p.task == name for p in task.profiles.values())
    assert task.data_files and all(f.path.startswith(f"{name}/") and len(f.sha256) == 64 for f in task.data_files)


def test_every_profile_file_is_built_into_the_wheel():
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted((REPO / "evalgate" / "tasks").rglob("*.yaml"))
    assert len(files) == 2
    for path in files:
        package = ".".join(path.parent.relative_to(REPO).parts)
        assert any(fnmatch.fnmatch(path.name, p) for p in package_data.get(package, [])), f"{path} not in the wheel"


def test_humaneval_profiles_hash_what_the_sandbox_runs():
    from evalgate.tasks.humaneval import sandbox
    from evalgate.tasks.humaneval.problems import PROGRAM_TEMPLATE, TIMEOUT_POLICY
    from evalgate.tasks.humaneval.task import PROFILES

    for profile in PROFILES.values():
        assert profile.settings["sandbox"] == {**sandbox.settings(), "timeout_policy": TIMEOUT_POLICY}
        assert profile.settings["program_template"] == PROGRAM_TEMPLATE


def test_gsm8k_cot_profile_hashes_the_exemplars_it_prompts_with():
    from evalgate.tasks.gsm8k import COT_EXEMPLARS, PROFILES

    assert PROFILES["gsm8k-cot-8shot"].settings["exemplars_sha256"] == sha256_text(json.dumps(COT_EXEMPLARS))


def test_a_profile_file_shares_parts_and_refuses_a_malformed_profile(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text('_common: &common {stop: ["\\n"], max_new_tokens: 8}\n'
                    "one: {version: '1', description: d, settings: {<<: *common, max_new_tokens: 4}}\n")
    profiles = load_profiles(path, "mytask")
    assert list(profiles) == ["one"] and profiles["one"].task == "mytask"
    assert profiles["one"].settings == {"stop": ["\n"], "max_new_tokens": 4}
    path.write_text("one: {version: '1', settings: {}}\n")
    with pytest.raises(UserError, match="profile 'one' must hold exactly version, description and settings"):
        load_profiles(path, "mytask")
