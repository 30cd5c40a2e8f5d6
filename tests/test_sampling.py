"""Coupled sampling (docs/scoring.md#k-samples): the keyed generator, the Gumbel-max choice, batch- and
order-invariant samples on a real model, two kernels coupled on the canary, k-sample records, the served
sampler equal to the in-process one, and greedy runs exactly as before."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from evalgate.errors import NotComparable
from evalgate.model_adapters.hf import sampling
from evalgate.model_adapters.hf.generation import decode, greedy_generate
from evalgate.model_adapters.hf.sampling import SampleKey, sample_seed
from evalgate.run.progress import Progress
from evalgate.pipeline import in_process_adapter
from evalgate.run.runner import execute
from evalgate.run.spec import RunSpec
from evalgate.run.samples import SampleGroups, Sampling
from evalgate.types import Generation, Request

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Question: Natalia sold clips to 48 of her friends in April.\nAnswer:",
           "Question: Weng earns $12 an hour.\nAnswer:"]


def quiet() -> Progress:
    return Progress(enabled=False, stream=open(os.devnull, "w"))


# --- the counter-based generator ---------------------------------------------------------------------------


def mix32_reference(x: int) -> int:
    """lowbias32 on Python integers (no tensors, no overflow questions)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_exact_integer_arithmetic():
    values = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF] + [random.Random(3).getrandbits(32) for _ in range(500)]
    got = sampling.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix32_reference(v) for v in values]


def test_the_generator_is_a_pure_function_of_its_keys():
    seeds = torch.tensor([0, 1, 2**40 + 5, 12345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 3, 0], dtype=torch.int64)
    together = sampling.uniforms(seeds, positions, 300)
    alone = torch.cat([sampling.uniforms(seeds[i:i + 1], positions[i:i + 1], 300) for i in range(4)])
    reordered = sampling.uniforms(seeds.flip(0), positions.flip(0), 300).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reordered)
    # a shorter vocabulary is a prefix: index v's draw does not depend on how many others there are
    assert torch.equal(sampling.uniforms(seeds, positions, 50), together[:, :50])
    # every key matters: seed (both halves), position and index
    assert not torch.equal(together[0], together[3]) and not torch.equal(together[1], together[2])
    moved = sampling.uniforms(seeds, positions + 1, 300)
    assert (moved != together).float().mean() > 0.99
    assert torch.unique(together).numel() == together.numel()
    # pinned values: a change to the generator changes every sample of every stored sampled run
    assert sampling.counter_words(seeds[:1], positions[:1], 2)[0].tolist() == [PINNED_WORDS]
    u = together.flatten()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


PINNED_WORDS = [4048549475, 1255543062]  # counter_words(seed 0, position 0, vocab 2), lane 0


def test_uniforms_pass_a_chi_square_check():
    u = sampling.uniforms(torch.arange(64, dtype=torch.int64), torch.arange(64, dtype=torch.int64) % 5, 4096)
    counts = np.histogram(u.numpy().ravel(), bins=256, range=(0.0, 1.0))[0]
    expected = u.numel() / 256
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert chi2.sf(statistic, 255) > 1e-4, statistic
    # the two lanes are not correlated with each other or with the neighbouring index
    hi, lo = (w.double().numpy().ravel() for w in sampling.counter_words(torch.arange(64), torch.zeros(64), 4096))
    assert abs(np.corrcoef(hi, lo)[0, 1]) < 0.01 and abs(np.corrcoef(hi[:-1], hi[1:])[0, 1]) < 0.01


def test_gumbel_noise_is_correctly_rounded_everywhere():
    m = torch.tensor([0, 1, 2**51, 2**52 - 2, 2**52 - 1] + [random.Random(5).getrandbits(52) for _ in range(3000)],
                     dtype=torch.int64)
    u = (2 * m + 1).to(torch.float64) * 2.0**-53
    fast = sampling.gumbel(u)
    exact = torch.tensor(sampling._exact_gumbel(u.tolist()), dtype=torch.float32)
    assert torch.equal(fast, exact)
    g = sampling.gumbel(sampling.uniforms(torch.arange(32), torch.zeros(32), 4096)).double()
    assert abs(float(g.mean()) - 0.5772) < 0.02 and abs(float(g.var()) - np.pi ** 2 / 6) < 0.05


