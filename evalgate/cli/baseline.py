"""`evalgate baseline record | import | list`: the stored baselines (immutable)."""

from __future__ import annotations

import json

import click

from click.core import ParameterSource

from evalgate.cli import preflight
from evalgate.cli.options import KERNEL, baselines_root_option


@click.group()
def baseline():
    """Stored baselines (results/baselines/<model>/<profile>/<kernel>/), immutable."""


@baseline.command("record")
@click.argument("run", type=click.Path())
@baselines_root_option("root")
@click.option("--force", is_flag=True, help="Replace an existing baseline.")
def baseline_record(run, root, force):
    """Store a complete run as the baseline for its model, profile(s) and kernel."""
    from evalgate.run.baselines import record

    preflight.stored_run(run, "RUN")
    preflight.writable_folder(root, "--baselines-root")
    for path in record(run, root, force=force):
        click.echo(f"recorded {path}")


@baseline.command("import")
@click.option("--task", required=True, help="The task the score is for: gsm8k or humaneval.")
@click.option("--score", type=float, required=True, help="Published score, a fraction (0.962).")
@click.option("--n", "n_items", type=int, required=True, help="Item count behind the score.")
@click.option("--model-id", required=True, help="A name for the model the score belongs to.")
@click.option("--profile", required=True, help="The profile the score was measured with, as far as known.")
@click.option("--kernel", type=KERNEL, default="w4a8", show_default=True, help="The kernel the score was measured with.")
@click.option("--source", default="", help="Where the score comes from.")
@baselines_root_option("root")
@click.option("--force", is_flag=True, help="Replace an existing baseline.")
def baseline_import(task, score, n_items, model_id, profile, kernel, source, root, force):
    """Store a published aggregate score (no per-item records): usable only by the weaker unpaired test."""
    from evalgate.run.baselines import import_aggregate

    preflight.writable_folder(root, "--baselines-root")
    path = import_aggregate(task, score, n_items, model_id, profile, kernel, source, root, force)
    click.echo(f"imported aggregate-only baseline {path}")


@baseline.command("list")
@baselines_root_option("root")
@click.option("--json", "as_json", is_flag=True, help="One JSON list instead of lines.")
def baseline_list(root, as_json):
    """Stored baselines."""
    from evalgate.run.baselines import list_baselines

    explicit = click.get_current_context().get_parameter_source("root") is not ParameterSource.DEFAULT
    preflight.baselines_root(root, explicit)
    rows = list_baselines(root)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        kind = "aggregate-only" if r["aggregate_only"] else f"{r['n_items']} items"
        psi0 = f", A/A ψ0 {100 * r['aa_psi0']:.2f}%" if r["aa_psi0"] is not None else ", no A/A"
        click.echo(f"{r['path']}: {r['task']} / {r['profile']} / {r['kernel']} ({kind}{psi0})")
