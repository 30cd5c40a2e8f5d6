"""Who watches a run as it goes: the runner tells its observer what it scored, so that nothing in the
process reads back what the runner has just written (the gate's early stop, the gate's decision)."""

from __future__ import annotations

from typing import Protocol

from evalgate.run.store import Run


class RunObserver(Protocol):
    """What ``evalgate.run.runner.execute`` calls, in this order: ``started`` once, then ``scored`` after
    each batch of records is stored (on the scoring thread) with ``should_stop`` asked after it, and
    ``finished`` once the run's manifest is final. Every method is required."""

    def started(self, run: Run) -> None:
        """The run as it starts: its manifest as written and, per task, the records a resumed run holds."""

    def scored(self, task: str, records: list[dict]) -> None:
        """Records just stored for ``task``, exactly as a reader of the file gets them."""

    def should_stop(self) -> dict | None:
        """The early-stop record (why, when, items per task) once the run need not go on; None: go on."""

    def finished(self, run: Run) -> None:
        """The whole run as stored (manifest and records in item order), without reading it back."""


class Collected:
    """An observer that keeps the finished run: what the gate decides on when it does not stop early."""

    def __init__(self):
        self.run: Run | None = None

    def started(self, run: Run) -> None:
        pass

    def scored(self, task: str, records: list[dict]) -> None:
        pass

    def should_stop(self) -> dict | None:
        return None

    def finished(self, run: Run) -> None:
        self.run = run
