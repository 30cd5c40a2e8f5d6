"""The Triton kernels (evalgate.kernels.triton) against the PyTorch emulator, bit for bit, under Triton's
interpreter (TRITON_INTERPRET=1: the same kernels on the CPU). Skipped where Triton does not import."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: pip install triton (its interpreter runs the kernels on a CPU)",
                allow_module_level=True)
# Triton reads TRITON_INTERPRET when it is imported (triton.language's own jit functions are made then):
# set it first. When something imported Triton earlier in this process without it (transformers can, in a
# full test session), the interpreter cannot run here and test_in_a_fresh_process reruns this file.
IN_PROCESS = (torch.cuda.is_available() or "triton" not in sys.modules
              or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
here = pytest.mark.skipif(not IN_PROCESS, reason="Triton was imported without TRITON_INTERPRET=1; see "
                                                 "test_in_a_fresh_process")

import evalgate.kernels as K
from evalgate.kernels import check, formats
from evalgate.kernels.emulator import MoEEmulation, weight_fault
from evalgate.kernels.triton import certify, dispatch, fast, moe
from evalgate.kernels.triton.quantize import quantize_rows, values_from_codes

from evalgate.errors import UserError

EMULATED = [n for n in K.kernel_names() if getattr(K.get_kernel(n).experts_forward, "recipe", None) is not None]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t):
    return t.to(torch.float32).contiguous().view(torch.int32)


def _emulate(case, recipe):
    """The emulator's output for one recipe on a synthetic layer (CPU)."""
    em = MoEEmulation(case.x, case.top_k_index, case.top_k_weights, recipe, case.weights.num_experts, case.limit,
                      case.routed_scaling)
    hit = torch.bincount(case.top_k_index.flatten(), minlength=case.weights.num_experts) > 0
    for lo in range(case.weights.num_experts):
        if hit[lo]:
            em.run_chunk(lo, lo + 1, *case.weights.dequantize(lo, lo + 1, fault=weight_fault(recipe)))
    return em.finish()


def _triton(case, recipe):
    dev = torch.device(DEVICE)
    return moe.moe_forward(case.x.to(dev), case.top_k_index.to(dev), case.top_k_weights.to(dev),
                           case.weights.to(dev), recipe, case.limit, case.routed_scaling).cpu()


@pytest.fixture(scope="module")
def tiny_case():
    return check.synthetic_layer("tiny", 24, seed=5)


# --- quantization ------------------------------------------------------------------------------------


@here
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("rule", [formats.PRE_DISPATCH, formats.SGLANG_FP8, formats.EPILOGUE], ids=lambda r: r.name)
def test_quantizer_gives_the_codes_and_bytes_of_formats_quantize(fmt, rule):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=g) * torch.exp(3 * torch.randn(8, 4, 1, generator=g)).repeat_interleave(32, 1).view(8, 128)
    x[0, :32] = torch.tensor([7, -1.5, 3.5, 0.5, 2.5, -5, 1, 0, 1.25, -0.75, 4, 6, -7, 0.625, 2, -3, 0.375, 1.5,
                              -2.5, 5.5, 0.125, -0.25, 3, -6.5, 1.75, -1, 0.875, 2.25, -4.5, 0.0625, -0.5, 4.5])  # T2
    x[1] = 0  # all-zero groups: the floor, or byte 0 at the epilogue
    x[2, 32:64] = 1e-30  # tiny groups
    for ties in ("zero", "even"):
        q, byte, hi, lo = quantize_rows(x.to(DEVICE), fmt, rule, ties)
        _, want_byte = formats.quantize(x, fmt, rule, ties)
        assert torch.equal(byte.cpu(), want_byte)
        assert torch.equal(values_from_codes(q.cpu(), byte.cpu(), fmt), formats.fake_quantize(x, fmt, rule, ties))
        assert hi[1] == -1 and lo[1] == 512  # no non-zero group: no term to certify
    if fmt == "e2m1":  # T2's tie elements: the two modes differ exactly where the spec says
        zero = quantize_rows(x[:1].to(DEVICE), fmt, formats.WEIGHTS, "zero")[0].cpu()
        even = quantize_rows(x[:1].to(DEVICE), fmt, formats.WEIGHTS, "even")[0].cpu()
        assert (zero[0, 0, :32] != even[0, 0, :32]).nonzero().flatten().tolist() == [0, 1, 2, 12, 17]


