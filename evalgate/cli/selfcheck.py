"""`evalgate selfcheck`: the gate proves itself on the built-in canary. Every healthy kernel must PASS against
the canary's stored W4A8 baseline (w4a8 itself at another batch size: an A/A) and every fault-injected kernel
must FAIL; one row per kernel, exit 0 only when every row is as expected.

Each row is exactly `evalgate gate --kernel K` with no --model (``pipeline.gate_model``); its run and its
reports (gate.json, report.md, ...) are kept under --runs-dir, and a finished run there is reused.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

from evalgate.cli.options import KERNELS, baselines_root_option, checked_device, parse_tasks, run_spec
from evalgate.gate.stopped import decided

if TYPE_CHECKING:
    from evalgate.gate.verdict import Verdict

# The healthy kernels of the canary's table (w4a8_sglang is w4a8 behind a server's scale rule: opt in with
# --kernels); the faulty ones are every registered faulty/ kernel.
HEALTHY = ("bf16", "w4a8", "w4a4", "w4a4_packed", "w4a4_te")
# Not the stored baseline's 32, so the w4a8 row is a real A/A; and half the gate's default (128): the faulty
# rows run until their accuracy FAIL is certain, which fewer rows in flight let them see sooner.
BATCH_SIZE = 64


@dataclass
class Row:
    kernel: str
    expected: str  # "PASS" (healthy) or "FAIL" (faulty)
    verdict: str  # overall: PASS, FAIL, INCONCLUSIVE
    tasks: dict[str, str] = field(default_factory=dict)  # task -> its verdict
    seconds: float = 0.0
    run_dir: str = ""
    error: str = ""  # why the gate gave no verdict (verdict "ERROR")
    conformance: str = "-"  # the kernel vs the one it declares: PASS, FAIL, "own" (its own reference), "-" (not checked)
    items: str = "all"  # "all", or "58/364" when the gate stopped early once its FAIL was certain

    @property
    def ok(self) -> bool:
        return self.verdict == self.expected


def default_kernels() -> list[str]:
    from evalgate.kernels import get_kernel, kernel_names

    names = kernel_names()
    return [k for k in HEALTHY if k in names] + [k for k in names if get_kernel(k).faulty]


def expected_verdict(kernel: str) -> str:
    from evalgate.kernels import get_kernel

    return "FAIL" if get_kernel(kernel).faulty else "PASS"


def check(kernels: list[str], gate_one: Callable[[str], tuple[Verdict, Path]],
          expected: Callable[[str], str] = expected_verdict, on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """One row per kernel: ``gate_one(kernel)`` gives (verdict, run folder) as ``pipeline.gate_model`` does;
    a kernel whose gate stops with an error is an ERROR row (never as expected) and the others still run."""
    from evalgate.errors import UserError

    rows = []
    for kernel in kernels:
        t0 = time.perf_counter()
        try:
            verdict, run_dir = gate_one(kernel)
        except UserError as exc:
            row = Row(kernel, expected(kernel), "ERROR", {}, round(time.perf_counter() - t0, 1), "", str(exc))
            rows.append(row)
            on_row(row)
            continue
        stopped = getattr(verdict, "early_stop", None)
        tasks = {t: _task_cell(t, d.outcome.verdict, stopped) for t, d in verdict.decision.tasks.items()} if verdict.decision \
            else {}
        row = Row(kernel, expected(kernel), verdict.verdict, tasks, round(time.perf_counter() - t0, 1), str(run_dir),
                  conformance=conformance_cell(getattr(verdict, "conformance", None)),
                  items=f"{stopped['items_run']}/{stopped['items_total']}" if stopped else "all")
        rows.append(row)
        on_row(row)
    return rows


def _task_cell(task: str, verdict: str, stopped: dict | None) -> str:
    """A task's verdict; "undecided" for a task a stopped-early run did not finish and whose best completion
    does not FAIL (its verdict there is only its best case), "not run" for one it stopped before its first
    item, as the reports show them."""
    share = ((stopped or {}).get("tasks") or {}).get(task) or {}
    if share and share["items_run"] == 0:
        return "not run"
    return verdict if decided(bool(share) and share["items_run"] < share["items_total"], verdict) else "undecided"


def conformance_cell(conformance: dict | None) -> str:
    if not conformance:
        return "-"
    if not conformance.get("checked"):
        return "own"
    return "PASS" if conformance["ok"] else "FAIL"


def table(rows: list[Row], tasks: list[str]) -> str:
    columns = ["kernel", "expected", "conformance", *tasks, "overall", "items", "time", "match"]
    cells = [[r.kernel, r.expected, r.conformance, *(r.tasks.get(t, "-") for t in tasks), r.verdict,
              r.items if r.items == "all" else f"{r.items} (stopped early)", f"{r.seconds:.1f} s",
              "yes" if r.ok else "NO"] for r in rows]
    widths = [max(len(row[i]) for row in [columns, *cells]) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *cells]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def same_answers(a: Path, b: Path, tasks: list[str]) -> bool:
    """Whether two runs answered every item identically (w4a4 and w4a4_packed share their numerics)."""
    from evalgate.run.store import load_run

    ra, rb = load_run(a), load_run(b)
    return all({r["doc_id"]: r["resps"] for r in ra.records[t]} == {r["doc_id"]: r["resps"] for r in rb.records[t]}
               for t in tasks)


def check_baselines(tasks: list[str], batch_size: int, baselines_root, data_dir: str | None) -> list[Path]:
    """The stored canary W4A8 baseline of every task, each with its A/A: checked once, before any kernel
    runs (the gate itself would find a missing A/A only after each run)."""
    from evalgate.errors import UserError
    from evalgate.plan import stored_baselines
    from evalgate.run.baselines import read_aa_record

    spec = run_spec(None, "w4a8", ",".join(tasks), (), None, batch_size, "cpu", None, None, data_dir)
    found = stored_baselines(spec, "w4a8", Path(baselines_root) if baselines_root else None)
    missing = [t for t, d in found.items() if d is None]
    if missing:
        raise UserError(f"no stored canary w4a8 baseline for {', '.join(missing)} under {baselines_root} or packaged "
                        "with evalgate; record one with `evalgate calibrate` (or point --baselines-root / "
                        "$EVALGATE_BASELINES at it)")
    dirs = [d for d in found.values() if d is not None]  # (none missing)
    uncalibrated = [str(d) for d in dirs if read_aa_record(d) is None]
    if uncalibrated:
        raise UserError(f"the canary baseline {', '.join(uncalibrated)} has no A/A calibration; run `evalgate calibrate` "
                        "with the same --baselines-root")
    return dirs


def canary_gate(tasks: list[str], batch_size: int, runs_dir: Path, baselines_root: str | Path | None,
                data_dir: str | None, device: str = "cpu",
                early_stop: bool = True) -> Callable[[str], tuple[Verdict, Path]]:
    """``evalgate gate --kernel K`` on the canary, its run in ``runs_dir/K`` and its reports beside it; as the
    gate, a run stops early once its FAIL is certain unless ``early_stop`` is False — on accuracy only: every
    faulty kernel fails its conformance check before any item, and the table is there to show what the
    canary's accuracy catches. The policy is resolved once, as the gate resolves it for the canary."""
    from evalgate.gate.policy import resolve_policy

    policy = resolve_policy(None, canary=True)

    def gate_one(kernel: str):
        from evalgate.pipeline import gate_model
        from evalgate.report.outputs import write_outputs

        spec = run_spec(None, kernel, ",".join(tasks), (), None, batch_size, device, None, None, data_dir)
        out = runs_dir / kernel.replace("/", "_")
        verdict, run_dir = gate_model(spec, "w4a8", baselines_root, out, policy,
                                      early_stop=early_stop, stop_on_conformance=False)
        write_outputs(verdict, Path(run_dir) / "gate")
        return verdict, run_dir

    return gate_one


