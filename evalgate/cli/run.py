"""`evalgate run`: run tasks with one kernel and store per-item records."""

from __future__ import annotations

from pathlib import Path

import click

from evalgate.cli.options import (KERNEL, default_out, parse_profiles, parse_tasks, run_options, sampling_options,
                                  sampling_settings, served_model_name, server_adapter, server_options,
                                  with_canary_profiles)
from evalgate.errors import UserError


@click.command()
@run_options
@click.option("--kernel", type=KERNEL, default="bf16", show_default=True, help="Kernel name (see `evalgate kernels list`).")
@click.option("--out", type=click.Path(), default=None, help="Run folder (default: results/runs/<time>-<kernel>).")
@click.option("--resume", is_flag=True, help="Continue the run in --out: finished items are kept, never redone.")
@sampling_options
@server_options
def run(model, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, kernel, out, resume,
        samples, temperature, seed, server, model_id, launch, launch_timeout, request_timeout, concurrency, retries,
        server_args):
    """Run tasks with one kernel and store per-item records.

    With --server or --launch, requests go to an OpenAI-compatible server; server arguments follow `--`."""
    from evalgate.run.runner import RunSpec, execute

    if resume and out is None:
        raise UserError("--resume needs --out: the folder of the run to continue")
    sampling = sampling_settings(samples, temperature, seed)
    task_list = parse_tasks(tasks)
    chosen = parse_profiles(profiles, task_list)
    if not (server or launch):
        chosen = with_canary_profiles(model, task_list, chosen)
    spec = RunSpec(model=served_model_name(model, server, launch, model_id), kernel=kernel, tasks=task_list,
                   profiles=chosen, limit=limit, batch_size=batch_size,
                   device=device, dtype=dtype, data_dir=data_dir, max_new_tokens=max_new_tokens, **sampling)
    out = Path(out) if out else default_out(kernel)
    if launch:  # refuse a bad --out before a server spends minutes starting
        from evalgate.run.runner import prepare_out

        prepare_out(out, resume)
    with server_adapter(server, launch, model, kernel, out, model_id, server_args, launch_timeout, request_timeout,
                        concurrency, retries, batch_size) as adapter:
        path = execute(spec, out, resume=resume, adapter=adapter)
    _print_run_summary(path)


def _print_run_summary(path: Path) -> None:
    from evalgate.run.store import load_run
    from evalgate.tasks import get_task

    run = load_run(path)
    for task_name, records in run.records.items():
        metric = get_task(task_name).gate_metric
        score = sum(float(r.get(metric, 0.0)) for r in records) / max(len(records), 1)
        click.echo(f"{task_name}: {metric} = {score:.4f} over {len(records)} items")
    click.echo(f"run stored in {path}")
