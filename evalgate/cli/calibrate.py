"""`evalgate calibrate`: the A/A runs that tell the gate how often the baseline disagrees with itself."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evalgate.cli.options import DEFAULT_BASELINES, canary_thresholds, run_options, run_spec


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
    spec = run_spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir)
    results = run_calibration(spec, Path(baselines_root), thresholds_path=canary_thresholds(model, thresholds_path),
                              second_batch_size=second_batch_size)
    for task, r in results.items():
        click.echo(f"{task}: A/A flip rate ψ0 = {100 * r['psi0']:.2f}% ({r['b'] + r['c']} of {r['n']} items), "
                   f"Δ0 = {100 * r['delta0']:+.2f} pp, A/A verdict {r['verdict']}; stored in {r['baseline']}")
    sys.exit(0 if all(r["verdict"] == "PASS" for r in results.values()) else 1)
