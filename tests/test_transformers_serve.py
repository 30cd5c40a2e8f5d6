"""A server nobody here wrote: ``transformers serve`` (the ``serving`` extra of the pinned transformers) on the
tiny model, CPU only. ``evalgate run --server`` against it equals the in-process bf16 run at batch 1 item for
item, the in-process model with PyTorch's own numerics (``numerics="native"``: transformers serve runs plain
transformers, not evalgate's canonical forward pass). Its ``/v1/models`` lists no model for a local folder (and answers 500 without a hub cache), so the run
rests on ``--model-id`` being sent as given, with a warning.

Skipped, with the reason, when the serving extra (fastapi, uvicorn, openai) is not installed.
"""

from __future__ import annotations

import os
import sys

import pytest
from serve_helpers import running_server

for _module in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(_module, reason=f"transformers serve needs {_module}: pip install -e '.[test]' "
                                        "(transformers[serving])")

from evalgate.model_adapters.server.launcher import free_port  # noqa: E402
from evalgate.run.store import load_run  # noqa: E402
import cli_process

LIMIT, MAX_NEW = 4, 24
ITEM_FIELDS = ("resps", "finish_reason", "stop_hit", "n_tokens", "n_prompt_tokens", "extracted", "filtered_resps",
               "exact_match", "prompt_hash", "profile_id")


@pytest.fixture(scope="module")
def transformers_serve(tiny_model, tmp_path_factory):
    port = free_port()
    home = tmp_path_factory.mktemp("hf")
    (home / "hub").mkdir()  # an empty hub cache: /v1/models lists nothing (the local folder is not in it)
    log = home / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(tiny_model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--format", "quiet"]
    with running_server(argv, port, log, env, "transformers serve", start_timeout_s=240) as url:
        yield url


def by_id(records: list[dict]) -> dict:
    return {r["doc_id"]: {k: r.get(k) for k in ITEM_FIELDS} for r in records}


@pytest.mark.slow
def test_a_run_against_transformers_serve_equals_the_in_process_bf16_run(transformers_serve, tiny_model, data_dir,
                                                                        cli_env, tmp_path):
    import inspect

    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    spec = RunSpec(model=str(tiny_model), kernel="bf16", tasks=["gsm8k"], limit=LIMIT, batch_size=1,
                   data_dir=str(data_dir), max_new_tokens=MAX_NEW)
    native = {"numerics": "native"} if "numerics" in inspect.signature(HFAdapter).parameters else {}
    adapter = HFAdapter(tiny_model, "bf16", batch_size=1, **native)
    local = load_run(execute(spec, tmp_path / "local", adapter=adapter,
                             progress=Progress(enabled=False, stream=open(os.devnull, "w"))))
    out = tmp_path / "served"
    # transformers serve pins the model to the path it was given and refuses any other name
    proc = cli_process.run(["run", "--server", transformers_serve,
                           "--model-id", str(tiny_model), "--kernel", "bf16", "--limit", str(LIMIT),
                           "--max-new-tokens", str(MAX_NEW), "--concurrency", "4", "--out", str(out)],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"sending {str(tiny_model)!r} as given" in proc.stderr  # /v1/models did not list it
    assert "deterministic mode is unknown" in proc.stderr
    served = load_run(out)
    assert len(served.records["gsm8k"]) == LIMIT
    assert by_id(served.records["gsm8k"]) == by_id(local.records["gsm8k"])
    model = served.manifest["model"]
    assert model["served_model"] == model["model_id"] == str(tiny_model) and model["kernel_verified"] is False
    assert model["determinism"]["state"] == "unknown"
    assert served.manifest["tasks"]["gsm8k"]["profile_id"] == local.manifest["tasks"]["gsm8k"]["profile_id"]
