"""Reproducible numerics (docs/kernels.md#canonical-numerics): the same item gives the same tokens whatever
its batch, the thread count and the CPU's instruction set; the emulated kernels accumulate exactly.

The canonical primitives are checked against exact references (fractions, mpmath); the canary's
generations are checked byte for byte across batch sizes, thread counts and every ATEN_CPU_CAPABILITY level
this CPU supports, in subprocesses; ``evalgate serve`` answers the same whatever a request is batched with.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest
from serve_helpers import running_server
import torch

import evalgate.kernels as K
from evalgate.kernels import canonical, exact, formats
from evalgate.kernels.emulator import MoEEmulation

HEALTHY = ["w4a8", "w4a8_sglang", "w4a4", "w4a4_packed", "w4a4_te"]
FAULTY = [n for n in K.kernel_names() if n.startswith("faulty/")]


def _rn32(value: Fraction) -> float:
    """Round-to-nearest-even of an exact rational to FP32 (normal range), the reference for exact sums."""
    if value == 0:
        return 0.0
    sign, a = (-1.0 if value < 0 else 1.0), abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = Fraction(2) ** (max(e, -126) - 23)
    n, rest = divmod(a, q)
    n = int(n) + (1 if rest / q > Fraction(1, 2) or (rest / q == Fraction(1, 2) and int(n) % 2) else 0)
    return sign * float(n * q)


# --- canonical primitives ---------------------------------------------------------------------------


def test_pow2_is_exact():
    e = torch.arange(-1022, 1024)
    assert torch.equal(canonical.pow2(e), torch.tensor([math.ldexp(1.0, int(i)) for i in e], dtype=torch.float64))


def test_fixed_matmul_row_depends_on_its_own_row_and_column_only():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(9, 600, generator=g) * torch.exp(torch.randn(9, 600, generator=g))).bfloat16()
    w = torch.randn(70, 600, generator=g).bfloat16()
    full = canonical.linear(a, w, out_dtype=torch.float32)
    for i in (0, 4, 8):
        assert torch.equal(canonical.linear(a[i:i + 1], w, out_dtype=torch.float32)[0], full[i])
    assert torch.equal(canonical.linear(a, w[:5], out_dtype=torch.float32), full[:, :5])
    ref = a.double() @ w.double().T
    assert float(((full.double() - ref).abs() / (a.double().abs() @ w.double().abs().T)).max()) < 2 ** -18


def test_fixed_matmul_values_ignore_padding_keys():
    """P·V in "rows" mode: zero-probability keys (padding) with any values change nothing."""
    g = torch.Generator().manual_seed(1)
    p = torch.rand(3, 40, generator=g).bfloat16()
    v = torch.randn(40, 64, generator=g).bfloat16()
    want = canonical.fixed_matmul(p, canonical.fixed_operand(v, "rows"))
    pad_p = torch.cat([torch.zeros(3, 7).bfloat16(), p], -1)
    pad_v = torch.cat([torch.randn(7, 64, generator=g).bfloat16() * 1e6, v])
    assert torch.equal(canonical.fixed_matmul(pad_p, canonical.fixed_operand(pad_v, "rows")), want)


def _plain_grid(x64, bits, dim):
    """The documented grid, step by step in float64 (module docstring of kernels/canonical.py)."""
    top = x64.abs().amax(dim=dim, keepdim=True)
    e = torch.frexp(top).exponent.to(torch.int64)  # top < 2^e
    s = canonical.pow2(torch.where(top > 0, bits - e, torch.zeros_like(e)))
    return torch.round(x64 * s), 1.0 / s


def test_a_decoding_step_attends_each_run_of_rows_over_its_own_keys_with_the_same_bits():
    """A left-padded decoding step cut into runs of rows (``decode_segments``) gives every row the bits of one
    call over all keys, and of the row alone over its own keys; the cuts skip most of the padding."""
    from types import SimpleNamespace

    from evalgate.model_adapters.canonical import invariant
    from evalgate.model_adapters.canonical.blocks import attend

    g = torch.Generator().manual_seed(0)
    b, h, d, t = 24, 4, 64, 3000
    lengths = [10 * n for n in (300, 290, 280, 150, 140, 140, 135, 20, 18, 17, 260, 250, 12, 11, 10, 9, 300, 8, 7, 6, 5,
                                4, 3, 2)]
    mask = torch.full((b, 1, 1, t), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16)
    for r, n in enumerate(lengths):
        mask[r, ..., t - n:] = 0
    query = torch.randn(b, h, 1, d, generator=g).bfloat16()
    keys = canonical.fixed_operand(torch.randn(b, 1, d, t, generator=g).bfloat16().float(), "columns")
    values = canonical.fixed_operand(torch.randn(b, 1, t, d, generator=g).bfloat16().float(), "rows")
    module = SimpleNamespace(sinks=torch.randn(h, generator=g))
    runs = invariant.decode_segments(mask)
    assert runs[0][0] == 0 and runs[-1][1] == b and all(a[1] == c[0] for a, c in zip(runs, runs[1:])) and len(runs) > 1
    assert invariant.decode_segments(mask) is runs  # once per step: every layer gets the same mask
    computed = sum((r1 - r0) * (t - k0) for r0, r1, k0 in runs)
    assert computed + len(runs) * invariant.SEGMENT_COST < 0.6 * b * t  # padding skipped, calls counted
    cut = invariant.canonical_attention(module, query, keys, values, mask, 0.125)
    whole = attend(query, keys, values, mask, module.sinks, 0.125).transpose(1, 2)
    assert torch.equal(cut.view(torch.int16), whole.contiguous().view(torch.int16))
    for r, n in enumerate(lengths):
        alone = attend(query[r:r + 1], keys.narrow(0, r, 1).narrow(-1, t - n, n), values.narrow(0, r, 1).narrow(-2, t - n, n),
                       mask[r:r + 1, ..., t - n:], module.sinks, 0.125).transpose(1, 2)
        assert torch.equal(cut[r:r + 1].view(torch.int16), alone.contiguous().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_fixed_matmul_and_sum_are_their_definition_for_every_input_dtype(dtype):
    """The grid is taken from each slice's largest magnitude in the input's own dtype and applied in place
    on a float64 copy: the result is the plain float64 definition, bit for bit, in both operand modes, and a
    float64 input is left as it was."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(2, 6, 96, generator=g) * torch.exp(2 * torch.randn(2, 6, 96, generator=g))).to(dtype)
    a[0, 1] = 0  # an all-zero row
    w = torch.randn(96, 40, generator=g).to(dtype)
    before = a.clone()
    a64 = a.double()
    q, inv = _plain_grid(a64, canonical.A_BITS, -1)
    b = canonical.fixed_operand(w, "columns")
    bq, binv = _plain_grid(w.double(), canonical.columns_bits(96), -2)
    assert torch.equal(b.q, bq) and torch.equal(b.scale, binv)
    want = ((q @ (bq * binv)) * inv).to(torch.float32)
    assert torch.equal(canonical.fixed_matmul(a, b, torch.float32), want)

    v = canonical.fixed_operand(w[:40], "rows")  # 40 keys of 40 channels
    p = a[..., :40]
    scaled = p.double() * v.scale.transpose(-1, -2)
    pq, pinv = _plain_grid(scaled, canonical.ROWS_A_BITS, -1)
    assert torch.equal(canonical.fixed_matmul(p, v, torch.float32), ((pq @ v.q) * pinv).to(torch.float32))

    sq, sinv = _plain_grid(a64, canonical.SUM_BITS, -1)
    assert torch.equal(canonical.fixed_sum(a, -1), (sq.sum(-1, keepdim=True) * sinv).squeeze(-1))
    assert torch.equal(a, before)


