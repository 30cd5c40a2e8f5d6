"""`evalgate gate`: run the candidate kernel (or take a stored run), compare with the baseline, decide."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evalgate.cli.options import (KERNEL, baselines_root_option, run_options, run_spec, sampling_options, sampling_settings,
                                  served_model_name, server_adapter, server_options)
from evalgate.errors import UserError


def _finish(verdict, report_dir: Path) -> None:
    from evalgate.report.outputs import write_outputs
    from evalgate.report.text import print_verdict

    from evalgate.gate.stopped import verdict_text

    paths = write_outputs(verdict, report_dir)
    print_verdict(verdict)  # a table that fits a terminal, or a CI log without wrapped cells
    observed = " of the items run" if verdict.early_stop else ""
    for task, rows in (verdict.to_dict().get("flips") or {}).items():
        lost = sum(r["direction"] == "lost" for r in rows)
        click.echo(f"{task}: {lost} lost, {len(rows) - lost} gained{observed} (see {paths['markdown']})")
    policy = verdict.thresholds
    click.echo(f"policy: {policy.path} ({policy.source}, sha256 {policy.sha256[:12]})")
    click.echo(f"verdict: {verdict_text(verdict)}  (reports in {report_dir})")
    sys.exit(verdict.exit_code)


@click.command()
@run_options
@click.option("--kernel", type=KERNEL, default="w4a4_packed", show_default=True, help="Candidate kernel (see `evalgate kernels list`).")
@click.option("--candidate", type=click.Path(), default=None, help="Decide from this stored run (no model needed).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True, help="Baseline folder(s); default: the stored baseline for the model and the tasks' profiles.")
@click.option("--baseline-kernel", type=KERNEL, default="w4a8", show_default=True, help="The kernel the stored baseline was run with.")
@baselines_root_option()
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file (default: $EVALGATE_THRESHOLDS, else the canary's own for canary runs, else ./thresholds.yaml, else the packaged one).")
@click.option("--out", type=click.Path(), default=None, help="Candidate run folder (default: results/runs/gate-<time>-<kernel>).")
@click.option("--report-dir", type=click.Path(), default=None, help="Where gate.json, report.md, junit.xml go (default: <run>/gate).")
@click.option("--allow-uncalibrated", is_flag=True, help="Decide even if the baseline has no A/A calibration (recorded).")
@click.option("--no-early-stop", "no_early_stop", is_flag=True,
              help="Run every item, even once the FAIL is certain (default: stop generating then; docs/gate.md#stopping-early).")
@sampling_options
@server_options
def gate(model, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, kernel, candidate,
         baselines, baseline_kernel, baselines_root, thresholds_path, out, report_dir, allow_uncalibrated,
         no_early_stop, samples, temperature, seed, server, model_id, launch, launch_timeout, request_timeout,
         concurrency, retries, server_args):
    """Compare a candidate kernel with the stored W4A8 baseline and decide.

    Exit codes: 0 PASS, 1 FAIL (the kernel is worse, or does not compute what it declares), 2 bad input or
    usage error, 3 INCONCLUSIVE (the data show neither; the verdict says how many samples would).

    With --server or --launch, the candidate runs on an OpenAI-compatible server; server arguments follow `--`.
    With --candidate, the gate decides from a stored run (no model needed)."""
    sampling = sampling_settings(samples, temperature, seed)
    if candidate:
        if server or launch:
            raise UserError("--candidate decides from a stored run; drop --server/--launch")
        if sampling != sampling_settings(1, 0.0, None):
            raise UserError("--candidate decides from a stored run, made with its own sampling settings; drop "
                            "--samples/--temperature/--seed")
        from evalgate.pipeline import gate as run_gate
        from evalgate.plan import plan_gate
        from evalgate.run.store import load_run

        plan = plan_gate(candidate=load_run(candidate), baselines=baselines, baseline_kernel=baseline_kernel,
                         baselines_root=baselines_root, thresholds=thresholds_path, report_dir=report_dir,
                         allow_uncalibrated=allow_uncalibrated)
        _finish(run_gate(plan), plan.report_dir)
    from evalgate.run.runner import load_tasks, prepare_ahead

    served = bool(server or launch)
    name = served_model_name(model, server, launch, model_id) if served else None
    spec = run_spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, name,
                    sampling)
    loaded = load_tasks(spec)  # the task data, read once
    prepare_ahead(loaded)  # the executor self-test runs beside the imports and the model's load

    from evalgate.pipeline import gate as run_gate  # imports torch: only when a model runs
    from evalgate.plan import gate_out, plan_gate

    run_out = Path(out) if out else gate_out(kernel)
    with server_adapter(server, launch, model, kernel, run_out, model_id, server_args, launch_timeout,
                        request_timeout, concurrency, retries, batch_size) as adapter:
        plan = plan_gate(spec=spec, tasks=loaded, baselines=baselines, baseline_kernel=baseline_kernel,
                         baselines_root=baselines_root, thresholds=thresholds_path, out=run_out,
                         report_dir=report_dir, allow_uncalibrated=allow_uncalibrated,
                         early_stop=not no_early_stop, served=served,
                         fingerprint=adapter.info()["fingerprint"] if adapter is not None else None)
        verdict = run_gate(plan, adapter)
    _finish(verdict, plan.report_dir)
