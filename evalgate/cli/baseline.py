"""`evalgate baseline record | import | list`: the stored baselines (immutable)."""

from __future__ import annotations

import json

import click

from click.core import ParameterSource

from evalgate.cli import preflight
from evalgate.cli.options import KERNEL, baselines_root_option, sampling_options


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
    """Stored baselines, where the gate looks for them in its order: yours, then the built-in canary's
    (packaged with evalgate)."""
    from evalgate.run.baselines import list_baselines, lookup_roots, user_root

    explicit = click.get_current_context().get_parameter_source("root") is not ParameterSource.DEFAULT
    preflight.baselines_root(root, explicit)
    rows = []
    for where in lookup_roots(root):
        packaged = where != user_root(root)
        if where.is_dir():
            rows += [{**r, "packaged": packaged} for r in list_baselines(where)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        kind = "aggregate-only" if r["aggregate_only"] else f"{r['n_items']} items"
        psi0 = f", A/A ψ0 {100 * r['aa_psi0']:.2f}%" if r["aa_psi0"] is not None else ", no A/A"
        shipped = ", packaged with the canary" if r["packaged"] else ""
        click.echo(f"{r['path']}: {r['task']} / {r['profile']} / {r['kernel']} ({kind}{psi0}{shipped})")


@baseline.command("find")
@click.option("--model", default=None, help="Local transformers checkpoint folder (default: the built-in canary).")
@click.option("--tasks", default=None, help="Comma-separated tasks [default: gsm8k,humaneval].")
@click.option("--profile", "profiles", multiple=True, help="Scoring profile (or task=NAME), as given to the gate. Repeatable.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="As given to the gate.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="As given to the gate.")
@click.option("--data-dir", type=click.Path(), default=None, envvar="EVALGATE_DATA_DIR",
              help="As given to the gate [env: EVALGATE_DATA_DIR].")
@sampling_options
@click.option("--candidate", type=click.Path(), default=None, help="The baseline a gate of this stored run would use.")
@click.option("--kernel", type=KERNEL, default="w4a8", show_default=True, help="The baseline's kernel.")
@baselines_root_option("root")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def baseline_find(model, tasks, profiles, limit, max_new_tokens, data_dir, sampling, candidate, kernel, root, as_json):
    """The stored baseline a gate with these arguments would use: the same model (fingerprint), each task's
    profile, and its A/A calibration. Exit 0 when every task has a calibrated baseline, 1 when one has none
    or no A/A record (then `evalgate calibrate` with the same arguments records it)."""
    import sys

    from evalgate.run.baselines import find_stored_baseline, lookup_roots, read_aa

    explicit = click.get_current_context().get_parameter_source("root") is not ParameterSource.DEFAULT
    preflight.baselines_root(root, explicit)
    fingerprint, profile_ids = _identity(model, tasks, profiles, limit, max_new_tokens, data_dir,
                                         sampling.settings(), candidate, kernel)
    roots = lookup_roots(root)
    found = {}
    for task, pid in profile_ids.items():
        path = find_stored_baseline(roots, fingerprint, pid, kernel)
        aa = read_aa(path) if path is not None else None
        psi0 = (aa or {}).get("tasks", {}).get(task, {}).get("psi0")
        found[task] = {"path": str(path) if path else None, "calibrated": psi0 is not None, "aa_psi0": psi0,
                       "profile_id": pid}
    if as_json:
        click.echo(json.dumps({"fingerprint": fingerprint, "kernel": kernel, "tasks": found}, indent=2))
    else:
        for task, f in found.items():
            if f["path"] is None:
                click.echo(f"{task}: no stored {kernel} baseline for this model and profile")
            elif not f["calibrated"]:
                click.echo(f"{task}: {f['path']} (no A/A calibration)")
            else:
                click.echo(f"{task}: {f['path']} (A/A ψ0 {100 * f['aa_psi0']:.2f}%)")
    sys.exit(0 if all(f["calibrated"] for f in found.values()) else 1)


def _identity(model, tasks, profiles, limit, max_new_tokens, data_dir, sampling, candidate, kernel):
    """(model fingerprint, task -> profile id) of the gate these arguments describe: a stored run's own, or
    a local model's (its config and headers, no weights) with its tasks' planned profiles (the data, read)."""
    if candidate:
        given = [flag for flag, value in (("--model", model), ("--tasks", tasks), ("--profile", profiles),
                                          ("--limit", limit), ("--max-new-tokens", max_new_tokens))
                 if value]
        if given:
            raise click.UsageError(f"--candidate names a stored run, which has its own settings; drop {'/'.join(given)}")
        from evalgate.run.store import load_run

        preflight.stored_run(candidate)
        manifest = load_run(candidate).meta
        return manifest.model.fingerprint, {t: m.profile_id for t, m in manifest.tasks.items()}
    preflight.model_folder(model)
    from evalgate.cli.options import run_spec
    from evalgate.plan import local_fingerprint, planned_profile_ids

    spec = run_spec(model, kernel, tasks, profiles, limit, 1, "cpu", None, max_new_tokens, data_dir,
                    sampling=sampling)
    return local_fingerprint(spec.model), planned_profile_ids(spec)