@click.command()
@click.option("--kernels", type=KERNELS, default=None, help="Comma-separated kernels [default: the healthy ones and every faulty/ kernel].")
@click.option("--tasks", default="gsm8k,humaneval", show_default=True, help="Comma-separated tasks each kernel is gated on.")
@click.option("--batch-size", type=click.IntRange(min=1), default=BATCH_SIZE, show_default=True,
              help="Not the stored baseline's 32, so that the w4a8 row is an A/A.")
@click.option("--runs-dir", type=click.Path(), default=None, help="Where the runs go (default: results/runs/selfcheck-<time>); finished runs there are reused.")
@baselines_root_option()
@click.option("--data-dir", type=click.Path(), default=None, envvar="EVALGATE_DATA_DIR", help="Offline data folder [env: EVALGATE_DATA_DIR].")
@click.option("--device", default="cpu", show_default=True, callback=checked_device, help="cpu, cuda, cuda:1...")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Also write the rows here.")
@click.option("--no-early-stop", "no_early_stop", is_flag=True,
              help="Run every item of every kernel (default: a gate stops once its FAIL is certain).")
def selfcheck(kernels, tasks, batch_size, runs_dir, baselines_root, data_dir, device, json_path, no_early_stop):
    """Gate every kernel on the canary: healthy ones must PASS, faulty ones FAIL. Exit 0 when all do, else 1."""
    names = kernels or default_kernels()
    task_list = parse_tasks(tasks)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs = Path(runs_dir) if runs_dir else Path("results/runs") / f"selfcheck-{stamp}"
    for baseline in check_baselines(task_list, batch_size, baselines_root, data_dir):
        click.echo(f"baseline: {baseline}", err=True)
    gate_one = canary_gate(task_list, batch_size, runs, baselines_root, data_dir, device, not no_early_stop)

    def progress(row: Row) -> None:
        tasks_text = ", ".join(f"{t} {v}" for t, v in row.tasks.items()) or row.error
        click.echo(f"{row.kernel}: {row.verdict} ({tasks_text}), expected {row.expected}, {row.seconds:.1f} s", err=True)

    rows = check(names, gate_one, on_row=progress)
    click.echo(table(rows, task_list))
    by_kernel = {r.kernel: Path(r.run_dir) for r in rows if r.run_dir}
    if "w4a4" in by_kernel and "w4a4_packed" in by_kernel:
        click.echo(f"w4a4 and w4a4_packed answer identically: {same_answers(by_kernel['w4a4'], by_kernel['w4a4_packed'], task_list)}")
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in rows], indent=2))
    bad = [r.kernel for r in rows if not r.ok]
    click.echo(f"selfcheck: {'all ' + str(len(rows)) + ' kernels as expected' if not bad else 'NOT as expected: ' + ', '.join(bad)} "
               f"(runs in {runs})")
    sys.exit(1 if bad else 0)
