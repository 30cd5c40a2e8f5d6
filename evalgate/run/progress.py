"""Progress for long work: a rich bar on a terminal, a plain line now and then otherwise (CI logs).

The time left is estimated from work, not from item counts: each item weighs what its answer is expected to
cost (the stored baseline's answer length, in tokens, where the gate has one; else its token limit; an item
without either weighs the mean of its task's). Continuous batching finishes short answers first, so a
count-based estimate would promise the end far too early; weighted, the first finished items already give a
fair estimate. Tasks decoded in one stream share their time, so the estimate is the run's: all of its
tasks' work done so far against all of their work left.

Until the estimate can be trusted within a factor of two it says "estimating…". The items decoding right now
(a batch, a server's concurrent requests: ``in_flight``) have done part of their work, which no count sees;
so the share of the work done is under-read by at most their share. Once the finished work is at least the
work in flight, the true share lies between the counted one and twice it, and the time the run takes
between the estimate and half of it. Without ``in_flight`` a tenth of the work must be done.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.rich = self.stream.isatty() if enabled is None else enabled
        self._bar = None
        self._tasks: list[TaskProgress] = []
        self._started: float | None = None
        self.in_flight: int | None = None  # items decoded at once (see the module's docstring)

    def __enter__(self):
        if self.rich:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.fields[items]}"), TimeElapsedColumn(),
                                     TextColumn("{task.fields[left]}"), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def task(self, description: str, total: int, done: int = 0, weights: dict | None = None,
             done_ids=()) -> "TaskProgress":
        """A task of ``total`` items, ``done`` of them already stored (``done_ids``: which). ``weights``:
        doc id -> expected cost (tokens) for the time-left estimate."""
        if self._started is None:
            self._started = time.monotonic()
        task = TaskProgress(self, description, total, done, weights or {}, done_ids)
        self._tasks.append(task)
        return task

    def seconds_left(self, now: float | None = None) -> float | None:
        """The run's estimate: the time since its first task over the work its tasks finished since, times
        the work they have left (None before any, or once all is done)."""
        done = sum(t.work_done - t.first_work for t in self._tasks)
        left = sum(t.work_total - t.work_done for t in self._tasks)
        if done <= 0 or left <= 0 or self._started is None:
            return None
        return ((time.monotonic() if now is None else now) - self._started) / done * left

    def settled(self) -> bool:
        """Whether the estimate is within a factor of two: the work finished in this run is at least the work
        in flight (a tenth of the run's work when that is unknown)."""
        done = sum(t.work_done - t.first_work for t in self._tasks)
        left = sum(t.work_total - t.work_done for t in self._tasks)
        items_left = sum(t.total - t.done for t in self._tasks)
        if done <= 0 or left <= 0:
            return False
        if self.in_flight is None:
            return done >= 0.1 * (done + left)
        flying = left * min(1.0, self.in_flight / max(items_left, 1))  # the work of the items decoding now
        return done >= flying

    def left_text(self, now: float | None = None) -> str:
        """"about 1:10 left", "estimating…" while the estimate is not yet within a factor of two, or "" when
        nothing is left."""
        left = self.seconds_left(now)
        if left is None and sum(t.total - t.done for t in self._tasks) <= 0:
            return ""
        if left is None or not self.settled():
            return "estimating…"
        return f"about {_clock(left)} left"

    def _refresh(self) -> None:
        """Every task's bar shows the run's estimate."""
        text = self.left_text()
        for t in self._tasks:
            if t.bar_id is not None:
                self._bar.update(t.bar_id, left=text)


class TaskProgress:
    def __init__(self, parent: Progress, description: str, total: int, done: int, weights: dict, done_ids=()):
        self.parent, self.description, self.total, self.done = parent, description, total, done
        known = [w for w in weights.values() if w and w > 0]
        self._weights, self._default = weights, (sum(known) / len(known) if known else 1.0)
        self.work_total = self._default * total + sum(self._weight(i) - self._default for i in weights)
        self.work_done = float(sum(self._weight(i) for i in done_ids)) if done_ids else self._default * done
        self._last_line = 0.0
        self._started, self.first_work = time.monotonic(), self.work_done  # a resume's items are not timed
        self.bar_id = (parent._bar.add_task(description, total=self.work_total, completed=self.work_done,
                                            items=self._items(), left="") if parent._bar else None)
        if parent._bar is None:
            self._line(force=True)

    def _weight(self, doc_id) -> float:
        w = self._weights.get(doc_id)
        return float(w) if w and w > 0 else self._default

    def _items(self) -> str:
        return f"{self.done}/{self.total}"

    def advance(self, n: int, doc_ids=()) -> None:
        """``n`` more items done (``doc_ids``: which, for their weights)."""
        self.done += n
        self.work_done += sum(self._weight(i) for i in doc_ids) if doc_ids else self._default * n
        if self.done >= self.total:
            self.work_done = self.work_total
        if self.bar_id is not None:
            self.parent._bar.update(self.bar_id, completed=self.work_done, items=self._items())
            self.parent._refresh()
        else:
            self._line(force=self.done >= self.total)

    def _line(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_line > 10:
            self._last_line = now
            print(f"{self.description}: {self._items()}{self._times(now)}", file=self.parent.stream, flush=True)

    def _times(self, now: float) -> str:
        """", 0:42 elapsed, about 1:10 left" (the run's estimate, "estimating…" until it can be trusted; none
        once this task is done)."""
        elapsed = now - self._started
        if elapsed < 1:
            return ""
        text = f", {_clock(elapsed)} elapsed"
        left = self.parent.left_text(now) if self.done < self.total else ""
        return text + (f", {left}" if left else "")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
