"""The time-left estimate weighs each item by its expected answer length (the stored baseline's), so the
short answers continuous batching finishes first do not promise an early end."""

from __future__ import annotations

import io

from evalgate.run.progress import Progress


def _task(weights, total=None, done_ids=()):
    stream = io.StringIO()
    progress = Progress(enabled=False, stream=stream)
    task = progress.task("gsm8k [w4a4_packed]", total=total or len(weights), done=len(done_ids), weights=weights,
                         done_ids=done_ids)
    return task, stream


def test_the_estimate_weighs_items_by_their_expected_length():
    task, _ = _task({0: 10, 1: 10, 2: 80})
    run = task.parent
    assert run.seconds_left() is None  # nothing done yet: no rate
    task.advance(1, [0])
    start = run._started
    # 10 of 100 tokens' worth in 5 s: 45 s left (a count would say 10 s: 1 of 3 items in 5 s)
    assert abs(run.seconds_left(start + 5.0) - 45.0) < 1e-9
    task.advance(1, [2])
    assert abs(run.seconds_left(start + 9.0) - 9.0 / 90 * 10) < 1e-9


def test_items_without_a_length_weigh_the_mean_and_a_resume_is_not_timed():
    task, _ = _task({0: 30, 1: 10}, total=4, done_ids=[0])  # items 2 and 3: no stored length, weigh 20
    run = task.parent
    assert task.work_total == 30 + 10 + 20 + 20 and task.work_done == 30
    assert run.seconds_left(run._started + 3.0) is None  # the resumed item took no time of this run
    task.advance(1, [2])
    assert abs(run.seconds_left(run._started + 4.0) - 4.0 / 20 * 30) < 1e-9


def test_tasks_in_one_stream_share_one_estimate():
    # HumanEval decodes first (costliest first); GSM8K's first item arrives late but the run's rate is known
    progress = Progress(enabled=False, stream=io.StringIO())
    humaneval = progress.task("humaneval", total=2, weights={"H/0": 100, "H/1": 100})
    gsm8k = progress.task("gsm8k", total=2, weights={0: 50, 1: 50})
    humaneval.advance(2, ["H/0", "H/1"])
    gsm8k.advance(1, [0])
    assert abs(progress.seconds_left(progress._started + 25.0) - 25.0 / 250 * 50) < 1e-9


def test_without_lengths_every_item_weighs_one_and_the_plain_lines_say_the_estimate():
    task, stream = _task({}, total=4)
    task._started -= 8.0  # eight seconds in
    task.parent._started -= 8.0
    task.advance(1)
    task._line(force=True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "gsm8k [w4a4_packed]: 0/4"
    assert lines[-1].startswith("gsm8k [w4a4_packed]: 1/4, 0:08 elapsed, about 0:2")  # 24 s, give or take the clock
    task.advance(3)
    assert task.parent.seconds_left() is None and stream.getvalue().splitlines()[-1].startswith("gsm8k [w4a4_packed]: 4/4")


class _Recording(Progress):
    def __init__(self):
        super().__init__(enabled=False, stream=io.StringIO())
        self.tasks = []

    def task(self, description, total, done=0, weights=None, done_ids=()):
        bar = super().task(description, total, done, weights, done_ids)
        self.tasks.append(bar)
        return bar


def test_a_run_weighs_its_bar_by_the_lengths_it_was_handed(tmp_path, data_dir):
    from test_decoding_schedule import LengthAdapter

    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    spec = RunSpec(model="fake", kernel="w4a4_packed", tasks=["gsm8k"], limit=4, batch_size=2, data_dir=str(data_dir))
    lengths = {0: 5, 1: 50, 2: 500, 3: 5000}
    progress = _Recording()
    execute(spec, tmp_path / "run", adapter=LengthAdapter("w4a4_packed"), progress=progress,
            expected_tokens={"gsm8k": lengths})
    (bar,) = progress.tasks
    assert bar.work_total == sum(lengths.values()) and bar.work_done == bar.work_total and bar.done == 4


def test_the_time_left_says_estimating_until_the_finished_work_covers_the_work_in_flight():
    """With 4 items decoding at once, the first finished item says little (the other three are partly done):
    no figure until the finished work is at least the work in flight, then one within a factor of two."""
    task, stream = _task({}, total=8)
    run = task.parent
    run.in_flight = 4
    run._started -= 30.0
    task._started -= 30.0
    task.advance(1)
    task._line(force=True)
    assert stream.getvalue().splitlines()[-1].endswith(", 0:30 elapsed, estimating…")
    assert run.left_text() == "estimating…"
    task.advance(2)  # 3 done, 5 left, 4 of them in flight: 3 < 4 items' work
    assert run.left_text() == "estimating…"
    task.advance(1)  # 4 done, 4 left (all in flight): the true share done is between 1/2 and 1
    assert run.left_text().startswith("about 0:3")  # 30 s for half the work: about 30 s left
    task.advance(4)
    assert run.left_text() == ""
