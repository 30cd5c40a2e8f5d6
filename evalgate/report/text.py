"""Verdict outputs as text: a rich table for the terminal, report.md (also the CI step summary), junit.xml."""

from __future__ import annotations

import os
from xml.sax.saxutils import escape, quoteattr

from evalgate.formatting import pp as _pp_unit
from evalgate.report.rows import task_rows

MAX_FLIPS_MD = 50


def pp(x: float) -> str:
    return _pp_unit(x, unit=False)


def console_table(verdict):
    from rich.table import Table

    table = Table(title=f"evalgate verdict: {verdict.verdict}", title_style="bold green" if verdict.verdict == "PASS" else "bold red")
    for col in ("task", "baseline", "candidate", "Δ pp [95% CI]", "b / c", "p", "ψ / ψ0", "margin", "verdict", "reason"):
        table.add_column(col, overflow="fold")
    for r in task_rows(verdict):
        ci = f"{pp(r['delta'])} [{pp(r['ci'][0])}, {pp(r['ci'][1])}]"
        style = "green" if r["verdict"] == "PASS" else "red"
        if r["paired"]:
            psi = f"{100 * r['psi']:.1f}% / " + (f"{100 * r['psi0']:.1f}%" if r["psi0"] is not None else "—")
            table.add_row(r["task"], f"{r['baseline']:.4f}", f"{r['candidate']:.4f}", ci, f"{r['b']} / {r['c']}",
                          f"{r['p']:.3g}", psi, f"{100 * r['margin']:.2f} pp", f"[{style}]{r['verdict']}[/]",
                          "; ".join(r["reasons"]))
        else:
            table.add_row(r["task"], "aggregate", "", ci, "unpaired", f"{r['p']:.3g}", "—",
                          f"{100 * r['margin']:.2f} pp", f"[{style}]{r['verdict']}[/]", "; ".join(r["reasons"]))
    return table


def markdown(verdict) -> str:
    icon = "✅" if verdict.verdict == "PASS" else "❌"
    lines = [f"# evalgate: {icon} {verdict.verdict}", ""]
    cmp = verdict.comparison
    if cmp is not None:
        b, c = cmp.baseline.manifest, cmp.candidate.manifest
        lines += [f"- candidate: `{c['kernel'].get('id')}` ({cmp.candidate.path})",
                  f"- baseline: `{b['kernel'].get('id')}` ({cmp.baseline.path})",
                  f"- model: `{c['model'].get('fingerprint')}` ({c['model'].get('model_type')})"]
    lines += [f"- policy: `{verdict.thresholds.path}` (sha256 `{verdict.thresholds.sha256[:12]}`), "
              f"α = {verdict.thresholds.alpha}, {verdict.thresholds.multiple_comparisons}, gate CI {verdict.thresholds.ci_method}"]
    lines += [f"- note: {n}" for n in verdict.notes]
    lines += ["", "| task | n | baseline | candidate | Δ pp | 95% CI (Tango) | b / c | p (McNemar) | ψ / ψ0 | margin | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in task_rows(verdict):
        if r["paired"]:
            psi0 = f"{100 * r['psi0']:.1f}%" if r["psi0"] is not None else "—"
            lines.append(f"| {r['task']} | {r['n']} | {r['baseline']:.4f} | {r['candidate']:.4f} | {pp(r['delta'])} | "
                         f"[{pp(r['ci'][0])}, {pp(r['ci'][1])}] | {r['b']} / {r['c']} | {r['p']:.3g} | "
                         f"{100 * r['psi']:.1f}% / {psi0} | {100 * r['margin']:.2f} pp | **{r['verdict']}** |")
        else:
            lines.append(f"| {r['task']} | — | aggregate | — | {pp(r['delta'])} | [{pp(r['ci'][0])}, {pp(r['ci'][1])}] | "
                         f"unpaired | {r['p']:.3g} | — | {100 * r['margin']:.2f} pp | **{r['verdict']}** |")
    lines.append("")
    for r in task_rows(verdict):
        for reason in r["reasons"]:
            lines.append(f"- **{r['task']}** {r['verdict']}: {reason}")
        for warning in r["warnings"]:
            lines.append(f"- **{r['task']}** warning: {warning}")
    if cmp is not None:
        for task in cmp.tasks:
            flips = cmp.flips(task)
            if flips.empty:
                continue
            lines += ["", f"## {task}: {len(flips)} flipped item(s), lost first", "",
                      "| doc_id | direction | baseline answer | candidate answer | finish (base → cand) | in A/A |",
                      "|---|---|---|---|---|---|"]
            for row in flips.head(MAX_FLIPS_MD).itertuples():
                lines.append(f"| {row.doc_id} | {row.direction} | {_cell(row.base_extracted)} | {_cell(row.cand_extracted)} | "
                             f"{row.base_finish_reason} → {row.cand_finish_reason} | {'yes' if row.flips_in_aa else ''} |")
            if len(flips) > MAX_FLIPS_MD:
                lines.append(f"\n… and {len(flips) - MAX_FLIPS_MD} more in gate.json / report.html")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")[:80]


def junit_xml(verdict) -> str:
    rows = task_rows(verdict)
    failures = sum(r["verdict"] != "PASS" for r in rows)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="evalgate" tests="{len(rows)}" failures="{failures}">',
           f'  <testsuite name="evalgate.gate" tests="{len(rows)}" failures="{failures}" errors="0">']
    for r in rows:
        out.append(f'    <testcase classname="evalgate.gate" name={quoteattr(r["task"])}>')
        if r["verdict"] != "PASS":
            message = "; ".join(r["reasons"])
            out.append(f'      <failure message={quoteattr(message)}>{escape(message)}</failure>')
        details = f"delta {pp(r['delta'])} pp, CI [{pp(r['ci'][0])}, {pp(r['ci'][1])}], p {r['p']:.4g}"
        out.append(f"      <system-out>{escape(details)}</system-out>")
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"



def append_step_summary(markdown_text: str) -> None:
    """GitHub Actions shows $GITHUB_STEP_SUMMARY on the run page."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(markdown_text + "\n")
