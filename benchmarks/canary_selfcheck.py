"""The gate proves itself on the canary: every kernel against the stored W4A8 canary baseline.

    python benchmarks/canary_selfcheck.py [--runs-dir results/runs/selfcheck] [--kernels ...]

For each kernel: run the canary (both tasks; a finished run in --runs-dir is reused), gate it against the
stored baseline, and print scores, flips (b lost / c gained) and the verdict with its first reason. Also
prints whether w4a4 and w4a4_packed agree item for item, and bf16 vs w4a8 flips. Expected: bf16 and w4a8
(A/A, another batch size) PASS, every faulty/ kernel FAILS, w4a4 == w4a4_packed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evalgate.run.baselines import DEFAULT_ROOT, find_baseline
from evalgate.gate.decide import gate_runs
from evalgate.kernels import kernel_names
from evalgate.canary import PROFILES, canary_path
from evalgate.model_adapters.fingerprint import model_fingerprint
from evalgate.pipeline import planned_profile_ids, run_or_resume
from evalgate.run.progress import Progress
from evalgate.run.runner import RunSpec
from evalgate.run.store import load_run

TASKS = ["gsm8k", "humaneval"]


def spec_for(kernel: str, batch_size: int, data_dir: str | None) -> RunSpec:
    return RunSpec(model=str(canary_path()), kernel=kernel, tasks=TASKS, profiles=dict(PROFILES),
                   batch_size=batch_size, data_dir=data_dir)


def same_items(a: Path, b: Path) -> bool:
    ra, rb = load_run(a), load_run(b)
    return all({r["doc_id"]: r["resps"] for r in ra.records[t]} == {r["doc_id"]: r["resps"] for r in rb.records[t]}
               for t in TASKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default="results/runs/selfcheck")
    parser.add_argument("--baselines-root", default=str(DEFAULT_ROOT))
    parser.add_argument("--kernels", default=None, help="comma-separated; default: every registered kernel")
    parser.add_argument("--batch-size", type=int, default=24, help="not the baseline's 32, so the w4a8 row is an A/A")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()

    kernels = args.kernels.split(",") if args.kernels else [k for k in kernel_names() if k != "w4a8_sglang"]
    fingerprint = model_fingerprint(canary_path())["fingerprint"]
    ids = planned_profile_ids(spec_for("w4a8", args.batch_size, args.data_dir))
    baselines = [find_baseline(args.baselines_root, fingerprint, ids[t], "w4a8") for t in TASKS]
    if None in baselines:
        raise SystemExit("no stored canary W4A8 baseline; run `evalgate calibrate` first")
    rows, runs = [], {}
    quiet = Progress(enabled=False, stream=open("/dev/null", "w"))
    for kernel in kernels:
        t0 = time.perf_counter()
        out = Path(args.runs_dir) / kernel.replace("/", "_")
        from evalgate.run.runner import execute

        if (out / "manifest.json").is_file():
            run_dir = run_or_resume(spec_for(kernel, args.batch_size, args.data_dir), out)
        else:
            run_dir = execute(spec_for(kernel, args.batch_size, args.data_dir), out, progress=quiet)
        runs[kernel] = run_dir
        verdict = gate_runs(baselines, run_dir)
        row = {"kernel": kernel, "verdict": verdict.verdict, "seconds": round(time.perf_counter() - t0, 1)}
        for task, dec in verdict.decision.tasks.items():
            row[task] = {"score": round(dec.counts.candidate_rate, 4), "b": dec.counts.b, "c": dec.counts.c,
                         "verdict": dec.verdict, "reason": dec.reasons[0] if dec.reasons else ""}
        rows.append(row)
        g, h = row["gsm8k"], row["humaneval"]
        print(f"{kernel:42s} {row['verdict']:4s}  gsm8k {g['score']:.3f} (b {g['b']:3d}, c {g['c']:2d})  "
              f"humaneval {h['score']:.3f} (b {h['b']:3d}, c {h['c']:2d})  {row['seconds']:6.1f}s", flush=True)
        for task in TASKS:
            if row[task]["verdict"] != "PASS":
                print(f"    {task}: {row[task]['reason']}")
    if "w4a4" in runs and "w4a4_packed" in runs:
        print(f"w4a4 and w4a4_packed identical item for item: {same_items(runs['w4a4'], runs['w4a4_packed'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
