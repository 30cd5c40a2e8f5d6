"""The whole-gate projection's arithmetic (benchmarks/gate_projection.py) on given step and prefill times."""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gate_projection as gp  # noqa: E402

TASKS = [gp.TaskLoad("gsm8k", 1319, 950.0, 850, 256, 120.0), gp.TaskLoad("humaneval", 164, 150.0, 0, 1024, 80.0)]
ROUNDS = gp.Rounds(psi=0.06, candidate={"gsm8k": 0.6, "humaneval": 4.0}, baseline={"gsm8k": 0.6, "humaneval": 4.0},
                   runs={"gsm8k": 0.15, "humaneval": 1.0}, looks=1.2, decide_s=2.0, round_ks=(4, 8))
M = gp.Measured(layers=12, batch=256, step_s=0.029, prefill_tokens_per_s=7000.0, cached_prefill_tokens_per_s=7000.0,
                load_s=60.0, compile_s=10.0, prefill_once_s=3.0, capture_s=2.0, conformance_s=1.5, check_s=1.1)


def proj(rounds=ROUNDS, m=M, gpus=2, lengths="expected", cache=False, tasks=TASKS):
    return gp.project(tasks, rounds, m, total_layers=43, per_replica=2, gpus=gpus, lengths=lengths, prefix_cache=cache)


def test_a_pass_by_hand():
    task = gp.TaskLoad("t", items=10, prompt_tokens=100.0, shared_prefix=60, max_new_tokens=8, expected_tokens=5.0)
    m = gp.Measured(layers=1, batch=4, step_s=0.01, prefill_tokens_per_s=1000.0, cached_prefill_tokens_per_s=500.0)
    worst = gp.run_pass([task], {"t": 1.0}, m, scale=2.0, replicas=1, lengths="limit", prefix_cache=False)
    assert worst.decode_s == pytest.approx(3 * 8 * 0.02)  # ceil(10 / 4) batches of 8 steps, each 2 x 0.01 s
    assert worst.prefill_s == pytest.approx(10 * 100 / 1000 * 2)
    assert worst.generated == 80
    expected = gp.run_pass([task], {"t": 1.0}, m, 2.0, 1, "expected", False)
    assert expected.decode_s == pytest.approx(10 * 5 / 4 * 0.02)  # slots refilled: tokens over the batch
    cached = gp.run_pass([task], {"t": 3.0}, m, 2.0, 1, "expected", True)
    assert cached.prefill_s == pytest.approx((60 + 10 * 40) / 500 * 2)  # the prefix once, each item's own once
    halves = gp.run_pass([task], {"t": 1.0}, m, 2.0, 2, "limit", False)  # two copies, five items each
    assert halves.decode_s == pytest.approx(2 * 8 * 0.02) and halves.generated == 80


def test_doubling_the_samples_doubles_the_sampled_part():
    doubled = dataclasses.replace(ROUNDS, candidate={t: 2 * k for t, k in ROUNDS.candidate.items()},
                                  baseline={t: 2 * k for t, k in ROUNDS.baseline.items()})
    one, two = proj(), proj(doubled)
    assert two.rounds_candidate.decode_s == pytest.approx(2 * one.rounds_candidate.decode_s)
    assert two.rounds_candidate.prefill_s == pytest.approx(2 * one.rounds_candidate.prefill_s)
    assert two.rounds_baseline.seconds == pytest.approx(2 * one.rounds_baseline.seconds)
    assert two.greedy.seconds == pytest.approx(one.greedy.seconds)  # the greedy pass is not sampled
    assert two.seconds() - one.seconds() == pytest.approx(one.rounds_candidate.seconds)


def test_the_worst_case_is_no_faster_than_the_expected_lengths():
    for gpus in (2, 4):
        for cache in (False, True):
            worst, expected = proj(gpus=gpus, lengths="limit", cache=cache), proj(gpus=gpus, cache=cache)
            assert worst.seconds() > expected.seconds()
            assert worst.seconds(False) > expected.seconds(False)
            assert worst.generated() > expected.generated()


