"""Continuous dispatch to a server: a bounded pool of in-flight requests (``--concurrency``) refilled as each
one finishes, independent of ``--batch-size``; records stored as they finish and read back in item order.
The in-process model still runs batch by batch."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from evalgate.model_adapters.server.openai_client import OpenAIAdapter
from evalgate.run.progress import Progress
from evalgate.run.runner import execute
from evalgate.run.spec import RunSpec
from evalgate.run.store import RecordWriter, load_run
from evalgate.types import AdapterBase, Generation
from fake_server import FakeServer

DETERMINISTIC = {"model_path": "/models/fake-model", "enable_deterministic_inference": True}


def quiet() -> Progress:
    return Progress(enabled=False, stream=open(os.devnull, "w"))


class Recording:
    """Wraps the adapter's ``dispatch`` to keep the pool it built (its statistics)."""

    def __init__(self, adapter: OpenAIAdapter):
        self.pools = []
        inner = adapter.dispatch

        def dispatch(requests):
            pool = inner(requests)
            self.pools.append(pool)
            return pool

        adapter.dispatch = dispatch


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # 1319 HTTP round trips: 3-10 s on 2 loaded cores
def test_a_full_gsm8k_run_at_concurrency_64_keeps_64_in_flight_until_the_tail(data_dir, tmp_path):
    with FakeServer(latency=(0.001, 0.01), server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=64, retries=1, backoff_s=0.01, batch_size=16)
        recording = Recording(adapter)
        spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], batch_size=16, data_dir=str(data_dir))
        out = execute(spec, tmp_path / "run", adapter=adapter, progress=quiet())
    [pool] = recording.pools
    stats = pool.stats()
    assert stats["requests"] == stats["started"] == 1319 == len(server.requests)
    # every request started after the first 64 found 63 others in flight: the pool refills as each finishes
    assert len(pool.in_flight_at_refill) == 1319 - 64 and min(pool.in_flight_at_refill) >= 60
    assert stats["mean_in_flight_until_tail"] >= 60
    run = load_run(out)
    assert [r["doc_id"] for r in run.records["gsm8k"]] == list(range(1319))  # read back in item order
    assert run.manifest["timings"]["gsm8k"]["mean_in_flight"] >= 60
    assert run.manifest["model"]["concurrency"] == 64 and run.manifest["model"]["dispatch"] == "continuous"
    # keep-alive: one connection per slot of the pool (and the describing calls), not one per request
    assert server.connections <= 64 + 4


def test_requests_reuse_the_pool_connections(data_dir, tmp_path):
    with FakeServer(server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=3, retries=0, batch_size=4)
        spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=30, batch_size=4,
                       data_dir=str(data_dir))
        execute(spec, tmp_path / "run", adapter=adapter, progress=quiet())
        adapter.close()
    assert len(server.requests) == 30 and server.connections <= 3 + 1


def test_concurrency_is_independent_of_the_batch_size(data_dir, tmp_path):
    with FakeServer(latency=(0.3, 0.4), server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=12, retries=1, backoff_s=0.01, batch_size=2)
        spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=24, batch_size=2,
                       data_dir=str(data_dir))
        execute(spec, tmp_path / "run", adapter=adapter, progress=quiet())
    assert max(server.in_flight_log) >= 10  # the server held 12 at once, never capped at the batch size of 2


def test_records_are_stored_as_they_finish_and_put_back_in_item_order(data_dir, tmp_path):
    out = tmp_path / "run"
    jsonl = out / "gsm8k.jsonl"
    seen: dict = {}
    from evalgate.tasks import get_task, resolve_profile

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, None), data_dir, 8)
    item_0 = task.requests(items, resolved)[0].prompt

    def hold_item_0(n, body):
        # item 0 answers only once later items are on disk: records are stored as they finish, not in order
        if body["prompt"] == item_0:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (jsonl.exists() and jsonl.read_text().count("\n") >= 5):
                time.sleep(0.02)
            seen["on_disk_before_item_0"] = [r["doc_id"] for r in lines(jsonl)] if jsonl.exists() else []
        return None

    with FakeServer(plan=hold_item_0, server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=4, retries=1, backoff_s=0.01)
        spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=8, data_dir=str(data_dir))
        execute(spec, out, adapter=adapter, progress=quiet())
    assert len(seen["on_disk_before_item_0"]) >= 5 and 0 not in seen["on_disk_before_item_0"]
    assert [r["doc_id"] for r in lines(jsonl)] == list(range(8))


def test_the_reversed_a_a_run_decodes_in_reverse_and_reads_back_in_item_order(data_dir, tmp_path):
    with FakeServer(server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=1, retries=1, backoff_s=0.01)
        spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=5, data_dir=str(data_dir),
                       order="reverse")
        out = execute(spec, tmp_path / "run", adapter=adapter, progress=quiet())
    questions = [r["question"] for r in lines(out / "gsm8k.jsonl")]
    assert [r["doc_id"] for r in lines(out / "gsm8k.jsonl")] == [0, 1, 2, 3, 4]
    assert [next(q for q in questions if q in b["prompt"].rsplit("Question: ", 1)[1]) for b in server.requests] \
        == questions[::-1]