def test_fixed_sum_ignores_order_and_zeros():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3000, generator=g) * torch.exp(3 * torch.randn(4, 3000, generator=g))
    s = canonical.fixed_sum(x, -1)
    assert torch.equal(canonical.fixed_sum(x[:, torch.randperm(3000, generator=g)], -1), s)
    assert torch.equal(canonical.fixed_sum(torch.cat([torch.zeros(4, 100), x, torch.zeros(4, 5)], -1), -1), s)
    big = torch.randn(2, 10000, generator=g)  # the int64 path
    assert torch.equal(canonical.fixed_sum(big, -1), canonical.fixed_sum(big.flip(-1), -1))


@pytest.mark.parametrize("name", ["exp", "softplus", "cos", "sin", "sqrt", "rsqrt"])
def test_correctly_rounded_functions_agree_with_mpmath(name, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(2000, generator=g) * 6, torch.tensor([0.0, -0.0, 1e-30, -80.0, 80.0, -110.0])])
    if name in ("cos", "sin"):
        x = torch.cat([x, torch.arange(0, 2048, 7, dtype=torch.float32) * 0.75])
    if name in ("sqrt", "rsqrt"):
        x = torch.cat([x.abs() * torch.exp(3 * torch.randn(x.shape, generator=g)), torch.tensor([1e-38, 4.0, 2.0])])
        x = x[x > 0]
    fast = canonical.correctly_rounded(name, x)
    monkeypatch.setattr(canonical, "FORCE_EXACT", True)
    assert torch.equal(fast, canonical.correctly_rounded(name, x))