# --- the weight decoder's PTX, read by a model of its instructions ---------------------------------------

_U32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte c[4i+2:4i] of {b, a}, or that byte's sign
    replicated where c[4i+3] is set."""
    pool = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 15
        byte = pool[sel & 7]
        out |= ((255 if byte & 128 else 0) if sel & 8 else byte) << 8 * i
    return out


def _run_ptx(asm: str, operands: dict) -> dict:
    """Run the straight-line b32/u32 PTX of an inline-asm block on Python ints (the instructions
    _WORDS_ASM uses); operands: "$k" -> value. Returns every register written."""
    regs = dict(operands)
    ops = {"mov": lambda a: a, "xor": lambda a, b: a ^ b, "or": lambda a, b: a | b, "and": lambda a, b: a & b,
           "sub": lambda a, b: (a - b) & _U32, "prmt": _prmt,
           # PTX clamps a shift amount, read unsigned, to 32
           "shl": lambda a, b: (a << min(b, 32)) & _U32, "shr": lambda a, b: a >> min(b, 32)}
    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        value = lambda t: int(t, 0) if t[0].isdigit() else regs[t]  # noqa: E731
        regs[dst] = ops[op.split(".")[0]](*map(value, src)) & _U32
    return regs


def test_the_weight_decoders_ptx_gives_the_table_of_shifted_twice_values():
    """Every code pair of a packed byte in every position of a 32-bit word, at every shift: the PTX the fast
    GEMMs decode weights with (fast._WORDS_ASM) gives the int8 twice-values, shifted, of the table the
    interpreter reads (fast.shifted_twice_table), K 8q .. 8q+3 in $0 and 8q+4 .. 8q+7 in $1."""
    table = fast.shifted_twice_table("cpu").view(4, 16).tolist()
    asm = fast._WORDS_ASM.value
    words = [b * 0x01010101 for b in range(256)] + [b << 8 * i for b in range(256) for i in range(4)]
    g = torch.Generator().manual_seed(3)
    words += torch.randint(0, 1 << 32, (4000,), generator=g, dtype=torch.int64).tolist()
    for shift in range(4):
        for word in words:
            regs = _run_ptx(asm, {"$2": word, "$3": shift, "$4": shift, "$5": shift, "$6": shift})
            got = [(regs[out] >> 8 * i) & 255 for out in ("$0", "$1") for i in range(4)]
            assert got == [table[shift][(word >> 4 * i) & 15] & 255 for i in range(8)], (hex(word), shift)
    # a group of zero codes (+0 and -0) takes its byte - the column's lo unclamped: below 0 or above 3
    zeros = [sum(((m >> i) & 1) << (4 * i + 3) for i in range(8)) for m in range(256)]
    for shift in [*range(-255, 0), *range(4, 256)]:
        for word in zeros[::17] + [zeros[(shift * 7) % 256]]:
            regs = _run_ptx(asm, {f"${i}": shift & _U32 for i in range(3, 7)} | {"$2": word})
            assert regs["$0"] == regs["$1"] == 0, (hex(word), shift)


# --- the whole forward, every recipe ----------------------------------------------------------------


@here
def test_every_emulated_kernel_is_bit_identical_on_a_tiny_layer(tiny_case):
    rows = check.triton_layer_check("tiny", case=tiny_case, device=DEVICE)
    assert sorted(r["kernel"] for r in rows) == sorted(EMULATED)
    for r in rows:
        assert r["identical"], r
        assert r["gemm_rows"] == 2 * 24 * 4  # both GEMMs, every (token, slot) row


# --- the routing plan: one kernel against its torch definition -------------------------------------------


def _routing_case(t, k, experts, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.1] = -1  # empty slots, and experts out of range
    idx[torch.rand(t, k, generator=g) < 0.05] = experts
    w = torch.rand(t, k, generator=g).to(torch.bfloat16)
    return idx.to(DEVICE), w.to(DEVICE)


@here
@pytest.mark.parametrize("t,k,experts,bm,one_program", [
    (1, 6, 256, 16, True), (3, 2, 5, 16, True), (2, 8, 3, 16, True), (21, 6, 8, 16, True),
    (40, 6, 8, 32, False), (64, 6, 256, 16, False), (600, 6, 256, 16, False), (682, 6, 7, 16, False)])
def test_the_routing_kernels_give_the_torch_definitions_integers(t, k, experts, bm, one_program):
    """`routing.route` on its kernels (one program up to ONE_PROGRAM_ROWS, else a counting sort over chunks)
    against SortedRows.torch + gemm.tile_schedule: every field, the padding tiles included (600 x 6 rows:
    more tiles than one pass of TILE_BLOCK and 29 chunks; 682 x 6: the last of 32 chunks partial)."""
    from evalgate.kernels.triton import routing
    from evalgate.kernels.triton.gemm import tile_schedule

    idx, w = _routing_case(t, k, experts, seed=t * k + experts)
    s = t * k
    assert routing.fits(s, experts) and (s <= routing.ONE_PROGRAM_ROWS) == one_program
    count = torch.full((6,), 7, dtype=torch.int32, device=DEVICE)  # garbage: the kernel sets them
    hi = torch.full((s,), 3, dtype=torch.int32, device=DEVICE)
    lo = torch.full((s,), 3, dtype=torch.int32, device=DEVICE)
    rows, tiles = routing.route(idx, w, experts, bm, count, hi, lo)
    want = routing.SortedRows.torch(idx, w, experts)
    for field in ("rows", "expert", "token", "counts", "w"):
        got, ref = getattr(rows, field), getattr(want, field)
        assert got.dtype == ref.dtype and torch.equal(got, ref), field
    for got, ref in zip(tiles, tile_schedule(want.counts, s, bm)):
        assert torch.equal(got, ref)
    assert count.eq(0).all() and hi.eq(-1).all() and lo.eq(512).all()


@here
def test_the_forward_gives_the_same_bits_with_the_torch_routing(tiny_case, monkeypatch):
    """Calls too large for one program take the torch definition: same output bits."""
    from evalgate.kernels.triton import routing

    recipe = K.get_kernel("w4a4_packed").experts_forward.recipe
    one_program = _triton(tiny_case, recipe)
    monkeypatch.setattr(routing, "ROUTE_MAX_ROWS", 0)
    assert torch.equal(_bits(_triton(tiny_case, recipe)), _bits(one_program))


@here
def test_the_faults_change_the_output(tiny_case):
    """Bit-identity is not vacuous: each faulty twin differs from w4a4_packed, on the Triton path too."""
    healthy = _triton(tiny_case, K.get_kernel("w4a4_packed").experts_forward.recipe)
    for name in EMULATED:
        if K.get_kernel(name).faulty:
            assert not torch.equal(_triton(tiny_case, K.get_kernel(name).experts_forward.recipe), healthy), name


@here
@pytest.mark.parametrize("name", ["w4a4_packed", "w4a8"])
def test_rows_the_certificate_refuses_are_recomputed_on_the_host(tiny_case, name):
    """A token whose groups' scales differ by 2^50: its rows fail the certificate, go through
    exact.exact_matmul on the host, and still give the emulator's bits."""
    x = tiny_case.x.clone()
    x[3, :32] *= 2.0**40  # (2^-10: above the input amax floor, so the group keeps non-zero codes)
    x[3, 32:64] *= 2.0**-10
    case = check.LayerCase(x, tiny_case.top_k_index, tiny_case.top_k_weights, tiny_case.weights, tiny_case.limit,
                           tiny_case.routed_scaling)
    recipe = K.get_kernel(name).experts_forward.recipe
    before = moe.STATS["host_rows"]
    out = _triton(case, recipe)
    assert moe.STATS["host_rows"] - before >= 1
    assert torch.equal(_bits(out), _bits(_emulate(case, recipe)))