# --- choosing tokens -------------------------------------------------------------------------------------


def test_rows_without_a_key_are_the_greedy_argmax_with_ties_to_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 5.0, 0.0]])
    assert sampling.next_tokens(logits, None, 0).tolist() == [1, 0]
    assert sampling.next_tokens(logits, [None, None], 3).tolist() == [1, 0]
    mixed = sampling.next_tokens(logits, [None, SampleKey(4, 1.0)], 0)
    assert mixed[0] == 1


def test_the_sampler_draws_from_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    temperature = 0.7
    keys = [SampleKey(sample_seed(11, i, 0), temperature) for i in range(4000)]
    drawn = sampling.next_tokens(logits, keys, 0)
    counts = np.bincount(drawn.numpy(), minlength=4)
    expected = torch.softmax(logits[0] / temperature, -1).numpy() * 4000
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert chi2.sf(statistic, 3) > 1e-3, (counts, expected)


def test_sample_seed_is_the_request_seed_the_client_sends():
    from evalgate.model_adapters.server.openai_client import request_seed

    assert sample_seed(7, "HumanEval/3", 2) == request_seed(7, "HumanEval/3", 2) < 2**31
    assert len({sample_seed(0, d, j) for d in range(50) for j in range(8)}) == 400


# --- on a model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from evalgate.model_adapters.hf.adapter import load_model

    return load_model(tiny_model, "bf16")


def test_the_same_samples_at_batch_1_and_batch_8_in_any_order(tiny):
    model, tok = tiny
    rows = [(p, SampleKey(sample_seed(3, d, j), 1.0)) for d, p in enumerate(PROMPTS) for j in range(4)]
    together = decode(model, tok, [p for p, _ in rows], [("Question:",)] * 8, [14] * 8, keys=[k for _, k in rows])
    alone = [decode(model, tok, [p], [("Question:",)], [14], keys=[k])[0] for p, k in rows]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = decode(model, tok, [rows[i][0] for i in order], [("Question:",)] * 8, [14] * 8,
                      keys=[rows[i][1] for i in order])
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert shuffled[order.index(i)].token_ids == a.token_ids
    # the samples of one item differ from each other (the keys matter), and greedy rows are untouched
    assert len({tuple(g.token_ids) for g in together[:4]}) > 1
    mixed = decode(model, tok, PROMPTS, [()] * 2, [14] * 2, keys=[None, rows[4][1]])
    assert mixed[0].token_ids == greedy_generate(model, tok, PROMPTS[:1], [()], [14])[0].token_ids
    assert mixed[1].token_ids == decode(model, tok, PROMPTS[1:], [()], [14], keys=[rows[4][1]])[0].token_ids


def test_two_kernels_produce_the_same_samples_unless_the_kernel_moves_them():
    """The canary with w4a8 and w4a4_packed: the same keys give mostly the same sampled tokens, far more than
    the same kernels with other keys (an uncoupled sampler) agree on."""
    from evalgate.canary import GSM8K_PROFILE, canary_path
    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.tasks import gsm8k

    items, resolved = gsm8k.TASK.load(gsm8k.PROFILES[GSM8K_PROFILE], None, 4)
    prompts = [r.prompt for r in gsm8k.TASK.requests(items, resolved)]
    keys = [SampleKey(sample_seed(0, d, j), 0.8) for d in range(4) for j in range(4)]
    other_keys = [SampleKey(sample_seed(1, d, j), 0.8) for d in range(4) for j in range(4)]
    rows = [p for p in prompts for _ in range(4)]
    n = len(rows)
    a = decode(*load_model(canary_path(), "w4a8"), rows, [()] * n, [8] * n, keys=keys)
    packed = load_model(canary_path(), "w4a4_packed")
    b = decode(*packed, rows, [()] * n, [8] * n, keys=keys)
    uncoupled = decode(*packed, rows, [()] * n, [8] * n, keys=other_keys)

    def agree(x, y):
        return (sum(s == t for gx, gy in zip(x, y) for s, t in zip(gx.token_ids, gy.token_ids)),
                sum(gx.token_ids == gy.token_ids for gx, gy in zip(x, y)))

    total = sum(len(g.token_ids) for g in a)
    (same_tokens, same_rows), (chance_tokens, chance_rows) = agree(a, b), agree(a, uncoupled)
    assert same_tokens >= 0.6 * total and same_tokens >= 2 * chance_tokens, (same_tokens, chance_tokens, total)
    assert same_rows >= n // 3 and same_rows > chance_rows
    assert len({tuple(g.token_ids) for g in a}) > 4  # it did sample: not one path per item