def test_exp_of_bf16_values_is_exp_bit_for_bit():
    # every BF16 bit pattern, as BF16 and as FP32: the table gives exp's own bits (NaNs stay NaN)
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x32 = x.float()
    finite = x32.isfinite()
    want = canonical.exp(x32[finite])
    for inp in (x, x32):
        got = canonical.exp_bf16(inp)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got[finite].view(torch.int32), want.view(torch.int32))
        assert got[x32.isnan()].isnan().all() and got[x32 == -math.inf].eq(0).all()
    # an FP32 value that is not a BF16 value falls back to exp itself
    odd = torch.tensor([[0.1, -2.5, 3.0], [1e-3, 7.25, -0.3]])
    assert torch.equal(canonical.exp_bf16(odd), canonical.exp(odd))


def test_the_two_stream_sinkhorn_is_the_torch_loop_bit_for_bit():
    from evalgate.model_adapters.canonical.invariant import _sinkhorn_2x2

    g = torch.Generator().manual_seed(5)
    eps = 1e-6
    for scale in (0.1, 3.0, 80.0):
        e = torch.exp(torch.randn(64, 3, 2, 2, generator=g) * scale).clamp(max=3e38)
        for iters in (1, 2, 20):
            ref = e / e.sum(-1, keepdim=True) + eps  # the loop as written for any number of streams
            ref = ref / (ref.sum(-2, keepdim=True) + eps)
            for _ in range(iters - 1):
                ref = ref / (ref.sum(-1, keepdim=True) + eps)
                ref = ref / (ref.sum(-2, keepdim=True) + eps)
            got = _sinkhorn_2x2(e, iters, eps)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (scale, iters)


def test_topk_breaks_ties_to_the_lower_index():
    values, idx = canonical.topk(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 2)
    assert idx.tolist() == [[1, 2]] and values.tolist() == [[3.0, 3.0]]


# --- exact accumulation of the emulated kernels --------------------------------------------------------


def _quantized_case(fmt, rows=40, k=128, seed=4):
    g = torch.Generator().manual_seed(seed)
    w = formats.fake_quantize(torch.randn(4, 48, k, generator=g), "e2m1", formats.WEIGHTS, "even")
    x = torch.randn(rows, k, generator=g) * torch.exp(2 * torch.randn(rows, k, generator=g))
    a = formats.fake_quantize(x, fmt, formats.PRE_DISPATCH, "zero")
    a[0, :32] *= 2.0 ** -60  # block scales 2^60 apart: only the exact path can add this row
    counts = torch.tensor([10, 0, 25, rows - 35])
    return a, w, counts


@pytest.mark.parametrize("fmt, sig", [("e2m1", 2), ("e4m3", 4)])
def test_every_tier_gives_the_exact_sum_rounded_once(fmt, sig, monkeypatch):
    a, w, counts = _quantized_case(fmt)
    got = exact.exact_grouped_matmul(a, sig, w, counts)
    for tier in (1, 2):
        monkeypatch.setattr(exact, "FORCE_TIER", tier)
        assert torch.equal(exact.exact_grouped_matmul(a, sig, w, counts), got)
    group = torch.repeat_interleave(torch.arange(4), counts)
    for r in (0, 1, 17, 39):
        for n in (0, 5, 47):
            truth = sum(Fraction(float(a[r, k])) * Fraction(float(w[group[r], n, k])) for k in range(a.shape[1]))
            assert float(got[r, n]) == _rn32(truth)


def test_round_sums_f32_settles_a_midpoint_by_the_remainder():
    mid = 1.0 + 2.0 ** -24  # halfway between 1 and the next FP32 value
    assert float(exact.round_sums_f32([[mid, 2.0 ** -80]])[0]) == 1.0 + 2.0 ** -23
    assert float(exact.round_sums_f32([[mid, -(2.0 ** -80)]])[0]) == 1.0
    assert float(exact.round_sums_f32([[mid]])[0]) == 1.0  # a true tie: to even


