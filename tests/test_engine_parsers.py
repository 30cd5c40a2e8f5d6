"""Contract tests against the engines' own code: every SGLang command line the launcher builds goes through
the real argument parsers of a representative set of SGLang releases (one on each side of every boundary
of the kernel table: 0.5.14, 0.5.17, 0.5.18, 0.5.19, 0.5.21, 0.5.22, 0.5.23); the fields ``/server_info``
reports (its resolved server arguments) include those verification reads; and what each table row says the
release does (W4A4 switch, token budget, shared-expert fusion, where routed scaling is applied, the DeepSeek-V4
backend override) is read from that release's sources. The packages are installed without their GPU
dependencies by ``.ci/run`` (``pip install --no-deps --target $EVALGATE_ENGINE_SITES/sglang-X sglang==X msgspec
pybase64``); the tests skip, saying so, where that folder is missing. vLLM's wheel is not a pure-Python package:
``.ci/run`` extracts the few source files of 0.34.0 that define its dev-mode ``/server_info`` and MoE backend
option into ``$EVALGATE_ENGINE_SITES/vllm-0.34.0``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalgate.kernels import get_kernel
import re

from evalgate.model_adapters.server.engines import TABLE, W4A4_FLAG, Selection, Stack, find_row, version_tuple
from evalgate.model_adapters.server.launcher import DEFAULT_PROGRAMS, plan_launch

HERE = Path(__file__).resolve().parent
SITES = Path(os.environ.get("EVALGATE_ENGINE_SITES") or Path.home() / ".cache" / "evalgate" / "engines")
# (SGLang version, the sgl-deep-gemm it is run with, whether a packed build is assumed)
STACKS = {"0.5.14": Stack("sglang", "0.5.14", "0.1.3", packed_build=True),  # each with its release's pin
          "0.5.17": Stack("sglang", "0.5.17", "0.1.5.post1", packed_build=True),  # a PR #44 build: w4a4_packed too
          "0.5.18": Stack("sglang", "0.5.18", "0.1.5.post3", packed_build=True),
          "0.5.19": Stack("sglang", "0.5.19", "0.1.7"), "0.5.21": Stack("sglang", "0.5.21", "0.2.0"),
          "0.5.22": Stack("sglang", "0.5.22", "0.2.2"), "0.5.23": Stack("sglang", "0.5.23", "0.2.5")}
VLLM = "0.34.0"
TOKENS = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"  # 0.5.14's default (1024) is below these chunks
SERVER_ARGS = (("--tp-size", "8", "--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "4096"),
               ("--tp-size", "4", "--dp-size", "2", "--enable-dp-attention", "--moe-a2a-backend", "megamoe",
                "--chunked-prefill-size", "8192"))


def site(version: str) -> Path:
    path = SITES / f"sglang-{version}"
    if not (path / "sglang" / "srt" / "server_args.py").is_file():
        pytest.skip(f"SGLang {version} is not installed under {path} (.ci/run installs it: pip install --no-deps "
                    f"--target {path} sglang=={version} msgspec pybase64)")
    return path


def parse(version: str, argvs: list[list[str]]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site(version)), str(HERE)])}
    proc = subprocess.run([sys.executable, str(HERE / "engine_parser_child.py")], input=json.dumps(argvs),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def launcher_lines(version: str) -> list[tuple[str, list[str]]]:
    """Every command line the launcher builds on this version's stack: each kernel it selects there, with the
    deterministic mode on and off, for each set of server arguments; the program part cut off."""
    stack = STACKS[version]
    row = next(r for r in TABLE if r.matches(stack))
    lines = []
    for kernel, how in row.kernels.items():
        if not isinstance(how, Selection):
            continue
        for extra in SERVER_ARGS:
            for deterministic in (True, False):
                plan = plan_launch("sglang", "/models/DeepSeek-V4-Flash", get_kernel(kernel), 30000, extra_args=extra,
                                   base_env={"PATH": "/usr/bin", TOKENS: "8192"}, deterministic=deterministic,
                                   stack=stack)
                lines.append((kernel, plan.argv[len(DEFAULT_PROGRAMS["sglang"]):]))
    return lines


@pytest.mark.slow  # imports SGLang's server arguments: 5-10 s a version
@pytest.mark.parametrize("version", sorted(STACKS))
def test_every_launch_command_line_passes_sglangs_own_parser(version):
    lines = launcher_lines(version)
    switch = version_tuple(version) >= (0, 5, 19)
    extra = [["--model-path", "/m", "--enable-w4a4-mxfp4-megamoe"], ["--model-path", "/m", "--tp", "4", "--dp", "4"]]
    answers = parse(version, [argv for _, argv in lines] + extra)
    assert len(lines) >= 8
    for (kernel, argv), answer in zip(lines, answers):
        assert answer["ok"], (kernel, argv, answer)
        args = answer["args"]
        assert (args["model_path"], args["host"], args["port"]) == ("/models/DeepSeek-V4-Flash", "127.0.0.1", 30000)
        assert args["moe_a2a_backend"] == "megamoe"
        assert args["enable_deterministic_inference"] is ("--enable-deterministic-inference" in argv)
        if switch:  # the W4A4 switch the table uses is this parser's, and only the W4A4 kernel sets it
            assert args["enable_w4a4_mxfp4_megamoe"] is (kernel in ("w4a4", "w4a4_te") and "--enable-w4a4-mxfp4-megamoe"
                                                         in argv)
    w4a4_flag, abbreviated = answers[len(lines):]
    # the switch exists from 0.5.19 (0.5.18 and older refuse it, as the table does)
    assert w4a4_flag["ok"] is switch
    # /server_info returns the resolved server arguments: the fields verification reads are among them
    fields = set(answers[0]["fields"])
    assert {"moe_a2a_backend", "moe_runner_backend", "enable_deterministic_inference"} <= fields
    assert ("enable_w4a4_mxfp4_megamoe" in fields) is switch
    # the abbreviations once in the docs: --tp 4 --dp 4 is tp_size 4 and dp_size 4, i.e. 16 GPUs
    assert abbreviated["ok"] and (abbreviated["args"]["tp_size"], abbreviated["args"]["dp_size"]) == (4, 4)


@pytest.mark.parametrize("version", sorted(STACKS, key=version_tuple))
def test_each_row_says_what_its_release_does(version):
    """The row the table finds for a release with its pin, against that release's sources."""
    src = site(version) / "sglang" / "srt"
    environ = (src / "environ.py").read_text()
    mega_moe = (src / "layers" / "moe" / "mega_moe.py").read_text()
    override = src / "arg_groups" / "model_overrides" / "deepseek_v4.py"
    server = (src / "entrypoints" / "http_server.py").read_text()
    row = find_row(STACKS[version])
    w4a8 = row.kernels["w4a8"]
    # the per-rank token budget the preflight assumes is the release's default
    cap = re.search(r"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK = EnvInt\((\d+)\)", environ).group(1)
    assert int(cap) == (8192 if version_tuple(version) >= (0, 5, 18) else 1024)
    # shared-expert fusion into the W4A8 kernel: the release's switch exists, default on, exactly where the row fuses
    fuses = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS = EnvBool(True)" in environ
    assert fuses is (w4a8.shared_expert_fusion == "fused")
    # routed scaling: on the router weights before the kernel, or on the output after it
    before = "topk_weights_in * routed_scaling_factor" in mega_moe
    assert before is (w4a8.routed_scaling == "before the kernel")
    assert before or re.search(r"y\.mul_\((moe\.)?routed_scaling_factor\)", mega_moe)
    # the W4A4 selection: DG_* variables forwarded before 0.5.19, the mma_type switch from 0.5.19
    switch = version_tuple(version) >= (0, 5, 19)
    assert ("_apply_mega_moe_dg_env" in mega_moe) is not switch
    assert ('"mxf4xmxf4" if' in mega_moe) is switch
    selections = [how for how in row.kernels.values() if isinstance(how, Selection)]
    by_flag = [how for how in selections if W4A4_FLAG in how.flags]
    by_env = [how for how in selections if "DG_USE_FP4_ACTS" in how.env]
    assert bool(by_flag) is switch and bool(by_env) is not switch
    # the megamoe variable is read only where mega_moe_on honours it
    assert ("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE = EnvBool" in environ) is (version_tuple(version) < (0, 5, 18))
    # without megamoe the DeepSeek-V4 override serves FlashInfer MXFP4 (no evalgate recipe) from 0.5.19
    overridden = override.is_file() and '"flashinfer_mxfp4"' in override.read_text()
    assert overridden is (version_tuple(version) >= (0, 5, 19))
    # /server_info returns the resolved server arguments (from 0.5.22 through utils/common.py's build_server_info)
    builder = src / "utils" / "common.py"
    built = "build_server_info" in server and "server_args.resolved_dict()" in builder.read_text()
    assert '@app.get("/server_info")' in server
    assert "resolved_dict()" in server or "asdict(server_args)" in server or built