@here
def test_host_path_alone_gives_the_same_bits(tiny_case, monkeypatch):
    monkeypatch.setattr(certify, "FORCE_HOST_ROWS", True)
    recipe = K.get_kernel("w4a4_te").experts_forward.recipe
    before = moe.STATS["host_rows"]
    out = _triton(tiny_case, recipe)
    assert moe.STATS["host_rows"] - before == 2 * 24 * 4
    assert torch.equal(_bits(out), _bits(_emulate(tiny_case, recipe)))


# --- the fast path and the per-block path ----------------------------------------------------------


def _same_bits(case, name):
    recipe = K.get_kernel(name).experts_forward.recipe
    assert torch.equal(_bits(_triton(case, recipe)), _bits(_emulate(case, recipe))), name


def _no_fast_rows(monkeypatch):
    """Plan every row for the per-block path (gemm.int_gemm): fast.plan_rows with force_slow."""
    plan = fast.plan_rows
    monkeypatch.setattr(fast, "plan_rows", lambda *args: plan(*args[:-1], True))


def _spy_limbs(monkeypatch) -> list[int]:
    """Record, per GEMM plan (fast.plan_rows), the most limbs one of its fast rows needs."""
    widest = []

    def spy(*args, plan=fast.plan_rows):
        need, p = plan(*args)
        widest.append(int(need.max()) if need.numel() else 0)
        return need, p

    monkeypatch.setattr(fast, "plan_rows", spy)
    return widest


