"""In-process generation beside a competing CPU load: the same canary GSM8K items, timed on an idle machine
and again beside one busy-loop process, and the ratio (target: at most 2x).

    python benchmarks/bench_contention.py [--items 40] [--batch-size 128] [--kernel w4a4_packed] [--threads N]

The model loads once, with the thread count evalgate chooses at load (``evalgate/cores.py``:
--threads, else OMP_NUM_THREADS, else the cores this process may use, capped by the model's size);
``--threads N`` measures another choice (``--threads 2`` on a 2-core machine is PyTorch's own default).
The machine may be shared: the load average is printed before each phase, and the outputs of the two
phases are compared (they must be identical: the load must change the time, never the tokens).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from evalgate.cli.options import BATCH_SIZE

HOG = "while True:\n    pass\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(adapter, requests, batch_size: int, give_up_s: float = float("inf")) -> tuple[float, list[str], bool]:
    """(seconds, texts in item order, finished) through the runner's path (``generate_stream``: continuous
    batching, one decoding process per available core); stops once ``give_up_s`` passes (a collapse is
    measured as a lower bound, not waited out)."""
    t0 = time.perf_counter()
    texts: dict[int, str] = {}
    stream = adapter.generate_stream(requests, batch_size)
    for finished in stream:
        texts.update((i, g.text) for i, g in finished)
        if time.perf_counter() - t0 > give_up_s and len(texts) < len(requests):
            stream.close()
            return time.perf_counter() - t0, texts, False
    return time.perf_counter() - t0, texts, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="the gate's default")
    parser.add_argument("--kernel", default="w4a4_packed")
    parser.add_argument("--threads", type=int, default=None, help="force a thread count (default: evalgate's choice)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="seconds the hog runs before timing starts")
    parser.add_argument("--give-up", type=float, default=10.0, help="stop the busy phase past this ratio")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still reaches the finally: the hog dies

    from evalgate.canary import PROFILES, canary_path
    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.cores import available_cores, generation_workers, intra_op_threads
    from evalgate.tasks import get_task, resolve_profile
    from evalgate.tasks.data import resolve_data_dir

    import torch

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, PROFILES["gsm8k"]), resolve_data_dir(None), args.items)
    requests = task.requests(items, resolved)
    adapter = HFAdapter(canary_path(), args.kernel, batch_size=args.batch_size, threads=args.threads)
    hidden = getattr(adapter.model.config, "hidden_size", None)
    _, why = intra_op_threads(hidden, args.threads)
    print(f"{len(requests)} canary GSM8K items, batch {args.batch_size}, kernel {args.kernel}; "
          f"{torch.get_num_threads()} intra-op thread(s) ({why}); {generation_workers()[0]} decoding process(es); "
          f"{available_cores()} available core(s), "
          f"{os.cpu_count()} on the machine", flush=True)

    print(f"idle:       load average {load_average()}", flush=True)
    idle_s, idle_texts, _ = timed(adapter, requests, args.batch_size)
    print(f"idle:       {idle_s:7.2f} s", flush=True)

    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        time.sleep(args.settle_s)
        print(f"beside hog: load average {load_average()} (hog pid {hog.pid})", flush=True)
        busy_s, busy_texts, finished = timed(adapter, requests, args.batch_size, args.give_up * idle_s)
    finally:
        hog.kill()
        hog.wait()
    if not finished:  # part of the items took longer than all of them idle: the ratio is a lower bound
        done = len(busy_texts)
        print(f"beside hog: {busy_s:7.2f} s for {done} of {len(requests)} items, gave up "
              f"(> {args.give_up:g}x the idle time)", flush=True)
        idle_texts = {i: t for i, t in idle_texts.items() if i in busy_texts}
    else:
        print(f"beside hog: {busy_s:7.2f} s", flush=True)
    ratio = busy_s / idle_s
    bound = "" if finished else ">= "
    print(f"ratio {bound}{ratio:.2f}x (target <= 2x): {'OK' if ratio <= 2 else 'ABOVE TARGET'}; "
          f"outputs identical: {idle_texts == busy_texts}", flush=True)


if __name__ == "__main__":
    main()
