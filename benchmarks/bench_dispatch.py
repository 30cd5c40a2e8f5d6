"""Continuous dispatch against batch-synchronous dispatch, on a stand-in server with variable latency.

The stand-in (``tests/fake_server.py``, in its own process) answers every completion after a stable latency
between ``--lo`` and ``--hi`` seconds (a function of the prompt), like a GPU server whose requests differ in
length. The full GSM8K test split (1319 items) runs through evalgate's runner twice at the same
``--concurrency``:

- batch-synchronous (what the runner did before continuous dispatch): batches of ``--batch-size`` handed over
  one at a time, each waiting for its slowest request;
- continuous: ``--concurrency`` requests in flight, refilled as each finishes.

The floor is the total latency divided by the concurrency (a pool that is always full and has no tail); the
ratio wall / floor says how close the dispatch comes to it. The wall runs from the first request to the last
record stored; the task data is loaded before it (and its time printed), as the commands do before they
reach a server. The stand-in counts the TCP connections
each run opens: with keep-alive, one per request in flight plus the describing calls, not one per request.

    python benchmarks/bench_dispatch.py [--items 1319] [--concurrency 64] [--batch-size 64] [--lo 0.05 --hi 0.5]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from evalgate.types import AdapterBase

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(lo: float, hi: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_server.py"), "--model-path", "/models/fake-model",
                             "--port", str(port), "--latency", str(lo), str(hi), "--enable-deterministic-inference",
                             "--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024"],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the stand-in server did not start") from None
            time.sleep(0.05)


class BatchSynchronous(AdapterBase):
    """The server adapter without ``dispatch``: the runner hands it one batch at a time (the old behaviour)."""

    def __init__(self, adapter):
        self._adapter = adapter
        self.kernel, self.load_s = adapter.kernel, adapter.load_s

    def info(self):
        return self._adapter.info()

    def generate(self, requests):
        return self._adapter.generate(requests)


def connections(url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/stats", timeout=10) as resp:
        return json.load(resp)["connections"]


def run_once(mode: str, url: str, args, data_dir: str, out: Path) -> tuple[float, float]:
    """(wall of the run, of it loading the task data): the data is loaded first and handed to the run, as
    `evalgate gate` and `evalgate run` do before they reach a server, so the wall is the dispatch's."""
    from evalgate.model_adapters.server.openai_client import OpenAIAdapter
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec, load_tasks

    adapter = OpenAIAdapter(url, "w4a8", concurrency=args.concurrency, batch_size=args.batch_size, retries=1,
                            request_timeout=60)
    spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=args.items,
                   batch_size=args.batch_size, data_dir=data_dir)
    t0 = time.perf_counter()
    loaded = load_tasks(spec)
    t1 = time.perf_counter()
    execute(spec, out, adapter=adapter if mode == "continuous" else BatchSynchronous(adapter), tasks=loaded,
            progress=Progress(enabled=False, stream=open(os.devnull, "w")))
    wall = time.perf_counter() - t1
    adapter.close()
    return wall, t1 - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=None, help="first N GSM8K test items (default: all 1319)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="batch of the batch-synchronous run")
    p.add_argument("--lo", type=float, default=0.05)
    p.add_argument("--hi", type=float, default=0.5)
    args = p.parse_args()

    from evalgate.run.store import load_run
    from evalgate.tasks import get_task, resolve_profile
    from evalgate.tasks.data import packaged_data_dir
    from fake_server import latency_for

    data_dir = str(packaged_data_dir())
    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, None), packaged_data_dir(), args.items)
    total = sum(latency_for(r.prompt, args.lo, args.hi) for r in task.requests(items, resolved))
    floor = total / args.concurrency
    proc, url = start_server(args.lo, args.hi)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("batch-synchronous", "continuous"):
                before = connections(url) + 1  # this count's own connection
                wall, loading = run_once(mode, url, args, data_dir, Path(tmp) / mode)
                opened = connections(url) - before
                run = load_run(Path(tmp) / mode)
                assert len(run.records["gsm8k"]) == len(items)
                rows.append((mode, wall, run.manifest["timings"]["gsm8k"].get("mean_in_flight"), opened, loading))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"{len(items)} GSM8K items, per-request latency {args.lo:g}-{args.hi:g} s (total {total:.1f} s), "
          f"concurrency {args.concurrency}, batch size {args.batch_size} (batch-synchronous)")
    print(f"floor = total latency / concurrency = {floor:.2f} s")
    print(f"{'dispatch':<20} {'wall s':>8} {'wall / floor':>13} {'mean in flight':>15} {'connections':>12} "
          f"{'data loaded before, s':>22}")
    for mode, wall, in_flight, opened, loading in rows:
        print(f"{mode:<20} {wall:8.2f} {wall / floor:13.3f} {in_flight if in_flight is not None else '-':>15} "
              f"{opened:>12} {loading:22.2f}")
    ratio = rows[1][1] / floor
    print(f"continuous: wall / floor = {ratio:.3f} ({'within' if ratio <= 1.15 else 'OVER'} the 1.15 bound); "
          f"{rows[0][1] / rows[1][1]:.2f}x faster than batch-synchronous")


if __name__ == "__main__":
    main()