@here
@pytest.mark.parametrize("name", ["w4a4_packed", "w4a8", "faulty/w4a4_packed-weight-after-requant"])
def test_the_per_block_path_in_small_chunks_gives_the_same_bits(tiny_case, monkeypatch, name):
    """Every row through the per-block path (no fast rows), SLOW_CHUNK_ROWS rows at a time."""
    _no_fast_rows(monkeypatch)
    monkeypatch.setattr(moe, "SLOW_CHUNK_ROWS", 7)
    before = moe.STATS["slow_rows"]
    _same_bits(tiny_case, name)
    if name != "faulty/w4a4_packed-weight-after-requant":  # that one takes the per-block path anyway
        assert moe.STATS["slow_rows"] - before == 2 * 24 * 4


def _spy_splits(monkeypatch):
    """Record the SPLIT each GEMM launch chose (fast._split_k)."""
    splits = []

    def spy(*args, choose=fast._split_k):
        splits.append(choose(*args))
        return splits[-1]

    monkeypatch.setattr(fast, "_split_k", spy)
    return splits


@here
def test_split_k_gives_the_same_bits(tiny_case, monkeypatch):
    """Split K (forced: FAST["split_k"] above any grid): L1 over 4 programs per tile and column block, L2
    over 2, their int32 partials added atomically and the epilogue in its own kernel; the same bits as the
    emulator (and so as the unsplit path, which the tests above hold to it)."""
    monkeypatch.setitem(fast.FAST, "split_k", 1 << 20)
    monkeypatch.setitem(fast.FAST, "bk", 64)  # a GPU's K step too (the interpreter's shrinks to 64 by itself)
    splits = _spy_splits(monkeypatch)
    names = ("w4a4_packed", "w4a8", "faulty/w4a4_packed-scale-exp")
    for name in names:
        _same_bits(tiny_case, name)
    assert [s for s, _ in splits] == [4, 2] * len(names)  # (L1 K = 256, L2 K = 128, K steps of 64)


