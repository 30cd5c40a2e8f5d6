"""Verdict outputs as text: a rich table for the terminal, report.md (also the CI step summary), junit.xml."""

from __future__ import annotations

import os
from xml.sax.saxutils import escape, quoteattr

from evalgate.formatting import pp as _pp_unit
from evalgate.report.rows import (alpha_text, bound_cells, conformance_line, earlier_look_lines, early_stop_lines,
                                  first_look_suffix, label, not_run, task_rows, verdict_reason)

MAX_FLIPS_MD = 50


def pp(x: float) -> str:
    return _pp_unit(x, unit=False)


STYLES = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}
ICONS = {"PASS": "✅", "FAIL": "❌", "INCONCLUSIVE": "⚠️"}


def psi_text(r: dict) -> str:
    """ψ of this comparison / the A/A ψ0 with its one-sided upper bound and the A/A items it rests on."""
    text = f"{100 * r['psi']:.2f}% / "  # the precision of the A/A warning, so both show the same numbers
    if r.get("psi0") is None:
        return text + "—"
    text += f"{100 * r['psi0']:.2f}%"
    if r.get("psi0_upper") is not None:
        items = r['aa_n'] if r.get('aa_n') is not None else r['n']
        bound = (f"above its bound {100 * r['psi0_upper']:.2f}%" if r["psi"] > r["psi0_upper"]
                 else f"≤ {100 * r['psi0_upper']:.2f}%")
        text += f" ({bound}, {items} A/A items)"
    return text


def mde_text(r: dict) -> str:
    """The minimum detectable effect at 80% power, with k, and the samples per item the margin needs."""
    if r.get("mde") is None:
        return "—"
    text = f"{100 * r['mde']:.2f} pp (k = {r['k']})"
    if not r["resolves_margin"]:
        text += f", k ≥ {r['samples_needed']}" if r["samples_needed"] is not None else ", no k ≤ 64"
    return text


def margin_cell(r: dict) -> str:
    return f"{100 * r['margin']:.2f} pp"


# Piped into a file or a CI log there is no terminal width to fit: the table is drawn as wide as its
# contents (no cell wraps), up to this many columns, and reasons follow as plain lines that never wrap.
LOG_WIDTH = 200


def console(stream=None):
    """A Rich console for verdict tables: the terminal's width on a terminal; otherwise a fixed, wide one
    with soft wrapping (a log line is never broken inside a table cell or a sentence)."""
    import sys

    from rich.console import Console

    stream = stream or sys.stdout
    tty = stream.isatty()
    return Console(file=stream, soft_wrap=not tty, width=None if tty else LOG_WIDTH, highlight=False)


def console_table(verdict, log: bool = False):
    """The per-task table (numbers and verdicts; the reasons are ``verdict_lines``). ``log``: for a file or
    CI log — a light box, no cell wrapping."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"evalgate verdict: {verdict.verdict}", title_style=f"bold {STYLES.get(verdict.verdict, 'red')}",
                  title_justify="left", box=box.SIMPLE_HEAD if log else box.HEAVY_HEAD, show_edge=not log)
    for col in ("task", "n", "baseline", "candidate", "Δ pp [95% CI]", "b / c", "p", "ψ / ψ0", "margin",
                "MDE (80%)", "verdict"):
        table.add_column(col, no_wrap=log, overflow="ignore" if log else "fold")
    for r in task_rows(verdict):
        ci = f"{pp(r['delta'])} [{pp(r['ci'][0])}, {pp(r['ci'][1])}]"
        style = STYLES.get(r["verdict"], "red")
        if r["paired"] and not_run(r):  # none of its items ran: no number to show but the margin
            cells = bound_cells(r)
            table.add_row(r["task"], cells["n"], cells["baseline"], "—", "—", "—", "—", "—", margin_cell(r), "—",
                          f"[yellow]{label(r)}[/]")
        elif r["paired"]:
            cells = bound_cells(r)
            table.add_row(r["task"], cells["n"], cells["baseline"], cells["candidate"], cells["le"] + ci,
                          cells["b_c"], f"{r['p']:.3g}", psi_text(r), margin_cell(r), mde_text(r),
                          f"[{style}]{label(r)}[/]")
        else:
            table.add_row(r["task"], "—", "aggregate", "", ci, "unpaired", f"{r['p']:.3g}", "—",
                          margin_cell(r), "—", f"[{style}]{r['verdict']}[/]")
    return table


def task_blocks(verdict):
    """The per-task table turned on its side (field, value; one block per task), for narrow terminals."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"evalgate verdict: {verdict.verdict}", title_style=f"bold {STYLES.get(verdict.verdict, 'red')}",
                  title_justify="left", box=box.SIMPLE, show_header=False)
    table.add_column("field", style="dim", no_wrap=True)
    table.add_column("value")
    for i, r in enumerate(task_rows(verdict)):
        if i:
            table.add_section()
        style = STYLES.get(r["verdict"], "red")
        table.add_row("task", f"[bold]{r['task']}[/] [{style}]{label(r)}[/]")
        table.add_row("Δ pp [95% CI]", f"{pp(r['delta'])} [{pp(r['ci'][0])}, {pp(r['ci'][1])}]")
        if r["paired"]:
            cells = bound_cells(r)
            table.add_row("baseline → candidate", f"{cells['baseline']} → {cells['candidate']} (n = {cells['n']})")
            table.add_row("b / c, p", f"{cells['b_c']}, p = {r['p']:.3g}")
            table.add_row("ψ / ψ0", psi_text(r))
            table.add_row("MDE (80%)", mde_text(r))
        table.add_row("margin", margin_cell(r))
    return table


