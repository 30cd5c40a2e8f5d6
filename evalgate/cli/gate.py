"""`evalgate gate`: run the candidate kernel (or take a stored run), compare with the baseline, decide."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evalgate.cli.options import (baselines_root_option, canary_thresholds, default_out, policy_file, run_options, run_spec,
                                  sampling_options, sampling_settings, served_model_name, server_adapter,
                                  server_options)
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
    click.echo(f"verdict: {verdict_text(verdict)}  (reports in {report_dir})")
    sys.exit(verdict.exit_code)


@click.command()
@run_options
@click.option("--kernel", default="w4a4_packed", show_default=True, help="Candidate kernel.")
@click.option("--candidate", type=click.Path(), default=None, help="Decide from this stored run (no model needed).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True, help="Baseline folder(s); default: the stored baseline for the model.")
@click.option("--baseline-kernel", default="w4a8", show_default=True)
@baselines_root_option()
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file (default: the packaged policy; the canary's own for canary runs).")
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
    """Compare a candidate kernel with the stored W4A8 baseline: PASS (exit 0) or FAIL (exit 1); 2 = error.

    With --server or --launch, the candidate runs on an OpenAI-compatible server; server arguments follow `--`."""
    sampling = sampling_settings(samples, temperature, seed)
    if not (candidate or server or launch):
        thresholds_path = canary_thresholds(model, thresholds_path)
    if candidate:
        if not baselines:
            raise UserError("--candidate needs --baseline: the baseline folder(s) to compare with")
        if server or launch:
            raise UserError("--candidate decides from a stored run; drop --server/--launch")
        if sampling != sampling_settings(1, 0.0, None):
            raise UserError("--candidate decides from a stored run, made with its own sampling settings; drop "
                            "--samples/--temperature/--seed")
        from evalgate.gate.decide import gate_runs

        verdict = gate_runs(list(baselines), candidate, policy_file(thresholds_path, candidate), allow_uncalibrated)
        run_dir = Path(candidate)
    else:
        from evalgate.run.runner import prepare_ahead

        name = served_model_name(model, server, launch, model_id) if (server or launch) else None
        spec = run_spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, name,
                        sampling)
        prepare_ahead(spec)  # the executor self-test runs beside the imports and the model's load

        from evalgate.kernels import get_kernel
        from evalgate.pipeline import gate_model, gate_out  # imports torch: only when a model runs

        get_kernel(kernel)
        run_out = Path(out) if out else (default_out(kernel) if baselines else gate_out(kernel))
        with server_adapter(server, launch, model, kernel, run_out, model_id, server_args, launch_timeout,
                            request_timeout, concurrency, retries, batch_size) as adapter:
            if baselines:
                from evalgate.gate.decide import gate_runs
                from evalgate.pipeline import early_stop_hook, run_or_resume

                hook = None
                if not no_early_stop:
                    try:  # the policy the decision will use: --thresholds, else the canary's for canary profiles
                        hook = early_stop_hook(list(baselines), policy_file(thresholds_path, baselines[0]),
                                               allow_uncalibrated)
                    except UserError:
                        pass  # the gate below says what is wrong with the baselines
                from evalgate.run.baselines import answer_lengths

                run_dir = run_or_resume(spec, run_out, adapter=adapter, stop_when=hook,
                                        expected_tokens=answer_lengths([Path(b) for b in baselines]))
                verdict = gate_runs(list(baselines), run_dir, policy_file(thresholds_path, run_dir), allow_uncalibrated)
            else:
                verdict, run_dir = gate_model(spec, baseline_kernel, Path(baselines_root), run_out,
                                              thresholds_path, allow_uncalibrated, adapter=adapter,
                                              early_stop=not no_early_stop)
    _finish(verdict, Path(report_dir) if report_dir else Path(run_dir) / "gate")
