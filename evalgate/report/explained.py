"""Why each of a gate's flips flipped, as the gate's outputs carry it (``evalgate gate --explain``).

A ``FlipExplanations`` holds every flip's explanation (``evalgate.explain.explain_flips`` replays them); the
terminal, report.md, report.html and gate.json all render that one object, and gate.json stores it whole, so
reports rewritten from the stored run show it again without a replay (``stored_explanations``). Timings are
printed, never stored: the stored explanations are the same bit for bit on every replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GATE_JSON_KEY = "explanations"


@dataclass(frozen=True)
class FlipExplanations:
    """Every flip of one comparison explained, in the gate's flip order (task by task, lost first)."""

    items: tuple[dict, ...]  # each ``Explanation.to_dict()`` with its one-line text as "line"
    summary: str  # "11 of 13 flips are near-ties: ...", or why none could be explained
    threshold: float  # the near-tie threshold, nats
    baseline_run: str | None  # the run ids explained: stored explanations are reused for these two runs only
    candidate_run: str | None
    replay_seconds: float | None = None  # printed only (None: read back from gate.json)
    load_seconds: float | None = None
    replayed: int = 0  # how many were replayed here (a server's or an identical text's are not)

    def tags(self) -> dict[tuple[str, str], dict]:
        """(task, doc_id as text) -> what a report shows of that flip: kind, margin, position, layer, expert
        and the explanation's line."""
        keys = ("kind", "margin", "position", "layer", "expert", "line")
        return {(x["task"], str(x["doc_id"])): {k: x.get(k) for k in keys} for x in self.items}

    def to_dict(self) -> dict:
        return {"summary": self.summary, "threshold": self.threshold, "baseline_run": self.baseline_run,
                "candidate_run": self.candidate_run, "items": list(self.items)}

    @classmethod
    def from_dict(cls, data: dict) -> "FlipExplanations":
        return cls(tuple(data["items"]), data["summary"], data["threshold"], data.get("baseline_run"),
                   data.get("candidate_run"))

    def timing(self) -> str | None:
        """"5 flip(s) replayed in 2.1 s (0.41 s each; ...)", when they were replayed here."""
        if self.replay_seconds is None or not self.replayed:
            return None
        return (f"{self.replayed} flip(s) replayed in {self.replay_seconds:.1f} s "
                f"({self.replay_seconds / self.replayed:.2f} s each; both kernels' models and the prompts loaded in "
                f"{self.load_seconds or 0.0:.1f} s)")


def run_ids(comparison) -> tuple[str | None, str | None]:
    return comparison.baseline.meta.run_id, comparison.candidate.meta.run_id


def flip_ids(comparison) -> list[tuple[str, object]]:
    """(task, doc_id) of every flip, in gate.json's order."""
    return [(task, doc_id) for task in comparison.tasks for doc_id in comparison.flips(task)["doc_id"]]


def stored_explanations(report_dir: Path, verdict) -> FlipExplanations | None:
    """The explanations a gate.json in ``report_dir`` holds for the verdict's two runs (the same run ids) and
    flips; None when there are none to reuse."""
    cmp = verdict.comparison
    path = Path(report_dir) / "gate.json"
    if cmp is None or not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8")).get(GATE_JSON_KEY)
        found = FlipExplanations.from_dict(stored) if stored else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable or not ours: nothing to reuse
        return None
    if found is None or (found.baseline_run, found.candidate_run) != run_ids(cmp):
        return None
    if {(t, str(d)) for t, d in flip_ids(cmp)} != set(found.tags()):
        return None  # decided on other flips (another policy's metric): these would not match
    return found


def hint(verdict, report_dir: Path) -> str | None:
    """The verdict's line on how to learn why its flips flipped, when they were not explained."""
    cmp = verdict.comparison
    n = len(flip_ids(cmp)) if cmp is not None else 0
    if not n:
        return None
    return (f"why they flipped: `evalgate explain {report_dir}` replays the {n} flip(s) (or gate with --explain; "
            "docs/explain.md)")


def verdict_line(verdict, explained: FlipExplanations | None, report_dir: Path) -> str | None:
    """What the printed verdict says of its flips' explanations: the summary line (with the replay's time when
    it ran here), or how to get it."""
    if explained is None:
        return hint(verdict, report_dir)
    timing = explained.timing()
    return f"why they flipped: {explained.summary}" + (f" — {timing}" if timing else "")