def test_four_gpus_are_faster_than_two():
    for lengths in ("expected", "limit"):
        two, four = proj(gpus=2, lengths=lengths), proj(gpus=4, lengths=lengths)
        assert four.seconds() < two.seconds()
        assert four.generated() == pytest.approx(two.generated())  # the same work, shared by two copies
        assert four.greedy.decode_s < two.greedy.decode_s
    assert proj(gpus=3).seconds() == pytest.approx(proj(gpus=2).seconds())  # a third GPU holds no whole copy


def test_a_baseline_sampled_in_the_gate_costs_its_rounds_and_a_load():
    p = proj()
    assert p.seconds(False) == pytest.approx(p.seconds(True) + p.rounds_baseline.seconds + M.load_s * 43 / 12)
    greedy_only = proj(gp.GREEDY_ONLY)
    assert greedy_only.seconds(False) == greedy_only.seconds(True)  # no rounds: nothing of the baseline's to run
    assert greedy_only.seconds() < p.seconds()


def test_the_prefix_cache_computes_fewer_tokens_at_the_same_rate():
    plain, cached = proj(), proj(cache=True)
    assert cached.greedy.prefill_s < plain.greedy.prefill_s
    assert cached.greedy.decode_s == plain.greedy.decode_s
    assert cached.greedy.prompt_tokens == plain.greedy.prompt_tokens  # the same prompts, fewer tokens computed
    with pytest.raises(ValueError, match="prefix cache"):
        proj(m=dataclasses.replace(M, cached_prefill_tokens_per_s=None), cache=True)


def test_tokens_per_gpu_and_the_one_time_costs():
    p = proj(gpus=4)
    assert p.tokens_per_s_per_gpu() == pytest.approx(p.generated() / p.seconds() / 4)
    scale = 43 / 12
    assert p.once_s == pytest.approx(60 * scale + 10 + (3 + 2 + 1.5) * scale)
    assert p.decisions_s == pytest.approx((1 + 1.2) * 2.0 + 1.1)
    # calibrate: the A/A's two greedy passes and two sampled passes at k = 4 and at k = 8, plus a load
    k1 = gp.run_pass(TASKS, {"gsm8k": 1.0, "humaneval": 1.0}, M, scale, 2, "expected", False).seconds
    assert p.calibration_s == pytest.approx(60 * scale + 10 + 2 * k1 + 2 * 4 * k1 + 2 * 8 * k1)


def test_the_table_prints_every_case_beside_the_published_figure():
    lines, rows = gp.table(TASKS, ROUNDS, M, 43, 2, prefix_cache_options=(False, True))
    assert len(rows) == 2 * 2 * 2 and len(lines) == 1 + len(rows) + 1
    assert "4,000-4,900 tokens/s per H200" in lines[-1]
    for r in rows:
        assert r["greedy_min"] < r["gate_min"] <= r["gate_base_sampled_min"]


def test_task_loads_count_the_real_prompts():
    by_bytes = lambda text: list(text.encode())  # noqa: E731
    gsm8k, humaneval = gp.task_loads(by_bytes, limit=12)
    assert (gsm8k.items, humaneval.items) == (1319, 164)
    # the default profile samples five shots per item: its prompts share only their first words
    assert gsm8k.shared_prefix < 20 < gsm8k.prompt_tokens / 10
    assert humaneval.shared_prefix < 20 < humaneval.prompt_tokens  # HumanEval's prompts are their own
    assert 0 < gsm8k.expected_tokens < gsm8k.max_new_tokens * 4 and humaneval.max_new_tokens >= gsm8k.max_new_tokens
    cot, _ = gp.task_loads(by_bytes, limit=12, profiles={"gsm8k": "gsm8k-cot-8shot"})
    assert cot.shared_prefix > cot.prompt_tokens / 2  # eight fixed exemplars: a prefix every prompt starts with


@pytest.mark.slow
def test_the_rounds_come_from_the_gate_itself():
    rounds = gp.gate_rounds(0.06, reps=1)
    assert rounds.round_ks and rounds.round_ks[0] == 4 and "1 PASS" in rounds.source
    assert set(rounds.candidate) == {"gsm8k", "humaneval"}
    for task, k in rounds.candidate.items():
        assert k == rounds.baseline[task] and k in (0, *rounds.round_ks, sum(rounds.round_ks))
    assert rounds.decide_s > 0 and gp.gate_rounds(0.06, reps=0).candidate == {}


