"""`evalgate run`: run tasks with one kernel and store per-item records."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING
from pathlib import Path

import click

from evalgate.cli import preflight
from evalgate.cli.options import (KERNEL, default_out, note_resumable, parse_profiles, parse_tasks, run_options,
                                  sampling_options, server_options, with_canary_profiles)
from evalgate.errors import EnvironmentFailure, UserError

if TYPE_CHECKING:
    from evalgate.records import RunManifest


@click.command()
@run_options
@click.option("--kernel", type=KERNEL, default="bf16", show_default=True, help="Kernel name (see `evalgate kernels list`).")
@click.option("--out", type=click.Path(), default=None, help="Run folder (default: results/runs/<time>-<kernel>).")
@click.option("--resume", is_flag=True, help="Continue the run in --out: finished items are kept, never redone.")
@sampling_options
@server_options
def run(run, kernel, out, resume, sampling, server, options):
    """Run tasks with one kernel and store per-item records (exit 0 when stored).

    With --server or --launch, requests go to an OpenAI-compatible server; server arguments follow `--`."""
    if resume and out is None:
        raise UserError("--resume needs --out: the folder of the run to continue")
    settings = sampling.settings()
    if not server.served:
        preflight.model_folder(run.model)
    preflight.server(server.url)
    out = Path(out) if out else default_out(kernel)
    preflight.writable_folder(out, "--out")

    from evalgate.run.runner import execute, prepare_out
    from evalgate.run.spec import RunSpec, load_tasks

    task_list = parse_tasks(run.tasks)
    chosen = parse_profiles(run.profiles, task_list)
    if not server.served:
        chosen = with_canary_profiles(run.model, task_list, chosen)
    spec = RunSpec(model=server.model_name(run.model), kernel=kernel, tasks=task_list,
                   profiles=chosen, limit=run.limit, batch_size=run.batch_size,
                   device=run.device, dtype=run.dtype, data_dir=run.data_dir, datasets=options.datasets,
                   max_new_tokens=run.max_new_tokens, **settings)
    previous = prepare_out(out, resume)  # a stored run without --resume is refused before the data load
    if previous is not None:
        spec = _resumed_spec(spec, previous)
    loaded = load_tasks(spec)
    if previous is not None:
        _refuse_another_run(previous, spec, loaded, out, served=server.served)
    preflight.free_space(out, preflight.run_bytes(sum(len(t.items) for t in loaded.values()), spec.samples), "--out")
    with preflight.run_lock(out):
        prepare_out(out, resume)  # refuse a bad --out before the model loads or a server spends minutes starting
        from evalgate.model_adapters.server.errors import RESUME_HINT, ServerError

        note_resumable(out, f"--out {shlex.quote(str(out))} --resume")
        try:
            with server.adapter(run.model, kernel, out, run.batch_size, options.deterministic,
                                resume_hint=False) as adapter:
                if adapter is None:
                    from evalgate.pipeline import in_process_adapter

                    adapter = in_process_adapter(spec, options)
                path = execute(spec, out, adapter, resume=resume, tasks=loaded)
        except ServerError as exc:  # the server went away mid-run: the environment, not the input
            raise EnvironmentFailure(str(exc).replace(f"; {RESUME_HINT}", "").replace(RESUME_HINT, "")) from None
    _print_run_summary(path)


def _refuse_another_run(previous: RunManifest, spec, loaded, out: Path, served: bool) -> None:
    """What the run refuses once the model is loaded (``runner._check_resumable``), said before it loads: a
    --resume with another kernel, other items or profiles, or another local model."""
    diffs = []
    if not served:
        from evalgate.model_adapters.hf.fingerprint import check_model_dir, model_fingerprint

        if previous.model.fingerprint != model_fingerprint(check_model_dir(spec.model))["fingerprint"]:
            diffs.append("model fingerprint")
    kernel = previous.kernel.name
    if kernel != spec.kernel:
        diffs.append(f"kernel ({kernel} vs {spec.kernel})")
    for name, task in loaded.items():
        before = previous.tasks.get(name)
        if before is None:
            diffs.append(f"task {name} not in the stored run")
        elif before.profile_id != task.profile_id:
            diffs.append(f"{name} profile (items, limit or settings changed)")
    if diffs:
        raise UserError(f"--resume: {str(out)!r} was made with a different {', '.join(diffs)}; rerun into a new --out")


# RunSpec fields a resumed run takes from its manifest unless the option is given (option name, field)
RESUMED = (("model", "model"), ("kernel", "kernel"), ("tasks", "tasks"), ("profiles", "profiles"), ("limit", "limit"),
           ("batch_size", "batch_size"), ("device", "device"), ("dtype", "dtype"), ("data_dir", "data_dir"),
           ("max_new_tokens", "max_new_tokens"), ("samples", "samples"), ("temperature", "temperature"),
           ("seed", "seed"), ("dataset", "datasets"))


def _resumed_spec(spec, manifest: RunManifest):
    """``run --resume --out X`` continues X with the settings it was started with: each option left at its
    default takes the stored run's value (an option given still wins, and a mismatch is refused later)."""
    from dataclasses import replace

    from click.core import ParameterSource

    ctx = click.get_current_context()
    stored = manifest.spec.to_dict() if manifest.spec is not None else {}  # the RunSpec's fields, by name
    taken = {field: stored[field] for option, field in RESUMED
             if field in stored and ctx.get_parameter_source(option) in (ParameterSource.DEFAULT, None)}
    if "order" in stored:
        taken["order"] = stored["order"]
    return replace(spec, **taken)


def _print_run_summary(path: Path) -> None:
    from evalgate.run.store import load_run
    from evalgate.tasks import get_task

    run = load_run(path)
    for task_name, records in run.records.items():
        metric = get_task(task_name).gate_metric
        score = sum(float(r.get(metric, 0.0)) for r in records) / max(len(records), 1)
        click.echo(f"{task_name}: {metric} = {score:.4f} over {len(records)} items")
    click.echo(f"run stored in {path}")
