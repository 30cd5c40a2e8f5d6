"""``evalgate kernels``: what each kernel computes, and how far its numerics are from a reference.

    evalgate kernels list [--json]
    evalgate kernels check --shape dsv4-flash --tokens 512      # one layer, every kernel vs FP32
    evalgate kernels check --model PATH --tasks gsm8k --limit 32  # teacher-forced KL / top-1 vs bf16
    evalgate kernels check --backend triton --shape small --tokens 64  # Triton kernels vs emulator, bit for bit
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time

import click

from evalgate.cli.options import KERNELS
from evalgate.errors import UserError

kernels_group = click.Group(
    "kernels", help="List the kernels evalgate can swap into a MoE model, and check their numerics."
)


def _kernel_rows(include_faulty: bool) -> list[dict]:
    from evalgate.kernels import KERNELS, kernel_names
    from evalgate.model_adapters.server.engines import served_by

    from evalgate.kernels.contract import Capability

    rows = []
    names = [n for n in kernel_names(include_faulty=include_faulty) if not n.startswith("recipe/")]
    for name in sorted(names, key=lambda n: (KERNELS[n].faulty, n)):  # healthy kernels first
        k = KERNELS[name]
        capability = k.library.capability if k.real else Capability()  # an emulation runs anywhere
        rows.append({"name": k.name, "version": k.version, "description": k.description, "served_by": served_by(name),
                     "api": k.api, "faulty": k.faulty, "twin": k.twin, "recipe": k.recipe, "origin": "evalgate",
                     "capability": capability.as_dict()})
    return rows + _plugin_rows(set(names))


def _plugin_rows(listed: set[str]) -> list[dict]:
    """The kernels installed packages offer, from their declarations (a declaration that cannot be read is
    listed with why: the other kernels stay usable)."""
    from evalgate.errors import UserError
    from evalgate.kernels import plugins

    rows = []
    for name in plugins.plugin_names():
        if name in listed:
            continue
        row = {"name": name, "origin": plugins.origin(name), "served_by": [], "api": {}, "faulty": False, "twin": None}
        try:
            spec = plugins.declaration(name)
        except UserError as exc:
            rows.append({**row, "version": "-", "description": f"cannot be used: {exc}", "recipe": None, "broken": True})
            continue
        missing = spec.capability.missing_library()
        rows.append({**row, "version": spec.version or "-", "description": spec.description,
                     "recipe": spec.recipe.as_dict(), "capability": spec.capability.as_dict(),
                     "tolerance": spec.tolerance.as_dict() if spec.tolerance else None,
                     **({"runs_here": False, "why_not": missing} if missing else {"runs_here": True})})
    return rows


@kernels_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every recipe field).")
@click.option("--faulty/--no-faulty", default=True, show_default=True, help="Include fault-injected test kernels.")
def list_kernels(as_json: bool, faulty: bool):
    """Name, what it computes, the release it emulates, and how each server version selects it
    (docs/serving.md#kernel-selection-per-engine-version); then the kernels installed packages offer, with
    the package they come from (docs/kernels.md#your-own-kernel)."""
    rows = _kernel_rows(faulty)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    print_kernel_rows(rows, _console())


def print_kernel_rows(rows: list[dict], console) -> None:
    """One block per kernel, the same on a terminal and in a pipe: its name, what it computes, what it
    emulates, and one line per server version that can serve it. Names and serving lines are never broken
    (a long one runs past the width instead); only the descriptions wrap, at words."""
    from rich.markup import escape

    for r in rows:
        console.print(escape(r["name"]), style="bold red" if r["faulty"] or r.get("broken") else "bold",
                      soft_wrap=True)
        plugin = r.get("origin", "evalgate") != "evalgate"
        for label, value in (("computes", r["description"]), ("version" if plugin else "emulates", r["version"])):
            console.print(f"  {label}: {escape(value)}")
        if plugin:
            console.print(f"  from: {escape(r['origin'])}", soft_wrap=True)
            if r.get("why_not"):
                console.print(f"  runs here: no, {escape(r['why_not'])}", soft_wrap=True)
        for line in r["served_by"] or ["in-process only"]:
            console.print(f"  served by: {escape(line)}", soft_wrap=True)


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)  # CI logs: keep kernel names on one line


def _parse_list(value: str | None, what: str) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise UserError(f"--{what} is empty; name at least one, comma-separated")
    return items


def _print_rows(rows: list[dict], columns: list[tuple[str, str, str]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for _, header, _ in columns:
        table.add_column(header, justify="right" if header != "kernel" else "left")
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        if r.get("faulty"):
            cells[0] = f"[red]{cells[0]}[/red]"
        table.add_row(*cells)
    _console().print(table)


LAYER_COLUMNS = [("kernel", "kernel", ""), ("rel_rmse", "rel RMSE", ".4f"), ("cosine", "cosine", ".6f"),
                 ("max_abs_err", "max |err|", ".4g"), ("calc_diff", "calc_diff", ".2e"),
                 ("bf16_identical", "bf16 ==", ".3f"), ("calc_diff_vs_twin", "calc_diff vs twin", ".2e")]
TRITON_COLUMNS = [("kernel", "kernel", ""), ("identical", "bit-identical", ""), ("differing", "differing", "d"),
                  ("gemm_rows", "GEMM rows", "d"), ("host_rows", "host rows", "d"),
                  ("triton_seconds", "Triton s", ".2f")]
MODEL_COLUMNS = [("kernel", "kernel", ""), ("mean_kl", "mean KL vs bf16", ".3e"),
                 ("top1_agreement", "top-1 agree", ".4f"), ("tokens", "tokens", "d"), ("seconds", "s", ".1f")]


class _Heartbeat:
    """A line on stderr every ``every_s`` seconds while a layer check works, whether or not it has moved since
    (one kernel's preparation at the dsv4-flash shape takes minutes on a CPU): the check's latest
    ``progress(what, done, total)`` and the time elapsed. A short check stays silent."""

    def __init__(self, t0: float, every_s: float = 10.0):
        self.t0, self.every_s = t0, every_s
        self.latest = ("starting", 0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __call__(self, what: str, done: int, total: int) -> None:
        self.latest = (what, done, total)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            what, done, total = self.latest
            count = f" {done}/{total}" if total else ""
            click.echo(f"layer check: {what}{count}, {time.perf_counter() - self.t0:.0f} s elapsed", err=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@kernels_group.command("check")
@click.option("--shape", default=None, help="Layer-level check at a named shape: dsv4-flash, small or tiny.")
@click.option("--tokens", default="512", show_default=True, help="Tokens routed through the layer (layer-level).")
@click.option("--model", "model_path", default=None, help="Model-level check: a local checkpoint directory.")
@click.option("--tasks", default="gsm8k", show_default=True, help="Tasks whose prompts feed the model-level check.")
@click.option("--limit", default=32, show_default=True, type=click.IntRange(min=1), help="Items per task (model-level).")
@click.option("--kernels", "kernels", type=KERNELS, default=None, help="Comma-separated kernels (default: all).")
@click.option("--data-dir", type=click.Path(file_okay=False), envvar="EVALGATE_DATA_DIR", default=None,
              help="Offline copy of the task data (model-level).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the synthetic layer.")
@click.option("--json", "as_json", is_flag=True, help="Print the result rows as JSON.")
@click.option("--backend", type=click.Choice(["torch", "triton"]), default="torch", show_default=True,
              help="triton: run the emulated kernels' Triton implementation on the layer (--shape) and compare it "
                   "with the PyTorch emulator bit for bit (on a CPU needs TRITON_INTERPRET=1).")
def check(shape, tokens, model_path, tasks, limit, kernels, data_dir, seed, as_json, backend):
    """Numerics of every kernel: one synthetic layer vs FP32 (--shape), or a model vs bf16 (--model)."""
    from evalgate.kernels import check as checks

    if (shape is None) == (model_path is None):
        raise UserError("kernels check needs exactly one of --shape (layer-level) or --model PATH (model-level)")
    if backend == "triton" and shape is None:
        raise UserError("--backend triton checks one synthetic layer: pass --shape (tiny, small or dsv4-flash)")
    t0 = time.perf_counter()
    if shape is not None:
        checks.shape_params(shape)
        try:
            n_tokens = int(tokens)
        except ValueError:
            raise UserError(f"--tokens must be an integer, got {tokens!r}") from None
        if backend == "triton":
            rows = checks.triton_layer_check(shape, n_tokens, seed, kernels)
            title = (f"Triton kernels vs the emulator, bit for bit: {shape}, {n_tokens} tokens, "
                     f"Triton on {rows[0]['device'] if rows else '-'}, emulator on cpu")
            columns = TRITON_COLUMNS
        else:
            with _Heartbeat(t0) as heartbeat:
                rows = checks.layer_check(shape, n_tokens, seed, kernels, progress=heartbeat)
            title = f"layer check: {shape}, {n_tokens} tokens, vs FP32 reference"
            columns = LAYER_COLUMNS
    else:
        if limit < 1:
            raise UserError(f"--limit must be at least 1 (got {limit})")
        from evalgate.model_adapters.hf.fingerprint import check_model_dir
        from evalgate.model_adapters.hf.adapter import load_model

        check_model_dir(model_path)
        pairs = task_pairs(_parse_list(tasks, "tasks"), limit, data_dir)
        model, tokenizer = load_model(model_path, "bf16", device="cpu")
        rows = checks.model_check(model, tokenizer, pairs, kernels)
        title = f"model check: {model_path}, {tasks} x {limit}, teacher-forced vs bf16"
        columns = MODEL_COLUMNS
    wall = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB
    if as_json:
        click.echo(json.dumps({"rows": rows, "wall_seconds": round(wall, 1), "peak_rss_gb": round(peak_gb, 2)},
                              indent=2))
        return
    _print_rows(rows, columns, title)
    click.echo(f"wall {wall:.1f} s, peak RSS {peak_gb:.2f} GB")
    if backend == "triton" and not all(r["identical"] for r in rows):
        click.echo("NOT bit-identical: the Triton kernels differ from the emulator", err=True)
        sys.exit(1)


def task_pairs(tasks: list[str], limit: int | None, data_dir=None) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs from evalgate's tasks, prompted exactly as a run prompts them;
    the reference answer (GSM8K's worked solution, HumanEval's canonical solution) is teacher-forced."""
    from evalgate.tasks import get_task, resolve_profile
    from evalgate.tasks.data import resolve_data_dir

    data_dir = resolve_data_dir(data_dir)
    pairs = []
    for name in tasks:
        task = get_task(name)
        items, resolved = task.load(resolve_profile(task, None), data_dir, limit)
        delimiter = resolved.profile.settings.get("target_delimiter", "")
        for item, request in zip(items, task.requests(items, resolved)):
            answer = item.get("answer") or item.get("canonical_solution") or ""
            pairs.append((request.prompt, delimiter + answer if item.get("answer") else answer))
    return pairs