def verdict_lines(verdict) -> list[str]:
    """Under the table: the kernel's conformance, every task's reasons and warnings, then the notes, one plain
    line each."""
    reason = verdict_reason(verdict)  # printed first, above the table
    lines = early_stop_lines(verdict) + [line for line in [conformance_line(verdict)]
                                         if line and not (reason or "").endswith(line)] + earlier_look_lines(verdict)
    for r in task_rows(verdict):
        lines += [f"{r['task']} {label(r, long=True)}: {reason}" for reason in r["reasons"]]
        lines += [f"{r['task']} warning: {w}" for w in r["warnings"]]
    return lines + [f"note: {n}" for n in verdict.notes]


def print_verdict(verdict, stream=None) -> None:
    """The verdict on stdout: what decides it, the numbers, then its reasons, warnings and notes as plain
    lines. One layout per destination: on a terminal one block per task (fits any width; lines wrap only
    between words, so no value is split); in a pipe or file the wide table, nothing wrapped."""
    from rich.markup import escape as markup_escape

    out = console(stream)
    reason = verdict_reason(verdict)
    if reason:  # what decides the verdict, before any number
        out.print(markup_escape(reason), style=f"bold {STYLES.get(verdict.verdict, 'red')}",
                  soft_wrap=not out.is_terminal)
    if out.is_terminal:
        out.print(task_blocks(verdict))
    else:  # drawn as wide as it is, without the blank edge rows and trailing blanks a box pads with
        with out.capture() as captured:
            out.print(console_table(verdict, log=True))
        out.file.write("\n".join(line.rstrip() for line in captured.get().splitlines() if line.strip()) + "\n")
    for line in verdict_lines(verdict):
        out.print(markup_escape(line), soft_wrap=not out.is_terminal)


def why_cell(tag: dict | None) -> str:
    """A flip's explanation in a table cell: "near-tie at token 5, margin 0.12 nats, layer 3 expert 7"."""
    if tag is None:
        return ""
    text = tag["kind"]
    if tag.get("position") is not None:
        text += f" at token {tag['position']}"
    if tag.get("margin") is not None:
        text += f", margin {tag['margin']:.3f} nats"
    if tag.get("layer") is not None:
        text += f", layer {tag['layer']} expert {tag['expert']}"
    return text