def vllm_site() -> Path:
    path = SITES / f"vllm-{VLLM}" / "vllm"
    if not (path / "entrypoints" / "serve" / "dev" / "server_info" / "api_router.py").is_file():
        pytest.skip(f"vLLM {VLLM}'s sources are not under {path.parent} (.ci/run extracts them from the wheel)")
    return path


def test_vllm_reports_its_moe_backend_only_in_dev_mode_and_as_verification_reads_it():
    src = vllm_site()
    router = (src / "entrypoints" / "serve" / "dev" / "server_info" / "api_router.py").read_text()
    routers = (src / "entrypoints" / "launchers" / "api_server" / "routers.py").read_text()
    kernel = (src / "config" / "kernel.py").read_text()
    args = (src / "engine" / "arg_utils.py").read_text()
    model = (src / "models" / "deepseek_v4" / "nvidia" / "model.py").read_text()
    # /server_info exists only in dev mode, and gives the config as JSON only when asked
    assert "if envs.VLLM_SERVER_DEV_MODE:" in routers and '@router.get("/server_info")' in router
    assert 'config_format: Annotated[Literal["text", "json"], Query()] = "text"' in router
    assert '"vllm_config"' in router and '"vllm_env"' in router and '"system_env"' in router
    # the backend the launcher selects, and the fields verification reads
    assert '"deep_gemm_mega_moe"' in kernel and "moe_backend: MoEBackend" in kernel
    assert 'add_argument("--moe-backend"' in args
    assert "parallel_config.enable_expert_parallel" in model
    assert "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION" in model
    assert "self.tp_size == 1" in model  # fusion at TP 1 (or sequence-parallel MoE), as verification records it
    row = find_row(Stack("vllm", VLLM))
    assert row.kernels["w4a8"].flags == ("--moe-backend=deep_gemm_mega_moe", "--enable-expert-parallel")
