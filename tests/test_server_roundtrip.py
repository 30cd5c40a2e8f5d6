"""A real HTTP round trip: `evalgate serve` with the tiny model on loopback, `evalgate run --server` against
it, and the same per-item outputs as the in-process run."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import running_server

from evalgate.errors import UserError
from evalgate.model_adapters.server.launcher import free_port
from evalgate.run.store import load_run
import cli_process

KERNEL = "w4a8"
LIMIT, MAX_NEW = 4, 24
ITEM_FIELDS = ("resps", "finish_reason", "stop_hit", "n_tokens", "n_prompt_tokens", "extracted", "filtered_resps",
               "exact_match", "prompt_hash", "profile_id")


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory, data_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "evalgate", "serve", "--model", str(tiny_model), "--kernel", KERNEL, "--port",
            str(port), "--batch-size", "4"]
    with running_server(argv, port, log, env, "evalgate serve") as url:
        yield url


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def by_id(records: list[dict]) -> dict:
    return {r["doc_id"]: {k: r.get(k) for k in ITEM_FIELDS} for r in records}


@pytest.mark.slow
def test_a_server_run_equals_the_in_process_run(served, tiny_model, data_dir, cli_env, tmp_path):
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    spec = RunSpec(model=str(tiny_model), kernel=KERNEL, tasks=["gsm8k"], limit=LIMIT, batch_size=2,
                   data_dir=str(data_dir), max_new_tokens=MAX_NEW)
    local = execute(spec, tmp_path / "local", in_process_adapter(spec),
                    progress=Progress(enabled=False, stream=open(os.devnull, "w")))
    out = tmp_path / "served"
    proc = cli_process.run(["run", "--server", served, "--model-id", "model",
                           "--kernel", KERNEL, "--limit", str(LIMIT), "--max-new-tokens", str(MAX_NEW),
                           "--batch-size", "4", "--concurrency", "4", "--out", str(out)],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    a, b = load_run(local), load_run(out)
    assert by_id(b.records["gsm8k"]) == by_id(a.records["gsm8k"])
    assert len(b.records["gsm8k"]) == LIMIT
    model = b.manifest["model"]
    assert model["adapter"] == "openai" and model["model_id"] == "model" and model["kernel_verified"] is True
    assert model["warnings"] == [] or all("deterministic mode" in w for w in model["warnings"])
    assert model["identity"]["evalgate_model_fingerprint"] == a.manifest["model"]["fingerprint"]
    assert b.manifest["tasks"]["gsm8k"]["profile_id"] == a.manifest["tasks"]["gsm8k"]["profile_id"]


def test_concurrent_requests_get_the_answers_of_single_ones(served):
    prompts = [f"Question: what is {i} plus {i}?\nAnswer:" for i in range(4)]
    body = lambda p: {"model": "model", "prompt": p, "max_tokens": 6, "temperature": 0, "stop": ["\n\n"]}
    single = [post(served + "/v1/completions", body(p))[1]["choices"][0] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: post(served + "/v1/completions", body(p))[1]["choices"][0], prompts))
    assert [c["text"] for c in together] == [c["text"] for c in single]
    status, listed = post(served + "/v1/completions", {**body(prompts[0]), "prompt": prompts})
    assert status == 200 and [c["text"] for c in listed["choices"]] == [c["text"] for c in single]
    assert listed["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "x", "temperature": 0.7}, 400, "needs a seed"),  # sampling is keyed: no seed, no sample
    ({"prompt": "x", "temperature": 0.7, "seed": 1, "top_p": 0.9}, 400, "top_p, n and best_of must be 1"),
    ({"prompt": "x", "stream": True}, 400, "stream is not supported"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "is not served here"),
    ({"prompt": [1, 2]}, 400, "token ids are not supported"),
])
def test_the_server_refuses_what_it_cannot_do(served, body, status, message):
    got, payload = post(served + "/v1/completions", body)
    assert got == status and message in payload["error"]["message"]


def test_chat_without_a_chat_template_is_refused_clearly(served):
    status, payload = post(served + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "no chat template" in payload["error"]["message"]


def test_the_server_describes_itself(served):
    models = json.load(urllib.request.urlopen(served + "/v1/models"))
    info = json.load(urllib.request.urlopen(served + "/get_server_info"))
    assert models["data"][0]["id"] == "model" and info["evalgate"]["kernel"]["name"] == KERNEL
    assert len(info["evalgate"]["model"]["fingerprint"]) == 16


def test_a_client_claiming_another_kernel_is_refused(served):
    from evalgate.model_adapters.server.openai_client import OpenAIAdapter

    with pytest.raises(UserError, match="reports kernel 'w4a8', not --kernel 'w4a4_packed'"):
        OpenAIAdapter(served, "w4a4_packed").info()
