"""The execution witness (kernels/witness.py): what ran inside the MoE layers, held against the kernel named."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from evalgate.kernels import get_kernel
from evalgate.kernels.witness import GEMM, Witness, _kernels_per_call, expectation, hold, joined, watch

DG = "void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 2048u, 128u>(float*, int*, unsigned int, unsigned int)"
CUBLAS = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"
GLUE = ["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)",
        "void at::native::index_elementwise_kernel<128, 4>(long, long)", "triton_poi_fused_mul_0"]


def _witness(name: str, calls: list[list[str]]) -> Witness:
    kernel = get_kernel(name)
    return hold(Witness(kernel.name, "cuda", "test"), [Counter(c) for c in calls], expectation(kernel))


def test_the_library_kernel_in_every_layer_call_and_no_other_gemm_passes():
    w = _witness("deepgemm/fp8_block128", [[DG, DG, *GLUE]] * 3)
    assert w.ok and w.held and w.layer_calls == 3 and w.ran[DG] == 6 and not w.missing and not w.foreign
    assert w.matched == {DG: 6}  # the evidence is kept by name even when glue kernels crowd it out of `ran`
    assert "ran in all 3 MoE layer calls" in w.summary()


def test_a_silent_fallback_to_another_gemm_fails_and_so_does_a_layer_without_the_library():
    fallback = _witness("faulty/deepgemm/fp8_block128-fallback", [[CUBLAS, CUBLAS, *GLUE]] * 2)
    assert not fallback.ok and fallback.missing == 2 and fallback.foreign == {CUBLAS: 4} and not fallback.matched
    assert "another GEMM path ran" in fallback.summary() and "did not run in 2 of 2" in fallback.summary()
    one_layer = _witness("deepgemm/fp8_block128", [[DG, DG, *GLUE], [CUBLAS, *GLUE]])
    assert not one_layer.ok and one_layer.missing == 1
    mixed = _witness("deepgemm/fp8_block128", [[DG, CUBLAS]])  # the library ran, but so did another GEMM
    assert not mixed.ok and not mixed.missing and CUBLAS in mixed.foreign


def test_an_emulated_kernel_is_held_to_evalgates_triton_gemms():
    assert _witness("w4a4_te", [["_l1_kernel", "_l2_kernel", "_route", "_quantize_rows"]]).ok
    w = _witness("w4a4_te", [["_route", "void at::native::elementwise_kernel", "nvjet_tst_128x64_64x4_1x2_h_bz_TNT"]])
    assert not w.ok and w.missing == 1 and "nvjet_tst_128x64_64x4_1x2_h_bz_TNT" in w.foreign
    assert GEMM.search(CUBLAS) and not any(GEMM.search(n) for n in GLUE)


def test_a_library_whose_symbols_are_not_on_file_is_recorded_not_held():
    w = _witness("torch/fp8_rowwise", [["cutlass::device_kernel<f8f8bf16_grouped>"]])
    assert w.ok and not w.held and "recorded only" in w.summary() + w.expected


def test_no_cuda_activity_at_all_is_not_held_rather_than_failed():
    w = _witness("deepgemm/fp8_block128", [[], [], []])  # a profiler without CUPTI records no kernel
    assert w.ok and not w.held and "not held" in w.summary()


def test_kernels_belong_to_the_layer_call_whose_span_holds_them():
    """Profiler events: two layer markers; a kernel between them belongs to neither."""
    from torch.autograd import DeviceType

    def ev(name, start, end, device=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               cpu_children=[], kernels=[])

    events = [ev("evalgate.witness.layer0", 0, 100), ev("evalgate.witness.layer1", 200, 300),
              ev(DG, 10, 50, DeviceType.CUDA), ev("router_gemm", 120, 150, DeviceType.CUDA),
              ev(CUBLAS, 210, 260, DeviceType.CUDA)]
    calls = _kernels_per_call(events)
    assert calls == [Counter({DG: 1}), Counter({CUBLAS: 1})]


def test_a_failed_witness_fails_the_conformance_record_it_joins():
    conformance = {"kernel": "k", "reference": "r", "checked": True, "ok": True, "summary": "k conforms to r"}
    bad = _witness("deepgemm/fp8_block128", [[CUBLAS]])
    record = joined(conformance, bad)
    assert record["ok"] is False and record["summary"].startswith("execution witness FAILED")
    assert record["witness"]["foreign"] == {CUBLAS: 1} and "k conforms to r" in record["summary"]
    good = joined(conformance, _witness("deepgemm/fp8_block128", [[DG]]))
    assert good["ok"] is True and good["summary"] == "k conforms to r" and good["witness"]["ok"] is True


def test_on_a_cpu_the_witness_records_the_emulators_functions(tiny_model):
    from evalgate.model_adapters.hf.adapter import greedy_decoder, load_model

    model, tokenizer = load_model(tiny_model, "w4a4_te")
    w = watch(model, get_kernel("w4a4_te"), ["Question: 2 + 3?\nAnswer:", "Question: 7 - 1?\nAnswer:"],
              "cpu", greedy_decoder(model, tokenizer, "cpu"))
    assert w.device == "cpu" and not w.held and w.ok
    assert w.steps >= 2 and w.layer_calls >= w.steps  # the prefill(s) and one decoding step, each MoE layer
    assert any(name.startswith("evalgate.kernels.") for name in w.ran), w.ran
    assert json.dumps(w.to_dict())  # goes into the manifest as it is


def test_a_gate_fails_a_run_whose_witness_failed(tmp_path):
    from gate_helpers import policy
    from synthetic_runs import write_pair

    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds

    base, cand = write_pair(tmp_path, n_gsm8k=200, n_humaneval=0, lost_every=10 ** 6, gained_every=10 ** 6)
    manifest = json.loads((cand / "manifest.json").read_text())
    conformance = {"kernel": "deepgemm/fp8_block128", "reference": "fp8_block128", "checked": True, "ok": True,
                   "summary": "deepgemm/fp8_block128 conforms to fp8_block128", "calc_diff": 2e-5, "limit": 1.2e-4}
    manifest["kernel"]["conformance"] = joined(conformance, _witness("deepgemm/fp8_block128", [[CUBLAS]]))
    (cand / "manifest.json").write_text(json.dumps(manifest))
    v = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0, rate=50.0)), allow_uncalibrated=True)
    assert (v.verdict, v.exit_code) == ("FAIL", 1) and "execution witness FAILED" in v.conformance["summary"]


@pytest.mark.parametrize("name", ["faulty/deepgemm/fp8_block128-fallback"])
def test_the_fallback_double_claims_the_library_it_does_not_use(name):
    kernel = get_kernel(name)
    assert kernel.faulty and kernel.twin == "deepgemm/fp8_block128" and kernel.library.module == "deep_gemm"
    assert expectation(kernel).required and "deep_gemm" in expectation(kernel).what.lower() + "deep_gemm"