# --- k-sample runs ------------------------------------------------------------------------------------------


def sampled_spec(tiny_model, data_dir, **kw) -> RunSpec:
    opts = dict(model=str(tiny_model), kernel="bf16", tasks=["gsm8k"], limit=3, batch_size=4,
                data_dir=str(data_dir), max_new_tokens=10, samples=3, temperature=1.0, seed=5)
    return RunSpec(**{**opts, **kw})


def test_a_sampled_run_records_k_samples_and_scores_their_mean(tiny_model, data_dir, tmp_path):
    from evalgate.gate.compare import compare, n_samples_of

    spec_a, spec_b = sampled_spec(tiny_model, data_dir), sampled_spec(tiny_model, data_dir, batch_size=1, order="reverse")
    run_a = execute(spec_a, tmp_path / "a", in_process_adapter(spec_a), progress=quiet())
    run_b = execute(spec_b, tmp_path / "b", in_process_adapter(spec_b), progress=quiet())
    from evalgate.run.store import load_run

    a, b = load_run(run_a), load_run(run_b)
    decoding = a.manifest["tasks"]["gsm8k"]["decoding"]
    assert decoding["n"] == 3 and decoding["temperature"] == 1.0 and decoding["seed"] == 5
    assert decoding["do_sample"] is True and decoding["sampler"] == sampling.SAMPLER
    for record in a.records["gsm8k"]:
        assert record["n_samples"] == n_samples_of(record) == 3 and len(record["samples"]) == 3
        outcomes = [s["exact_match,strict-match"] for s in record["samples"]]
        assert record["exact_match,strict-match"] == sum(outcomes) / 3
        assert record["resps"] == [s["resps"] for s in record["samples"]]
        assert all(s["finish_reason"] in ("stop", "length") for s in record["samples"])
        assert all(isinstance(s["invalid,strict-match"], bool) for s in record["samples"])
    # batch 4 in item order and batch 1 in reverse order: the same samples, item by item
    strip = lambda rs: [{k: v for k, v in r.items() if k != "latency_s" and k != "samples"} for r in rs]
    assert strip(a.records["gsm8k"]) == strip(b.records["gsm8k"])
    pairing = compare(a, b)
    assert pairing.pairs["gsm8k"].k == 3 and pairing.pairs["gsm8k"].scores("base") == pairing.pairs["gsm8k"].scores("cand")


def test_runs_with_other_sampling_settings_are_not_comparable(tiny_model, data_dir, tmp_path):
    from evalgate.gate.compare import compare
    from evalgate.run.store import load_run

    spec = sampled_spec(tiny_model, data_dir, limit=1, max_new_tokens=3, samples=2)
    a = execute(spec, tmp_path / "a", in_process_adapter(spec), progress=quiet())
    for name, change in (("seed", {"seed": 6}), ("k", {"samples": 3}), ("greedy", {"samples": 1, "temperature": 0.0})):
        spec_b = sampled_spec(tiny_model, data_dir, limit=1, max_new_tokens=3, **{"samples": 2, **change})
        other = execute(spec_b, tmp_path / name, in_process_adapter(spec_b), progress=quiet())
        with pytest.raises(NotComparable) as info:
            compare(load_run(a), load_run(other))
        message = str(info.value)
        assert "\n" not in message and "sampling settings differ" in message and "--samples" in message, message


