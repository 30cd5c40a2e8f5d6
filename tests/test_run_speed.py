"""What makes the default gate fast without changing what it computes: every task in one decoding stream,
HumanEval's executor self-test started in a child interpreter before the model loads, and a plain process
exit after the command (atexit handlers still run)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from evalgate.errors import UserError
from evalgate.tasks.humaneval import selftest
from evalgate.types import AdapterBase, Generation


class StreamingAdapter(AdapterBase):
    """Answers GSM8K with 18 and HumanEval with a body that returns None; records every stream call."""

    kernel = SimpleNamespace(name="w4a8", version="fake 1.0", id="w4a8@fake 1.0", description="fake kernel",
                             env={}, recipe={"weights": "e2m1"}, faulty=False)
    serving = "stream"

    def __init__(self):
        self.calls = []

    def info(self) -> dict:
        return {"adapter": "fake", "fingerprint": "0123456789abcdef", "config_sha256": "a" * 64,
                "safetensors_headers_sha256": "b" * 64, "tokenizer_sha256": "c" * 64, "dtype": "bfloat16",
                "model_type": "fake", "machine": {"python": sys.version.split()[0], "cuda": None}}

    def generate_stream(self, requests, batch_size=None):
        self.calls.append(list(requests))
        # finish in an order that interleaves the tasks: last request first
        for i in reversed(range(len(requests))):
            text = "    return None\n" if "def " in requests[i].prompt else " 6 + 12 = 18\n#### 18"
            yield [(i, Generation(text=text, finish_reason="stop", n_prompt_tokens=10, n_tokens=5))]


def test_every_task_decodes_in_one_stream_and_each_record_lands_in_its_own_task(tmp_path, data_dir):
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    adapter = StreamingAdapter()
    spec = RunSpec(model="fake", kernel="w4a8", tasks=["gsm8k", "humaneval"], limit=4, batch_size=2,
                   data_dir=str(data_dir))
    with open(os.devnull, "w") as devnull:
        out = execute(spec, tmp_path / "run", adapter=adapter, progress=Progress(enabled=False, stream=devnull))
    assert len(adapter.calls) == 1 and len(adapter.calls[0]) == 8  # one stream: 4 GSM8K + 4 HumanEval requests
    run = load_run(out)
    assert [r["doc_id"] for r in run.records["gsm8k"]] == [0, 1, 2, 3]  # item order restored
    assert [r["doc_id"] for r in run.records["humaneval"]] == [f"HumanEval/{i}" for i in range(4)]
    assert all(r["extracted"]["strict-match"] == "18" for r in run.records["gsm8k"])
    assert all(r["failure_class"] != "passed" and "entry_point" in r for r in run.records["humaneval"])
    manifest = run.manifest
    assert all(manifest["tasks"][t]["complete"] for t in ("gsm8k", "humaneval"))
    assert manifest["tasks"]["humaneval"]["prepare"]["ok"] is True
    assert "generate_s" in manifest["timings"] and "score_s" in manifest["timings"]["humaneval"]


@pytest.fixture
def empty_cache(monkeypatch):
    monkeypatch.setattr(selftest, "_cache", {})


def test_the_selftest_started_ahead_is_the_one_the_run_takes(empty_cache, monkeypatch, data_dir):
    selftest.start_selftest(data_dir)

    def not_here(*args, **kwargs):
        raise AssertionError("the self-test ran in this process, not in the child started ahead")

    monkeypatch.setattr(selftest, "selftest_humaneval", not_here)
    result = selftest.require_selftest(data_dir)  # waits for the child
    assert result["ok"] and result["canonical"]["passed"] == result["n_problems"] == 164
    assert result["empty_body"]["passed"] == 0 and result["forgery_probes"]["passed"] == 0


def test_a_child_that_fails_leaves_the_error_to_the_run(empty_cache, tmp_path):
    """No dataset where the child looks: nothing is cached, and the run raises the usual one-line error."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    selftest.start_selftest(empty)
    with pytest.raises(UserError) as ahead:
        selftest.require_selftest(empty)
    selftest._cache.clear()
    with pytest.raises(UserError) as direct:
        selftest.require_selftest(empty)
    assert str(ahead.value) == str(direct.value)


def test_the_console_entry_runs_atexit_handlers_and_keeps_exit_codes(tmp_path):
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran', flush=True)); "
            "sys.argv = ['evalgate'] + sys.argv[1:]; from evalgate.cli import entry; entry()")
    ok = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True)
    assert ok.returncode == 0 and "version" in ok.stdout and ok.stdout.rstrip().endswith("atexit ran")
    bad = subprocess.run([sys.executable, "-c", code, "gate", "--candidate", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("evalgate: error:")
    assert len(bad.stderr.strip().splitlines()) == 1 and "atexit ran" in bad.stdout


def test_the_last_prompts_are_shared_between_the_decoding_workers():
    import multiprocessing

    from evalgate.model_adapters.hf.generation import _SharedQueue

    queue = _SharedQueue(list(range(200)), multiprocessing.get_context("fork"), workers=2)
    assert queue.take(64) == list(range(64))  # plenty left: full takes
    assert queue.take(64) == list(range(64, 128))
    assert queue.take(16) == list(range(128, 144))
    assert queue.take(64) == list(range(144, 172))  # 56 left: half of them
    assert queue.take(16) == list(range(172, 186))  # 28 left: 14
    taken = []
    while (got := queue.take(16)):
        assert len(got) <= 7
        taken += got
    assert taken == list(range(186, 200))


def test_the_selftest_child_yields_to_the_run_it_serves():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        selftest._lower_priority(child.pid)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(19, mine + selftest.SELFTEST_NICE)
    finally:
        child.kill()
        child.wait()


def test_the_console_script_pauses_the_collector_for_its_imports():
    """``entry`` stops automatic collection before any import (the start-up's full collections find no garbage);
    a command that never loads a model ends with it still paused."""
    code = ("import atexit, gc, sys\n"
            "sys.argv = ['evalgate', '--version']\n"
            "atexit.register(lambda: print('collecting:', gc.isenabled()))\n"
            "from evalgate.cli.main import entry\n"
            "entry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "collecting: False" in out.stdout


def test_a_run_resumes_collection_before_it_generates(tmp_path, data_dir):
    """Once the model is loaded, ``execute`` freezes what exists and collects again, so decoding never runs
    with the collector off; a collector someone else disabled is left as they left it."""
    import gc

    from evalgate import collector
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    class Observing(StreamingAdapter):
        def generate_stream(self, requests, batch_size=None):
            self.collecting = (gc.isenabled(), gc.get_freeze_count())
            yield from super().generate_stream(requests, batch_size)

    spec = RunSpec(model="fake", kernel="w4a8", tasks=["gsm8k"], limit=2, batch_size=2, data_dir=str(data_dir))
    adapter = Observing()
    try:
        collector.pause()
        assert not gc.isenabled() and collector.paused()
        with open(os.devnull, "w") as devnull:
            execute(spec, tmp_path / "run", adapter=adapter, progress=Progress(enabled=False, stream=devnull))
        enabled, frozen = adapter.collecting
        assert enabled and frozen > 0 and not collector.paused()

        gc.disable()  # not ours: resume leaves it alone
        collector.resume()
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