@here
def test_split_k_with_every_limb_count_and_slow_rows_gives_the_same_bits(tiny_case, monkeypatch):
    """Split K on rows needing 1, 2 and 3 limbs (one split launch per limb count into the same partials,
    one epilogue for all) beside an expert the fast path refuses; and under ``defer_finish``."""
    monkeypatch.setitem(fast.FAST, "split_k", 1 << 20)
    monkeypatch.setitem(fast.FAST, "bk", 64)  # a GPU's K step too (the interpreter's shrinks to 64 by itself)
    splits = _spy_splits(monkeypatch)
    widest = _spy_limbs(monkeypatch)
    _same_bits(_wide_case(tiny_case), "w4a4_packed")
    assert 3 in widest and 2 in widest
    assert all(s > 1 for s, _ in splits)
    recipe = K.get_kernel("faulty/w4a4_packed-drop-slot").experts_forward.recipe
    with moe.defer_finish() as layers:
        deferred = _triton(tiny_case, recipe)
        assert int(layers.slow_rows(DEVICE)) == 0
    assert torch.equal(_bits(deferred), _bits(_emulate(tiny_case, recipe)))


def test_split_k_is_chosen_from_static_shapes(monkeypatch):
    """SPLIT on a GPU of 132 SMs at DSV4-Flash's decoding shapes (K step 128): the largest power of two
    keeping programs within FAST["split_k"] per SM and K / SPLIT a multiple of the K step."""
    monkeypatch.setattr(fast, "interpreted", lambda: False)
    monkeypatch.setattr(fast, "sm_count", lambda device: 132)
    monkeypatch.setitem(fast.FAST, "split_k", 8)
    # 1 token x top-6: 7 tiles (the schedule's static bound) x 32 column blocks (L1: 64 gate + 64 up columns
    # over K 4096; L2: 128 columns over K 2048)
    assert fast._split_k(7 * 32, 4096, 128, "cuda") == (4, 128)
    assert fast._split_k(7 * 32, 2048, 128, "cuda") == (4, 128)
    assert fast._split_k(102 * 32, 4096, 128, "cuda") == (1, 128)  # 16 tokens: 102 tiles
    assert fast._split_k(1, 256, 128, "cuda") == (2, 128)  # no K range shorter than one step
    monkeypatch.setitem(fast.FAST, "split_k", 2)
    assert fast._split_k(7 * 32, 4096, 128, "cuda") == (1, 128)
    monkeypatch.setitem(fast.FAST, "split_k", 0)
    assert fast._split_k(7 * 32, 4096, 128, "cuda") == (1, 128)


@here
@pytest.mark.parametrize("widest_first", [True, False])
def test_l2_upper_limbs_on_half_tiles_give_the_same_bits(monkeypatch, widest_first):
    """L2 with each expert's rows sorted by the limbs they need (fast.halves): tiles whose second half needs
    one limb run the upper limbs on their first half (HALF 1), the others every limb on every row (HALF 2;
    reached here by sorting the narrowest rows first instead)."""
    case = check.synthetic_layer("tiny", 160, seed=5)
    monkeypatch.setitem(fast.FAST, "bm", 32)
    monkeypatch.setitem(fast.FAST, "half2", 32)
    if not widest_first:
        narrowest_first = lambda e, n: torch.sort(e * 4 + n.to(torch.int32), stable=True).indices  # noqa: E731
        monkeypatch.setattr(fast, "sort_by_need", narrowest_first)
    kinds = set()

    def spy(a, p, need, slot, fp4, bases, tiles, bm, *args, l2=fast.l2_gemm, **kw):
        assert kw["halves"] and bm == 32
        for e, b, end in zip(*(t.tolist() for t in tiles)):
            if e >= 0 and end - b > 16:
                kinds.add((int(need[b:end].max()) > 1, int(need[b + 16:end].max()) > 1))
        return l2(a, p, need, slot, fp4, bases, tiles, bm, *args, **kw)

    monkeypatch.setattr(fast, "l2_gemm", spy)
    for name in ("w4a4_packed", "faulty/w4a4_packed-scale-exp"):
        _same_bits(case, name)
    assert ((True, False) in kinds) if widest_first else ((True, True) in kinds)


