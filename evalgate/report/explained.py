"""Why each of a gate's flips flipped, as the gate's outputs carry it (``evalgate gate --explain``).

``explain_flips(verdict)`` replays every flip of the verdict's comparison once (``evalgate.explain``) into a
``FlipExplanations``; the terminal, report.md, report.html and gate.json all render that one object, and
gate.json stores it whole, so a report rewritten from the stored run shows it again without a replay
(``stored_explanations``). Timings are printed, never stored: the stored explanations are the same bit for
bit on every replay.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from evalgate.explain import NEAR_TIE_NATS, Explainer, Explanation, summary_line

GATE_JSON_KEY = "explanations"


@dataclass(frozen=True)
class FlipExplanations:
    """Every flip of one comparison explained, in the gate's flip order (task by task, lost first)."""

    explanations: tuple[Explanation, ...]
    summary: str  # summary_line's "11 of 13 flips are near-ties: ...", or why none could be explained
    baseline_run: str | None  # the run ids explained: stored explanations are reused for these two runs only
    candidate_run: str | None
    threshold: float = NEAR_TIE_NATS
    replay_seconds: float | None = None  # printed only (None: read back from gate.json)
    load_seconds: float | None = None

    def tags(self) -> dict[tuple[str, str], dict]:
        """(task, doc_id as text) -> what a report shows of that flip: kind, margin, position, layer, expert
        and the explanation's line."""
        return {(x.task, str(x.doc_id)): {"kind": x.kind, "margin": x.margin, "position": x.position,
                                          "layer": x.layer, "expert": x.expert, "line": x.line()}
                for x in self.explanations}

    def to_dict(self) -> dict:
        return {"summary": self.summary, "threshold": self.threshold, "baseline_run": self.baseline_run,
                "candidate_run": self.candidate_run, "items": [x.to_dict() for x in self.explanations]}

    @classmethod
    def from_dict(cls, data: dict) -> "FlipExplanations":
        return cls(tuple(Explanation.from_dict(x) for x in data.get("items", ())), data["summary"],
                   data.get("baseline_run"), data.get("candidate_run"), data.get("threshold", NEAR_TIE_NATS))

    def timing(self) -> str | None:
        """"5 flips replayed in 2.1 s (0.41 s each; both kernels' models loaded in 6.0 s)", when replayed here."""
        n = sum(x.reproduced is not None for x in self.explanations)  # replayed (not: same text, a server's)
        if self.replay_seconds is None or not n:
            return None
        return (f"{n} flip(s) replayed in {self.replay_seconds:.1f} s ({self.replay_seconds / n:.2f} s each; both "
                f"kernels' models and the prompts loaded in {self.load_seconds or 0.0:.1f} s)")


def _run_ids(comparison) -> tuple[str | None, str | None]:
    return comparison.baseline.manifest.get("run_id"), comparison.candidate.manifest.get("run_id")


def _device(run) -> str:
    """Where the run computed, when this machine has it (a replay reproduces the run there); else the CPU."""
    device = str((run.manifest.get("model") or {}).get("device") or "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "cpu"
    return device


def flip_ids(comparison) -> list[tuple[str, object]]:
    """(task, doc_id) of every flip, in gate.json's order."""
    return [(task, doc_id) for task in comparison.tasks for doc_id in comparison.flips(task)["doc_id"]]


def explain_flips(verdict, device: str | None = None) -> FlipExplanations | None:
    """Replay every flip of the verdict's comparison (None for an aggregate-only verdict: no items). A run
    through a server is not replayed (no in-process model): the summary line says so. Anything that stops
    the replay is said in the summary line instead of failing the gate, whose verdict stands without it."""
    cmp = verdict.comparison
    if cmp is None:
        return None
    base_run, cand_run = _run_ids(cmp)
    wanted = flip_ids(cmp)
    if not wanted:
        return FlipExplanations((), "no flips: nothing to explain", base_run, cand_run)
    explainer = Explainer(cmp, device=device or _device(cmp.candidate))
    try:
        load_s = explainer.load(sorted({task for task, _ in wanted}))
        t0 = time.perf_counter()
        found = tuple(explainer.explain(task, doc_id) for task, doc_id in wanted)
        spent = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - the verdict is decided; an explanation must not lose it
        from evalgate.errors import UserError

        why = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        return FlipExplanations((), f"{len(wanted)} flip(s) not explained: {why}", base_run, cand_run)
    return FlipExplanations(found, summary_line(list(found)), base_run, cand_run, replay_seconds=spent,
                            load_seconds=load_s)


def stored_explanations(report_dir: Path, verdict) -> FlipExplanations | None:
    """The explanations a gate.json in ``report_dir`` holds for the verdict's two runs (the same run ids), for
    the flips the verdict has; None when there are none to reuse."""
    cmp = verdict.comparison
    path = Path(report_dir) / "gate.json"
    if cmp is None or not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8")).get(GATE_JSON_KEY)
        found = FlipExplanations.from_dict(stored) if stored else None
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable or older file: nothing to reuse
        return None
    if found is None or (found.baseline_run, found.candidate_run) != _run_ids(cmp):
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
