"""`evalgate explain RUN [ITEM]`: why each flip flipped, replayed teacher-forced through both kernels."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from evalgate.cli.options import baselines_root_option, checked_device
from evalgate.errors import NotComparable, UserError


def _comparison(run: str, baselines: tuple[str, ...], root: str | None):
    """The pair to explain: a gate's output folder pairs what it decided on; a run folder is paired with
    ``--baseline`` folders, else with its stored W4A8 baseline (``--baselines-root``, then the canary's)."""
    from evalgate import api
    from evalgate.run.baselines import lookup_roots

    path = Path(run)
    if not path.is_dir():
        raise UserError(f"{run!r} is not a folder; pass a run folder or a gate's output folder")
    if api._gate_file(path) is not None and not baselines:
        return api.compare(path)
    if baselines:
        return api.compare(list(baselines), path, items="candidate")
    candidate = api.load_run(path)
    problems = []
    for candidate_root in lookup_roots(root):
        if not api._is_baselines_root(candidate_root):
            continue
        try:
            return api.compare(candidate_root, candidate, items="candidate")
        except NotComparable as exc:
            problems.append(str(exc))
    raise UserError(f"no stored baseline to pair {run!r} with; pass --baseline DIR"
                    + (f" ({problems[0]})" if problems else ""))


def _items(cmp, item: str | None, task: str | None) -> list[tuple[str, object]]:
    if item is None:
        df = cmp.flips(task)
        names = [task] * len(df) if task else list(df["task"]) if len(df) else []
        return list(zip(names, df["doc_id"]))
    tasks = [task] if task else [t for t, p in cmp.pairs.items() if str(item) in {str(d) for d in p.doc_ids}]
    if not tasks:
        raise UserError(f"no task of this run has an item {item!r}")
    return [(t, item) for t in tasks]


@click.command()
@click.argument("run_dir", metavar="RUN", type=click.Path())
@click.argument("item", required=False)
@click.option("--task", default=None, help="Only this task's flips (or the task of ITEM).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True,
              help="Baseline run or baseline folder(s) (default: the stored W4A8 baseline of RUN's model and profiles).")
@baselines_root_option()
@click.option("--model", default=None, type=click.Path(),
              help="Checkpoint to replay (default: the run's own; needed for a run through a server).")
@click.option("--device", default="cpu", show_default=True, callback=checked_device,
              help="Where to replay: cpu, cuda, cuda:1...")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every explanation to this JSON file.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the HTML report of RUN against its baseline with each flip tagged (a run of every item).")
def explain(run_dir, item, task, baselines, baselines_root, model, device, json_path, report_path):
    """Explain every flip of RUN against its baseline (or ITEM, flipped or not): the first token where the two
    generations differ, each kernel's top-2 tokens and margin there, the KL along the shared prefix,
    near-tie or divergence, and the MoE layer and expert that differ most (docs/explain.md). RUN: a run
    folder or a gate's output folder. Exit 0 when explained."""
    from evalgate.explain import summary_line

    cmp = _comparison(run_dir, baselines, baselines_root)
    if task is not None and task not in cmp.pairs:
        raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(cmp.pairs)}")
    wanted = _items(cmp, item, task)
    if not wanted:
        click.echo(f"no flips between {cmp.baseline.kernel} and {cmp.candidate.kernel}: nothing to explain")
        return
    explainer = cmp.explainer(model, device)
    load_s = explainer.load(sorted({name for name, _ in wanted}))
    t0 = time.perf_counter()
    found = []
    for name, doc_id in wanted:
        x = explainer.explain(name, doc_id)
        found.append(x)
        click.echo(x.line())
        if item is not None:
            _details(x)
    total = time.perf_counter() - t0
    if item is None:
        click.echo(summary_line(found))
    click.echo(f"{len(found)} item(s) explained in {total:.1f} s ({total / len(found):.2f} s per item; both "
               f"kernels' models and the prompts loaded in {load_s:.1f} s)")
    if json_path:
        Path(json_path).write_text(json.dumps([x.to_dict() for x in found], indent=1, default=str) + "\n",
                                   encoding="utf-8")
    if report_path:
        _write_report(cmp, found, baselines, baselines_root, Path(report_path))
        click.echo(f"report with each flip tagged: {report_path}")


def _write_report(cmp, found, baselines: tuple, baselines_root, out: Path) -> None:
    """``evalgate report``'s page for this run, decided as ``evalgate report`` decides (the stored baseline
    the gate would use), each explained flip tagged."""
    from evalgate.explain import summary_line
    from evalgate.gate.decide import gate_runs
    from evalgate.plan import GateRequest, plan_gate
    from evalgate.report.html import report_html

    from evalgate.run.store import load_run

    run = load_run(cmp.candidate.path)  # as stored (a comparison on the candidate's items renames its profiles)
    plan = plan_gate(GateRequest(candidate=run, baselines=baselines, baselines_root=baselines_root))
    verdict = gate_runs(plan.baseline, run, plan.policy, False)
    tags = {(x.task, str(x.doc_id)): {"kind": x.kind, "line": x.line()} for x in found}
    text = report_html(verdict, tags, summary_line([x for x in found if x.direction]))
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)


def _details(x) -> None:
    """One item's tables: the text before the divergence, both kernels' top-2 tokens, the MoE layers."""
    if x.base is not None:
        click.echo(f"  after …{x.shared_text!r}")
        click.echo(x.top.to_string(index=False))
    if x.layers:
        click.echo(x.frame.to_string(index=False))
    for note in x.notes:
        click.echo(f"  note: {note}")