@here
def test_wide_rows_take_more_limbs_and_wide_experts_the_per_block_path(tiny_case, monkeypatch):
    """Token rows whose groups span 2^6 and 2^12 (2 and 3 activation limbs), and an expert with a weight
    column spanning 2^5 (refused by the fast path: its rows go the per-block way), in one call."""
    case = _wide_case(tiny_case)
    widest, slow = _spy_limbs(monkeypatch), moe.STATS["slow_rows"]
    _same_bits(case, "w4a4_packed")
    assert 3 in widest
    assert moe.STATS["slow_rows"] > slow


def _wide_case(case):
    """``case`` with rows of 2 and 3 activation limbs and an expert the fast path refuses (its rows go the
    per-block way)."""
    x = case.x.clone()
    x[1, :32] *= 2.0**6
    x[2, :32] *= 2.0**12
    w = case.weights
    s1 = w.w1_scale.clone()
    s1[int(case.top_k_index[0, 0]), 0, 0] += 5
    weights = type(w)(w.w1, s1, w.w2, w.w2_scale, source=w.source)
    return check.LayerCase(x, case.top_k_index, case.top_k_weights, weights, case.limit, case.routed_scaling)


@here
@pytest.mark.parametrize("name", ["w4a4_packed", "faulty/w4a4_packed-scale-exp", "faulty/w4a4_packed-drop-slot"])
def test_a_deferred_layer_gives_the_final_bits_when_it_counts_no_slow_rows(tiny_case, name):
    """Under ``defer_finish`` (what a whole-step CUDA graph captures) a call never syncs; when its device
    count of rows the fast path left is 0 its output is already the finished one, bit for bit; a call with
    wide rows and a refused expert counts them (the step then runs again without the graph)."""
    recipe = K.get_kernel(name).experts_forward.recipe
    with moe.defer_finish() as layers:
        deferred = _triton(tiny_case, recipe)
        assert int(layers.slow_rows(DEVICE)) == 0 and len(layers.counts) == 1
    assert torch.equal(_bits(deferred), _bits(_triton(tiny_case, recipe)))
    with moe.defer_finish() as layers:
        _triton(_wide_case(tiny_case), recipe)
        assert int(layers.slow_rows(DEVICE)) > 0


@here
def test_paths_that_sync_are_refused_under_deferral(tiny_case, monkeypatch):
    packed = K.get_kernel("w4a4_packed").experts_forward
    assert moe.capturable(packed.recipe) is None
    after = K.get_kernel("faulty/w4a4_packed-weight-after-requant").experts_forward
    assert "syncs on the host" in moe.capturable(after.recipe)
    with moe.defer_finish(), pytest.raises(moe.NotCapturable):
        _triton(tiny_case, after.recipe)
    monkeypatch.setattr(certify, "FORCE_HOST_ROWS", True)
    assert "syncs on the host" in moe.capturable(packed.recipe)
    with moe.defer_finish(), pytest.raises(moe.NotCapturable):
        _triton(tiny_case, packed.recipe)


