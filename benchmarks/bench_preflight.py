"""Time to the error for mistakes the gate checks before its heavy start, against `evalgate --help`, without
and with a kernel plugin installed.

    python benchmarks/bench_preflight.py [--repeats 3]

Each mistake runs as the console script in a fresh process (exit code 2 or 4, one stderr line), as does the
reference, `evalgate gate --help` (the interpreter, click and evalgate's command modules), interleaved so
background load hits both alike. Each runs twice: as installed, and with a package offering kernels through
the ``evalgate.kernels`` entry points (a dist-info folder on PYTHONPATH, as pip leaves one; docs/kernels.md#your-own-kernel),
where the last three rows choose its kernel, a broken one and one whose library is missing. Prints per
mistake the median wall time of each and its ratio to the reference's median without the plugin, and
whether torch was imported before the answer; then the plugin's own part of the check, timed inside fresh
processes (the entry-point scan, the chosen declaration's import and checks), which a loaded machine's
process start-up noise would hide.
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
        "plugin kernel, missing --model": ["gate", "--kernel", "bench/w4a4", "--model", str(ws / "nope")],
        "plugin that fails to import": ["gate", "--kernel", "bench/broken"],
        "plugin whose library is missing": ["gate", "--kernel", "bench/needs-library"],
    }


PLUGIN = """from evalgate.kernels.contract import Capability, KernelSpec
W4A4 = dict(activations="e2m1", input_ties="zero", intermediate="e2m1")
K = KernelSpec(name="bench/w4a4", forward="benchplug.impl:forward", recipe=W4A4, description="bench")
LIB = KernelSpec(name="bench/needs-library", forward="benchplug.impl:forward", recipe=W4A4, description="bench",
                 capability=Capability(devices=("cuda",), module="no_such_gemm_library"))
"""


def plugin_site(ws: Path) -> Path:
    """A folder laid out as an installed distribution offering three kernels through entry points."""
    site = ws / "site"
    (site / "benchplug").mkdir(parents=True)
    (site / "benchplug" / "__init__.py").write_text("")
    (site / "benchplug" / "decl.py").write_text(PLUGIN)
    (site / "benchbroken.py").write_text("import no_such_gemm_library\n")
    info = site / "benchplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: benchplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[evalgate.kernels]\nbench/w4a4 = benchplug.decl:K\n"
                                           "bench/broken = benchbroken:K\nbench/needs-library = benchplug.decl:LIB\n")
    return site


# In a fresh process: the plugin's part of the name check alone (the entry-point scan; the chosen kernel's
# declaration imported and checked), beside the import of the CLI it runs in.
PLUGIN_COST = ("import time; t0 = time.perf_counter(); import evalgate.cli.main; t1 = time.perf_counter(); "
               "from evalgate.kernels import plugins; names = plugins.plugin_names(); t2 = time.perf_counter(); "
               "plugins.require('bench/w4a4'); t3 = time.perf_counter(); print(t1 - t0, t2 - t1, t3 - t2)")


def plugin_cost(env: dict, repeats: int) -> list[float]:
    """Medians over ``repeats`` fresh processes: the CLI's import, the entry-point scan, the declaration."""
    rows = [[float(v) for v in subprocess.run([sys.executable, "-c", PLUGIN_COST], env=env, capture_output=True,
                                               text=True, check=True).stdout.split()] for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*rows)]


def timed(args: list[str], probe: Path, env: dict) -> tuple[float, int, bool]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          env={**env, "EG_PROBE": str(probe)})
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
        plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        envs = {"no plugin": plain, "plugin": {**plain, "PYTHONPATH": str(plugin_site(ws))}}
        reference = {e: [] for e in envs}
        times = {(e, name): [] for e in envs for name in cases}
        codes, torch = {}, {}
        for _ in range(args.repeats):
            for e, env in envs.items():
                reference[e].append(timed(["gate", "--help"], probe, env)[0])
                for name, argv in cases.items():
                    seconds, codes[e, name], torch[e, name] = timed(argv, probe, env)
                    times[e, name].append(seconds)
        ref = statistics.median(reference["no plugin"])
        print(f"reference `evalgate gate --help`: {ref:.2f} s without a plugin, "
              f"{statistics.median(reference['plugin']):.2f} s with one (median of {args.repeats})")
        print(f"{'mistake':34} {'exit':>4} {'median s':>9} {'× ref':>6}   {'plugin: exit':>12} {'median s':>9} "
              f"{'× ref':>6}  torch imported")
        for name in cases:
            a, b = statistics.median(times["no plugin", name]), statistics.median(times["plugin", name])
            loaded = "yes" if torch["no plugin", name] or torch["plugin", name] else "no"
            print(f"{name:34} {codes['no plugin', name]:>4} {a:>9.2f} {a / ref:>6.2f}   {codes['plugin', name]:>12} "
                  f"{b:>9.2f} {b / ref:>6.2f}  {loaded}")
        cli, scan, declaration = plugin_cost(envs["plugin"], max(args.repeats, 5))
        print(f"the plugin's part, in-process (median of {max(args.repeats, 5)} fresh processes): entry-point scan "
              f"{scan * 1e3:.1f} ms, the chosen declaration imported and checked {declaration * 1e3:.1f} ms, "
              f"beside {cli * 1e3:.0f} ms importing the CLI")


if __name__ == "__main__":
    main()
