"""Greedy runs of every kernel on candidate canary checkpoints, in parallel, and the verdict each would get.

    python scripts/canary/candidates.py MODEL_DIR [MODEL_DIR ...] --out DIR [--workers N]

Training (``train.py``) predicts verdicts teacher-forced on a GPU; this measures what ``evalgate`` itself
sees: ``evalgate run`` with the canary profiles and canonical numerics (one thread per run, so N runs use N
cores and nothing depends on the machine), then per kernel the items lost (b) and gained (c) against the
W4A8 run and the canary policy's verdict from those counts (``train.predicted_verdict``). Writes
``DIR/table.json`` and prints one line per (model, kernel).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from evalgate.canary import PROFILES
from evalgate.files import read_jsonl
from train import FAULTY, HEALTHY, predicted_verdict  # beside this script

METRICS = {"gsm8k": "exact_match,strict-match", "humaneval": "pass@1"}
KERNELS = ("w4a8",) + HEALTHY + FAULTY


def run_one(model: Path, kernel: str, out: Path, batch_size: int) -> Path:
    folder = out / model.name / kernel.replace("/", "_")
    if (folder / "manifest.json").is_file():
        return folder
    cmd = [sys.executable, "-m", "evalgate", "run", "--model", str(model), "--kernel", kernel,
           "--tasks", "gsm8k,humaneval", "--threads", "1", "--batch-size", str(batch_size), "--out", str(folder)]
    for task, profile in PROFILES.items():
        cmd += ["--profile", f"{task}={profile}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{model.name} {kernel}: {done.stderr.strip().splitlines()[-1:]}")
    return folder


def correct(folder: Path, task: str) -> dict[str, bool]:
    rows = read_jsonl(folder / f"{task}.jsonl")
    return {str(r["doc_id"]): float(r[METRICS[task]]) >= 1.0 for r in rows}


def table(folders: dict[str, Path]) -> dict:
    base = {t: correct(folders["w4a8"], t) for t in METRICS}
    rows = {"w4a8": {"accuracy": {t: sum(v.values()) / len(v) for t, v in base.items()}}}
    for kernel, folder in folders.items():
        if kernel == "w4a8":
            continue
        counts = {}
        for t in METRICS:
            cand = correct(folder, t)
            counts[t] = (sum(base[t][d] and not cand[d] for d in base[t]),
                         sum(cand[d] and not base[t][d] for d in base[t]), len(base[t]))
        rows[kernel] = {"vs_w4a8": counts, "verdict": predicted_verdict(counts),
                        "expected": "FAIL" if kernel.startswith("faulty/") else "PASS"}
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    out = Path(args.out)
    jobs = [(Path(m), k) for m in args.models for k in KERNELS]
    with ThreadPoolExecutor(args.workers) as pool:
        folders = list(pool.map(lambda job: run_one(job[0], job[1], out, args.batch_size), jobs))
    result = {}
    for model in args.models:
        mine = {k: f for (m, k), f in zip(jobs, folders) if m == Path(model)}
        result[Path(model).name] = rows = table(mine)
        ok = all(r.get("verdict", r.get("expected")) == r.get("expected") for k, r in rows.items() if k != "w4a8")
        print(f"{Path(model).name}: {'ALL AS EXPECTED' if ok else 'not as expected'} w4a8 acc {rows['w4a8']['accuracy']}")
        for k, r in rows.items():
            if k != "w4a8":
                print(f"  {k:45s} {r['verdict']:13s} (expect {r['expected']}) {r['vs_w4a8']}")
    (out / "table.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
