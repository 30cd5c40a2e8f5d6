"""HumanEval, prompted as Codex / simple-evals did and scored by running each program in the sandbox.

Profiles (docs/scoring.md#humaneval), as data in ``profiles.yaml`` beside this module:
- ``humaneval-completion-codex``: the prompt verbatim, Codex stops, 1024 new tokens, greedy;
- ``humaneval-chat-simpleevals``: one user message (simple-evals' instruction + prompt), its fenced-code
  extractor with its known defects kept, 2048 tokens;
- ``humaneval-canary-v1``: the codex profile with a 320-token limit (the built-in canary's).

Either way the program is ``prompt + completion + "\\n" + test + "\\n" + "check(<entry_point>)"``.
Scoring refuses to start until the executor self-test (``evalgate.tasks.humaneval.selftest``) has passed in this process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field

from evalgate.errors import UserError
from evalgate.records import ItemRecord
from evalgate.tasks.base import TaskBase, load_profiles
from evalgate.tasks.humaneval import sandbox
from evalgate.tasks.humaneval.passk import pass_at_k
from evalgate.tasks.humaneval.problems import (  # noqa: F401 (public)
    DATA_FILE,
    N_PROBLEMS,
    PROGRAM_TEMPLATE,
    PUBLISHED,
    TIMEOUT_POLICY,
    build_program,
    load_problem_split,
    load_problems,
)
from evalgate.tasks.humaneval.runtime import python_warning
from evalgate.tasks.humaneval.selftest import require_selftest, start_selftest
from evalgate.types import Generation, Profile, Request, ResolvedProfile, sha256_text

PROFILES = load_profiles(Path(__file__).with_name("profiles.yaml"), "humaneval")
# what the extractors read, from the profiles that name them
CODEX_STOPS = PROFILES["humaneval-completion-codex"].settings["stop"]
_CHAT = PROFILES["humaneval-chat-simpleevals"].settings
CHAT_INSTRUCTION = _CHAT["user_template"].removesuffix("{prompt}")
FENCE_REGEX = _CHAT["extractor"]["regex"]  # re.DOTALL; the first block, else the whole reply
SIGNATURE_CUT = _CHAT["extractor"]["cut"]  # drop up to and including ":\n" (find + 2); -1 + 2 drops the first character
INVALID_CLASSES = ("no_code", "failed:syntax")  # the validity-rate gate's indicator (docs/gate.md#rate-checks)


class HumanEvalRecord(ItemRecord):
    """A HumanEval problem: the program that ran and its outcome; n samples add ``pass@k`` and ``samples``."""

    doc_id: str
    task_id: str | None = None
    entry_point: str | None = None
    filtered_resps: str | list[str] | None = None
    program: str | None = None
    program_sha256: str | None = None
    passed: bool | None = None
    failure_class: str | None = None
    result: str | None = None
    exception: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    duration_s: float | None = None
    timeout_s: float | None = None
    network_isolation: str | None = None
    pass_at_1: float | None = Field(default=None, alias="pass@1")
    n: int | None = None
    c: int | None = None
    invalid: bool | None = None
    truncated: bool | None = None
    samples: list[dict[str, Any]] | None = None


# ---- extraction and programs (public: a notebook can call these) ----

def cut_at_stops(text: str, stops=CODEX_STOPS) -> str:
    """The completion before the first stop string (idempotent on an adapter's already-cut text)."""
    cut = len(text)
    for stop in stops:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


def find_code(reply: str) -> str:
    """simple-evals' ``find_code``, defects included: helpers or imports before the function break it, and
    when there is no ``":\\n    "`` the first character is dropped (``find`` gives -1, plus 2)."""
    matches = re.findall(FENCE_REGEX, reply, re.DOTALL)
    code = matches[0] if matches else reply
    return code[code.find(SIGNATURE_CUT) + 2:]


def extract_completion(text: str, profile: Profile) -> str:
    if profile.settings["api_mode"] == "chat":
        return find_code(text)
    return cut_at_stops(text, profile.settings["stop"])



# ---- the task ----

class HumanEval(TaskBase):
    name = "humaneval"
    profiles = PROFILES
    default_profile = "humaneval-completion-codex"
    gate_metric = "pass@1"
    record_model = HumanEvalRecord
    data_files = (PUBLISHED,)

    def __init__(self):
        self._data_dir: Path | None = None  # where the self-test reads the problems from
        self._problems: list[dict] | None = None  # the self-test's problems when they are not the published ones

    def load(self, profile: Profile, data_dir: Path | None, limit: int | None, dataset: dict | None = None):
        if profile.name not in PROFILES:
            raise UserError(f"unknown HumanEval profile {profile.name!r}; choose from: {', '.join(PROFILES)}")
        if limit is not None and limit < 1:
            raise UserError(f"--limit must be at least 1, got {limit}")
        self._data_dir = data_dir
        split = load_problem_split(data_dir, dataset)
        # the published problems, whatever their format, are the self-test's own (read by its child); others
        # are handed to it, so every problem's timeout comes from its own canonical solution
        self._problems = None if split.published else split.rows
        items = [{"doc_id": p["task_id"], **p} for p in split.rows[:limit]]
        resolved = ResolvedProfile(
            profile=profile, dataset_sha256=split.identity,
            item_ids=tuple(i["doc_id"] for i in items),
            decoding={"temperature": 0.0, "do_sample": False, "top_p": 1.0, "n": 1},
            data={split.record["split"]: split.record},
        )
        return items, resolved

    def requests(self, items: list[dict], resolved: ResolvedProfile) -> list[Request]:
        s = resolved.profile.settings
        out = []
        for item in items:
            if s["api_mode"] == "chat":
                content = s["user_template"].format(prompt=item["prompt"])
                out.append(Request(doc_id=item["doc_id"], prompt=content, stop=tuple(s["stop"]),
                                   max_new_tokens=s["max_new_tokens"],
                                   messages=({"role": "user", "content": content},)))
            else:
                out.append(Request(doc_id=item["doc_id"], prompt=s["prompt_template"].format(prompt=item["prompt"]),
                                   stop=tuple(s["stop"]), max_new_tokens=s["max_new_tokens"]))
        return out

    def prepare_ahead(self, resolved: ResolvedProfile, data_dir: Path | None) -> None:
        """The executor self-test, started in a child interpreter beside whatever this process does next."""
        if self._problems is None:  # other problems are self-tested in this process, by prepare
            start_selftest(data_dir if data_dir is not None else self._data_dir)

    def prepare(self, resolved: ResolvedProfile, data_dir: Path | None) -> dict:
        """The executor self-test (fail closed); what it returns is stored in the run manifest."""
        return require_selftest(data_dir if data_dir is not None else self._data_dir, problems=self._problems)

    def is_invalid(self, record: dict, metric: str = "pass@1") -> bool:
        """No code, or code that does not parse: the answer could not be used (docs/gate.md#validity-checks)."""
        return record.get("failure_class") in INVALID_CLASSES

    # ---- how reports show an item: read from the stored program (the prompt is its beginning) ----

    def item_title(self, record: dict) -> str | None:
        """The problem's id and the function's signature line (``def <entry_point>(...)``)."""
        task_id, entry = record.get("task_id"), record.get("entry_point")
        signature = next((line.strip() for line in (record.get("program") or "").splitlines()
                          if entry and line.startswith(f"def {entry}(")), None)
        return f"{task_id}: {signature}" if task_id and signature else task_id

    def item_heading(self, record: dict) -> str | None:
        """The entry point's signature and the first line of its docstring (the report shows the id in a
        column of its own)."""
        return program_heading(record.get("program") or "", record.get("entry_point")) or self.item_title(record)

    def item_gold(self, record: dict) -> str | None:
        """The test call on the entry point."""
        return f"check({record['entry_point']})" if record.get("entry_point") else None

    def item_answer(self, record: dict):
        return None  # a program passes or fails: there is no answer to read (the failure class says why)

    def item_prompt(self, record: dict) -> str | None:
        """The program before the completion."""
        program, resps = record.get("program"), record.get("resps")
        while isinstance(resps, list) and resps:  # several samples: the first
            resps = resps[0]
        if program and isinstance(resps, str) and resps and resps in program:
            return program[: program.index(resps)]
        return None

    def comparison_notes(self, base_summary: dict | None, cand_summary: dict | None) -> list[str]:
        """One line when the two runs' programs ran under different Python minors (compared anyway)."""
        note = python_warning(self.name, base_summary, cand_summary)
        return [note] if note else []

    def score(self, item: dict, request: Request, generation: Generation | list[Generation],
              resolved: ResolvedProfile) -> dict:
        return self.score_batch([item], [request], [generation], resolved)[0]

    def score_batch(self, items: list[dict], requests: list[Request], generations: list,
                    resolved: ResolvedProfile, workers: int | None = None) -> list[dict]:
        """Records for a batch; every program of the batch runs on one bounded pool.

        An entry of ``generations`` may be a list of k samples (a sampled run): every sample's program runs,
        and the record carries n_samples = n = k, c (samples passed), pass@1 = c / k (the mean over the
        samples, what the gate scores), pass@k and each sample's outcome (docs/scoring.md#k-samples).
        """
        timeouts = require_selftest(self._data_dir, problems=self._problems)["timeouts_s"]
        sampled = [isinstance(g, (list, tuple)) for g in generations]
        samples = [list(g) if is_list else [g] for g, is_list in zip(generations, sampled)]
        jobs = []  # (item index, sample index, program, timeout) for every completion that holds code
        completions = []
        for i, (item, gens) in enumerate(zip(items, samples)):
            completions.append([extract_completion(g.text, resolved.profile) for g in gens])
            for j, completion in enumerate(completions[i]):
                if completion.strip():
                    jobs.append((i, j, build_program(item, completion), timeouts[item["task_id"]]))
        # the completion runs in the sandbox; the dataset's test runs in the trusted judge (sandbox.Program)
        outcomes = sandbox.run_programs([sandbox.humaneval_program(items[i], completions[i][j]) for i, j, _, _ in jobs],
                                        [j[3] for j in jobs], workers=workers)
        by_key = {(i, j): (program, timeout, outcome) for (i, j, program, timeout), outcome in zip(jobs, outcomes)}
        return [self._record(item, request, samples[i], completions[i], by_key, i, sampled[i])
                for i, (item, request) in enumerate(zip(items, requests))]

    def _record(self, item, request, gens, completions, by_key, i, sampled: bool = False) -> dict:
        per_sample = [_sample_record(item, g, c, by_key.get((i, j))) for j, (g, c) in enumerate(zip(gens, completions))]
        first = per_sample[0]
        n, c = len(per_sample), sum(s["passed"] for s in per_sample)
        record = {
            "doc_id": item["doc_id"],
            "task_id": item["task_id"],
            "entry_point": item["entry_point"],
            "prompt_hash": sha256_text(request.prompt),
            "resps": gens[0].text if n == 1 else [g.text for g in gens],
            "filtered_resps": completions[0] if n == 1 else completions,
            **{k: first[k] for k in ("program", "program_sha256", "passed", "failure_class", "result", "exception",
                                     "stdout", "stderr", "duration_s", "timeout_s", "network_isolation")},
            "pass@1": pass_at_k(n, c, 1),
            "n": n,
            "c": c,
            "invalid": first["failure_class"] in INVALID_CLASSES,
            "truncated": gens[0].finish_reason == "length",
            "finish_reason": gens[0].finish_reason,
            "stop_hit": gens[0].stop_hit,
            "n_prompt_tokens": gens[0].n_prompt_tokens,
            "n_tokens": gens[0].n_tokens,
            "latency_s": round(gens[0].latency_s, 4),
        }
        if n > 1:
            for k in (1, 5, 10, 100):
                if k <= n:
                    record[f"pass@{k}"] = pass_at_k(n, c, k)
        if sampled:  # the gate's per-item score is the mean over the samples, exactly
            record["pass@1"] = c / n
            record["n_samples"] = n
        if n > 1 or sampled:
            record["samples"] = per_sample
        return record


def _sample_record(item: dict, generation: Generation, completion: str, ran) -> dict:
    if ran is None:  # nothing to run: the extractor found no code
        program = build_program(item, completion)
        return {"completion": completion, "program": program, "program_sha256": sha256_text(program),
                "passed": False, "failure_class": "no_code", "result": "no code", "exception": None,
                "stdout": "", "stderr": "", "duration_s": 0.0, "timeout_s": None, "network_isolation": None,
                "finish_reason": generation.finish_reason}
    program, timeout, outcome = ran
    return {"completion": completion, "program": program, "program_sha256": sha256_text(program),
            "passed": outcome.passed, "failure_class": outcome.failure_class, "result": outcome.result,
            "exception": outcome.exception, "stdout": outcome.stdout, "stderr": outcome.stderr,
            "duration_s": outcome.duration_s, "timeout_s": timeout,
            "network_isolation": outcome.network_isolation, "finish_reason": generation.finish_reason}


def program_heading(program: str, entry: str | None) -> str | None:
    """A program's function in one line: its signature and the first line of its docstring; None when the
    program holds no ``def <entry>(``."""
    lines = program.splitlines()
    start = next((i for i, line in enumerate(lines) if entry and line.startswith(f"def {entry}(")), None)
    if start is None:
        return None
    end = next((j for j in range(start, min(start + 8, len(lines))) if lines[j].rstrip().endswith(":")), start)
    signature = " ".join(line.strip() for line in lines[start:end + 1])
    doc = None
    for line in lines[end + 1:end + 6]:
        text = line.strip()
        for quote in ('"""', "'''"):
            if text.startswith(quote):
                text = text[len(quote):].strip().removesuffix(quote).strip()
                break
        if text:
            doc = text
            break
    return f"{signature} {doc}" if doc else signature


TASK = HumanEval()
