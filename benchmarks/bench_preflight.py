"""Time to the error for mistakes the gate checks before its heavy start, against `evalgate --help`.

    python benchmarks/bench_preflight.py [--repeats 3]

Each mistake runs as the console script in a fresh process (exit code 2 or 4, one stderr line), as does the
reference, `evalgate gate --help` (the interpreter, click and evalgate's command modules), interleaved so
background load hits both alike. Prints per mistake the median wall time and its ratio to the reference's
median, and whether torch was imported before the answer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = ("import atexit, os, sys; atexit.register(lambda: open(os.environ['EG_PROBE'], 'w').write("
         "str('torch' in sys.modules))); from evalgate.cli.main import entry; entry()")


def mistakes(ws: Path) -> dict[str, list[str]]:
    (ws / "afile").write_text("x\n")
    (ws / "corrupt.yaml").write_text("alpha: 0.05\ntasks: [unclosed\n")
    (ws / "empty").mkdir(exist_ok=True)
    return {
        "missing --model": ["gate", "--model", str(ws / "nope")],
        "--model is a file": ["gate", "--model", str(ws / "afile")],
        "missing --thresholds": ["gate", "--thresholds", str(ws / "nope.yaml")],
        "corrupt --thresholds": ["gate", "--thresholds", str(ws / "corrupt.yaml")],
        "refused --server": ["gate", "--server", "http://127.0.0.1:1"],
        "missing --candidate": ["gate", "--candidate", str(ws / "nope")],
        "--baselines-root is a file": ["gate", "--candidate", str(ws), "--baselines-root", str(ws / "afile")],
        "--out is a file": ["gate", "--out", str(ws / "afile")],
        "kernel typo": ["gate", "--kernel", "w4a4_pakced"],
        "--device cuda, no GPU": ["gate", "--device", "cuda"],
        "missing --data-dir": ["gate", "--data-dir", str(ws / "nope")],
        "--out holds another run": ["run", "--out", str(ws)],
        "--samples with no baseline": ["gate", "--samples", "2", "--temperature", "0.7",
                                       "--baselines-root", str(ws / "empty")],
    }


def timed(args: list[str], probe: Path) -> tuple[float, int, bool]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          env={**os.environ, "EG_PROBE": str(probe)})
    seconds = time.perf_counter() - started
    return seconds, proc.returncode, probe.read_text() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        probe = ws / "probe"
        cases = mistakes(ws)
        reference, times = [], {name: [] for name in cases}
        codes, torch = {}, {}
        for _ in range(args.repeats):
            reference.append(timed(["gate", "--help"], probe)[0])
            for name, argv in cases.items():
                seconds, codes[name], torch[name] = timed(argv, probe)
                times[name].append(seconds)
        ref = statistics.median(reference)
        print(f"reference `evalgate gate --help`: {ref:.2f} s (median of {args.repeats})")
        print(f"{'mistake':38} {'exit':>4} {'median s':>9} {'× ref':>6}  torch imported")
        for name in cases:
            med = statistics.median(times[name])
            print(f"{name:38} {codes[name]:>4} {med:>9.2f} {med / ref:>6.2f}  {'yes' if torch[name] else 'no'}")


if __name__ == "__main__":
    main()
