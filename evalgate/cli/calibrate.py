"""`evalgate calibrate`: the A/A runs that tell the gate how often the baseline disagrees with itself."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evalgate.cli.options import KERNEL, baselines_root_option, run_options, sampling_options, server_options
from evalgate.cli import preflight
from evalgate.cli.notes import skipped_local_policy



@click.command()
@run_options
@click.option("--kernel", type=KERNEL, default="w4a8", show_default=True, help="The baseline kernel to calibrate.")
@baselines_root_option()
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file of the A/A verdicts (default: $EVALGATE_THRESHOLDS, else the canary's own for canary runs, else ./thresholds.yaml, else the packaged one).")
@click.option("--second-batch-size", type=click.IntRange(min=1), default=None, help="Batch size of the second in-process run (default: another one).")
@click.option("--runs-dir", type=click.Path(), default="results/runs", show_default=True, help="Where the two A/A runs (and a launched server's log) go.")
@sampling_options
@server_options
def calibrate(run, kernel, baselines_root, thresholds_path, second_batch_size, runs_dir, sampling, server, options):
    """A/A: run the baseline kernel twice and store how often it disagrees with itself next to the baseline.
    Exit 0 when every task's A/A pair passes, 1 when one fails, 3 when one is inconclusive.

    With --server or --launch both runs go to an OpenAI-compatible server (one launched server serves both);
    the second run sends the items in reverse order with half the concurrency. Server arguments follow `--`."""
    if not server.served:
        preflight.model_folder(run.model)
    preflight.server(server.url)
    preflight.thresholds_file(thresholds_path)
    preflight.writable_folder(runs_dir, "--runs-dir")
    preflight.writable_folder(baselines_root, "--baselines-root")
    from evalgate.canary import scored_as_canary
    from evalgate.gate.policy import resolve_policy
    from evalgate.pipeline import calibrate as run_calibration, calibration_stamp

    served = server.served
    spec = run.spec(kernel, server.model_name(run.model) if served else None, sampling.settings(), options.datasets)
    policy = resolve_policy(thresholds_path, canary=not served and scored_as_canary(spec.profiles))
    skipped_local_policy(policy.source)
    stamp = calibration_stamp()
    runs = Path(runs_dir)
    if server.launch:  # one server for both runs; its log beside them
        from evalgate.run.runner import prepare_out

        prepare_out(runs / f"calibrate-{stamp}-{kernel.replace('/', '_')}-server", resume=False)
    log_dir = runs / f"calibrate-{stamp}-{kernel.replace('/', '_')}-server"
    from evalgate.errors import EnvironmentFailure
    from evalgate.model_adapters.server.errors import RESUME_HINT, ServerError

    try:
        with server.adapter(run.model, kernel, log_dir, run.batch_size, options.deterministic,
                            resume_hint=False) as adapter:
            results = run_calibration(spec, policy, Path(baselines_root), runs_dir=runs,
                                      second_batch_size=second_batch_size, adapter=adapter, stamp=stamp,
                                      options=options)
    except ServerError as exc:  # the server, not the input; a calibration is not resumed: it starts again
        raise EnvironmentFailure(str(exc).replace(RESUME_HINT, "restart the server and run the calibration "
                                                              "again")) from None
    for task, r in results.items():
        click.echo(f"{task}: A/A flip rate ψ0 = {100 * r['psi0']:.2f}% ({r['b'] + r['c']} of {r['n']} items), "
                   f"Δ0 = {100 * r['delta0']:+.2f} pp, A/A verdict {r['verdict']}; stored in {r['baseline']}")
    sys.exit(exit_code(results))


def exit_code(results: dict) -> int:
    """As the gate's: 1 when some task's A/A pair FAILed (the baseline is not reproducible, or degrades against
    itself), else 3 when some task's was INCONCLUSIVE (too few items to show the pair within the margin; the
    gate still accepts such a calibration), else 0."""
    verdicts = {r["verdict"] for r in results.values()}
    if verdicts - {"PASS", "INCONCLUSIVE"}:
        return 1
    if "INCONCLUSIVE" in verdicts:
        inconclusive = ", ".join(t for t, r in results.items() if r["verdict"] == "INCONCLUSIVE")
        click.echo(f"calibration INCONCLUSIVE ({inconclusive}): stored, and the gate uses it; the A/A pair could not "
                   "show the baseline within its margin of itself (exit 3)")
        return 3
    return 0