def test_restoring_the_order_moves_lines_untouched_and_drops_a_torn_tail(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [b'{"doc_id": 2, "x": "\\u00e9"}\n', b'{"doc_id": 0}\n', b'{"doc_id": 1}\n']
    path.write_bytes(b"".join(rows) + b'{"doc_id": 3')
    assert [r["doc_id"] for r in RecordWriter(path).close([0, 1, 2, 3])] == [0, 1, 2]
    assert path.read_bytes() == rows[1] + rows[2] + rows[0]
    before = path.stat().st_mtime_ns
    RecordWriter(path).close([0, 1, 2, 3])  # already in order: left alone
    assert path.stat().st_mtime_ns == before


class BatchRecorder(AdapterBase):
    """An in-process-like adapter (no ``dispatch``): records the batches it is handed."""

    def __init__(self):
        from evalgate.kernels import get_kernel

        self.kernel, self.load_s, self.batches = get_kernel("bf16"), 0.0, []
        self._lock = threading.Lock()

    def info(self) -> dict:
        return {"adapter": "hf", "fingerprint": "0" * 16, "dtype": "bfloat16"}

    def generate(self, requests):
        self.batches.append(len(requests))
        return [Generation(text=" The answer is 3.\n\n#### 3", finish_reason="stop") for _ in requests]


def test_the_in_process_adapter_still_runs_batch_by_batch(data_dir, tmp_path):
    adapter = BatchRecorder()
    spec = RunSpec(model="m", kernel="bf16", tasks=["gsm8k"], limit=7, batch_size=3, data_dir=str(data_dir))
    out = execute(spec, tmp_path / "run", adapter=adapter, progress=quiet())
    assert adapter.batches == [3, 3, 1]
    assert [r["doc_id"] for r in lines(out / "gsm8k.jsonl")] == list(range(7))


@pytest.mark.parametrize("after_fsync", [True, False])
def test_a_ctrl_c_landing_just_after_a_write_stores_no_item_twice(data_dir, tmp_path, monkeypatch, after_fsync):
    # Ctrl-C arrives once a batch is on disk (or written but before its fsync) and before the dispatcher has
    # forgotten it; the dispatcher hands the same items over again to keep them. Each must be stored once,
    # and a resume must end with every item exactly once.
    import evalgate.run.store as store

    real_append, real_fsync = store.RecordWriter.append, os.fsync
    calls = {"n": 0}

    def append_then_interrupt(self, records):
        calls["n"] += 1
        if calls["n"] == 2 and not after_fsync:
            monkeypatch.setattr(store.os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            written = real_append(self, records)
        finally:
            monkeypatch.setattr(store.os, "fsync", real_fsync)
        if calls["n"] == 2 and after_fsync:
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(store.RecordWriter, "append", append_then_interrupt)
    monkeypatch.setattr("evalgate.run.runner.WRITE_EVERY_S", 0.0)  # a write per finished item
    out = tmp_path / "run"
    spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=6, data_dir=str(data_dir))
    with FakeServer(latency=(0.05, 0.06), server_info=DETERMINISTIC) as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=1, retries=1, backoff_s=0.01)
        with pytest.raises(KeyboardInterrupt):
            execute(spec, out, adapter=adapter, progress=quiet())
        kept = [r["doc_id"] for r in lines(out / "gsm8k.jsonl")]
        assert len(kept) == len(set(kept)) >= 2  # the batch in hand when Ctrl-C came is stored once
        assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
        monkeypatch.setattr(store.RecordWriter, "append", real_append)
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=1, retries=1, backoff_s=0.01)
        execute(spec, out, resume=True, adapter=adapter, progress=quiet())
    assert [r["doc_id"] for r in lines(out / "gsm8k.jsonl")] == list(range(6))


def test_a_kept_alive_connection_the_server_closed_while_idle_is_reopened_and_nothing_is_sent_twice():
    """The server answers as HTTP/1.1 (keep-alive) but closes each connection after its answer: the next
    request finds the socket at end of stream and goes out on a new connection, once."""
    import http.server
    import threading
    import time as _time

    from evalgate.model_adapters.server.openai_client import Connections

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            self.close_connection = True  # without saying so: the client still holds it as kept alive

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        pool = Connections(f"http://127.0.0.1:{httpd.server_address[1]}", 10.0)
        for n in range(3):
            with pool.lend() as conn:
                assert conn.request("GET", f"/r{n}") == (200, b"{}")
            _time.sleep(0.05)  # the server's close reaches the idle socket
        assert seen == ["/r0", "/r1", "/r2"] and len(pool._all) == 1  # one slot, reopened, no request repeated
        pool.close()
    finally:
        httpd.shutdown()
