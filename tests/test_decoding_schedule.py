"""The decoding workers' schedule: with the stored baseline's answer lengths, the worker that took the costliest
prompts takes fewer of the rest, so the workers finish together; the lengths reach the decoder from the gate's
baselines and change no token, record or manifest."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from types import SimpleNamespace

import pytest

from evalgate.model_adapters.hf import generation
from evalgate.model_adapters.hf.generation import Costs, _SharedQueue
from evalgate.types import AdapterBase, Generation


def _queue(prompt_lens, expected, max_new=320):
    enc = [[0] * n for n in prompt_lens]
    costs = Costs.of(enc, [max_new] * len(enc), expected)
    order = sorted(range(len(enc)), key=lambda i: -costs.whole[i])
    queue = _SharedQueue(order, multiprocessing.get_context("fork"), workers=2, costs=costs)
    return queue, order


def test_the_worker_holding_the_longest_answer_leaves_the_rest_to_the_other():
    """One 200-token answer and twenty 10-token ones: the worker that takes the long one (its last steps cost
    a whole step each) takes nothing more while the other's load is smaller; the other takes every short one."""
    queue, order = _queue([10] * 21, [200] + [10] * 20)
    first, second = queue.of_worker(0), None
    assert first.take(8) == [0]  # idle: the costliest prompt, which alone is over an even split
    second = _SharedQueue.__new__(_SharedQueue)
    second.__dict__.update({**queue.__dict__, "worker": 1})  # the other forked worker's view of the same counters
    got = second.take(8)
    assert got == order[1:9]  # a full take: far below the even split
    first.publish([(0, 10)])
    assert first.take(8, live=[(0, 10)]) == []  # 190 tokens left, each step's fixed part: over its share
    taken = list(got)
    while len(taken) < 20:
        more = second.take(8, live=[(i, 5) for i in taken[-4:]])
        assert more, "the lighter worker must take what is left"
        taken += more
    assert sorted(taken) == list(range(1, 21)) and first.take(8, live=[(0, 100)]) == []


def test_without_expected_lengths_the_queue_shares_as_before():
    queue = _SharedQueue(list(range(40)), multiprocessing.get_context("fork"), workers=2)
    assert not queue.balances
    assert queue.take(16, live=[(0, 3)]) == list(range(16))  # the live rows do not matter without costs
    assert queue.take(16) == list(range(16, 28))  # 24 left: half of them


def test_costs_use_the_expected_length_capped_by_the_limit_else_the_limit():
    costs = Costs.of([[0] * 10, [0] * 20, [0] * 30], [50, 50, 50], [20, None, 500])
    assert costs.tokens == [20, 50, 50]
    assert costs.whole == [pytest.approx(generation.PREFILL_TOKEN_ROWS * n + t) for n, t in
                            ((10, 20), (20, 50), (30, 50))]
    # a row's last steps cost a whole step each: a long row weighs more than many short ones of its tokens
    assert costs.load([100.0]) > costs.load([10.0] * 10)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from evalgate.model_adapters.hf.adapter import load_model

    return load_model(tiny_model, "w4a8")


PROMPTS = ["Question: 7 times 8?\nAnswer:", "Question: What is 100 minus 37?\nAnswer:",
           "Question: A box holds 24 pencils. How many boxes hold 96 pencils?\nAnswer:",
           "Question: If a shirt costs $15 and is 20% off, what is the price?\nAnswer:",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"]
MAX_NEW = [9, 4, 12, 7, 10]


@pytest.mark.parametrize("expected", [[1, 30, None, 7, 2], [12, 12, 12, 12, 12]])
def test_expected_lengths_change_no_token(tiny, expected):
    """Right, wrong or missing expected lengths: every row's tokens are those it gets alone."""
    from evalgate.model_adapters.hf.generation import decode, decode_stream

    model, tok = tiny
    stops = [("\n\n",)] * len(PROMPTS)
    alone = [decode(model, tok, [p], [s], [m])[0] for p, s, m in zip(PROMPTS, stops, MAX_NEW)]
    got = {}
    for finished in decode_stream(model, tok, PROMPTS, stops, MAX_NEW, batch_size=2, refill=1, workers=2,
                                  expected_tokens=expected):
        got.update(finished)
    assert [(g.token_ids, g.text, g.finish_reason) for g in alone] == \
           [(got[i].token_ids, got[i].text, got[i].finish_reason) for i in range(len(PROMPTS))]


class LengthAdapter(AdapterBase):
    """Answers GSM8K with 18 in a number of tokens that depends on the item; records what each stream was
    told to expect."""

    serving = "stream"

    def __init__(self, kernel: str):
        self.kernel = SimpleNamespace(name=kernel, version="fake 1.0", id=f"{kernel}@fake 1.0", description="fake",
                                      recipe={}, faulty=False)
        self.expected = []

    def info(self) -> dict:
        return {"adapter": "fake", "fingerprint": "0123456789abcdef", "dtype": "bfloat16", "model_type": "fake",
                "machine": {"python": sys.version.split()[0], "cuda": None}}

    def generate_stream(self, requests, batch_size=None):
        self.expected.append({r.doc_id: r.expected_tokens for r in requests})
        for i, r in enumerate(requests):
            yield [(i, Generation(text=" 6 + 12 = 18\n#### 18", finish_reason="stop", n_prompt_tokens=4,
                                  n_tokens=3 + len(r.prompt) % 17))]


def test_the_gate_hands_the_baselines_answer_lengths_to_the_decoder(tmp_path, data_dir):
    from gate_helpers import policy

    from evalgate.gate.policy import load_thresholds
    from evalgate.pipeline import gate_model
    from evalgate.run.baselines import answer_lengths, record
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    root = tmp_path / "baselines"
    spec = RunSpec(model="fake", kernel="w4a8", tasks=["gsm8k"], limit=6, batch_size=2, data_dir=str(data_dir))
    with open(os.devnull, "w") as devnull:
        base = execute(spec, tmp_path / "base", adapter=LengthAdapter("w4a8"),
                       progress=Progress(enabled=False, stream=devnull))
    (stored,) = record(base, root)
    lengths = {r["doc_id"]: r["n_tokens"] for r in load_run(base).records["gsm8k"]}
    assert len(set(lengths.values())) > 1 and answer_lengths(load_run(stored)) == {"gsm8k": lengths}

    candidate = LengthAdapter("w4a4_packed")
    spec = RunSpec(model="fake", kernel="w4a4_packed", tasks=["gsm8k"], limit=6, batch_size=2,
                   data_dir=str(data_dir))
    verdict, run_dir = gate_model(spec, "w4a8", root, tmp_path / "cand", load_thresholds(policy(tmp_path)),
                                  allow_uncalibrated=True, adapter=candidate)
    assert candidate.expected == [lengths]
    stored_text = (run_dir / "gsm8k.jsonl").read_text() + (run_dir / "manifest.json").read_text()
    assert "expected_tokens" not in stored_text  # a schedule, not part of the run
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"


def test_unreadable_baselines_are_one_line_errors(tmp_path):
    from evalgate.errors import UserError
    from evalgate.run.baselines import load_baseline

    with pytest.raises(UserError, match="is not a run directory"):
        load_baseline([tmp_path / "missing"])
