"""Emulated kernels: registry, the docs/kernels.md#the-moe-forward recipe on one layer, and kernels swapped into a tiny DeepSeek-V4."""

import pytest
import torch

import evalgate.kernels as K
from evalgate.errors import UserError
from evalgate.kernels import check, formats, weights
from evalgate.kernels.emulator import MoEEmulation, combine, gate_up_to_bf16, swiglu
from evalgate.kernels.tiny_model import tiny_deepseek_v4

HEALTHY = ["bf16", "w4a8", "w4a8_sglang", "w4a4", "w4a4_packed", "w4a4_te"]
FAULTY = [
    "faulty/w4a4_packed-scale-exp",
    "faulty/w4a4_packed-fp8-layout",
    "faulty/w4a4_packed-weight-after-requant",
    "faulty/w4a4_packed-drop-slot",
]


# --- registry ---------------------------------------------------------------------------------------


def test_every_kernel_is_registered_on_both_interfaces():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert set(HEALTHY + FAULTY) <= set(K.kernel_names())
    for name in HEALTHY + FAULTY:
        assert ALL_EXPERTS_FUNCTIONS[name] is K.get_kernel(name).experts_forward
        assert ALL_FP8_EXPERTS_FUNCTIONS[name] is K.get_kernel(name).experts_forward


def test_kernel_identities():
    packed, old = K.get_kernel("w4a4_packed"), K.get_kernel("w4a4")
    assert packed.recipe == old.recipe and packed.version != old.version
    assert old.recipe["input_ties"] == "zero" and K.get_kernel("w4a4_te").recipe["input_ties"] == "even"
    assert K.get_kernel("w4a8").recipe["input_amax_floor"] == 1e-4
    assert K.get_kernel("w4a8").recipe["router_weight"] == "before_requant"
    for name in FAULTY:
        k = K.get_kernel(name)
        assert k.faulty and k.twin == "w4a4_packed" and name.startswith("faulty/")
    assert not any(K.get_kernel(n).faulty for n in HEALTHY)
    assert "faulty/w4a4_packed-scale-exp" not in K.kernel_names(include_faulty=False)


def test_unknown_kernel_is_a_user_error():
    with pytest.raises(UserError, match="unknown kernel"):
        K.get_kernel("w4a2")


# --- one layer against the FP32 reference ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_layer():
    case = check.synthetic_layer("tiny", 96, seed=3)
    rows = check.layer_check("tiny", case=case)
    return case, {r["kernel"]: r for r in rows}


def test_layer_error_grows_with_coarser_formats(tiny_layer):
    _, r = tiny_layer
    assert r["bf16"]["rel_rmse"] < r["w4a8"]["rel_rmse"] < r["w4a4"]["rel_rmse"]
    assert r["w4a4"]["cosine"] > 0.9


def test_w4a4_and_w4a4_packed_are_identical(tiny_layer):
    case, r = tiny_layer
    assert r["w4a4"] == {**r["w4a4_packed"], "kernel": "w4a4"}
    runs = {}
    for name in ("w4a4", "w4a4_packed"):
        em = MoEEmulation(case.x, case.top_k_index, case.top_k_weights,
                          K.get_kernel(name).experts_forward.recipe, 16, case.limit, 1.5)
        em.run_chunk(0, 16, *case.weights.dequantize())
        runs[name] = em.finish()
    assert torch.equal(runs["w4a4"], runs["w4a4_packed"])


@pytest.mark.parametrize("name", ["faulty/w4a4_packed-scale-exp", "faulty/w4a4_packed-fp8-layout",
                                  "faulty/w4a4_packed-drop-slot"])
def test_faulty_kernels_stand_out(tiny_layer, name):
    _, r = tiny_layer
    assert r[name]["rel_rmse"] > 1.5 * r["w4a4_packed"]["rel_rmse"]
    assert r[name]["calc_diff"] > 3 * r["w4a4_packed"]["calc_diff"]


def test_router_weight_after_requant_differs_from_its_twin(tiny_layer):
    """Fault (c) is as far from the FP32 reference as its twin (both are one FP4 rounding of the same
    thing, T6), so error size cannot reveal it; held against the twin emulation it fails docs/kernels.md#checking-a-real-kernel's
    calc_diff < 0.001 by an order of magnitude."""
    case, _ = tiny_layer
    outs = {}
    for name in ("w4a4_packed", "faulty/w4a4_packed-weight-after-requant"):
        em = MoEEmulation(case.x, case.top_k_index, case.top_k_weights,
                          K.get_kernel(name).experts_forward.recipe, 16, case.limit, 1.5)
        em.run_chunk(0, 16, *case.weights.dequantize())
        outs[name] = em.finish()
    assert check.calc_diff(*outs.values()) > 10 * 1e-3


# --- the experts function against a step-by-step scalar-ish reference --------------------------------


