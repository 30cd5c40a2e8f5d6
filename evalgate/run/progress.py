"""Progress for long work: a rich bar on a terminal, a plain line now and then otherwise (CI logs)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.rich = self.stream.isatty() if enabled is None else enabled
        self._bar = None

    def __enter__(self):
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def task(self, description: str, total: int, done: int = 0) -> "TaskProgress":
        return TaskProgress(self, description, total, done)


class TaskProgress:
    def __init__(self, parent: Progress, description: str, total: int, done: int):
        self.parent, self.description, self.total, self.done = parent, description, total, done
        self._last_line = 0.0
        self._started, self._first = time.monotonic(), done  # items already stored (a resume) are not timed
        self._id = parent._bar.add_task(description, total=total, completed=done) if parent._bar else None
        if parent._bar is None:
            self._line(force=True)

    def advance(self, n: int) -> None:
        self.done += n
        if self._id is not None:
            self.parent._bar.update(self._id, completed=self.done)
        else:
            self._line(force=self.done >= self.total)

    def _line(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_line > 10:
            self._last_line = now
            print(f"{self.description}: {self.done}/{self.total}{self._times(now)}", file=self.parent.stream,
                  flush=True)

    def _times(self, now: float) -> str:
        """", 0:42 elapsed, about 1:10 left" (the rate of the items done so far; none before the first)."""
        elapsed = now - self._started
        if elapsed < 1:
            return ""
        text = f", {_clock(elapsed)} elapsed"
        done = self.done - self._first
        if 0 < done and self.done < self.total:
            text += f", about {_clock(elapsed / done * (self.total - self.done))} left"
        return text


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
