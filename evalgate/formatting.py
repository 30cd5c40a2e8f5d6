"""Number formatting shared by the verdict's reasons and every report (one copy)."""

from __future__ import annotations


def pp(x: float, unit: bool = True) -> str:
    """A fraction as signed percentage points: 0.0123 -> "+1.23 pp" (or "+1.23" without the unit)."""
    text = f"{100 * x:+.2f}"
    return f"{text} pp" if unit else text
