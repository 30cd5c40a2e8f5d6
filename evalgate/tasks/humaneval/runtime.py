"""The Python a run's HumanEval programs ran under: recorded in the run, not hashed into the profile id.

A run records it twice over: the executor self-test's ``python`` (``manifest["tasks"]["humaneval"]
["prepare"]["python"]``, e.g. ``"3.11.7"``), and, in runs recorded before the version left the profile id,
``settings.sandbox.python`` (``"3.11"``). Two runs under different Python minors are still compared (the
programs and tests are the same; a few behaviours of the standard library differ between minors), with
one line saying so in the verdict's report and in a notebook comparison.
"""

from __future__ import annotations


def recorded_python(task_summary: dict | None) -> str | None:
    """The Python version the task's sandbox ran under, as recorded; None when the task ran no sandbox."""
    if not isinstance(task_summary, dict):
        return None
    prepare = task_summary.get("prepare") or {}
    sandbox = (task_summary.get("settings") or {}).get("sandbox") or {}
    found = prepare.get("python") or sandbox.get("python")
    return str(found) if found else None


def minor(version: str | None) -> str | None:
    """"3.11.7" -> "3.11"."""
    return ".".join(str(version).split(".")[:2]) if version else None


def python_warning(task: str, base_summary: dict | None, cand_summary: dict | None) -> str | None:
    """One line when baseline and candidate ran the task's programs under different Python minors."""
    b, c = recorded_python(base_summary), recorded_python(cand_summary)
    if b is None or c is None or minor(b) == minor(c):
        return None
    return (f"{task}: the baseline's programs ran under Python {minor(b)}, the candidate's under {minor(c)}; "
            "compared anyway (a program's result can depend on the Python version), re-record the baseline "
            f"under Python {minor(c)} to rule that out")
