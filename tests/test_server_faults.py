"""The OpenAI client adapter against a scripted stand-in server: requests, retries, faults, resume, gate.

Every fault (HTTP 500, malformed JSON, a dropped connection, a timeout, an aborted request, a server that
dies) gives retries, then one clear error; records finished before the fault stay on disk (also those of
the failing batch), and ``--resume`` against a healthy server ends with the same records as a clean run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.model_adapters.server.openai_client import OpenAIAdapter, ServerError, _parse_choice, normalize_url, request_seed
from evalgate.run.progress import Progress
from evalgate.run.runner import execute
from evalgate.run.spec import RunSpec
from evalgate.run.store import load_run
from evalgate.types import Request
from fake_server import FakeServer
import cli_process

HERE = Path(__file__).resolve().parent
VOLATILE = {"latency_s"}
LIMIT = 6


def quiet() -> Progress:
    return Progress(enabled=False, stream=open(os.devnull, "w"))


def adapter(url, kernel="w4a8", **kw) -> OpenAIAdapter:
    opts = {"retries": 2, "backoff_s": 0.01, "request_timeout": 5.0, "concurrency": 1, "batch_size": 4, **kw}
    return OpenAIAdapter(url, kernel, **opts)


def run(url, out, data_dir, resume=False, kernel="w4a8", batch_size=4, **kw) -> Path:
    spec = RunSpec(model="fake-model", kernel=kernel, tasks=["gsm8k"], limit=LIMIT, batch_size=batch_size,
                   data_dir=str(data_dir))
    return execute(spec, out, resume=resume, adapter=adapter(url, kernel, batch_size=batch_size, **kw),
                   progress=quiet())


def records(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "gsm8k.jsonl").read_text().splitlines()]


def stable(recs) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in recs), key=lambda r: r["doc_id"])


@pytest.fixture(scope="module")
def clean_run(data_dir, tmp_path_factory) -> Path:
    with FakeServer() as server:
        return run(server.url, tmp_path_factory.mktemp("clean") / "run", data_dir)


def test_requests_are_greedy_with_stops_seed_and_token_limit(data_dir, tmp_path):
    with FakeServer() as server:
        out = run(server.url, tmp_path / "run", data_dir)
    body = server.requests[0]
    assert body["temperature"] == 0.0 and body["n"] == 1 and body["stream"] is False
    # a seed per (item, sample): run seed 0, the item's doc id, sample 0; the same whatever the order
    seeds = {r["doc_id"]: r["seed"] for r in ({"doc_id": d, "seed": b["seed"]} for d, b in
                                              zip(range(LIMIT), server.requests))}
    assert seeds == {d: request_seed(0, d, 0) for d in range(LIMIT)} and len(set(seeds.values())) == LIMIT
    assert request_seed(0, 3) != request_seed(1, 3) and request_seed(0, 3, 1) != request_seed(0, 3, 0)
    assert body["model"] == "fake-model" and body["stop"] == ["Question:", "</s>", "<|im_end|>"]
    assert body["max_tokens"] == 256 and body["prompt"].startswith("Question:")
    recs = records(out)
    assert len(recs) == LIMIT and all(r["finish_reason"] == "stop" and r["stop_hit"] == "Question:" for r in recs)
    assert all(r["n_tokens"] > 0 and r["n_prompt_tokens"] > 0 for r in recs)
    assert all(r["resps"].endswith(".\n\n") and r["filtered_resps"]["flexible-extract"] for r in recs)


def test_manifest_records_the_server_and_an_unverified_kernel(clean_run):
    model = load_run(clean_run).manifest["model"]
    assert model["adapter"] == "openai" and model["served_model"] == "fake-model" and len(model["fingerprint"]) == 16
    assert model["kernel_claimed"] == "w4a8" and model["kernel_verified"] is False
    assert model["identity"]["model_path"] == "/models/fake-model"
    assert model["server_reported"]["server_info"]["tp_size"] == 1 and model["launch"] is None


def test_fingerprint_survives_a_restart_on_another_port_but_not_another_model():
    with FakeServer() as a, FakeServer() as b, FakeServer(server_info={"model_path": "/other", "tp_size": 1}) as c:
        fa, fb, fc = (adapter(s.url).info()["fingerprint"] for s in (a, b, c))
    assert a.url != b.url and fa == fb and fa != fc


def test_the_stop_string_is_cut_even_if_the_server_leaves_it_in():
    with FakeServer(strip_stop=False) as server:
        [gen] = adapter(server.url).generate([Request(0, "Q", ("Question:",), 50)])
    assert gen.text == " Some steps.\nThe answer is 81.\n\n" and gen.finish_reason == "stop"
    assert gen.stop_hit == "Question:"


def test_chat_requests_go_to_chat_completions():
    with FakeServer() as server:
        [gen] = adapter(server.url).generate([Request(0, "hi", (), 5, messages=({"role": "user", "content": "hi"},))])
    assert server.requests[0]["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in server.requests[0]
    assert gen.finish_reason == "length" and gen.n_tokens == 5


@pytest.mark.parametrize("choice, expected", [
    ({"text": "a", "finish_reason": "stop", "stop_reason": "\n\n"}, ("a", "stop", "\n\n")),  # vLLM
    ({"text": "a", "finish_reason": "stop", "stop_reason": 2}, ("a", "stop", None)),  # vLLM, EOS token id
    ({"text": "a", "finish_reason": "length", "matched_stop": None}, ("a", "length", None)),  # SGLang
])
def test_finish_reasons_map_to_stop_or_length(choice, expected):
    text, reason, hit, _ = _parse_choice({"choices": [choice]}, chat=False)
    assert (text, reason, hit) == expected


def test_urls_are_normalized_and_bad_ones_refused():
    assert normalize_url("http://gpu-node:30000/v1/") == "http://gpu-node:30000"
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    with pytest.raises(UserError, match="not an http"):
        normalize_url("ftp://x")


def test_several_served_models_need_a_model_id():
    with FakeServer(extra_models=["other"]) as server:
        with pytest.raises(UserError, match="serves 2 models .* pass --model-id"):
            adapter(server.url)
        assert adapter(server.url, model_id="other").served_model == "other"
    with FakeServer() as server:  # one model and no --model-id: its name is used
        info = adapter(server.url).info()
    assert info["served_model"] == "fake-model" and info["model_id"] == "fake-model"


def test_a_model_id_given_is_sent_whatever_the_server_lists(capsys):
    # transformers serve lists no model for a local folder (or answers 500 without a hub cache): the id given
    # is sent anyway, with a warning
    with FakeServer() as server:
        a = adapter(server.url, model_id="dsv4-flash")
        [gen] = a.generate([Request(0, "Q", ("Question:",), 5)])
        info = a.info()
    assert server.requests[0]["model"] == "dsv4-flash" and gen.text
    assert info["served_model"] == "dsv4-flash" and info["model_id"] == "dsv4-flash"
    assert any("not --model-id 'dsv4-flash'; sending 'dsv4-flash' as given" in w for w in info["warnings"])
    assert "sending 'dsv4-flash' as given" in capsys.readouterr().err
    with FakeServer(models_status=500) as server:
        info = adapter(server.url, model_id="/models/local").info()
    assert info["served_model"] == "/models/local" and info["server_reported"]["models"] is None
    assert any("/v1/models answered HTTP 500" in w for w in info["warnings"])
    with FakeServer(models_status=500) as server:  # without --model-id the list is needed: one clear error
        with pytest.raises(UserError, match="failed the model list .*HTTP 500"):
            adapter(server.url)


def test_determinism_is_read_from_the_server_and_unknown_is_a_warning(capsys):
    with FakeServer(server_info={"model_path": "/m", "enable_deterministic_inference": True}) as server:
        info = adapter(server.url).info()
    assert info["determinism"]["state"] == "on" and "warning" not in info["determinism"]
    with FakeServer(server_info={"model_path": "/m", "enable_deterministic_inference": False}) as server:
        info = adapter(server.url).info()
    assert info["determinism"]["state"] == "off" and "deterministic mode is off" in info["determinism"]["warning"]
    with FakeServer(server_info={}) as server:  # vLLM: /version and /v1/models only
        server.version = "0.33.0"
        info = adapter(server.url).info()
        quiet_info = adapter(server.url, deterministic=False).info()
    assert info["determinism"]["state"] == "unknown" and info["server_reported"]["version"] == {"version": "0.33.0"}
    assert "VLLM_BATCH_INVARIANT=1" in info["determinism"]["warning"]
    assert quiet_info["determinism"] == {"state": "unknown", "requested": False,
                                         "source": "the server does not report a deterministic mode"}
    # the mode is part of the server identity: a baseline from a non-deterministic server is another model
    with FakeServer(server_info={"model_path": "/m", "enable_deterministic_inference": True}) as on, \
            FakeServer(server_info={"model_path": "/m", "enable_deterministic_inference": False}) as off:
        assert adapter(on.url).info()["fingerprint"] != adapter(off.url).info()["fingerprint"]


def test_an_unreachable_server_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(UserError, match=rf"server http://127.0.0.1:{port} failed the model list .* 3 attempts"):
            adapter(f"http://127.0.0.1:{port}")


def test_transient_faults_are_retried_and_the_run_completes(data_dir, tmp_path, clean_run):
    faults = {0: "500", 1: "drop", 3: "malformed", 5: "503", 7: "abort"}  # never three in a row for one item
    with FakeServer(plan=lambda n, body: faults.get(n)) as server:
        out = run(server.url, tmp_path / "run", data_dir)
    assert len(server.requests) == LIMIT + len(faults)
    assert stable(records(out)) == stable(records(clean_run))


@pytest.mark.parametrize("fault", ["500", "malformed", "drop", "timeout", "abort"])
def test_a_persistent_fault_keeps_finished_items_and_resume_completes(fault, data_dir, tmp_path, clean_run):
    out = tmp_path / "run"
    # items 0-3 (the first batch) and item 4 answer; from item 5 on the server is broken
    with FakeServer(plan=lambda n, body: fault if n >= 5 else None, slow_s=1.0) as server:
        with pytest.raises(ServerError) as info:
            run(server.url, out, data_dir, request_timeout=0.3)
    message = str(info.value)
    assert message.startswith(f"server {server.url} failed item 5 on /v1/completions after 3 attempts")
    assert "rerun with --resume" in message and "\n" not in message
    assert len(server.requests) == 5 + 3  # three attempts, then nothing new is started
    partial = records(out)
    assert sorted(r["doc_id"] for r in partial) == [0, 1, 2, 3, 4]  # item 4 of the failing batch is kept
    assert stable(partial) == stable(records(clean_run))[:5]
    assert load_run(out).manifest["status"] == "interrupted"

    with FakeServer() as healthy:
        run(healthy.url, out, data_dir, resume=True)
    assert len(healthy.requests) == 1  # only the lost item is redone
    assert stable(records(out)) == stable(records(clean_run))


def test_concurrent_requests_keep_every_finished_item_of_a_failing_batch(data_dir, tmp_path, clean_run):
    out = tmp_path / "run"
    question = next(r["question"] for r in records(clean_run) if r["doc_id"] == 2)
    with FakeServer(plan=lambda n, body: "500" if question in body["prompt"] else None) as server:
        with pytest.raises(ServerError, match="failed item 2"):
            run(server.url, out, data_dir, batch_size=LIMIT, concurrency=3)
    kept = sorted(r["doc_id"] for r in records(out))
    assert 2 not in kept and {0, 1} <= set(kept)  # in flight beside item 2, finished, kept
    with FakeServer() as healthy:
        run(healthy.url, out, data_dir, resume=True, batch_size=LIMIT, concurrency=3)
    assert stable(records(out)) == stable(records(clean_run))


def test_a_refused_request_is_not_retried(data_dir, tmp_path):
    with FakeServer(plan=lambda n, body: "400") as server:
        with pytest.raises(ServerError, match=r"refused item 0 .*HTTP 400 \(injected 400\)"):
            run(server.url, tmp_path / "run", data_dir)
    assert len(server.requests) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fake(port: int, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_server.py"), "--model-path", "/models/fake-model",
                             "--port", str(port), "--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024",
                             *args], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("fake server did not start")


def test_a_server_killed_mid_run_loses_nothing_and_resume_after_restart_completes(data_dir, tmp_path, clean_run):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    server = _start_fake(port, "--die-after", "3")  # answers three items, then the process is gone
    try:
        with pytest.raises(ServerError, match=f"server {url} failed item 3 .*after 3 attempts: ConnectionRefusedError"):
            run(url, out, data_dir, batch_size=2)
    finally:
        server.kill()
        server.wait()
    assert sorted(r["doc_id"] for r in records(out)) == [0, 1, 2]
    restarted = _start_fake(port)
    try:
        run(url, out, data_dir, resume=True, batch_size=2)
    finally:
        restarted.kill()
        restarted.wait()
    assert stable(records(out)) == stable(records(clean_run))


def test_cli_server_fault_is_one_line_and_exit_4(data_dir, cli_env, tmp_path):
    out = tmp_path / "run"
    with FakeServer(plan=lambda n, body: "500" if n >= 2 else None) as server:
        proc = cli_process.run(["run", "--server", server.url, "--kernel", "w4a8",
                               "--limit", "4", "--batch-size", "4", "--concurrency", "1", "--retries", "1",
                               "--out", str(out)], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 4, proc.stderr  # the server went away: could not finish, rerun resumes
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"evalgate: could not finish: server {server.url} failed item 2 on /v1/completions after "
                           "2 attempts: HTTP 500 (injected 500)")
    assert f"--out {out} --resume" in last and "Traceback" not in proc.stderr
    assert sorted(r["doc_id"] for r in records(out)) == [0, 1]


def test_gate_finds_the_server_baseline_by_the_server_fingerprint(data_dir, tmp_path):
    from evalgate.run.baselines import record
    from evalgate.gate.policy import load_thresholds
    from evalgate.pipeline import gate_model
    from gate_helpers import policy

    root = tmp_path / "baselines"
    with FakeServer() as server:
        base = run(server.url, tmp_path / "base", data_dir)
        record(base, root)
        spec = RunSpec(model="fake-model", kernel="w4a4_packed", tasks=["gsm8k"], limit=LIMIT, batch_size=4,
                       data_dir=str(data_dir))
        verdict, run_dir = gate_model(spec, "w4a8", root, tmp_path / "cand", load_thresholds(policy(tmp_path)),
                                      allow_uncalibrated=True, adapter=adapter(server.url, "w4a4_packed"))
    assert verdict.verdict == "PASS" and load_run(run_dir).manifest["model"]["adapter"] == "openai"
    with FakeServer(server_info={"model_path": "/elsewhere"}) as other:
        with pytest.raises(UserError, match="no stored w4a8 baseline .* `evalgate calibrate --server URL"):
            gate_model(spec, "w4a8", root, tmp_path / "cand2", load_thresholds(policy(tmp_path)), allow_uncalibrated=True,
                       adapter=adapter(other.url, "w4a4_packed"))


def test_cli_gate_runs_the_candidate_on_the_server(data_dir, cli_env, tmp_path):
    from gate_helpers import policy

    with FakeServer() as server:
        base = run(server.url, tmp_path / "base", data_dir)
        proc = cli_process.run(["gate", "--server", server.url, "--model-id", "fake-model",
                               "--kernel", "w4a4_packed", "--tasks", "gsm8k", "--limit", str(LIMIT), "--batch-size", "4",
                               "--baseline", str(base), "--thresholds", str(policy(tmp_path)), "--allow-uncalibrated",
                               "--out", str(tmp_path / "cand")], env=cli_env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: PASS" in proc.stdout
    assert load_run(tmp_path / "cand").manifest["model"]["kernel_claimed"] == "w4a4_packed"


@pytest.mark.slow  # two CLI runs in one subprocess: ~20 s on 2 loaded cores
def test_cli_calibrate_runs_the_a_a_pair_on_the_server(data_dir, cli_env, tmp_path):
    from gate_helpers import policy

    info = {"model_path": "/models/fake-model", "enable_deterministic_inference": True}
    with FakeServer(server_info=info) as server:
        proc = cli_process.run(["calibrate", "--server", server.url, "--kernel", "w4a8",
                               "--tasks", "gsm8k", "--limit", str(LIMIT), "--concurrency", "1",
                               "--baselines-root", str(tmp_path / "baselines"), "--runs-dir", str(tmp_path / "runs"),
                               "--thresholds", str(policy(tmp_path))], env=cli_env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gsm8k: A/A flip rate ψ0 = 0.00% (0 of 6 items)" in proc.stdout and "A/A verdict PASS" in proc.stdout
    [aa_file] = (tmp_path / "baselines").rglob("aa.json")
    second = json.loads(aa_file.read_text())["tasks"]["gsm8k"]["second_run"]
    assert second["order"] == "reverse" and second["concurrency"] == 1 and second["server"] == server.url
    # both runs on the server: the first in item order, the second reversed (items read back in order)
    assert len(server.requests) == 2 * LIMIT
    from evalgate.tasks import get_task, resolve_profile

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, None), data_dir, LIMIT)
    item_prompts = [r.prompt for r in task.requests(items, resolved)]
    arrived = [b["prompt"] for b in server.requests]
    assert arrived == item_prompts + item_prompts[::-1]  # run A in item order, run B reversed (one at a time)
    b_run = Path(second["path"])
    assert [r["doc_id"] for r in records(b_run)] == list(range(LIMIT))
    assert load_run(b_run).manifest["model"]["determinism"]["state"] == "on"
