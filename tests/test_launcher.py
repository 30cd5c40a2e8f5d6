"""The launcher: command lines and environments per kernel (docs/kernels.md#the-packed-fp4-hazard, docs/kernels.md#selecting-a-real-kernel), refusals, and a real
child server (the stand-in ``tests/fake_server.py``) started, health-checked and stopped, also on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.kernels import Kernel, get_kernel
from evalgate.model_adapters.launcher import ServerProcess, check_environment, free_port, plan_launch

HERE = Path(__file__).resolve().parent
FAKE = f"{sys.executable} {HERE / 'fake_server.py'}"
FP4_SGLANG = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS"


def plan(kernel: str, engine: str = "sglang", env: dict | None = None, extra=("--tp", "4", "--dp", "4"),
         deterministic: bool = True):
    return plan_launch(engine, "/models/dsv4", get_kernel(kernel), 30000, extra_args=extra,
                       base_env={"PATH": "/usr/bin", **(env or {})}, deterministic=deterministic)


def kernel_vars(p) -> dict:
    return {k: v for k, v in p.env.items() if k.startswith(("DG_", "SGLANG_OPT"))}


def test_sglang_command_line():
    p = plan("w4a8")
    assert p.argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/dsv4",
                      "--host", "127.0.0.1", "--port", "30000", "--enable-deterministic-inference",
                      "--tp", "4", "--dp", "4"]
    assert p.url == "http://127.0.0.1:30000" and p.env["PATH"] == "/usr/bin"
    assert "VLLM_BATCH_INVARIANT" not in p.env


def test_vllm_command_line():
    p = plan("w4a8", "vllm", extra=())
    assert p.argv == ["vllm", "serve", "/models/dsv4", "--host", "127.0.0.1", "--port", "30000"]
    assert p.env["VLLM_BATCH_INVARIANT"] == "1"  # vLLM's batch invariance is an environment variable


@pytest.mark.parametrize("engine, how", [("sglang", "--enable-deterministic-inference"),
                                         ("vllm", "VLLM_BATCH_INVARIANT=1")])
def test_deterministic_mode_is_on_by_default_and_recorded(engine, how):
    rec = plan("w4a4_packed", engine, env={"VLLM_BATCH_INVARIANT": "0", "HF_TOKEN": "x", "VLLM_API_KEY": "y",
                                           "NCCL_ALGO": "Ring"}).record()
    assert rec["deterministic"]["requested"] is True and rec["deterministic"]["on"] is True
    assert rec["deterministic"]["how"] == how and rec["deterministic"]["doc"].startswith("https://docs.")
    assert rec["engine"] == engine and rec["engine_version"] == "not installed"
    assert rec["engine_env"]["NCCL_ALGO"] == "Ring" and rec["engine_env"]["DG_MEGA_MOE_FP4"] == "1"
    assert "HF_TOKEN" not in rec["engine_env"] and "VLLM_API_KEY" not in rec["engine_env"]
    if engine == "vllm":  # an inherited 0 does not switch it off
        assert rec["engine_env"]["VLLM_BATCH_INVARIANT"] == "1"
    else:
        assert "--enable-deterministic-inference" in rec["argv"]


def test_no_deterministic_opts_out_and_is_recorded():
    p = plan("w4a8", deterministic=False)
    assert "--enable-deterministic-inference" not in p.argv and p.deterministic["on"] is False
    assert p.deterministic["requested"] is False and "without its deterministic mode" in p.warnings[-1]
    v = plan("w4a8", "vllm", extra=(), deterministic=False)
    assert "VLLM_BATCH_INVARIANT" not in v.env and v.deterministic["on"] is False
    # asked for all the same (a flag after `--`, an inherited variable): on, and recorded as on
    assert plan("w4a8", extra=("--enable-deterministic-inference",), deterministic=False).deterministic["on"] is True
    assert plan("w4a8", "vllm", extra=(), env={"VLLM_BATCH_INVARIANT": "1"},
                deterministic=False).deterministic["on"] is True
    # given after `--` and on by default: not twice
    assert plan("w4a8", extra=("--enable-deterministic-inference",)).argv.count("--enable-deterministic-inference") == 1


@pytest.mark.parametrize("kernel, expected", [
    ("w4a8", {}),  # the sgl-deep-gemm 0.1.0 default: no FP4 variable at all
    ("w4a8_sglang", {}),
    ("w4a4", {"DG_USE_FP4_ACTS": "1", FP4_SGLANG: "1"}),  # SGLang's pre-dispatch packs FP4 only under its flag
    ("w4a4_packed", {"DG_USE_FP4_ACTS": "1", "DG_MEGA_MOE_FP4": "1", FP4_SGLANG: "1"}),  # both (docs/kernels.md#the-packed-fp4-hazard)
])
def test_sglang_environment_per_kernel(kernel, expected):
    assert kernel_vars(plan(kernel)) == expected


def test_vllm_gets_the_deepgemm_variables_only():
    assert kernel_vars(plan("w4a4_packed", "vllm")) == {"DG_USE_FP4_ACTS": "1", "DG_MEGA_MOE_FP4": "1"}


def test_the_record_logs_every_kernel_variable_and_the_deepgemm_version():
    rec = plan("w4a4_packed", env={"DG_BLOCK_K": "128", "DG_JIT_CACHE_DIR": "/tmp/x"}).record()
    assert rec["kernel_env"] == {"DG_BLOCK_K": "128", "DG_JIT_CACHE_DIR": "/tmp/x", "DG_MEGA_MOE_FP4": "1",
                                 "DG_USE_FP4_ACTS": "1", FP4_SGLANG: "1"}
    assert rec["sgl_deep_gemm"] == "not installed" and rec["engine"] == "sglang"


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


def test_an_inherited_zero_is_off_and_the_kernel_sets_what_it_needs():
    p = plan("w4a4_packed", env={"DG_USE_FP4_ACTS": "0", "DG_MEGA_MOE_FP4": "0"})
    assert p.env["DG_USE_FP4_ACTS"] == "1" and p.env["DG_MEGA_MOE_FP4"] == "1"


def test_the_interop_hazard_is_refused():
    with pytest.raises(UserError, match=r"DG_MEGA_MOE_FP4=1 without DG_USE_FP4_ACTS=1 .*docs/kernels.md#the-packed-fp4-hazard"):
        check_environment({"DG_MEGA_MOE_FP4": "1"}, "sglang")
    hazard = Kernel(name="packed-alone", version="x", description="x", experts_forward=lambda *a: None,
                    env={"DG_MEGA_MOE_FP4": "1"})
    with pytest.raises(UserError, match="DG_MEGA_MOE_FP4=1 without DG_USE_FP4_ACTS=1"):
        plan_launch("sglang", "/m", hazard, 1, base_env={})
    with pytest.raises(UserError, match="SGLang's pre-dispatch"):
        check_environment({"DG_USE_FP4_ACTS": "1"}, "sglang")
    check_environment({"DG_USE_FP4_ACTS": "1"}, "vllm")


@pytest.mark.parametrize("kernel, message", [
    ("faulty/w4a4_packed-fp8-layout", "fault-injected test double"),
    ("w4a4_te", "mma_type='mxf4xmxf4'"),
    ("bf16", "no DeepGEMM setting"),
])
def test_kernels_no_launch_environment_selects_are_refused(kernel, message):
    with pytest.raises(UserError, match=message):
        plan(kernel)


def test_port_and_host_belong_to_evalgate_and_unknown_engines_are_refused():
    with pytest.raises(UserError, match="--port after `--` is chosen by evalgate"):
        plan("w4a8", extra=("--port=1",))
    with pytest.raises(UserError, match="unknown --launch engine"):
        plan("w4a8", engine="trtllm")


def test_the_mega_moe_path_is_a_warning_not_an_error():
    assert any("mega-MoE path" in w for w in plan("w4a4_packed").warnings)
    assert plan("w4a4_packed", extra=("--moe-a2a-backend", "megamoe")).warnings == []


# ---- a real child process ----


def fake_plan(kernel: str, *extra: str):
    env = {**os.environ, "EVALGATE_SGLANG_COMMAND": FAKE}
    return plan_launch("sglang", "/models/fake-model", get_kernel(kernel), free_port(), extra_args=extra, base_env=env)


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
    env = {**cli_env, "EVALGATE_SGLANG_COMMAND": FAKE}
    args = [sys.executable, "-m", "evalgate", "run", "--launch", "sglang", "--model", "/models/fake-model",
            "--kernel", "w4a4_packed", "--limit", "12", "--batch-size", "1", "--concurrency", "1", "--out", str(out)]
    server_args = ["--", "--moe-a2a-backend", "megamoe", "--pid-file", str(tmp_path / "pid")]
    # 1 s per answer: Ctrl-C lands with most items still to do, even on a loaded machine
    proc = subprocess.Popen(args + server_args + ["--delay", "1.0"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    assert launch["kernel_env"]["DG_MEGA_MOE_FP4"] == "1" and launch["sgl_deep_gemm"] == "not installed"
    assert "--enable-deterministic-inference" in launch["argv"] and launch["deterministic"]["on"] is True
    assert manifest["model"]["determinism"]["state"] == "on"  # launched with it, and the server reports it
    assert manifest["model"]["kernel_verified"] is False and (out / "server.log").is_file()

    done = subprocess.run(args + ["--resume"] + server_args, env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    resumed = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert len(resumed) == 12 and len({r["doc_id"] for r in resumed}) == 12 and resumed[:len(kept)] == kept
    assert not alive(int((tmp_path / "pid").read_text()))
    assert (out / "server.log").read_text().count("=== evalgate:") == 2


@pytest.mark.slow
def test_a_launched_vllm_gets_batch_invariance_and_no_deterministic_is_recorded(cli_env, tmp_path):
    env = {**cli_env, "EVALGATE_VLLM_COMMAND": FAKE}
    for name, extra in (("default", []), ("opt-out", ["--no-deterministic"])):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "evalgate", "run", "--launch", "vllm", "--model", "/models/fake-model",
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
        else:
            assert "VLLM_BATCH_INVARIANT" not in child_env and launch["deterministic"]["on"] is False
            assert determinism == {"state": "off", "requested": False, "source": "launch: VLLM_BATCH_INVARIANT=1"}
            assert "runs without its deterministic mode (--no-deterministic)" in proc.stderr
