"""Contract tests against the engines' own code: every SGLang command line the launcher builds goes through
SGLang 0.5.14's and 0.5.23's real argument parsers, and the engine defaults the preflight relies on are read
from their sources. The packages are installed without their GPU dependencies by ``.ci/run`` (``pip install
--no-deps --target $EVALGATE_ENGINE_SITES/sglang-X sglang==X msgspec pybase64``); the tests skip, saying
so, where that folder is missing. vLLM is not covered here: its wheel is not a pure-Python package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalgate.kernels import get_kernel
from evalgate.model_adapters.engines import TABLE, Selection, Stack
from evalgate.model_adapters.launcher import DEFAULT_PROGRAMS, plan_launch

HERE = Path(__file__).resolve().parent
SITES = Path(os.environ.get("EVALGATE_ENGINE_SITES") or Path.home() / ".cache" / "evalgate" / "engines")
# (SGLang version, the sgl-deep-gemm it is run with, whether a packed build is assumed)
STACKS = {"0.5.14": Stack("sglang", "0.5.14", "0.1.3", packed_build=True), "0.5.23": Stack("sglang", "0.5.23", "0.2.5")}
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
    extra = [["--model-path", "/m", "--enable-w4a4-mxfp4-megamoe"], ["--model-path", "/m", "--tp", "4", "--dp", "4"]]
    answers = parse(version, [argv for _, argv in lines] + extra)
    assert len(lines) >= 8
    for (kernel, argv), answer in zip(lines, answers):
        assert answer["ok"], (kernel, argv, answer)
        args = answer["args"]
        assert (args["model_path"], args["host"], args["port"]) == ("/models/DeepSeek-V4-Flash", "127.0.0.1", 30000)
        assert args["moe_a2a_backend"] == "megamoe"
        assert args["enable_deterministic_inference"] is ("--enable-deterministic-inference" in argv)
        if version == "0.5.23":  # the W4A4 switch the table uses is this parser's, and only w4a4_te sets it
            assert args["enable_w4a4_mxfp4_megamoe"] is (kernel == "w4a4_te")
    w4a4_flag, abbreviated = answers[len(lines):]
    # 0.5.14 has no W4A4 switch (the table refuses w4a4_te there); 0.5.23 has it
    assert w4a4_flag["ok"] is (version == "0.5.23")
    # the abbreviations once in the docs: --tp 4 --dp 4 is tp_size 4 and dp_size 4, i.e. 16 GPUs
    assert abbreviated["ok"] and (abbreviated["args"]["tp_size"], abbreviated["args"]["dp_size"]) == (4, 4)


@pytest.mark.parametrize("version, cap, fusion", [("0.5.14", 1024, False), ("0.5.23", 8192, True)])
def test_the_mega_moe_defaults_the_preflight_uses_are_the_engines(version, cap, fusion):
    environ = (site(version) / "sglang" / "srt" / "environ.py").read_text()
    assert f"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK = EnvInt({cap})" in environ
    assert ("SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS = EnvBool(True)" in environ) is fusion
    assert ("SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS" in environ) is (version == "0.5.14")
