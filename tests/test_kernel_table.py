"""The kernel table (model_adapters/server/engines.py) row by row: for every engine version it covers, evalgate
either selects and verifies each kernel or refuses it in one line, before a launch (preflight) and after
start (the stand-in server behaving as that version, launched or given); and the verdict side: a
contradicted server kernel gets no verdict, an unverified one is said in the verdict's notes."""

from __future__ import annotations

import json
import re
import os
import sys
from pathlib import Path

import pytest

from engine_sites import site
from evalgate.errors import NotComparable, UserError
from evalgate.model_adapters.server.engines import TABLE, Stack, preflight
from evalgate.model_adapters.server.launcher import served_adapter
from evalgate.model_adapters.server.openai_client import OpenAIAdapter
from fake_server import FakeServer
import cli_process

HERE = Path(__file__).resolve().parent
FAKE = f"{sys.executable} {HERE / 'fake_server.py'}"
MEGA = ["--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024"]
KERNELS = ("w4a8", "w4a8_sglang", "w4a4", "w4a4_packed", "w4a4_te")

FP4_ENV = {"DG_USE_FP4_ACTS": "1", "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS": "1"}
FLAG = ("--enable-w4a4-mxfp4-megamoe",)
OLD_PACKED = "only SGLang 0.5.12-0.5.18 with a PR #44 build"
# one stack per row of the table, with what each kernel does there: the kernel variables set and flags added,
# or a phrase of the one-line refusal
STACKS = {
    "sglang 0.5.14 + sgl-deep-gemm 0.1.3 (the seed's stock stack)": (Stack("sglang", "0.5.14", "0.1.3"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()), "w4a4": (FP4_ENV, ()),
        "w4a4_packed": "no released sgl-deep-gemm contains the packed kernel",
        "w4a4_te": "has no --enable-w4a4-mxfp4-megamoe"}),
    "sglang 0.5.14 + sgl-deep-gemm 0.1.9": (Stack("sglang", "0.5.14", "0.1.9"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()),
        "w4a4": "raises RuntimeError on DG_USE_FP4_ACTS", "w4a4_packed": "raises RuntimeError on DG_USE_FP4_ACTS",
        "w4a4_te": "has no --enable-w4a4-mxfp4-megamoe"}),
    "sglang 0.5.19 + sgl-deep-gemm 0.1.5 (older than its pin)": (Stack("sglang", "0.5.19", "0.1.5"), {
        k: "calls sgl-deep-gemm's mma_type API" for k in KERNELS}),
    "sglang 0.5.19 + sgl-deep-gemm 0.1.7 (its stock pin)": (Stack("sglang", "0.5.19", "0.1.7"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()), "w4a4": ({}, FLAG), "w4a4_packed": OLD_PACKED,
        "w4a4_te": "rounds FP4 input ties toward zero"}),
    "sglang 0.5.21 + sgl-deep-gemm 0.2.0 (its stock pin)": (Stack("sglang", "0.5.21", "0.2.0"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()), "w4a4": "rounds FP4 input ties to even",
        "w4a4_packed": OLD_PACKED, "w4a4_te": ({}, FLAG)}),
    "sglang 0.5.22 + sgl-deep-gemm 0.1.8": (Stack("sglang", "0.5.22", "0.1.8"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()), "w4a4": ({}, FLAG), "w4a4_packed": OLD_PACKED,
        "w4a4_te": "rounds FP4 input ties toward zero"}),
    "sglang 0.5.23 + sgl-deep-gemm 0.2.5": (Stack("sglang", "0.5.23", "0.2.5"), {
        "w4a8": ({}, ()), "w4a8_sglang": ({}, ()), "w4a4": "rounds FP4 input ties to even",
        "w4a4_packed": OLD_PACKED, "w4a4_te": ({}, FLAG)}),
    "vllm 0.34.0": (Stack("vllm", "0.34.0"), {
        "w4a8": ({"VLLM_SERVER_DEV_MODE": "1"}, ("--moe-backend=deep_gemm_mega_moe", "--enable-expert-parallel")),
        "w4a8_sglang": "does not run SGLang's FP8 pre-dispatch",
        "w4a4": "no W4A4 kernel for DeepSeek-V4", "w4a4_packed": "no W4A4 kernel for DeepSeek-V4",
        "w4a4_te": "no W4A4 kernel for DeepSeek-V4"}),
}