@here
def test_whole_decoding_steps_give_the_eager_steps_bits(monkeypatch):
    """A tiny DeepSeek-V4 model on the Triton path decoding from slots: each step through its bucket (on a
    GPU a CUDA graph of the whole step, captured on the bucket's second step; on a CPU the same body without
    a graph) gives, bit for bit, the logits of the eager step of the same rows (the same padding rows)."""
    from evalgate.kernels.tiny_model import tiny_deepseek_v4
    from evalgate.model_adapters.fast.attention_slots import SlotCache
    from evalgate.model_adapters.fast.step_graphs import StepGraphs

    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    model = tiny_deepseek_v4(seed=2, layers=2).to(DEVICE)  # a hash-routed layer and a routed one
    model.set_experts_implementation("w4a4_packed")
    cache = SlotCache(model, slots=4, max_length=40, spare=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for slot, n in zip((3, 0, 2), (9, 14, 5)):
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(DEVICE)
            cache.admit(slot, model(input_ids=ids, use_cache=True).past_key_values, n)
        steps = StepGraphs(cache, graphs=DEVICE == "cuda")
        slots, tokens = [3, 0, 2], torch.tensor([5, 6, 7], device=DEVICE)
        for i in range(3):
            padded = torch.tensor(slots + [4], device=DEVICE)  # the bucket of 4: one padding row, spare slot 4
            eager = cache.forward(torch.cat([tokens, tokens.new_zeros(1)]), padded)[:3]  # the pad token: 0
            got = steps.step(tokens, slots)
            assert torch.equal(_bits(got), _bits(eager)), i
            tokens = got.argmax(-1)
    assert steps.stats["reruns"] == 0
    assert steps.stats["replays"] == (2 if DEVICE == "cuda" else 0)  # the steps after the first


@here
def test_the_triton_path_never_dequantizes_the_experts(tiny_case, monkeypatch):
    """Weights stay packed: the kernels read codes and scale bytes; no dequantized copy is made."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path dequantized the experts")

    monkeypatch.setattr(type(tiny_case.weights), "dequantize", refuse)
    monkeypatch.setattr(formats, "dequantize_packed_e2m1", refuse)
    _triton(tiny_case, K.get_kernel("w4a4_packed").experts_forward.recipe)


# --- backend choice ---------------------------------------------------------------------------------


@here
def test_registered_kernels_choose_their_backend(monkeypatch):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = K.get_kernel("w4a4_packed").experts_forward
    assert ALL_EXPERTS_FUNCTIONS["w4a4_packed"] is fn and fn.torch_forward is not None
    assert fn.recipe == fn.torch_forward.recipe
    assert K.get_kernel("bf16").experts_forward.__dict__.get("torch_forward") is None  # no recipe: unchanged
    x = torch.zeros(2, 8, device=DEVICE)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
    assert not dispatch.use_triton(x, fn.recipe)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "auto")
    assert dispatch.use_triton(x, fn.recipe) == (DEVICE == "cuda")
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    assert dispatch.use_triton(x, fn.recipe)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "fast")
    with pytest.raises(UserError, match="EVALGATE_KERNEL_BACKEND"):
        dispatch.backend()


@here
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU needs the interpreter; a GPU does not")
def test_triton_backend_on_a_cpu_without_the_interpreter_says_how(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(torch.zeros(1, 8), K.get_kernel("w4a4").experts_forward.recipe)


@here
def test_a_tiny_model_generates_the_same_tokens_on_both_backends(monkeypatch):
    """Through transformers' experts interface: the Triton backend, chosen by the environment, gives the
    emulator's logits exactly."""
    from evalgate.kernels.tiny_model import tiny_deepseek_v4

    model = tiny_deepseek_v4(seed=2)
    model.set_experts_implementation("w4a4_packed")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
        emulated = model(input_ids=ids).logits
        monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
        before = moe.STATS["rows"]
        tritoned = model.to(DEVICE)(input_ids=ids.to(DEVICE)).logits.cpu()
    assert moe.STATS["rows"] > before
    assert torch.equal(_bits(emulated), _bits(tritoned))


@here
def test_cli_reports_bit_identity():
    from click.testing import CliRunner

    from evalgate.cli import main

    result = CliRunner().invoke(main, ["kernels", "check", "--backend", "triton", "--shape", "tiny", "--tokens", "8",
                                       "--kernels", "w4a4_packed,faulty/w4a4_packed-fp8-layout", "--json"])
    assert result.exit_code == 0, result.output
    import json

    rows = json.loads(result.output[result.output.index("{"):])["rows"]
    assert [r["identical"] for r in rows] == [True, True]


@pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
def test_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
