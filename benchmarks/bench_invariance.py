"""CPU time of in-process generation on the canary, canonical numerics against PyTorch's own (or against an
older evalgate revision), and whether the outputs match.

    python benchmarks/bench_invariance.py                         # this tree: canonical vs native numerics
    python benchmarks/bench_invariance.py --against <git rev>     # this tree (canonical) vs that revision
    python benchmarks/bench_invariance.py --items 16 --repeats 2 --threads 2

Each measurement runs in its own process: it loads the canary with the kernel, builds the first ``--items``
requests of the canary GSM8K and HumanEval profiles and generates them in batches of ``--batch-size``
through the in-process adapter. It reports the process's CPU time (user + system, all threads) and wall
time for generation only, alternating the two sides ``--repeats`` times; the ratio is of the medians.
``--against REV`` exports that revision with ``git archive`` into a temporary folder and imports evalgate
from there (nothing is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, os, resource, sys, time
import torch
items, batch, kernel, numerics = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from evalgate.canary import canary_path, GSM8K_PROFILE, HUMANEVAL_PROFILE
from evalgate.model_adapters.hf.adapter import HFAdapter
from evalgate.tasks import gsm8k
from evalgate.tasks.data import resolve_data_dir
from evalgate.tasks.humaneval import task as humaneval
kwargs = {} if numerics == "old" else {"numerics": numerics}
adapter = HFAdapter(canary_path(), kernel, batch_size=batch, **kwargs)
requests = []
for mod, profile in ((gsm8k, GSM8K_PROFILE), (humaneval, HUMANEVAL_PROFILE)):
    its, resolved = mod.TASK.load(mod.TASK.profiles[profile], resolve_data_dir(None), items)
    requests += mod.TASK.requests(its, resolved)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
texts, tokens = [], 0
for start in range(0, len(requests), batch):
    for g in adapter.generate(requests[start:start + batch]):
        texts.append(g.text)
        tokens += g.n_tokens
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.perf_counter() - t0, "tokens": tokens,
                  "outputs": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16],
                  "numerics": adapter.info().get("numerics", "native"), "threads": torch.get_num_threads()}))
"""


def export(rev: str, into: Path) -> Path:
    """``git archive rev`` laid out as an importable evalgate package (kernels/ and model_adapters/ inside)."""
    src = into / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    site = into / "site"
    shutil.copytree(src / "evalgate", site / "evalgate")
    shutil.copytree(src / "kernels", site / "evalgate" / "kernels")
    shutil.copytree(src / "model_adapters", site / "evalgate" / "model_adapters")
    return site


def measure(pythonpath: Path | None, numerics: str, args) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(args.items), str(args.batch_size), args.kernel, numerics],
                          env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="git revision to compare with (default: this tree with native numerics)")
    parser.add_argument("--against-path", help="an evalgate package folder to compare with (as --against exports)")
    parser.add_argument("--items", type=int, default=32, help="items per task (GSM8K and HumanEval canary profiles)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--kernel", default="w4a4_packed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: torch's own)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.against_path:
            other = (f"evalgate at {args.against_path}", Path(args.against_path).resolve(), "old")
        elif args.against:
            other = (f"evalgate {args.against}", export(args.against, Path(tmp)), "old")
        else:
            other = ("native numerics", None, "native")
        sides = [("canonical numerics", None, "canonical"), other]
        results = {name: [] for name, _, _ in sides}
        for _ in range(args.repeats):
            for name, path, numerics in sides:
                r = measure(path, numerics, args)
                results[name].append(r)
                print(f"{name:>28}: cpu {r['cpu_s']:7.1f} s  wall {r['wall_s']:6.1f} s  tokens {r['tokens']:6d}  "
                      f"outputs {r['outputs']}  ({r['numerics']}, {r['threads']} threads)", flush=True)
    (a, _, _), (b, _, _) = sides
    cpu_a = statistics.median(r["cpu_s"] for r in results[a])
    cpu_b = statistics.median(r["cpu_s"] for r in results[b])
    wall_a = statistics.median(r["wall_s"] for r in results[a])
    wall_b = statistics.median(r["wall_s"] for r in results[b])
    print(f"CPU time ratio {a} / {b}: {cpu_a / cpu_b:.2f} (wall {wall_a / wall_b:.2f}); "
          f"{args.items} GSM8K + {args.items} HumanEval canary items, batch {args.batch_size}, {args.kernel}")


if __name__ == "__main__":
    main()
