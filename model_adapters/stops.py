"""Where a generation ends: the earliest of its stop strings (shared by the in-process decoder and the
server client, which cuts what an engine returned past a stop)."""

from __future__ import annotations


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """``text`` cut before the earliest stop string, and which stop string that was."""
    best, hit = len(text), None
    for s in stops:
        i = text.find(s)
        if i != -1 and i < best:
            best, hit = i, s
    return text[:best], hit
