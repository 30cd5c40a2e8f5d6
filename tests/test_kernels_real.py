"""Real kernels on a CPU: the FP8 recipes and their boundary faults, the SM100 adapters against the stand-in of
sgl-deep-gemm's API, and what selecting a real kernel does where its library is missing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evalgate.kernels import check, get_kernel, kernel_names
from evalgate.kernels.fp8_moe import Fp8Recipe, convert_fp4_weights, exact_gemm
from evalgate.kernels.real import sm100_mega_moe
from evalgate.kernels.real.catalog import real_forward
from evalgate.kernels.real.contiguous import pad_by_expert, scatter_rows
from evalgate.kernels.real.faults import FAULTS
from evalgate.kernels.registry import KERNELS, register_kernel
from evalgate.kernels.weights import Fp4ExpertWeights
import cli_process


@pytest.fixture(scope="module")
def tiny_case():
    case = check.synthetic_layer("tiny", 48)
    return case, check.Fp4ExpertsModule(case.weights, case.limit, "cpu")


@pytest.fixture
def standin(monkeypatch):
    import standin_deep_gemm

    monkeypatch.setattr(sm100_mega_moe, "library", lambda: standin_deep_gemm)
    return standin_deep_gemm


@pytest.mark.parametrize("name", ["sgl-deep-gemm/w4a8", "sgl-deep-gemm/w4a4"])
def test_sm100_adapter_meets_the_api_contract_and_computes_its_recipe(standin, tiny_case, name):
    """The adapter hands the stand-in weights, scales, routing and buffers as the real API takes them; what
    comes back is the declared recipe, bit for bit (the stand-in computes it after undoing the layout)."""
    case, module = tiny_case
    kernel = get_kernel(name)
    idx = case.top_k_index.clone()
    idx[0, -1] = case.weights.num_experts  # an empty slot (transformers' index E) becomes DeepGEMM's -1
    out = kernel.experts_forward(module, case.x, idx, case.top_k_weights)
    ref = get_kernel(kernel.reference).experts_forward(module, case.x, idx, case.top_k_weights)
    assert kernel.reference == {"sgl-deep-gemm/w4a8": "w4a8", "sgl-deep-gemm/w4a4": "w4a4_te"}[name]
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    buffer = standin._BUFFERS[-1]
    assert buffer.mma_type == kernel.api["mma_type"] and buffer.num_max_tokens_per_rank == 128


def test_the_standin_refuses_what_the_real_api_would_mishandle(standin, tiny_case):
    case, module = tiny_case
    mega = sm100_mega_moe.MegaMoE(standin, module, "fp8xfp4")
    buffer = mega.symm_buffer(8, 4)
    x, idx, w = case.x[:8], case.top_k_index[:8].to(torch.int64), case.top_k_weights[:8].float()
    standin.mega_moe_pre_dispatch(x, idx, w, buffer.x, buffer.x_sf, buffer.topk_idx, buffer.topk_weights, num_tokens=8)
    y = torch.empty(8, case.x.shape[1], dtype=torch.bfloat16)
    plain = ((case.weights.w1.view(torch.int8), sm100_mega_moe.pack_scale_bytes(case.weights.w1_scale)),
             (case.weights.w2.view(torch.int8), sm100_mega_moe.pack_scale_bytes(case.weights.w2_scale)))
    with pytest.raises(standin.ContractError, match="not laid out by transform_weights_for_mega_moe"):
        standin.fp8_fp4_mega_moe(y, *plain, buffer, activation_clamp=10.0)  # the transform skipped
    other = standin.transform_weights_for_mega_moe(*plain, mma_type="mxf4xmxf4")
    with pytest.raises(standin.ContractError, match="mma_type='fp8xfp4'"):
        standin.fp8_fp4_mega_moe(y, *other, buffer, activation_clamp=10.0)  # laid out for another mma_type
    with pytest.raises(standin.ContractError, match="int64"):
        standin.mega_moe_pre_dispatch(x, idx.to(torch.int32), w, buffer.x, buffer.x_sf, buffer.topk_idx,
                                      buffer.topk_weights, num_tokens=8)
    with pytest.raises(standin.ContractError, match="int32"):  # scale bytes not packed four per word
        standin.transform_weights_for_mega_moe((plain[0][0], case.weights.w1_scale), plain[1])


def test_scale_bytes_pack_four_per_word_first_group_lowest():
    packed = sm100_mega_moe.pack_scale_bytes(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8))
    assert packed.tolist() == [[0x04030201, 0x08070605]]


@pytest.mark.parametrize("layout", ["block128", "rowwise"])
def test_fp8_recipe_is_exact_and_each_boundary_fault_changes_its_expert(tiny_case, layout):
    """A kernel that runs the recipe's pipeline with an exact GEMM is bit-identical to the recipe; each fault
    injected at the library boundary changes the outputs."""
    case, module = tiny_case
    recipe = Fp8Recipe(layout)
    ref = get_kernel(f"fp8_{layout}").experts_forward(module, case.x, case.top_k_index, case.top_k_weights)
    same = real_forward(recipe, exact_gemm)(module, case.x, case.top_k_index, case.top_k_weights)
    assert torch.equal(same.view(torch.int16), ref.view(torch.int16))
    for name, fault in FAULTS.items():
        out = real_forward(recipe, exact_gemm, fault)(module, case.x, case.top_k_index, case.top_k_weights)
        assert not torch.equal(out, ref), name


def test_fp4_to_fp8_conversion_is_exact_up_to_a_spread_of_14_binades():
    """Under a block whose largest element is 6 x 2^(top byte - 127), an E2M1 weight whose group byte sits d
    below the top becomes e2m1 x 2^(6-d): exact for d <= 14; at d = 15, 0.5 becomes 2^-10, half E4M3's
    smallest subnormal (rounded to 0)."""
    def module(spread):
        e, n, k = 1, 128, 128
        codes = torch.full((e, n, k // 2), 0x11, dtype=torch.uint8)  # every element 0.5 ...
        codes[0, 0, :16] = 0x77  # ... but the top group's: 6
        scale = torch.full((e, n, k // 32), 127, dtype=torch.uint8)
        scale[0, 0, 0] = 127 + spread  # one group `spread` binades above the rest
        w = Fp4ExpertWeights(codes, scale, torch.full((e, k, n // 2), 0x11, dtype=torch.uint8),
                             torch.full((e, k, n // 32), 127, dtype=torch.uint8), source="synthetic")
        return check.Fp4ExpertsModule(w, 10.0, "cpu")

    assert convert_fp4_weights(module(14), Fp8Recipe("block128"), "cpu").inexact == 0
    assert convert_fp4_weights(module(15), Fp8Recipe("block128"), "cpu").inexact == 128 * 128 - 32


def test_rows_are_padded_per_expert_and_scattered_back():
    counts = torch.tensor([3, 0, 5])
    p = pad_by_expert(counts, 4)
    assert p.rows == 12 and p.ends.tolist() == [4, 4, 12] and p.index.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert p.expert.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1]
    x = torch.arange(8, dtype=torch.float32).view(8, 1).to(torch.float8_e4m3fn)
    assert scatter_rows(x, p)[p.index].float().flatten().tolist() == list(range(8))


def test_a_fault_of_a_real_kernel_is_listed_only_where_its_library_runs():
    names = kernel_names()
    assert {"deepgemm/fp8_block128", "torch/fp8_rowwise", "sgl-deep-gemm/w4a8", "sgl-deep-gemm/w4a4"} <= set(names)
    if get_kernel("deepgemm/fp8_block128").library.missing():
        assert not any(n.startswith("faulty/deepgemm/") for n in names)
        assert "faulty/deepgemm/fp8_block128-swap-expert" in KERNELS  # registered, not offered


def test_a_real_kernel_names_its_library_and_recipe():
    k = get_kernel("deepgemm/fp8_block128")
    assert k.real and k.reference == "fp8_block128" and k.library.module == "deep_gemm"
    assert k.tolerance.expert_calc_diff > 0 and get_kernel("sgl-deep-gemm/w4a4").tolerance is None  # exact sums


@pytest.mark.slow
def test_selecting_a_real_kernel_without_its_library_is_one_line_exit_2(tiny_model, cli_env, tmp_path):
    if get_kernel("deepgemm/fp8_block128").library.missing() is None:
        pytest.skip("DeepGEMM runs here")
    p = cli_process.run(["run", "--model", str(tiny_model), "--kernel",
                        "deepgemm/fp8_block128", "--tasks", "gsm8k", "--limit", "1", "--out", str(tmp_path / "r")],
                       env=cli_env, capture_output=True, text=True)
    lines = [line for line in p.stderr.splitlines() if line.strip() and "Warning" not in line and "torchao" not in line
             and "pytree" not in line]
    assert p.returncode == 2, p.stderr
    assert lines[-1].startswith("evalgate: error: DeepGEMM") and "'deep_gemm' is not installed" in lines[-1]
    assert "Traceback" not in p.stderr


def test_a_stand_in_real_kernel_through_conformance_passes_healthy_and_fails_each_fault(tiny_case):
    """The conformance machinery on a real kernel whose library is stood in by the exact GEMM: healthy
    bit-identical; every boundary fault over its limit, in the experts it hit."""
    from evalgate.kernels.conformance import model_conformance

    case, module = tiny_case

    class Model(torch.nn.Module):  # one routed-experts module, fed directly (captured inputs)
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].mlp = torch.nn.Module()
            self.layers[0].mlp.experts = module

    captured = {0: (case.x, case.top_k_index, case.top_k_weights)}
    base = replace(get_kernel("deepgemm/fp8_block128"), library=None)
    results = {}
    try:
        for fault in [None, *FAULTS.values()]:
            name = f"test/fp8-{fault.__name__ if fault else 'healthy'}"
            register_kernel(replace(base, name=name, experts_forward=real_forward(Fp8Recipe("block128"), exact_gemm, fault)))
            results[name] = model_conformance(Model(), name, captured=captured)
    finally:
        for name in results:
            KERNELS.pop(name, None)
    healthy = results.pop("test/fp8-healthy")
    assert healthy.ok and healthy.identical and healthy.experts == int((case.weights.num_experts > 0) and
                                                                     torch.unique(case.top_k_index).numel())
    for name, c in results.items():
        assert not c.ok and c.failed_experts >= 1 and c.worst_experts[0]["calc_diff"] > base.tolerance.expert_calc_diff, name