def test_per_item_aggregation_of_humaneval_samples(monkeypatch):
    from evalgate.tasks.humaneval import task as humaneval

    items, resolved = humaneval.TASK.load(humaneval.PROFILES["humaneval-completion-codex"], None, 1)
    request = humaneval.TASK.requests(items, resolved)[0]
    right = Generation(items[0]["canonical_solution"], "stop")
    wrong = Generation("    return None\n", "length")

    # the sandbox is tested elsewhere (test_humaneval.py): here its outcomes are scripted, one per sample
    monkeypatch.setattr(humaneval, "require_selftest", lambda data_dir, **kwargs: {"timeouts_s": {items[0]["task_id"]: 3.0}})
    outcomes = iter([True, False, False, True, True])
    monkeypatch.setattr(humaneval.sandbox, "run_programs", lambda programs, timeouts, workers=None: [
        type("Outcome", (), dict(passed=next(outcomes), failure_class=None, result="", exception=None, stdout="",
                                 stderr="", duration_s=0.0, network_isolation=None)) for _ in programs])
    record = humaneval.TASK.score_batch(items, [request], [[right, wrong, wrong, right]], resolved)[0]
    assert record["n_samples"] == 4 and record["pass@1"] == 0.5 and record["c"] == 2
    assert [s["passed"] for s in record["samples"]] == [True, False, False, True]
    assert [s["finish_reason"] for s in record["samples"]] == ["stop", "length", "length", "stop"]
    single = humaneval.TASK.score_batch(items, [request], [[right]], resolved)[0]
    assert single["n_samples"] == 1 and len(single["samples"]) == 1


def test_sample_groups_hand_over_whole_items_in_any_order():
    items = [Request(doc_id=d, prompt="p", stop=(), max_new_tokens=1) for d in ("a", "b")]
    plan = Sampling(3, 0.5, 1)
    expanded = plan.expand(items)
    assert [(r.doc_id, r.sample) for r in expanded] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert expanded[4].seed == sample_seed(1, "b", 1) and expanded[4].temperature == 0.5
    groups = SampleGroups(plan, items)
    gens = {(r.doc_id, r.sample): Generation(f"{r.doc_id}{r.sample}", "stop") for r in expanded}
    order = [expanded[i] for i in (5, 0, 3, 1)]
    assert groups.add(order, [gens[(r.doc_id, r.sample)] for r in order]) == ([], [])
    done_items, done = groups.add([expanded[4], expanded[2]], [gens[("b", 1)], gens[("a", 2)]])
    assert [r.doc_id for r in done_items] == ["b", "a"]
    assert [[g.text for g in gs] for gs in done] == [["b0", "b1", "b2"], ["a0", "a1", "a2"]]


# --- greedy stays what it was ------------------------------------------------------------------------------


# the profile ids of the canary's stored greedy w4a8 baselines (evalgate/canary/baselines/deepseek_v4-…/
# <profile>-<id[:12]>/w4a8): a greedy run must still find them. HumanEval's no longer hashes the sandbox's
# Python version (test_humaneval.PINNED_PROFILE_IDS)
CANARY_BASELINE_PROFILE_IDS = {
    "gsm8k": "479b86ce74d8e53f20d9cdf72a12294912590381f05b426cd155da0b8e8ab6aa",
    "humaneval": "983dfc0c3eb77332db6470e3710832367a2a22be03e078a7b00e6b38b090bbab",
}