def test_the_benchmark_rows_feed_the_projection():
    import dsv4_flash_fullwidth as script

    row = {"batch": 256, "step_ms": 29.0, "prefill_tokens_per_s": 2900.0, "prefill_again_tokens_per_s": 7000.0,
           "warmup_s": 10.0, "prefill_once_s": 3.0}
    m = script.measured_for(row, {"load_s": 60.0, "conformance_s": 1.5}, 12, 1.1, capture=(0.5, 4.0))
    assert (m.step_s, m.prefill_tokens_per_s, m.cached_prefill_tokens_per_s) == (0.029, 7000.0, None)
    assert m.capture_s == pytest.approx(0.5 * 9)  # a capture for each bucket 1, 2, 4, ..., 256
    assert m.compile_s == pytest.approx(10.0 + 4.0)  # the first prefill's and the first capture's, once
    assert (m.load_s, m.prefill_once_s, m.conformance_s, m.check_s) == (60.0, 3.0, 1.5, 1.1)
    cached = script.measured_for(dict(row, prefix_cache_tokens_per_s=9000.0), {}, 12, 0.0)
    assert cached.cached_prefill_tokens_per_s == 9000.0 and cached.load_s == 0.0
    assert cached.cached_prefill_once_s is None


def test_compilation_is_priced_once_and_the_rest_by_the_layers():
    import dsv4_flash_fullwidth as script

    rows = [{"batch": 256, "step_ms": 29.0, "prefill_tokens_per_s": 2900.0, "prefill_once_s": 3.0,
             "prefix_cache_tokens_per_s": 9000.0, "prompt_cache_once_s": 0.5,
             "capture_s": 0.7, "capture_compile_s": 9.0},
            {"batch": 1, "step_ms": 5.0, "prefill_tokens_per_s": 2900.0, "capture_s": 0.4, "capture_compile_s": 3.0}]
    # buckets 256 and 1 measured (in the run's compile_s); 128, 64, ..., 2 compile as the second one did
    capture = script.capture_parts(rows, 256)
    assert capture == (0.7, pytest.approx(7 * 3.0))
    assert script.capture_parts(rows, 1) == (0.7, 0.0)
    m = script.measured_for(rows[0], {"compile_s": 40.0, "conformance_s": 2.0}, 12, 0.0, capture)
    assert (m.compile_s, m.capture_s, m.cached_prefill_once_s) == (pytest.approx(61.0), pytest.approx(0.7 * 9), 0.5)
    scale = 43 / 12
    for cache, first in ((False, 3.0), (True, 0.5)):  # each path's own first prefills
        p = gp.project(TASKS, ROUNDS, m, 43, 2, 2, "expected", cache)
        assert p.once_s == pytest.approx(61.0 + (first + 0.7 * 9 + 2.0) * scale)
    # rows without the compilation timed apart: the fastest capture a bucket's, the rest of the first compiling
    old = [{k: v for k, v in r.items() if k != "capture_compile_s"} for r in rows]
    assert script.capture_parts(old, 256) == (0.4, pytest.approx(0.3))
    assert script.capture_parts([{"batch": 1}], 1) == (0.0, 0.0)
    assert script._buckets(256) == {1, 2, 4, 8, 16, 32, 64, 128, 256} and script._buckets(3) == {1, 2, 3}


def test_the_compile_clock_times_each_compilation(monkeypatch):
    import time

    from compile_clock import CompileClock
    from triton.runtime.jit import JITFunction

    def slow_compile(fn, *args, **kwargs):
        time.sleep(0.05)
        return "binary"

    monkeypatch.setattr(JITFunction, "_do_compile", slow_compile)
    kernel = type("K", (), {"__name__": "my_kernel"})()
    with CompileClock() as clock:
        assert JITFunction._do_compile(kernel, "key") == "binary"
        mark = clock.seconds
        JITFunction._do_compile(kernel, "key2")
        assert clock.since(mark) >= 0.05
        clock.exclude(clock.since(mark))
    assert JITFunction._do_compile is slow_compile  # restored
    assert clock.seconds >= 0.1 and clock.kernels == {"my_kernel": 2}
    assert clock.counted() == pytest.approx(mark)
