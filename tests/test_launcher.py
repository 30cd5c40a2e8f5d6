"""The launcher: command lines and environments per kernel (docs/kernels.md#the-packed-fp4-hazard, docs/kernels.md#selecting-a-real-kernel), refusals, and a real
child server (the stand-in ``tests/fake_server.py``) started, health-checked and stopped, also on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.kernels import get_kernel
from evalgate.model_adapters.server.engines import Stack
from evalgate.model_adapters.server.launcher import ServerProcess, check_environment, free_port, plan_launch
from engine_sites import site
import cli_process

HERE = Path(__file__).resolve().parent
FAKE = f"{sys.executable} {HERE / 'fake_server.py'}"
FP4_SGLANG = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS"
MEGA = ("--tp-size", "4", "--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024")
SEED = Stack("sglang", "0.5.14", "0.1.3", packed_build=True)  # the seed's stack, with a build that has the packed kernel
NEW = Stack("sglang", "0.5.23", "0.2.5")
VLLM = Stack("vllm", "0.34.0")


def plan(kernel: str, engine: str = "sglang", env: dict | None = None, extra=MEGA, deterministic: bool = True,
         stack: Stack | None = None):
    stack = stack or (SEED if engine == "sglang" else VLLM)
    return plan_launch(engine, "/models/dsv4", get_kernel(kernel), 30000, extra_args=extra,
                       base_env={"PATH": "/usr/bin", **(env or {})}, deterministic=deterministic, stack=stack)


def kernel_vars(p) -> dict:
    return {k: v for k, v in p.env.items() if k.startswith(("DG_", "SGLANG_OPT"))}


def test_sglang_command_line():
    p = plan("w4a8")
    assert p.argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/dsv4",
                      "--host", "127.0.0.1", "--port", "30000", "--enable-deterministic-inference", *MEGA]
    assert p.url == "http://127.0.0.1:30000" and p.env["PATH"] == "/usr/bin"
    assert "VLLM_BATCH_INVARIANT" not in p.env


def test_vllm_command_line():
    p = plan("w4a8", "vllm", extra=())
    # DeepGEMM's mega-MoE backend (the W4A8 recipe), which needs expert parallelism; dev mode, so that vLLM
    # reports the backend it runs (/server_info)
    assert p.argv == ["vllm", "serve", "/models/dsv4", "--host", "127.0.0.1", "--port", "30000",
                      "--moe-backend=deep_gemm_mega_moe", "--enable-expert-parallel"]
    assert p.env["VLLM_BATCH_INVARIANT"] == "1"  # vLLM's batch invariance is an environment variable
    assert p.env["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize("engine, how, kernel", [("sglang", "--enable-deterministic-inference", "w4a4_packed"),
                                                 ("vllm", "VLLM_BATCH_INVARIANT=1", "w4a8")])
def test_deterministic_mode_is_on_by_default_and_recorded(engine, how, kernel):
    rec = plan(kernel, engine, env={"VLLM_BATCH_INVARIANT": "0", "HF_TOKEN": "x", "VLLM_API_KEY": "y",
                                    "NCCL_ALGO": "Ring"}, extra=MEGA if engine == "sglang" else ()).record()
    assert rec["deterministic"]["requested"] is True and rec["deterministic"]["on"] is True
    assert rec["deterministic"]["how"] == how and rec["deterministic"]["doc"].startswith("https://docs.")
    assert rec["engine"] == engine and rec["engine_version"] == (SEED if engine == "sglang" else VLLM).engine_version
    assert rec["engine_env"]["NCCL_ALGO"] == "Ring"
    assert "HF_TOKEN" not in rec["engine_env"] and "VLLM_API_KEY" not in rec["engine_env"]
    if engine == "vllm":  # an inherited 0 does not switch it off
        assert rec["engine_env"]["VLLM_BATCH_INVARIANT"] == "1"
    else:
        assert "--enable-deterministic-inference" in rec["argv"] and rec["engine_env"]["DG_MEGA_MOE_FP4"] == "1"


def test_no_deterministic_opts_out_and_is_recorded():
    p = plan("w4a8", deterministic=False)
    assert "--enable-deterministic-inference" not in p.argv and p.deterministic["on"] is False
    assert p.deterministic["requested"] is False and "without its deterministic mode" in p.warnings[-1]
    v = plan("w4a8", "vllm", extra=(), deterministic=False)
    assert "VLLM_BATCH_INVARIANT" not in v.env and v.deterministic["on"] is False
    # asked for all the same (a flag after `--`, an inherited variable): on, and recorded as on
    assert plan("w4a8", extra=(*MEGA, "--enable-deterministic-inference"), deterministic=False).deterministic["on"] is True
    assert plan("w4a8", "vllm", extra=(), env={"VLLM_BATCH_INVARIANT": "1"},
                deterministic=False).deterministic["on"] is True
    # given after `--` and on by default: not twice
    assert plan("w4a8", extra=(*MEGA, "--enable-deterministic-inference")).argv.count("--enable-deterministic-inference") == 1


@pytest.mark.parametrize("kernel, expected", [
    ("w4a8", {}),  # the sgl-deep-gemm 0.1.x default: no FP4 variable at all
    ("w4a8_sglang", {}),
    ("w4a4", {"DG_USE_FP4_ACTS": "1", FP4_SGLANG: "1"}),  # SGLang's pre-dispatch packs FP4 only under its flag
    ("w4a4_packed", {"DG_USE_FP4_ACTS": "1", "DG_MEGA_MOE_FP4": "1", FP4_SGLANG: "1"}),  # both (docs/kernels.md#the-packed-fp4-hazard)
])
def test_seed_stack_environment_per_kernel(kernel, expected):
    assert kernel_vars(plan(kernel)) == expected


def test_new_sglang_selects_w4a4_by_its_flag_and_sets_no_legacy_variable():
    p = plan("w4a4_te", stack=NEW)
    assert "--enable-w4a4-mxfp4-megamoe" in p.argv and kernel_vars(p) == {}
    assert "--enable-w4a4-mxfp4-megamoe" not in plan("w4a8", stack=NEW).argv
    rec = p.record()
    assert rec["selection"]["server_info"] == {"moe_a2a_backend": "megamoe", "enable_w4a4_mxfp4_megamoe": True}
    assert rec["stack"]["sgl_deep_gemm"] == "0.2.5" and "exec_.py" in rec["selection"]["source"]


def test_the_record_logs_every_kernel_variable_and_the_deepgemm_version():
    rec = plan("w4a4_packed", env={"DG_BLOCK_K": "128", "DG_JIT_CACHE_DIR": "/tmp/x"}).record()
    assert rec["kernel_env"] == {"DG_BLOCK_K": "128", "DG_JIT_CACHE_DIR": "/tmp/x", "DG_MEGA_MOE_FP4": "1",
                                 "DG_USE_FP4_ACTS": "1", FP4_SGLANG: "1"}
    assert rec["sgl_deep_gemm"] == "0.1.3" and rec["engine"] == "sglang" and rec["stack"]["packed_build"] is True


def test_the_mxf4_kind_may_come_from_the_environment_only_with_fp4_activations():
    assert plan("w4a4", env={"DG_USE_MXF4_KIND": "1"}).env["DG_USE_MXF4_KIND"] == "1"
    with pytest.raises(UserError, match="DG_USE_MXF4_KIND=1, which selects another kernel than 'w4a8'"):
        plan("w4a8", env={"DG_USE_MXF4_KIND": "1"})


@pytest.mark.parametrize("env, message", [
    ({"DG_MEGA_MOE_FP4": "1"}, "DG_MEGA_MOE_FP4=1, which selects another kernel than 'w4a8'"),
    ({"DG_USE_FP4_ACTS": "1"}, "DG_USE_FP4_ACTS=1, which selects another kernel than 'w4a8'"),
    ({FP4_SGLANG: "true"}, f"{FP4_SGLANG}=true, which selects another kernel"),
    ({"DG_USE_FP8_COMBINE": "1"}, "DG_USE_FP8_COMBINE=1 sends the L2 output as FP8"),
])
def test_inherited_variables_that_change_the_kernel_are_refused(env, message):
    with pytest.raises(UserError, match=message):
        plan("w4a8", env=env)


def test_a_variable_the_new_library_refuses_is_never_passed_on():
    # sgl-deep-gemm >= 0.1.7 reads DG_USE_FP4_ACTS with int(): "false" would crash it as surely as "1"
    with pytest.raises(UserError, match="DG_USE_FP4_ACTS='false', which sgl-deep-gemm 0.2.5 refuses at start"):
        plan("w4a8", env={"DG_USE_FP4_ACTS": "false"}, stack=NEW)
    assert plan("w4a8", env={"DG_USE_FP4_ACTS": "0"}, stack=NEW).env["DG_USE_FP4_ACTS"] == "0"


def test_an_inherited_zero_is_off_and_the_kernel_sets_what_it_needs():
    p = plan("w4a4_packed", env={"DG_USE_FP4_ACTS": "0", "DG_MEGA_MOE_FP4": "0"})
    assert p.env["DG_USE_FP4_ACTS"] == "1" and p.env["DG_MEGA_MOE_FP4"] == "1"


def test_the_interop_hazard_is_refused():
    with pytest.raises(UserError, match=r"DG_MEGA_MOE_FP4=1 without DG_USE_FP4_ACTS=1 .*docs/kernels.md#the-packed-fp4-hazard"):
        check_environment({"DG_MEGA_MOE_FP4": "1"}, "sglang")
    with pytest.raises(UserError, match="SGLang's pre-dispatch"):
        check_environment({"DG_USE_FP4_ACTS": "1"}, "sglang")
    check_environment({"DG_USE_FP4_ACTS": "1"}, "vllm")


@pytest.mark.parametrize("kernel, message", [
    ("faulty/w4a4_packed-fp8-layout", "fault-injected test double"),
    ("w4a4_te", "this SGLang has no --enable-w4a4-mxfp4-megamoe"),
    ("bf16", "no server recipe"),
])
def test_kernels_the_seed_stack_cannot_select_are_refused(kernel, message):
    with pytest.raises(UserError, match=message):
        plan(kernel)


def test_port_and_host_belong_to_evalgate_and_unknown_engines_are_refused():
    with pytest.raises(UserError, match="--port after `--` is chosen by evalgate"):
        plan("w4a8", extra=("--port=1",))
    with pytest.raises(UserError, match="unknown --launch engine"):
        plan("w4a8", engine="trtllm")


def test_a_w4a4_kernel_without_the_mega_moe_path_is_refused():
    with pytest.raises(UserError, match="runs on SGLang's DeepGEMM mega-MoE path only"):
        plan("w4a4_packed", extra=("--tp-size", "4"))
    assert plan("w4a4_packed").warnings == []


# ---- a real child process ----


def fake_plan(kernel: str, *extra: str):
    env = {**os.environ, "EVALGATE_SGLANG_COMMAND": FAKE}
    return plan_launch("sglang", "/models/fake-model", get_kernel(kernel), free_port(), extra_args=(*MEGA, *extra),
                       base_env=env, stack=SEED)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_launched_server_is_healthy_inside_and_gone_after(tmp_path):
    p = fake_plan("w4a4_packed", "--env-file", str(tmp_path / "env.json"), "--startup-s", "0.5")
    with ServerProcess(p, tmp_path / "run" / "server.log", health_timeout_s=30) as server:
        pid = server.proc.pid
        from urllib.request import urlopen

        assert json.load(urlopen(p.url + "/v1/models"))["data"][0]["id"] == "fake-model"
        child_env = json.loads((tmp_path / "env.json").read_text())
    assert child_env["DG_USE_FP4_ACTS"] == "1" and child_env["DG_MEGA_MOE_FP4"] == "1"
    assert child_env[FP4_SGLANG] == "1"
    assert not alive(pid) and server.proc.returncode is not None
    log = (tmp_path / "run" / "server.log").read_text()
    assert "=== kernel w4a4_packed, DG_MEGA_MOE_FP4=1 DG_USE_FP4_ACTS=1" in log and "fake server: listening" in log
    assert "--enable-deterministic-inference" in log.splitlines()[1]  # the command line, as launched


def test_a_server_that_exits_at_start_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"exited with code 3 before it was healthy: fake server: failing to start"):
        with ServerProcess(fake_plan("w4a8", "--exit-code", "3"), tmp_path / "server.log", health_timeout_s=30):
            pass


def test_a_server_that_never_gets_healthy_is_stopped(tmp_path):
    p = fake_plan("w4a8", "--startup-s", "60", "--pid-file", str(tmp_path / "pid"))
    with pytest.raises(UserError, match="not healthy after 2 s"):
        with ServerProcess(p, tmp_path / "server.log", health_timeout_s=2, grace_s=5):
            pass
    assert not alive(int((tmp_path / "pid").read_text()))


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    p = fake_plan("w4a8", "--ignore-sigterm")
    with ServerProcess(p, tmp_path / "server.log", health_timeout_s=30, grace_s=0.5) as server:
        pid = server.proc.pid
        t0 = time.monotonic()
    assert not alive(pid) and server.proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10


@pytest.mark.slow
def test_ctrl_c_stops_the_launched_server_and_keeps_finished_items(cli_env, tmp_path):
    out = tmp_path / "run"
    env = {**cli_env, "EVALGATE_SGLANG_COMMAND": FAKE,
           "PYTHONPATH": str(site(tmp_path / "site", sglang="0.5.14", deep_gemm="0.1.3", packed=True))}
    args = ["run", "--launch", "sglang", "--model", "/models/fake-model",
            "--kernel", "w4a4_packed", "--limit", "12", "--batch-size", "1", "--concurrency", "1", "--out", str(out)]
    server_args = ["--", *MEGA, "--pid-file", str(tmp_path / "pid")]
    # 1 s per answer: Ctrl-C lands with most items still to do, even on a loaded machine
    proc = cli_process.start(args + server_args + ["--delay", "1.0"], env=env, cwd=tmp_path,
                             stdout=cli_process.PIPE, stderr=cli_process.PIPE, text=True)
    jsonl = out / "gsm8k.jsonl"
    deadline = time.monotonic() + 120
    while not (jsonl.exists() and jsonl.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no records within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    server_pid = int((tmp_path / "pid").read_text())
    assert not alive(server_pid)
    kept = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert 2 <= len(kept) < 12 and len({r["doc_id"] for r in kept}) == len(kept)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    launch = manifest["model"]["launch"]
    assert launch["kernel_env"]["DG_MEGA_MOE_FP4"] == "1" and launch["sgl_deep_gemm"] == "0.1.3"
    assert "--enable-deterministic-inference" in launch["argv"] and launch["deterministic"]["on"] is True
    assert manifest["model"]["determinism"]["state"] == "on"  # launched with it, and the server reports it
    assert manifest["model"]["kernel_verified"] is False and (out / "server.log").is_file()
    assert manifest["model"]["kernel_check"]["status"] == "unverified"  # 0.5.14 does not report DG_* variables

    done = cli_process.run(args + ["--resume"] + server_args, env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    resumed = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert len(resumed) == 12 and len({r["doc_id"] for r in resumed}) == 12 and resumed[:len(kept)] == kept
    assert not alive(int((tmp_path / "pid").read_text()))
    assert (out / "server.log").read_text().count("=== evalgate:") == 2


@pytest.mark.slow
def test_a_launched_vllm_gets_batch_invariance_and_no_deterministic_is_recorded(cli_env, tmp_path):
    env = {**cli_env, "EVALGATE_VLLM_COMMAND": FAKE, "PYTHONPATH": str(site(tmp_path / "site", vllm="0.34.0"))}
    for name, extra in (("default", []), ("opt-out", ["--no-deterministic"])):
        out = tmp_path / name
        proc = cli_process.run(["run", "--launch", "vllm", "--model", "/models/fake-model",
                               "--kernel", "w4a8", "--limit", "2", "--out", str(out), *extra, "--",
                               "--env-file", str(tmp_path / f"{name}.json")], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        child_env = json.loads((tmp_path / f"{name}.json").read_text())
        manifest = json.loads((out / "manifest.json").read_text())
        launch, determinism = manifest["model"]["launch"], manifest["model"]["determinism"]
        if name == "default":
            assert child_env["VLLM_BATCH_INVARIANT"] == "1" and launch["engine_env"]["VLLM_BATCH_INVARIANT"] == "1"
            assert launch["deterministic"] == {**launch["deterministic"], "requested": True, "on": True,
                                               "how": "VLLM_BATCH_INVARIANT=1"}
            assert determinism["state"] == "on" and "warning" not in determinism
            assert manifest["model"]["kernel_verified"] is True and launch["stack"]["engine_version"] == "0.34.0"
        else:
            assert "VLLM_BATCH_INVARIANT" not in child_env and launch["deterministic"]["on"] is False
            assert determinism == {"state": "off", "requested": False, "source": "launch: VLLM_BATCH_INVARIANT=1"}
            assert "runs without its deterministic mode (--no-deterministic)" in proc.stderr