def test_greedy_settings_leave_requests_decoding_and_canary_profile_ids_unchanged(data_dir):
    from evalgate.plan import planned_profile_ids

    greedy = Sampling()
    assert greedy.greedy and greedy.decoding({"temperature": 0.0, "n": 1}) == {"temperature": 0.0, "n": 1}
    items = [Request(doc_id=0, prompt="p", stop=(), max_new_tokens=1)]
    assert greedy.expand(items) == items
    stored = set(CANARY_BASELINE_PROFILE_IDS.values())
    # baselines in the tree (when present) are keyed by these very ids
    paths = [p for root in (REPO / "results" / "baselines", REPO / "evalgate" / "canary" / "baselines")
             for p in root.glob("*/*-canary-v1-*/w4a8/manifest.json")]
    for path in paths:
        assert {t["profile_id"] for t in json.loads(path.read_text())["tasks"].values()} <= stored
    spec = RunSpec(model="canary", kernel="w4a8", tasks=["gsm8k", "humaneval"],
                   profiles={"gsm8k": "gsm8k-canary-v1", "humaneval": "humaneval-canary-v1"})
    assert planned_profile_ids(spec) == CANARY_BASELINE_PROFILE_IDS
    sampled = RunSpec(**{**spec.__dict__, "samples": 4, "temperature": 0.8})
    assert not set(planned_profile_ids(sampled).values()) & stored


def test_a_greedy_record_has_no_sample_fields():
    from evalgate.tasks.gsm8k import TASK

    items, resolved = TASK.load(TASK.profiles["gsm8k-lmeval-v3"], None, 1)
    request = TASK.requests(items, resolved)[0]
    record = TASK.score_batch(items, [request], [Generation("#### 3", "stop")], resolved)[0]
    assert "samples" not in record and "n_samples" not in record and record["resps"] == "#### 3"


@pytest.mark.parametrize("args, message", [
    (["--samples", "4"], "--samples 4 at --temperature 0"),
    (["--seed", "3"], "--seed only applies to sampling"),
    (["--temperature", "-1"], "--temperature"),
])
def test_bad_sampling_options_are_one_line_and_exit_2(args, message, tmp_path):
    from click.testing import CliRunner

    from evalgate.cli.main import main

    result = CliRunner().invoke(main, ["run", "--tasks", "gsm8k", "--limit", "1", "--out", str(tmp_path / "r"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r").exists()


# --- over a server -------------------------------------------------------------------------------------------


def test_a_sampled_server_run_sends_temperature_and_the_stream_seed_of_each_sample(data_dir, tmp_path):
    from fake_server import FakeServer

    from evalgate.model_adapters.server.openai_client import OpenAIAdapter

    spec = RunSpec(model="fake-model", kernel="w4a8", tasks=["gsm8k"], limit=2, batch_size=4, data_dir=str(data_dir),
                   samples=3, temperature=0.6, seed=9)
    with FakeServer() as server:
        adapter = OpenAIAdapter(server.url, "w4a8", concurrency=2, retries=0, request_timeout=5.0)
        out = execute(spec, tmp_path / "served", adapter=adapter, progress=quiet())
    sent = sorted((b["seed"], b["temperature"], b["top_p"], b["n"]) for b in server.requests)
    assert sent == sorted((sample_seed(9, d, j), 0.6, 1.0, 1) for d in range(2) for j in range(3))
    from evalgate.run.store import load_run

    assert all(r["n_samples"] == 3 for r in load_run(out).records["gsm8k"])


def test_evalgate_serve_samples_what_the_in_process_model_samples(tiny, tiny_model):
    from evalgate.model_adapters.server.serve import BadRequest, BatchingGenerator, OpenAIApp

    model, tok = tiny
    app = OpenAIApp(BatchingGenerator(model, tok, batch_size=4), tok, "model", {"model_path": str(tiny_model)})
    seed = sample_seed(2, 0, 1)
    body = {"model": "model", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "seed": seed}
    status, served = asyncio.run(app.completions(json.dumps(body).encode()))
    local = decode(model, tok, PROMPTS[:1], [()], [12], keys=[SampleKey(seed, 0.9)])[0]
    assert status == 200 and served["choices"][0]["text"] == local.text
    with pytest.raises(BadRequest, match="needs a seed"):
        asyncio.run(app.completions(json.dumps({**body, "seed": None}).encode()))