def test_every_row_of_the_table_has_a_stack_here():
    from evalgate.model_adapters.server.engines import find_row

    assert {id(find_row(stack)) for stack, _ in STACKS.values()} == {id(row) for row in TABLE}
    assert all(row.source and set(row.kernels) == set(KERNELS) for row in TABLE)


@pytest.mark.parametrize("name", STACKS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_preflight_selects_or_refuses_each_kernel_on_each_row(name, kernel):
    stack, expected = STACKS[name]
    want = expected[kernel]
    if isinstance(want, str):
        with pytest.raises(UserError, match=re.escape(want)) as info:
            preflight(kernel, stack, MEGA, {})
        assert "\n" not in str(info.value)
        return
    selection, row, _ = preflight(kernel, stack, MEGA, {})
    assert (selection.env, selection.flags) == want and row.matches(stack)


def test_the_packed_kernel_runs_only_on_a_build_that_contains_it():
    packed = Stack("sglang", "0.5.14", "0.1.3", packed_build=True)
    assert preflight("w4a4_packed", packed, MEGA, {})[0].env["DG_MEGA_MOE_FP4"] == "1"


@pytest.mark.parametrize("kernel, args, env, message", [
    ("w4a8", ["--enable-w4a4-mxfp4-megamoe", *MEGA], {}, "contradicts --kernel w4a8"),
    ("w4a4_te", ["--tp-size", "8"], {}, "runs on SGLang's DeepGEMM mega-MoE path only"),
    # without megamoe SGLang's DeepSeek-V4 override serves FlashInfer MXFP4: no evalgate recipe, so no W4A8 label
    ("w4a8", ["--tp-size", "8"], {}, "flashinfer_mxfp4 from 0.5.19.*is not an evalgate recipe"),
    ("w4a8", ["--moe-runner-backend", "flashinfer_mxfp4"], {}, "is not an evalgate recipe"),
    ("w4a4_te", ["--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "-1"], {}, "needs chunked prefill"),
    ("w4a4_te", ["--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "16384"], {},
     "needs 16384 tokens per rank but SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK is 8192"),
])
def test_settings_that_contradict_the_kernel_or_fail_at_start_are_refused(kernel, args, env, message):
    with pytest.raises(UserError, match=message):
        preflight(kernel, Stack("sglang", "0.5.23", "0.2.5"), args, env)


def test_the_mega_moe_budget_counts_per_rank_and_a_larger_budget_passes():
    new = Stack("sglang", "0.5.23", "0.2.5")
    args = ["--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "16384"]
    preflight("w4a4_te", new, args, {"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK": "16384"})
    preflight("w4a4_te", new, [*args, "--dp-size", "2", "--enable-dp-attention"], {})  # 8192 a rank
    for args in (["--tp-size", "4", "--dp-size", "4"], ["--tp", "4", "--dp", "4"]):  # argparse takes the prefixes
        _, _, warnings = preflight("w4a8", new, [*MEGA, *args], {})
        assert any("16 GPUs" in w for w in warnings)  # dp counts whole model copies
    with pytest.raises(UserError, match="--dp-size 'four' after `--` is not an integer"):
        preflight("w4a8", new, [*MEGA, "--dp-size", "four"], {})


def test_the_budget_default_and_the_old_mega_moe_variable_follow_the_release():
    chunk = ["--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "4096"]
    preflight("w4a8", Stack("sglang", "0.5.18", "0.1.5"), chunk, {})  # 8192 from 0.5.18 (environ.py:1030)
    with pytest.raises(UserError, match="needs 4096 tokens per rank but .* is 1024"):
        preflight("w4a8", Stack("sglang", "0.5.17", "0.1.5"), chunk, {})  # 1024 until 0.5.17
    env = {"SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE": "1"}  # read by 0.5.12-0.5.17 only
    preflight("w4a8", Stack("sglang", "0.5.17", "0.1.5"), ["--chunked-prefill-size", "1024"], env)
    with pytest.raises(UserError, match="mega-MoE path only"):
        preflight("w4a8", Stack("sglang", "0.5.18", "0.1.5"), ["--chunked-prefill-size", "1024"], env)


def test_vllm_w4a8_is_the_mega_moe_backend_and_another_backend_is_refused():
    with pytest.raises(UserError, match="--moe-backend marlin` after `--` selects a vLLM MoE backend that is not"):
        preflight("w4a8", Stack("vllm", "0.34.0"), ["--moe-backend", "marlin"], {})
    _, _, warnings = preflight("w4a8", Stack("vllm", "0.34.0"), [],
                               {"VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION": "1"})
    assert any("recorded as not fused" in w for w in warnings)


def test_a_w4a4_kernel_on_a_hopper_gpu_is_refused():
    with pytest.raises(UserError, match="runs only on SM100 .* sm90, where the selection is silently ignored"):
        preflight("w4a4", Stack("sglang", "0.5.14", "0.1.3", gpu_arch="sm90"), MEGA, {})


# ---- after start: a given stand-in server per engine version ----

def sglang_info(version: str, backend: str = "megamoe", w4a4_flag: bool | None = None,
                runner: str | None = None) -> dict:
    info = {"model_path": "/models/dsv4", "tp_size": 4, "version": version, "moe_a2a_backend": backend,
            "enable_deterministic_inference": True}
    if w4a4_flag is not None:  # SGLang >= 0.5.19 reports its W4A4 switch
        info["enable_w4a4_mxfp4_megamoe"] = w4a4_flag
    if runner is not None:  # the resolved runner backend (0.5.19+: flashinfer_mxfp4 for DeepSeek-V4 without megamoe)
        info["moe_runner_backend"] = runner
    return info


def vllm_info(moe_backend: str = "deep_gemm_mega_moe", expert_parallel: bool = True, tp: int = 1, **env) -> dict:
    """vLLM's dev-mode /server_info?config_format=json (vllm 0.34 entrypoints/serve/dev/server_info/api_router.py)."""
    return {"vllm_config": {"kernel_config": {"moe_backend": moe_backend},
                            "parallel_config": {"enable_expert_parallel": expert_parallel, "tensor_parallel_size": tp}},
            "vllm_env": {"VLLM_BATCH_INVARIANT": True, **env}}


@pytest.mark.parametrize("kernel, info, version, status", [
    ("w4a8", sglang_info("0.5.14"), None, "unverified"),  # 0.5.14 does not report DG_* variables
    ("w4a4", sglang_info("0.5.14"), None, "unverified"),
    ("w4a4", sglang_info("0.5.14", backend="none"), None, "not on DeepGEMM's mega-MoE path"),
    # 0.5.19 has the W4A4 switch and pins sgl-deep-gemm 0.1.7 (ties toward zero): it serves w4a4
    ("w4a4", sglang_info("0.5.19", w4a4_flag=True), None, "verified"),
    ("w4a4_te", sglang_info("0.5.19", w4a4_flag=True), None, "W4A4 MXFP4 kernel \\(w4a4\\), not w4a4_te"),
    ("w4a8", sglang_info("0.5.19", w4a4_flag=False), None, "verified"),
    ("w4a8", sglang_info("0.5.19", backend="none", w4a4_flag=False, runner="flashinfer_mxfp4"), None,
     "moe_runner_backend='flashinfer_mxfp4'.* is not an evalgate recipe"),
    ("w4a8", sglang_info("0.5.23", w4a4_flag=False), None, "verified"),
    ("w4a4_te", sglang_info("0.5.23", w4a4_flag=True), None, "verified"),
    ("w4a8", sglang_info("0.5.23", w4a4_flag=True), None, "enable_w4a4_mxfp4_megamoe=true"),
    ("w4a4_te", sglang_info("0.5.23", w4a4_flag=False), None, "enable_w4a4_mxfp4_megamoe': False"),
    ("w4a8", {}, "0.34.0", "unverified"),  # vLLM without dev mode: /version alone
    ("w4a8", vllm_info(), "0.34.0", "verified"),
    ("w4a8", vllm_info("auto"), "0.34.0", "moe_backend='auto'.*is not an evalgate recipe"),
    ("w4a8", vllm_info(expert_parallel=False), "0.34.0", "enable_expert_parallel false"),
    ("w4a4_packed", {}, "0.34.0", "no W4A4 kernel for DeepSeek-V4"),
    ("w4a8", {}, None, "unverified"),  # a server that says nothing about itself
])
def test_a_given_server_is_verified_or_refused_by_what_it_reports(kernel, info, version, status):
    with FakeServer(server_info=info) as server:
        server.version = version
        if status in ("verified", "unverified"):
            adapter = OpenAIAdapter(server.url, kernel, retries=0, deterministic=False)
            model = adapter.info()
            adapter.close()
            assert model["kernel_check"]["status"] == status and model["kernel_verified"] is (status == "verified")
            assert model["kernel_check"]["rests_on"] or not info and not version  # the fields it rests on
            if kernel == "w4a8" and info and "vllm_config" not in info:
                assert model["served_numerics"] == "w4a8_sglang"  # SGLang's own FP8 pre-dispatch
            if "vllm_config" in info:  # the JSON form was asked for; the host inventory is not kept
                assert isinstance(model["server_reported"]["server_info"]["vllm_config"], dict)
                assert model["serving_identity"]["shared_expert_fusion"] == "fused"  # TP 1
        else:
            with pytest.raises(UserError, match=f"contradicts --kernel {kernel}: .*{status}"):
                OpenAIAdapter(server.url, kernel, retries=0, deterministic=False)


def test_serving_identity_names_fusion_and_routed_scaling():
    with FakeServer(server_info=sglang_info("0.5.23", w4a4_flag=False)) as new, \
            FakeServer(server_info=sglang_info("0.5.21", w4a4_flag=False)) as mid, \
            FakeServer(server_info=sglang_info("0.5.14")) as old:
        fused = OpenAIAdapter(new.url, "w4a8", retries=0).info()["kernel_check"]["serving_identity"]
        unfused = [OpenAIAdapter(s.url, "w4a8", retries=0).info()["kernel_check"]["serving_identity"]
                   for s in (mid, old)]
    assert fused["shared_expert_fusion"].startswith("fused") and fused["routed_scaling"] == "before the kernel"
    # 0.5.20-0.5.21 never fuse and scale after the kernel (mega_moe.py:414-415 of 0.5.21): fusion starts in 0.5.22
    assert unfused == [{"served_numerics": "w4a8_sglang", "routed_scaling": "after the kernel",
                        "shared_expert_fusion": "not fused"}] * 2


def test_a_given_server_warming_up_is_waited_for(capsys):
    with FakeServer(server_info=sglang_info("0.5.23", w4a4_flag=True), warmup_s=1.0) as server:
        OpenAIAdapter.HEALTH_PROGRESS_S = 0.3
        try:
            adapter = OpenAIAdapter(server.url, "w4a4_te", retries=0, health_timeout=30)
        finally:
            OpenAIAdapter.HEALTH_PROGRESS_S = 30.0
        assert adapter.kernel_check.verified
        with pytest.raises(UserError, match="/health still answers 503 after 0 s"):
            server.healthy_at += 60
            OpenAIAdapter(server.url, "w4a4_te", retries=0, health_timeout=0.2)
    assert "/health 503 after" in capsys.readouterr().err


# ---- launched: the stand-in started as that engine version ----

def launch(tmp_path, kernel: str, engine: str = "sglang", args=tuple(MEGA), **versions):
    env = {f"EVALGATE_{engine.upper()}_COMMAND": FAKE, "PYTHONPATH": str(site(tmp_path / "site", **versions))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with served_adapter(kernel, tmp_path / "run", launch=engine, model="/models/dsv4", server_args=tuple(args),
                            launch_timeout=60, retries=0) as adapter:
            return adapter.info()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize("kernel, versions, message", [
    ("w4a4_packed", {"sglang": "0.5.14", "deep_gemm": "0.1.3"}, "no released sgl-deep-gemm contains the packed kernel"),
    ("w4a4", {"sglang": "0.5.23", "deep_gemm": "0.2.5"}, "rounds FP4 input ties to even"),
    ("w4a4_te", {"sglang": "0.5.14", "deep_gemm": "0.1.3"}, "has no --enable-w4a4-mxfp4-megamoe"),
])
def test_a_launch_the_installed_stack_cannot_run_is_refused_before_start(tmp_path, kernel, versions, message):
    with pytest.raises(UserError, match=message):
        launch(tmp_path, kernel, **versions)
    assert not (tmp_path / "run" / "server.log").exists()  # nothing was started


def test_a_vllm_launch_of_a_w4a4_kernel_is_refused(tmp_path):
    with pytest.raises(UserError, match="vLLM has no W4A4 kernel for DeepSeek-V4"):
        launch(tmp_path, "w4a4_packed", engine="vllm", args=(), vllm="0.34.0")


@pytest.mark.parametrize("kernel, versions, status", [
    ("w4a4_te", {"sglang": "0.5.23", "deep_gemm": "0.2.5"}, "verified"),
    ("w4a4", {"sglang": "0.5.19", "deep_gemm": "0.1.7"}, "verified"),  # 0.5.19's switch: ties toward zero
    ("w4a4_packed", {"sglang": "0.5.14", "deep_gemm": "0.1.3", "packed": True}, "unverified"),
])
def test_a_launched_stand_in_is_verified_as_far_as_its_version_reports(tmp_path, kernel, versions, status):
    model = launch(tmp_path, kernel, args=(*MEGA, "--warmup-s", "0.5"), **versions)
    check, launched = model["kernel_check"], model["launch"]
    assert check["status"] == status and check["engine_version"] == versions["sglang"]
    assert launched["stack"]["sgl_deep_gemm"] == versions["deep_gemm"]
    if kernel in ("w4a4_te", "w4a4"):
        assert "--enable-w4a4-mxfp4-megamoe" in launched["argv"] and "DG_USE_FP4_ACTS" not in launched["kernel_env"]
        assert check["rests_on"]["/server_info enable_w4a4_mxfp4_megamoe"] is True
    else:
        assert launched["kernel_env"]["DG_MEGA_MOE_FP4"] == "1" and "launch.kernel_env" in check["why"]


# ---- the verdict ----

def test_a_contradicted_server_kernel_gets_no_verdict_and_an_unverifiable_one_is_said(tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", n_gsm8k=60, n_humaneval=0)
    manifest = json.loads((cand / "manifest.json").read_text())
    thresholds = policy(tmp_path, rate=50.0)
    for status, why in (("unverified", "SGLang before 0.5.19 selects W4A4 from DG_* variables"),
                        ("unverifiable", "a run stored before the label was renamed"),
                        ("verified", "/server_info reports moe_a2a_backend='megamoe'"),
                        ("contradicted", "/server_info reports enable_w4a4_mxfp4_megamoe=true")):
        rests_on = {"/server_info moe_a2a_backend": "megamoe"}
        manifest["model"]["kernel_check"] = {"status": status, "why": why, "rests_on": rests_on}
        (cand / "manifest.json").write_text(json.dumps(manifest))
        if status == "contradicted":
            with pytest.raises(NotComparable, match="contradicts its kernel .*enable_w4a4_mxfp4_megamoe=true"):
                gate_runs(load_baseline(base), load_run(cand), load_thresholds(thresholds), allow_uncalibrated=True)
        else:
            verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(thresholds), allow_uncalibrated=True)
            if status == "verified":  # the verdict names the reported fields the label rests on
                assert "server kernel verified from /server_info moe_a2a_backend='megamoe'" in verdict.notes
                assert not any("unverified" in n for n in verdict.notes)
            else:
                assert f"server kernel unverified: {why}" in verdict.notes
                from evalgate.report.text import markdown

                assert f"server kernel unverified: {why}" in markdown(verdict)  # the reports carry the label


def test_runs_served_with_and_without_the_fused_shared_expert_are_not_comparable(tmp_path):
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", n_gsm8k=60, n_humaneval=0)
    served = {"shared_expert_fusion": "fused", "routed_scaling": "before the kernel"}  # SGLang 0.5.23, W4A8
    for path, identity in ((base, served), (cand, {**served, "shared_expert_fusion": "not fused"})):
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["model"]["serving_identity"] = identity
        (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NotComparable, match="serving identity differs .*'fused'.*'not fused'.*--across-serving"):
        gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path)), allow_uncalibrated=True)
    # asked for, the comparison is made and the verdict says across what
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path)), allow_uncalibrated=True, across_serving=True)
    assert verdict.verdict in ("PASS", "FAIL", "INCONCLUSIVE")
    (note,) = [n for n in verdict.notes if "across a serving difference" in n]
    assert "'not fused'" in note and "--across-serving" in note


def test_the_command_line_compares_across_serving_only_when_asked(tmp_path, cli_env):

    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", n_gsm8k=60, n_humaneval=0)
    for path, fusion in ((base, "fused"), (cand, "not fused")):
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["model"]["serving_identity"] = {"shared_expert_fusion": fusion, "routed_scaling": "before the kernel"}
        (path / "manifest.json").write_text(json.dumps(manifest))
    gate = ["gate", "--candidate", str(cand), "--baseline", str(base),
            "--allow-uncalibrated", "--thresholds", str(policy(tmp_path))]
    refused = cli_process.run(gate, env=cli_env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "pass --across-serving" in refused.stderr, refused.stderr
    asked = cli_process.run([*gate, "--across-serving"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert asked.returncode in (0, 1, 3), asked.stderr
    assert "compared across a serving difference" in (cand / "gate" / "report.md").read_text()


def test_the_probe_reads_versions_packed_build_and_gpu_in_the_servers_environment(tmp_path):
    from evalgate.model_adapters.server.engines import probe_stack, server_python

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 10.0\necho 10.0\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(site(tmp_path / "site", sglang="0.5.14", deep_gemm="0.1.3", packed=True))}
    python = server_python([sys.executable, "-m", "sglang.launch_server"], env)
    assert python == sys.executable
    assert probe_stack("sglang", python, env) == Stack("sglang", "0.5.14", "0.1.3", True, "sm100")
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\n")
    script.chmod(0o755)
    assert server_python(["vllm", "serve"], env) == sys.executable  # the script's interpreter
    assert server_python(["vllm", "serve"], {**env, "EVALGATE_SERVER_PYTHON": "/opt/py"}) == "/opt/py"
    bare = {**env, "PYTHONPATH": str(site(tmp_path / "bare", sglang="0.5.23", deep_gemm="0.2.5"))}
    assert probe_stack("sglang", python, bare).packed_build is False