def markdown(verdict, explained=None) -> str:
    """report.md; ``explained``: the flips' ``FlipExplanations`` (its summary line, and each flip's tag)."""
    icon = ICONS.get(verdict.verdict, "❌")
    lines = [f"# evalgate: {icon} {verdict.verdict}", ""]
    reason = verdict_reason(verdict)
    if reason:
        lines += [f"**{reason}**", ""]
    cmp = verdict.comparison
    if cmp is not None:
        b, c = cmp.baseline.meta, cmp.candidate.meta
        lines += [f"- candidate: `{c.kernel.id}` ({cmp.candidate.path})",
                  f"- baseline: `{b.kernel.id}` ({cmp.baseline.path})",
                  f"- model: `{c.model.fingerprint}` ({c.model.model_type})"]
    lines += [f"- policy: `{verdict.thresholds.path}` ({verdict.thresholds.source}, sha256 `{verdict.thresholds.sha256[:12]}`), "
              f"{alpha_text(verdict)}, {verdict.thresholds.multiple_comparisons}, gate CI {verdict.thresholds.ci_method}"]
    lines += [f"- note: {n}" for n in verdict.notes]
    if explained is not None:
        lines += [f"- why they flipped: {explained.summary}"]
    tags = explained.tags() if explained is not None else {}
    stopped = early_stop_lines(verdict)
    if stopped:
        lines += [f"- **{stopped[0]}**"] + [f"  - {line}" for line in stopped[1:]]
    conformance = conformance_line(verdict)
    if conformance and not (reason or "").endswith(conformance):
        lines += [f"- **{conformance}**"]
    lines += ["", "| task | n | baseline | candidate | Δ pp | 95% CI (Tango) | b / c | p (McNemar) | ψ / ψ0 | margin | "
                  "MDE (80% power) | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in task_rows(verdict):
        if r["paired"] and not_run(r):
            lines.append(f"| {r['task']} | 0/{r['n']} | {bound_cells(r)['baseline']} | — | — | — | — | — | — | "
                         f"{margin_cell(r)} | — | **{label(r)}** |")
        elif r["paired"]:
            cells = bound_cells(r)
            lines.append(f"| {r['task']} | {cells['n']} | {cells['baseline']} | {cells['candidate']} | "
                         f"{cells['le']}{pp(r['delta'])} | "
                         f"[{pp(r['ci'][0])}, {pp(r['ci'][1])}] | {cells['b_c']} | {r['p']:.3g} | "
                         f"{psi_text(r)} | {margin_cell(r)} | {mde_text(r)} | **{label(r)}** |")
        else:
            lines.append(f"| {r['task']} | — | aggregate | — | {pp(r['delta'])} | [{pp(r['ci'][0])}, {pp(r['ci'][1])}] | "
                         f"unpaired | {r['p']:.3g} | — | {margin_cell(r)} | — | **{r['verdict']}** |")
    lines.append("")
    lines += [f"- {line}" for line in earlier_look_lines(verdict)]
    for r in task_rows(verdict):
        for reason in r["reasons"]:
            lines.append(f"- **{r['task']}** {label(r, long=True)}: {reason}")
        for warning in r["warnings"]:
            lines.append(f"- **{r['task']}** warning: {warning}")
    if cmp is not None:
        for task in cmp.tasks:
            flips = cmp.flips(task)
            if flips.empty:
                continue
            ran = " of the items run" if verdict.early_stop else ""
            ran += first_look_suffix(verdict, task)
            why = " why |" if tags else ""
            lines += ["", f"## {task}: {len(flips)} flipped item(s){ran}, lost first", "",
                      "| doc_id | direction | baseline answer | candidate answer | finish (base → cand) | in A/A |" + why,
                      "|---|---|---|---|---|---|" + ("---|" if tags else "")]
            for row in flips.head(MAX_FLIPS_MD).itertuples():
                cell = f" {_cell(why_cell(tags.get((task, str(row.doc_id)))))} |" if tags else ""
                lines.append(f"| {row.doc_id} | {row.direction} | {_cell(row.base_extracted)} | {_cell(row.cand_extracted)} | "
                             f"{row.base_finish_reason} → {row.cand_finish_reason} | {'yes' if row.flips_in_aa else ''} |"
                             + cell)
            if len(flips) > MAX_FLIPS_MD:
                lines.append(f"\n… and {len(flips) - MAX_FLIPS_MD} more in gate.json / report.html")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")[:80]


def junit_xml(verdict) -> str:
    rows = task_rows(verdict)
    conformance = conformance_line(verdict)  # a test case of its own when the kernel was checked
    tests = len(rows) + (conformance is not None)
    failures = (sum(r["verdict"] != "PASS" and r.get("decided", True) for r in rows)
                + (conformance is not None and not verdict.conformance["ok"]))
    skipped = sum(not r.get("decided", True) for r in rows)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="evalgate" tests="{tests}" failures="{failures}">',
           f'  <testsuite name="evalgate.gate" tests="{tests}" failures="{failures}" errors="0"'
           + (f' skipped="{skipped}">' if skipped else ">")]
    stopped = early_stop_lines(verdict)  # the run stopped early: said on the suite and in every task's output
    if stopped:
        out += ["    <properties>", f"      <property name=\"early_stop\" value={quoteattr(stopped[0])}/>",
                "    </properties>"]
    observed = {line.split(":", 1)[0]: line for line in stopped[1:]}
    if conformance is not None:
        out.append('    <testcase classname="evalgate.gate" name="kernel-conformance">')
        if not verdict.conformance["ok"]:
            out.append(f'      <failure type="FAIL" message={quoteattr(conformance)}>{escape(conformance)}</failure>')
        out.append(f"      <system-out>{escape(conformance)}</system-out>")
        out.append("    </testcase>")
    for r in rows:
        out.append(f'    <testcase classname="evalgate.gate" name={quoteattr(r["task"])}>')
        if not r.get("decided", True):  # a stopped-early run's task whose FAIL was not needed: not decided
            message = f"{stopped[0]}; {r['task']} not decided: its best completion gives {r['verdict']}"
            out.append(f'      <skipped message={quoteattr(message)}/>')
        elif r["verdict"] != "PASS":  # INCONCLUSIVE is not a pass either: a failure of type INCONCLUSIVE
            message = "; ".join(([stopped[0]] if stopped else []) + r["reasons"])
            out.append(f'      <failure type={quoteattr(r["verdict"])} message={quoteattr(message)}>{escape(message)}</failure>')
        details = f"delta {pp(r['delta'])} pp, CI [{pp(r['ci'][0])}, {pp(r['ci'][1])}], p {r['p']:.4g}"
        if r.get("mde") is not None:
            details += f", MDE {100 * r['mde']:.2f} pp (80% power, k = {r['k']})"
        if r["task"] in observed:
            details += f"\n{observed[r['task']]}"
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