def _slow_forward(x, idx, w, fp4, recipe_name, limit=10.0):
    """Spec docs/kernels.md#the-moe-forward one (token, slot) at a time with plain matmuls: the independent reading of the recipe."""
    r = K.get_kernel(recipe_name).recipe
    w1, w2 = fp4.dequantize()
    rule = formats.SCALE_RULES[r["input_scale_rule"]]
    e_count = w1.shape[0]
    out = torch.zeros(x.shape[0], idx.shape[1], x.shape[1])
    for t in range(x.shape[0]):
        xq = formats.fake_quantize(x[t : t + 1].float(), r["activations"], rule, r["input_ties"])
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0 or e >= e_count:
                continue
            g, u = gate_up_to_bf16(_exact_dot(xq, w1[e]), limit)
            v = formats.fake_quantize(swiglu(g, u) * w[t, k].float(), r["intermediate"], formats.EPILOGUE, "even")
            out[t, k] = formats.bf16_round(_exact_dot(v, w2[e]))[0]
    return combine(out)


def _exact_dot(x, w):
    """x [1, K] @ w[N, K]^T: float64 is exact for these small quantized operands; rounded once to FP32."""
    return (x.double() @ w.double().T).float()


class _Experts(torch.nn.Module):
    def __init__(self, gate_up, down, limit=10.0):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = torch.nn.Parameter(down, requires_grad=False)
        self.limit = limit
        self.num_experts = gate_up.shape[0]


def _experts_case(seed=0, e=6, h=64, i=32, t=12, k=3):
    g = torch.Generator().manual_seed(seed)
    module = _Experts((torch.randn(e, 2 * i, h, generator=g) * 0.3).bfloat16(),
                      (torch.randn(e, h, i, generator=g) * 0.3).bfloat16())
    x = (torch.randn(t, h, generator=g) * 2).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) * 0.5
    return module, x, idx, w


@pytest.mark.parametrize("name", ["w4a8", "w4a4", "w4a4_te"])
def test_vectorised_forward_matches_step_by_step(name):
    module, x, idx, w = _experts_case()
    idx[0, 1] = module.num_experts  # HF's sentinel: an empty slot
    idx[1, 0] = -1  # DeepGEMM's
    got = K.get_kernel(name).experts_forward(module, x, idx, w)
    want = _slow_forward(x, idx, w, weights.fp4_weights(module), name)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want)  # exact accumulation: no summation order to differ in


@pytest.mark.parametrize("name", ["w4a8", "w4a4_packed", "faulty/w4a4_packed-fp8-layout"])
def test_l1_spans_computed_per_token_are_those_of_the_l1_rows(name):
    """The L1 input repeats each token's quantized row in every slot: its certificate span is computed once
    per token and must equal the span of the rows the GEMM reads, for every expert range."""
    from evalgate.kernels.exact import row_span

    module, x, idx, w = _experts_case(t=20, k=4)
    em = MoEEmulation(x, idx, w, K.get_kernel(name).experts_forward.recipe, module.num_experts, None)
    for lo, hi in ((0, module.num_experts), (0, 2), (3, 6)):
        begin, end = em.span(lo, hi)
        assert torch.equal(em.l1_span(begin, end), row_span(em.l1_input(begin, end), em.l1_sig))


def test_empty_slots_contribute_nothing():
    module, x, idx, w = _experts_case()
    f = K.get_kernel("w4a4").experts_forward
    all_empty = torch.full_like(idx, module.num_experts)
    assert f(module, x, all_empty, w).abs().sum() == 0


def test_weights_are_quantized_once_and_invalidated_by_edits():
    module, x, idx, w = _experts_case()
    f = K.get_kernel("w4a8").experts_forward
    f(module, x, idx, w)
    first = weights.fp4_weights(module)
    f(module, x, idx, w)
    assert weights.fp4_weights(module) is first
    with torch.no_grad():
        module.gate_up_proj.mul_(2)
    assert weights.fp4_weights(module) is not first


def test_chunked_dequantization_matches_cached(monkeypatch):
    module, x, idx, w = _experts_case()
    f = K.get_kernel("w4a4").experts_forward
    cached = f(module, x, idx, w)
    monkeypatch.setattr(weights, "DEQUANT_CACHE_BYTES", 0)
    monkeypatch.setattr(weights, "CHUNK_BYTES", 2 * 3 * 64 * 32 * 12)  # two experts at a time
    assert torch.equal(f(module, x, idx, w), cached)


def test_the_accumulation_scheme_is_part_of_every_kernel_identity():
    from evalgate.kernels.recipe import ACCUMULATION

    assert ACCUMULATION == "canonical-v1"
    for name in HEALTHY[1:] + FAULTY:
        assert K.get_kernel(name).recipe["accumulation"] == ACCUMULATION