# The FP8-layout fault reads other tokens' bytes (the hazard it stands for): it depends on the batch by design.
# The one-expert fault is in a router weight, outside the experts' recipe this test replays.
@pytest.mark.parametrize("name", HEALTHY + [n for n in FAULTY if not n.endswith(("fp8-layout", "one-expert"))])
def test_an_emulated_token_does_not_depend_on_its_batch(name):
    """Each token's routed-experts output is the same alone and among 95 others (and their routing)."""
    from evalgate.kernels import check

    case = check.synthetic_layer("tiny", 96, seed=5)
    recipe = K.get_kernel(name).experts_forward.recipe
    w1, w2 = case.weights.dequantize()

    def run(sel):
        em = MoEEmulation(case.x[sel], case.top_k_index[sel], case.top_k_weights[sel], recipe, 16, case.limit, 1.5)
        em.run_chunk(0, 16, w1, w2)
        return em.finish()

    everything = run(slice(None))
    for t in (0, 37, 95):
        assert torch.equal(run(slice(t, t + 1))[0], everything[t])
    assert torch.equal(run(slice(10, 42)), everything[10:42])


# --- the canary: byte-identical generations across batch, threads and instruction set -----------------

MATRIX_CHILD = r"""
import dataclasses, hashlib, json, sys, torch
from evalgate.canary import canary_path, GSM8K_PROFILE, HUMANEVAL_PROFILE
from evalgate.model_adapters.hf.adapter import HFAdapter
from evalgate.tasks import gsm8k
from evalgate.tasks.data import resolve_data_dir
from evalgate.tasks.humaneval import task as humaneval
data = resolve_data_dir(None)
kernels, batches, max_new = sys.argv[1].split(","), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
g_items, g_res = gsm8k.TASK.load(gsm8k.TASK.profiles[GSM8K_PROFILE], data, 40)
h_items, h_res = humaneval.TASK.load(humaneval.TASK.profiles[HUMANEVAL_PROFILE], data, 2)
short = lambda r: dataclasses.replace(r, max_new_tokens=max_new)
gsm = [short(r) for r in gsm8k.TASK.requests(g_items, g_res)]
targets = [gsm[0], short(humaneval.TASK.requests(h_items, h_res)[1])]
fillers = gsm[1:]
def logits_of(adapter, prompts):
    tok = adapter.tokenizer
    enc = tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    mask = enc["attention_mask"]
    with torch.no_grad():
        out = adapter.model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            logits_to_keep=1)
    return out.logits[:, -1].float()
out = {}
for kernel in kernels:
    adapter = HFAdapter(canary_path(), kernel, batch_size=max(batches))
    for b in batches:
        if b == 1:
            gens = [adapter.generate([t])[0] for t in targets]
        else:  # the targets among b - 2 neighbours, one near each end of the batch
            batch = [targets[0]] + fillers[: b - 2] + [targets[1]]
            got = adapter.generate(batch)
            gens = [got[0], got[-1]]
        out[f"{kernel}/batch {b}"] = [[g.text, g.n_tokens, g.finish_reason] for g in gens]
        # and, more sensitive than tokens, the prompts' next-token logits bit for bit
        prompts = [t.prompt for t in targets] if b == 1 else [r.prompt for r in batch]
        rows = [logits_of(adapter, [p])[0] for p in prompts] if b == 1 else list(logits_of(adapter, prompts))
        picked = rows if b == 1 else [rows[0], rows[-1]]
        out[f"{kernel}/batch {b}/logits"] = [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in picked]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                  "numerics": adapter.info()["numerics"], "out": out}))
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split(":", 1)[-1].split())
    except OSError:
        return set()


# The CPU features each ATEN_CPU_CAPABILITY level needs: ATen honours the variable without checking the CPU,
# and a level the CPU lacks dies of SIGILL in the first vectorised kernel.
LEVEL_FLAGS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def _capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY levels this CPU runs, lowest first."""
    flags = _cpu_flags()
    return [level for level, need in LEVEL_FLAGS.items() if need <= flags]


def _matrix_run(capability: str, threads: int, kernels, batches, max_new) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", MATRIX_CHILD, ",".join(kernels), ",".join(map(str, batches)),
                           str(max_new)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_canary_generations_are_identical_across_batch_threads_and_instruction_set():
    """The CI subset of the matrix in docs/kernels.md#canonical-numerics: w4a8 and w4a4_packed, a GSM8K and a
    HumanEval item at batch 1 and 32, one thread at the lowest instruction set and two at the highest
    (every other level this CPU has, with one thread)."""
    levels = _capabilities()
    assert "default" in levels
    runs = [("default", 1)] + [(level, 1) for level in levels[1:-1]] + [(levels[-1], 2)]
    results = [_matrix_run(cap, threads, ["w4a8", "w4a4_packed"], [1, 32], 12) for cap, threads in runs]
    assert {r["numerics"] for r in results} == {canonical.VERSION}
    assert len({r["capability"] for r in results}) == len(levels)
    for r in results:
        for key, got in r["out"].items():
            kernel, _, what = key.split("/", 1)[0], None, "/logits" if key.endswith("/logits") else ""
            want = results[0]["out"][f"{kernel}/batch 1{what}"]
            assert got == want, f"{key} at {r['capability']} with {r['threads']} threads: {got} != {want}"


