"""Stages take loaded objects; only the edges (the CLI commands, ``evalgate.api``) read folders and policy files.

An ``ast`` scan of the gate's stages, the planner and the pipeline: no function hands one of its own arguments
to a loader (``load_run``, ``load_baseline``, ``load_thresholds``). A loader called on a folder the stage made
or found itself (a run it just wrote, a baseline it looked up) is not an input and stays allowed. The policy
module is the loader itself, and is not scanned.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "evalgate"
STAGES = sorted(p for p in (PACKAGE / "gate").glob("*.py") if p.name != "policy.py") + [
    PACKAGE / "plan.py", PACKAGE / "pipeline.py"]
LOADERS = {"load_run", "load_baseline", "load_thresholds"}
# the run stage's own output folder: a complete run already stored there is reused, not an input handed in
OWN_OUTPUT = {"pipeline.py": ["run_or_resume: load_run(out)"]}


def loads_of_arguments(source: str) -> list[str]:
    """``function: loader(argument)`` for each loader call on an argument of the function it is in."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = fn.args
        params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            if name not in LOADERS:
                continue
            handed = {n.id for arg in [*call.args, *(k.value for k in call.keywords)]
                      for n in ast.walk(arg) if isinstance(n, ast.Name)}
            found += [f"{fn.name}: {name}({p})" for p in sorted(handed & params)]
    return found


@pytest.mark.parametrize("path", STAGES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_stage_loads_what_it_was_handed(path):
    assert loads_of_arguments(path.read_text(encoding="utf-8")) == OWN_OUTPUT.get(path.name, [])


def test_the_scan_sees_a_stage_that_loads_its_argument():
    # the shapes the stages had: a path-or-object normalised inside, a policy file read where it is decided
    stage = ("def gate_runs(baseline, candidate, thresholds=None):\n"
             "    cand = candidate if isinstance(candidate, Run) else load_run(candidate)\n"
             "    policy = policy_module.load_thresholds(thresholds)\n"
             "    stored = load_baseline([Path(b) for b in baseline])\n")
    assert sorted(loads_of_arguments(stage)) == ["gate_runs: load_baseline(baseline)", "gate_runs: load_run(candidate)",
                                                 "gate_runs: load_thresholds(thresholds)"]
    made_here = "def gate(plan):\n    out = execute(plan)\n    return load_run(out)\n"
    assert loads_of_arguments(made_here) == []