def test_bf16_replica_in_the_check_matches_transformers():
    """The layer check's chunked bf16 path computes what the registered bf16 kernel computes."""
    from evalgate.kernels.reference import Bf16GroupedMM

    module, x, idx, w = _experts_case()
    module.has_gate, module.has_bias, module.is_transposed, module._is_expert_parallel = True, False, False, False
    module.has_post_expert_norm = False
    module._apply_gate = lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0].clamp(max=10.0)) * gu.chunk(2, -1)[1].clamp(-10.0, 10.0)
    want = K.get_kernel("bf16").experts_forward(module, x, idx, w)
    r = Bf16GroupedMM(x, idx, w, module.num_experts, 10.0)
    r.run_chunk(0, module.num_experts, module.gate_up_proj.float(), module.down_proj.float())
    got = r.finish()
    assert (got == want.float()).float().mean() > 0.97  # BF16 GEMM vs FP32 GEMM + round: order only
    assert torch.allclose(got, want.float(), rtol=1e-2, atol=1e-3)


# --- a tiny DeepSeek-V4 model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_logits():
    model = tiny_deepseek_v4(seed=0)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for name in HEALTHY + FAULTY:
            model.set_experts_implementation(name)
            out[name] = model(ids).logits.float()
        ref32 = model.float()
        ref32.set_experts_implementation("bf16")
        out["fp32"] = ref32(ids).logits.float()
    return out


def _kl(lg, ref):
    return float(torch.nn.functional.kl_div(lg.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean())


def test_swapping_the_kernel_changes_the_logits(tiny_logits):
    assert not torch.equal(tiny_logits["w4a4"], tiny_logits["bf16"])
    assert not torch.equal(tiny_logits["w4a8"], tiny_logits["bf16"])


def test_model_error_grows_bf16_w4a8_w4a4(tiny_logits):
    kl = {n: _kl(tiny_logits[n], tiny_logits["fp32"]) for n in ("bf16", "w4a8", "w4a4")}
    assert kl["bf16"] < kl["w4a8"] < kl["w4a4"]


def test_model_w4a4_and_packed_identical(tiny_logits):
    assert torch.equal(tiny_logits["w4a4"], tiny_logits["w4a4_packed"])


@pytest.mark.parametrize("name,factor", [("faulty/w4a4_packed-scale-exp", 3), ("faulty/w4a4_packed-fp8-layout", 3),
                                         ("faulty/w4a4_packed-drop-slot", 3)])
def test_model_faulty_kernels_stand_out(tiny_logits, name, factor):
    """KL to bf16 through a whole model, against the healthy twin's KL."""
    twin = _kl(tiny_logits["w4a4_packed"], tiny_logits["bf16"])
    assert _kl(tiny_logits[name], tiny_logits["bf16"]) > factor * twin


def test_model_router_weight_fault_is_invisible_in_kl_but_not_bitwise(tiny_logits):
    """Fault (c) is one FP4 rounding of the same value as its twin's (T6): as close to bf16 as the twin,
    yet its logits are not the twin's."""
    name = "faulty/w4a4_packed-weight-after-requant"
    twin = _kl(tiny_logits["w4a4_packed"], tiny_logits["bf16"])
    assert _kl(tiny_logits[name], tiny_logits["bf16"]) < 3 * twin
    assert not torch.equal(tiny_logits[name], tiny_logits["w4a4_packed"])


def test_from_pretrained_with_an_emulated_kernel(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_deepseek_v4(seed=1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="w4a4_packed")
    assert loaded.config._experts_implementation == "w4a4_packed"
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        a = loaded(ids).logits
        loaded.set_experts_implementation("bf16")
        b = loaded(ids).logits
    assert not torch.equal(a, b)


def test_bf16_kernel_skips_empty_slots():
    """transformers' grouped_mm path alone turns an empty slot (index E) into NaN; ours skips it."""
    module, x, idx, w = _experts_case()
    module.has_gate, module.has_bias, module.is_transposed, module._is_expert_parallel = True, False, False, False
    module.has_post_expert_norm = False
    module._apply_gate = lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0].clamp(max=10.0)) * gu.chunk(2, -1)[1].clamp(-10.0, 10.0)
    f = K.get_kernel("bf16").experts_forward
    with_sentinel = idx.clone()
    with_sentinel[:, -1] = module.num_experts
    assert torch.equal(f(module, x, with_sentinel, w), f(module, x, idx[:, :-1], w[:, :-1]))


def test_the_catalogs_register_the_torch_free_declarations_and_nothing_else():
    # the command line checks --kernel against evalgate.kernels.names before loading torch, and the catalogs
    # build every kernel from its declaration there: what is registered is what the command line accepts
    import subprocess
    import sys

    from evalgate.kernels.names import ALL, listed_names
    from evalgate.kernels.registry import KERNELS

    assert set(K.KERNELS) == set(KERNELS) == ALL  # no kernel of another package until it is chosen
    assert set(listed_names()) == {n for n in ALL if not (KERNELS[n].faulty and KERNELS[n].real)}
    probe = ("import sys; import evalgate.kernels.names, evalgate.cli.options as o; "
             "o.KERNEL.convert('w4a4_packed', None, None); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
