"""The ``evalgate`` command line. Exit codes: 0 pass/ok, 1 fail, 2 error or not comparable."""

from __future__ import annotations

import datetime as dt
import importlib
import sys
from pathlib import Path

import click

from evalgate.errors import UserError

# command groups owned by other modules: (module, attribute)
SUBCOMMANDS = [
    ("evalgate.cli.kernels", "kernels_group"),
    ("evalgate.cli.selftest", "selftest_group"),
    ("evalgate.cli.gate", "commands"),
    ("evalgate.cli.report", "commands"),
    ("evalgate.cli.serve", "commands"),
]


class EvalgateGroup(click.Group):
    """Turns user errors into one line on stderr and exit 2, from any command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"evalgate: error: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=EvalgateGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evalgate")
def main():
    """Gate a new low-precision MoE kernel: run GSM8K and HumanEval with it, compare every item with a
    stored W4A8 baseline, and answer PASS or FAIL with the flips that explain it."""


def _parse_tasks(value: str | None, default: str = "gsm8k") -> list[str]:
    value = default if value is None else value
    tasks = [t.strip() for t in value.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; name at least one task, e.g. --tasks gsm8k")
    return tasks


def _parse_profiles(values: tuple[str, ...], tasks: list[str]) -> dict[str, str]:
    """``--profile NAME`` (the task is looked up) or ``--profile task=NAME``."""
    from evalgate.tasks import get_task

    chosen: dict[str, str] = {}
    for value in values:
        if "=" in value:
            task, name = value.split("=", 1)
            chosen[task] = name
            continue
        owners = [t for t in tasks if value in get_task(t).profiles]
        if not owners:
            known = ", ".join(p for t in tasks for p in get_task(t).profiles)
            raise UserError(f"unknown profile {value!r} for tasks {', '.join(tasks)}; choose from: {known}")
        chosen[owners[0]] = value
    return chosen


def default_out(kernel: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results/runs") / f"{stamp}-{kernel.replace('/', '_')}"


def run_options(f):
    """Options shared by ``run``, ``gate`` and ``calibrate``."""
    decorators = [
        click.option("--model", "model", default=None, help="Local transformers checkpoint folder (default: the built-in canary)."),
        click.option("--tasks", default=None, help="Comma-separated tasks [default: gsm8k for run; gsm8k,humaneval for gate and calibrate]."),
        click.option("--profile", "profiles", multiple=True, help="Scoring profile, e.g. gsm8k-cot-8shot (or task=NAME). Repeatable."),
        click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N items of each task."),
        click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1..."),
        click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None, help="Override the checkpoint dtype."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="Override every profile's token limit (changes the profile id; for smoke runs)."),
        click.option("--data-dir", type=click.Path(), default=None, envvar="EVALGATE_DATA_DIR", help="Offline data laid out like shared/data [env: EVALGATE_DATA_DIR]."),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f


def server_options(f):
    """Options of ``run`` and ``gate`` that drive an OpenAI-compatible server instead of the in-process model."""
    decorators = [
        click.option("--server", default=None, metavar="URL", help="A running OpenAI-compatible server (SGLang, vLLM, evalgate serve) started with --kernel selected."),
        click.option("--model-id", default=None, help="The served model's name; part of a server run's model identity."),
        click.option("--launch", type=click.Choice(["sglang", "vllm"]), default=None, help="Start this server on --model with the kernel's environment, stop it after; its arguments follow `--` [command: env EVALGATE_SGLANG_COMMAND / EVALGATE_VLLM_COMMAND]."),
        click.option("--launch-timeout", type=click.FloatRange(min=1), default=1800.0, show_default=True, help="Seconds a launched server has to become healthy."),
        click.option("--request-timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True, help="Seconds one server request may take."),
        click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="Server requests in flight at once (at most --batch-size: the runner hands over one batch at a time)."),
        click.option("--retries", type=click.IntRange(min=0), default=3, show_default=True, help="Retries per request on connection errors, timeouts, 5xx and malformed answers."),
        click.argument("server_args", nargs=-1, type=click.UNPROCESSED),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f


def server_adapter(server, launch, model, kernel, out, model_id, server_args, launch_timeout, request_timeout,
                   concurrency, retries, batch_size):
    """Context manager yielding the server adapter, or None for the in-process model."""
    from evalgate.model_adapters.launcher import served_adapter

    return served_adapter(kernel, out, server=server, launch=launch, model=model, model_id=model_id,
                          server_args=server_args, launch_timeout=launch_timeout, request_timeout=request_timeout,
                          concurrency=concurrency, retries=retries, batch_size=batch_size)


def with_canary_profiles(model: str | None, task_list: list[str], chosen: dict[str, str]) -> dict[str, str]:
    """With no --model the canary runs, scored with its own profiles unless --profile says otherwise."""
    if model:
        return chosen
    from evalgate.canary import PROFILES

    return {**{t: PROFILES[t] for t in task_list if t in PROFILES}, **chosen}


def canary_thresholds(model: str | None, thresholds_path: str | None) -> str | None:
    """The canary's own policy (its item counts differ from GSM8K test's) unless --thresholds is given."""
    if model or thresholds_path:
        return thresholds_path
    from evalgate.canary import THRESHOLDS

    return str(THRESHOLDS)


def resolve_model(model: str | None) -> str:
    if model:
        return model
    try:
        from evalgate.canary import canary_path
    except ImportError:
        raise UserError("no --model given and this install has no built-in canary model; pass --model PATH") from None
    return str(canary_path())


def served_model_name(model, server, launch, model_id) -> str:
    """What ``RunSpec.model`` holds: the checkpoint, or for a server run its name (identity is the fingerprint)."""
    if launch:
        return model or ""
    if server:
        return model_id or server
    return resolve_model(model)


@main.command()
@run_options
@click.option("--kernel", default="bf16", show_default=True, help="Kernel name (see `evalgate kernels list`).")
@click.option("--out", type=click.Path(), default=None, help="Run folder (default: results/runs/<time>-<kernel>).")
@click.option("--resume", is_flag=True, help="Continue the run in --out: finished items are kept, never redone.")
@server_options
def run(model, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, kernel, out, resume,
        server, model_id, launch, launch_timeout, request_timeout, concurrency, retries, server_args):
    """Run tasks with one kernel and store per-item records.

    With --server or --launch, requests go to an OpenAI-compatible server; server arguments follow `--`."""
    from evalgate.kernels import get_kernel
    from evalgate.run.runner import RunSpec, execute

    if resume and out is None:
        raise UserError("--resume needs --out: the folder of the run to continue")
    get_kernel(kernel)  # fail on a bad name before loading anything
    task_list = _parse_tasks(tasks)
    chosen = _parse_profiles(profiles, task_list)
    if not (server or launch):
        chosen = with_canary_profiles(model, task_list, chosen)
    spec = RunSpec(model=served_model_name(model, server, launch, model_id), kernel=kernel, tasks=task_list,
                   profiles=chosen, limit=limit, batch_size=batch_size,
                   device=device, dtype=dtype, data_dir=data_dir, max_new_tokens=max_new_tokens)
    out = Path(out) if out else default_out(kernel)
    if launch:  # refuse a bad --out before a server spends minutes starting
        from evalgate.run.runner import _prepare_out

        _prepare_out(out, resume)
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


def _add_subcommands() -> None:
    for module_name, attr in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that room has not landed in this install
            raise
        found = getattr(module, attr)
        for command in found if isinstance(found, (list, tuple)) else [found]:
            main.add_command(command)


_add_subcommands()

if __name__ == "__main__":
    main()
