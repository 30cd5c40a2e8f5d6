"""`evalgate report`: decide from two stored runs, like `evalgate gate --candidate`, and write report.html."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evalgate.cli import preflight
from evalgate.cli.options import decision_options
from evalgate.errors import UserError


@click.command()
@click.option("--baseline", "baselines", type=click.Path(), multiple=True, required=True,
              help="Baseline run or baseline folder(s).")
@click.option("--candidate", type=click.Path(), required=True, help="Candidate run folder.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default="report.html", show_default=True,
              help="Where to write the self-contained HTML report.")
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file (default: $EVALGATE_THRESHOLDS, else the canary's own for canary runs, else ./thresholds.yaml, else the packaged one).")
@click.option("--allow-uncalibrated", is_flag=True, help="Decide even if the baseline has no A/A calibration (recorded).")
@decision_options
def report(baselines, candidate, html_path, thresholds_path, allow_uncalibrated, items, across_serving):
    """Per-item HTML report of a candidate run against a baseline, and its verdict (exit 0 PASS, 1 FAIL,
    3 INCONCLUSIVE)."""
    from evalgate.gate.door import decide_pair
    from evalgate.gate.policy import policy_for_run
    from evalgate.report.html import report_html
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run

    out = Path(html_path)
    if out.exists() and out.is_dir():
        raise UserError(f"--html {html_path!r} is a folder; give a file name such as report.html")
    if not out.parent.exists():
        raise UserError(f"--html {html_path!r}: folder {str(out.parent)!r} does not exist; create it or choose another path")
    preflight.writable_folder(out.parent, "--html's folder")
    preflight.stored_run(candidate)
    run = load_run(candidate)  # read once: for its profiles (a canary run has its own policy) and the decision
    baselines = _baseline_folders(baselines, run)
    # the one door: the same policy resolution, decision and look as `gate --candidate` (docs/gate.md#reruns)
    verdict = decide_pair(load_baseline([Path(b) for b in baselines]), run, policy_for_run(thresholds_path, run),
                          allow_uncalibrated, items, across_serving)
    from evalgate.report.explained import stored_explanations

    # flips a `gate --explain` of this very pair explained are tagged again (nothing replayed)
    text = report_html(verdict, stored_explanations(Path(candidate) / "gate", verdict))  # rendered before the file is touched
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    look = (verdict.sequence or {}).get("looks", [{}])[0]
    at = f", look {look['look'] + 1} at α = {look['alpha']:.4g}" if "look" in look else ""
    click.echo(f"verdict: {verdict.verdict}  (report in {out}{at})")
    sys.exit(verdict.exit_code)


def _baseline_folders(values: tuple[str, ...], run) -> tuple[str, ...]:
    """--baseline as the gate takes it (a baselines root, a model or profile folder under one, a gate's folder,
    baseline or run folders): the W4A8 baseline folders of ``run``'s model and profiles."""
    from evalgate.cli.baseline_paths import resolve_baselines

    folders, root = resolve_baselines(values, "w4a8")
    if root is None:
        return folders
    from evalgate.api import find_baselines

    return tuple(str(p) for p in find_baselines(root, run))