# --- evalgate serve ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def canary_server(tmp_path_factory):
    from evalgate.model_adapters.server.launcher import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "evalgate", "serve", "--kernel", "w4a4_packed", "--port", str(port), "--batch-size",
            "8", "--batch-window-ms", "20"]
    with running_server(argv, port, log, env, "evalgate serve") as url:
        yield url


def _complete(url: str, prompt: str, delay: float) -> str:
    time.sleep(delay)
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": ["Question:"]}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["text"]


def _client_run(url: str, prompts: list[str], seed: int, workers: int) -> list[str]:
    """One client pass: the prompts sent by ``workers`` threads with random delays, so that the server
    batches them differently every time."""
    rng = random.Random(seed)
    delays = [rng.uniform(0, 0.2) for _ in prompts]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pd: _complete(url, *pd), zip(prompts, delays)))


@pytest.mark.slow
def test_serve_answers_the_same_whatever_a_request_is_batched_with(canary_server):
    from evalgate.canary import GSM8K_PROFILE
    from evalgate.tasks import gsm8k

    items, resolved = gsm8k.TASK.load(gsm8k.TASK.profiles[GSM8K_PROFILE], None, 12)
    prompts = [r.prompt for r in gsm8k.TASK.requests(items, resolved)]
    first = _client_run(canary_server, prompts, seed=1, workers=12)
    second = _client_run(canary_server, prompts, seed=2, workers=5)
    alone = _client_run(canary_server, prompts, seed=3, workers=1)
    assert first == second == alone
    info = json.load(urllib.request.urlopen(canary_server + "/get_server_info"))
    assert info["evalgate"]["model"]["numerics"] == canonical.VERSION


def test_kept_operands_let_rows_leave_and_join_in_place_as_copies_would():
    """``KeptOperands`` (a decoding batch's fixed-point keys and values): rows leaving (``select``, with the
    leading keys none of them sees cut), rows joining shorter (into spare rows and keys, nothing else written)
    and longer (new buffers) and new keys appended hold exactly what stacking fresh copies holds."""
    from evalgate.model_adapters.canonical.invariant import KeptOperands, stack_left_padded

    g = torch.Generator().manual_seed(1)

    def fresh(rows, length):
        keys = canonical.fixed_operand(torch.randn(rows, 1, 8, length, generator=g).bfloat16().float(), "columns")
        values = canonical.fixed_operand(torch.randn(rows, 1, length, 8, generator=g).bfloat16().float(), "rows")
        return KeptOperands(keys, values)

    def parts(kept):
        return [v.clone() for v in kept._views()]

    def joined(a, b):
        length = max(a[0].shape[2], b[0].shape[2])
        return [stack_left_padded(x, y, 2, length, pad) for x, y, pad in zip(a, b, KeptOperands.PAD)]

    kept = fresh(6, 20)
    want = parts(kept)
    # no spare rows yet (new buffers, twice the rows); longer, within the spare keys before the window (in
    # place); shorter (in place); longer than those spare keys (new buffers)
    for step, (rows, length) in enumerate([(3, 12), (2, 30), (4, 5), (2, 400)]):
        other = fresh(rows, length)
        before = kept.bufs[0]
        pad_self, pad_other = max(0, length - kept.length), max(0, kept.length - length)
        want = joined(want, parts(other))
        kept.join(other, pad_self, pad_other)
        assert (kept.bufs[0] is before) == (step in (1, 2))
        assert all(torch.equal(a, b) for a, b in zip(parts(kept), want))
        keep = [j for j in range(kept.batch) if j % 3 != 1]
        index = torch.tensor(keep)
        mask = torch.stack([v.abs().sum((1, 3)) > 0 for v in want[:1]])[0][index]
        cut = int(mask.any(0).nonzero()[0])
        want = [v[index][:, :, cut:] for v in want]
        kept.select(index, cut)
        assert all(torch.equal(a, b) for a, b in zip(parts(kept), want))
        new = fresh(kept.batch, 1)
        kept.append(*new.operands())
        want = [torch.cat([a, b], 2) for a, b in zip(want, parts(new))]
        assert all(torch.equal(a, b) for a, b in zip(parts(kept), want))
    repeated = torch.tensor([0, 0, 1, 1] * kept.batch)  # more rows than the buffers hold: new ones
    want = [v[repeated] for v in want]
    kept.select(repeated, 0)
    assert all(torch.equal(a, b) for a, b in zip(parts(kept), want))
