"""The exact test's supremum searched off the nuisance grid, against the grid alone, measured in one run.

    python3 benchmarks/bench_exact_ni.py

Prints, per task size, the seconds of one decision's exact-test work (both p-values, the critical value, a
rate check's p-values) with the grid only (refine=False, the reference) and with the search, and their ratio.
The null laws on the grid are built first and shared by both (they are what a process pays once).
"""

from __future__ import annotations

import time

from evalgate.stats import exact_ni


def one_decision(n: int, margin: float, refine: bool) -> float:
    start = time.perf_counter()
    exact_ni.exact_pvalues(30, 20, n, margin, refine=refine)
    exact_ni.exact_pvalues(12, 3, n, 0.01, refine=refine)
    if refine:
        exact_ni.critical_value(n, margin, 0.025)
    else:
        max(exact_ni._critical_at(law, 0.025) for law in exact_ni.null_law(n, margin))
    return time.perf_counter() - start


def main() -> None:
    for name, n, margin in (("HumanEval", 164, 0.05), ("GSM8K", 1319, 0.015)):
        for m in (margin, 0.01):
            exact_ni.null_law(n, m)
        grid = one_decision(n, margin, refine=False)
        searched = one_decision(n, margin, refine=True)
        print(f"{name:9s} n={n:5d} M={margin:.3f}: grid {grid:.3f} s, searched {searched:.3f} s, "
              f"ratio {searched / max(grid, 1e-9):.1f}x")


if __name__ == "__main__":
    main()
