"""Where the canary gate's time goes: ``evalgate gate`` (the console script's entry, no options) in an empty
folder, with a timer on each phase of its critical path.

    python benchmarks/bench_canary_gate.py              # one run: the phase split
    python benchmarks/bench_canary_gate.py --runs 4 --ab   # A B A B: as shipped, and with the start-up cuts undone

Each run is a fresh interpreter in a fresh temporary folder (``entry()`` with ``argv = ["evalgate", "gate"]``);
the timers are put on the functions when their module is first imported, so the imports happen in the order
and the place they always do. Per phase: wall seconds and this process's CPU seconds (every thread); the CPU of
the child processes (the decoding workers, the HumanEval self-test and sandbox) is summed at the end.

``--ab`` alternates runs as shipped (A) with runs that undo the start-up cuts (B: transformers' own FP4
unpacking on load, the published files read through ``datasets``), so both see the same load on a shared
machine; it prints each variant's min-max. The verdict and records are the same either way (exit 0, PASS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# critical-path phases, in order: (label, the event that ends it)
PHASES = [
    ("cli, preflight", "data:start"),
    ("data: task files", "data:end"),
    ("imports: policy, statistics, plan", "model:start"),
    ("imports: torch, transformers, kernels", "load:start"),
    ("model load", "load:end"),
    ("conformance (witness)", "conformance:end"),
    ("wait: sandbox self-test", "prepare:end"),
    ("first early-stop decision", "decode:start"),
    ("decoding (+ sandbox scoring beside it)", "decode:end"),
    ("decide, reports, output", "exit"),
]


def child(out_path: str, undo_cuts: bool) -> None:
    """One gate in this process, timed; writes the events to ``out_path`` at the process's exit."""
    import importlib.abc
    import importlib.util
    import resource
    import threading

    t0 = time.perf_counter()
    events: dict[str, tuple[float, float]] = {}  # name -> (wall since start, process CPU)
    scoring = {"wall": 0.0}
    main_pid = os.getpid()

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def mark(name: str, first: bool = True) -> None:
        if not (first and name in events):
            events[name] = (time.perf_counter() - t0, cpu())

    def timed(fn, name: str, main_only: bool = True):
        def wrapper(*args, **kwargs):
            on_main = threading.current_thread() is threading.main_thread()
            if on_main or not main_only:
                mark(f"{name}:start")
            try:
                return fn(*args, **kwargs)
            finally:
                if on_main or not main_only:
                    mark(f"{name}:end", first=False)
        return wrapper

    def scored(fn):
        def wrapper(*args, **kwargs):
            s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                scoring["wall"] += time.perf_counter() - s
        return wrapper

    hooks = {
        "evalgate.run.spec": [(None, "load_tasks", "data")],
        "evalgate.pipeline": [(None, "in_process_adapter", "model")],
        "evalgate.model_adapters.hf.adapter": [("HFAdapter", "__init__", "load"), ("HFAdapter", "conformance", "conformance")],
        "evalgate.run.runner": [("_TaskRun", "prepare", "prepare"), (None, "run_in_process", "decode"),
                                ("_TaskRun", "score_and_write", None)],
    }
    if undo_cuts:
        import contextlib

        hooks["evalgate.model_adapters.loading.fp4_unpack"] = []
        hooks["evalgate.tasks.source"] = []

    def instrument(name: str, module) -> None:
        for cls, attr, label in hooks[name]:
            owner = getattr(module, cls) if cls else module
            fn = getattr(owner, attr)
            setattr(owner, attr, scored(fn) if label is None else timed(fn, label))
        if undo_cuts and name == "evalgate.model_adapters.loading.fp4_unpack":
            module.fast_fp4_unpack = contextlib.nullcontext
        if undo_cuts and name == "evalgate.tasks.source":
            module._published_jsonl_rows = lambda path, fields: None

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in hooks:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                instrument(fullname, module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())
    real_exit = os._exit

    def exit_and_record(code: int) -> None:
        if os.getpid() == main_pid:
            mark("exit")
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            with open(out_path, "w") as f:
                json.dump({"code": code, "events": events, "scoring_wall": scoring["wall"],
                           "children_cpu": kids.ru_utime + kids.ru_stime,
                           "imported": sorted(m for m in ("datasets", "pandas", "pyarrow") if m in sys.modules)}, f)
        real_exit(code)

    os._exit = exit_and_record
    sys.argv = ["evalgate", "gate"]
    from evalgate.cli.main import entry

    entry()


def one_run(undo_cuts: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-canary-gate-") as folder:
        out = os.path.join(folder, "phases.json")
        work = os.path.join(folder, "work")
        os.mkdir(work)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", out]
                              + (["--undo-cuts"] if undo_cuts else []), cwd=work, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if not os.path.exists(out):
            sys.exit(f"the gate wrote no timings (exit {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out) as f:
            result = json.load(f)
    result["wall"] = wall
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("verdict:")]
    result["verdict"] = verdict[-1].split()[1] if verdict else "?"
    return result


def split(result: dict) -> list[tuple[str, float, float]]:
    """(phase, wall s, process CPU s) along the critical path."""
    events = result["events"]
    rows, before = [], (0.0, 0.0)
    for label, end in PHASES:
        if end not in events:
            continue
        wall, cpu = events[end]
        rows.append((label, wall - before[0], cpu - before[1]))
        before = (wall, cpu)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--ab", action="store_true", help="alternate A (as shipped) and B (start-up cuts undone)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--undo-cuts", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.undo_cuts)
        return 0
    variants = ["A", "B"] if args.ab else ["A"]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    print(f"load average before: {os.getloadavg()[0]:.2f}; cores: {len(os.sched_getaffinity(0))}")
    for i in range(args.runs):
        for v in variants:
            r = one_run(undo_cuts=v == "B")
            results[v].append(r)
            print(f"\nrun {i + 1}{v if args.ab else ''}: exit {r['code']} {r['verdict']}, wall {r['wall']:.1f} s, "
                  f"children CPU {r['children_cpu']:.1f} s, sandbox scoring (beside decoding) {r['scoring_wall']:.1f} s, "
                  f"imported: {', '.join(r['imported']) or 'no datasets/pandas/pyarrow'}")
            for label, wall, cpu in split(r):
                print(f"  {label:40s} {wall:7.2f} s wall {cpu:7.2f} s CPU")
    print()
    for v in variants:
        walls = [r["wall"] for r in results[v]]
        start = [r["events"]["decode:start"][0] for r in results[v] if "decode:start" in r["events"]]
        name = {"A": "as shipped", "B": "start-up cuts undone"}[v] if args.ab else "gate"
        print(f"{name:22s} wall {min(walls):.1f}-{max(walls):.1f} s; until decoding starts "
              f"{min(start):.1f}-{max(start):.1f} s ({len(walls)} runs)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
