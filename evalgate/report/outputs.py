"""Write a verdict's files: gate.json, report.md (also appended to $GITHUB_STEP_SUMMARY), junit.xml, report.html."""

from __future__ import annotations

from pathlib import Path

from evalgate.records import verdict_json
from evalgate.report.explained import GATE_JSON_KEY
from evalgate.report.html import report_html
from evalgate.report.text import append_step_summary, junit_xml, markdown


def write_outputs(verdict, out_dir: str | Path, explained=None) -> dict[str, Path]:
    """``explained``: the flips' ``FlipExplanations`` (``evalgate gate --explain``), stored in gate.json and
    shown in report.md and report.html; None: none."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "gate.json", "markdown": out / "report.md", "junit": out / "junit.xml",
             "html": out / "report.html"}
    data = verdict.to_dict()
    if explained is not None:
        data[GATE_JSON_KEY] = explained.to_dict()
    paths["json"].write_text(verdict_json(data), encoding="utf-8")  # typed, with schema_version
    text = markdown(verdict, explained)
    paths["markdown"].write_text(text, encoding="utf-8")
    paths["junit"].write_text(junit_xml(verdict), encoding="utf-8")
    paths["html"].write_text(report_html(verdict, explained), encoding="utf-8")
    append_step_summary(text)
    return paths
