"""`evalgate gate`, `evalgate calibrate` and `evalgate baseline ...`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from evalgate.cli.main import (_parse_profiles, _parse_tasks, canary_thresholds, resolve_model, run_options, server_adapter,
                          server_options, with_canary_profiles)
from evalgate.errors import UserError

DEFAULT_BASELINES = "results/baselines"


def _console():
    from rich.console import Console

    return Console(stderr=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def _spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, name=None):
    from evalgate.run.runner import RunSpec

    task_list = _parse_tasks(tasks, default="gsm8k,humaneval")
    chosen = _parse_profiles(profiles, task_list)
    if name is None:
        chosen = with_canary_profiles(model, task_list, chosen)
    return RunSpec(model=name or resolve_model(model), kernel=kernel, tasks=task_list,
                   profiles=chosen, limit=limit, batch_size=batch_size,
                   device=device, dtype=dtype, data_dir=data_dir, max_new_tokens=max_new_tokens)


def _finish(verdict, report_dir: Path) -> None:
    from evalgate.report import text as reports
    from evalgate.gate.decide import write_outputs

    paths = write_outputs(verdict, report_dir)
    _console().print(reports.console_table(verdict))
    for task, rows in (verdict.to_dict().get("flips") or {}).items():
        lost = sum(r["direction"] == "lost" for r in rows)
        click.echo(f"{task}: {lost} lost, {len(rows) - lost} gained (see {paths['markdown']})")
    click.echo(f"verdict: {verdict.verdict}  (reports in {report_dir})")
    sys.exit(verdict.exit_code)


@click.command()
@run_options
@click.option("--kernel", default="w4a4_packed", show_default=True, help="Candidate kernel.")
@click.option("--candidate", type=click.Path(), default=None, help="Decide from this stored run (no model needed).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True, help="Baseline folder(s); default: the stored baseline for the model.")
@click.option("--baseline-kernel", default="w4a8", show_default=True)
@click.option("--baselines-root", type=click.Path(), default=DEFAULT_BASELINES, show_default=True)
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file (default: thresholds.yaml).")
@click.option("--out", type=click.Path(), default=None, help="Candidate run folder (default: results/runs/gate-<time>-<kernel>).")
@click.option("--report-dir", type=click.Path(), default=None, help="Where gate.json, report.md, junit.xml go (default: <run>/gate).")
@click.option("--allow-uncalibrated", is_flag=True, help="Decide even if the baseline has no A/A calibration (recorded).")
@server_options
def gate(model, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, kernel, candidate,
         baselines, baseline_kernel, baselines_root, thresholds_path, out, report_dir, allow_uncalibrated,
         server, model_id, launch, launch_timeout, request_timeout, concurrency, retries, server_args):
    """Compare a candidate kernel with the stored W4A8 baseline: PASS (exit 0) or FAIL (exit 1); 2 = error.

    With --server or --launch, the candidate runs on an OpenAI-compatible server; server arguments follow `--`."""
    from evalgate.gate.decide import gate_runs
    from evalgate.pipeline import gate_model, gate_out

    if not (candidate or server or launch):
        thresholds_path = canary_thresholds(model, thresholds_path)
    if candidate:
        if not baselines:
            raise UserError("--candidate needs --baseline: the baseline folder(s) to compare with")
        if server or launch:
            raise UserError("--candidate decides from a stored run; drop --server/--launch")
        verdict = gate_runs(list(baselines), candidate, thresholds_path, allow_uncalibrated)
        run_dir = Path(candidate)
    else:
        from evalgate.cli.main import default_out, served_model_name
        from evalgate.kernels import get_kernel

        get_kernel(kernel)
        name = served_model_name(model, server, launch, model_id) if (server or launch) else None
        spec = _spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, name)
        run_out = Path(out) if out else (default_out(kernel) if baselines else gate_out(kernel))
        with server_adapter(server, launch, model, kernel, run_out, model_id, server_args, launch_timeout,
                            request_timeout, concurrency, retries, batch_size) as adapter:
            if baselines:
                from evalgate.pipeline import run_or_resume

                run_dir = run_or_resume(spec, run_out, adapter=adapter)
                verdict = gate_runs(list(baselines), run_dir, thresholds_path, allow_uncalibrated)
            else:
                verdict, run_dir = gate_model(spec, baseline_kernel, Path(baselines_root), run_out,
                                              thresholds_path, allow_uncalibrated, adapter=adapter)
    _finish(verdict, Path(report_dir) if report_dir else Path(run_dir) / "gate")


@click.command()
@run_options
@click.option("--kernel", default="w4a8", show_default=True, help="The baseline kernel to calibrate.")
@click.option("--baselines-root", type=click.Path(), default=DEFAULT_BASELINES, show_default=True)
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None)
@click.option("--second-batch-size", type=click.IntRange(min=1), default=None, help="Batch size of the second run (default: another one).")
def calibrate(model, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, kernel,
              baselines_root, thresholds_path, second_batch_size):
    """A/A: run the baseline kernel twice and store how often it disagrees with itself next to the baseline."""
    from evalgate.kernels import get_kernel
    from evalgate.pipeline import calibrate as run_calibration

    get_kernel(kernel)
    spec = _spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir)
    results = run_calibration(spec, Path(baselines_root), thresholds_path=canary_thresholds(model, thresholds_path),
                              second_batch_size=second_batch_size)
    for task, r in results.items():
        click.echo(f"{task}: A/A flip rate ψ0 = {100 * r['psi0']:.2f}% ({r['b'] + r['c']} of {r['n']} items), "
                   f"Δ0 = {100 * r['delta0']:+.2f} pp, A/A verdict {r['verdict']}; stored in {r['baseline']}")
    sys.exit(0 if all(r["verdict"] == "PASS" for r in results.values()) else 1)


@click.group()
def baseline():
    """Stored baselines (results/baselines/<model>/<profile>/<kernel>/), immutable."""


@baseline.command("record")
@click.argument("run", type=click.Path())
@click.option("--root", type=click.Path(), default=DEFAULT_BASELINES, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing baseline.")
def baseline_record(run, root, force):
    """Store a complete run as the baseline for its model, profile(s) and kernel."""
    from evalgate.run.baselines import record

    for path in record(run, root, force=force):
        click.echo(f"recorded {path}")


@baseline.command("import")
@click.option("--task", required=True)
@click.option("--score", type=float, required=True, help="Published score, a fraction (0.962).")
@click.option("--n", "n_items", type=int, required=True, help="Item count behind the score.")
@click.option("--model-id", required=True, help="A name for the model the score belongs to.")
@click.option("--profile", required=True, help="The profile the score was measured with, as far as known.")
@click.option("--kernel", default="w4a8", show_default=True)
@click.option("--source", default="", help="Where the score comes from.")
@click.option("--root", type=click.Path(), default=DEFAULT_BASELINES, show_default=True)
@click.option("--force", is_flag=True)
def baseline_import(task, score, n_items, model_id, profile, kernel, source, root, force):
    """Store a published aggregate score (no per-item records): usable only by the weaker unpaired test."""
    from evalgate.run.baselines import import_aggregate

    path = import_aggregate(task, score, n_items, model_id, profile, kernel, source, root, force)
    click.echo(f"imported aggregate-only baseline {path}")


@baseline.command("list")
@click.option("--root", type=click.Path(), default=DEFAULT_BASELINES, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def baseline_list(root, as_json):
    """Stored baselines."""
    from evalgate.run.baselines import list_baselines

    rows = list_baselines(root)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        kind = "aggregate-only" if r["aggregate_only"] else f"{r['n_items']} items"
        psi0 = f", A/A ψ0 {100 * r['aa_psi0']:.2f}%" if r["aa_psi0"] is not None else ", no A/A"
        click.echo(f"{r['path']}: {r['task']} / {r['profile']} / {r['kernel']} ({kind}{psi0})")


commands = [gate, calibrate, baseline]
