"""How each evalgate kernel is selected on each serving stack, and the preflight that refuses a launch that
would run another kernel, or none (docs/serving.md#kernel-selection-per-engine-version).

A stack is (engine, engine version, sgl-deep-gemm version, whether that build contains the packed FP4
kernel, GPU architecture). ``TABLE`` maps a stack to one ``Row``: for every kernel either a ``Selection``
(environment, server flags, what ``/server_info`` must then show, the numerics the server really computes)
or the reason it is not available there. The rows were read from the engines' released sources; each
names its files. ``probe_stack`` reads the stack in the Python environment that will run the server;
``preflight`` checks a launch against it before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from evalgate.errors import UserError

FP4_ACTS_ENV = {"DG_USE_FP4_ACTS": "1", "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS": "1"}
PACKED_ENV = {**FP4_ACTS_ENV, "DG_MEGA_MOE_FP4": "1"}
W4A4_FLAG = "--enable-w4a4-mxfp4-megamoe"  # SGLang >= 0.5.19: DeepGEMM's mma_type mxf4xmxf4
FUSE_SHARED_ENV = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS"  # SGLang >= 0.5.22, default on
TOKENS_PER_RANK_ENV = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"
MEGA_ENV = "SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE"  # SGLang 0.5.12-0.5.17 only: sets --moe-a2a-backend megamoe
MEGA = {"moe_a2a_backend": "megamoe"}  # what /server_info shows when SGLang runs DeepGEMM's mega-MoE kernel
VLLM_MEGA_FLAGS = ("--moe-backend=deep_gemm_mega_moe", "--enable-expert-parallel")
VLLM_DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the only way vLLM reports its configuration (/server_info)
VLLM_NO_FUSION_ENV = "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION"
W4A4_KERNELS = ("w4a4", "w4a4_packed", "w4a4_te")


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(p) for p in parts) if parts else None


@dataclass(frozen=True)
class Stack:
    """What will run the server. ``None`` fields were not readable (not installed, no GPU visible)."""

    engine: str
    engine_version: str | None = None
    library_version: str | None = None  # sgl-deep-gemm
    packed_build: bool = False  # the installed deep_gemm ships the packed FP4 mega-MoE kernel
    gpu_arch: str | None = None  # "sm100", "sm90", ...

    def record(self) -> dict:
        return {"engine": self.engine, "engine_version": self.engine_version,
                "sgl_deep_gemm": self.library_version, "packed_build": self.packed_build, "gpu_arch": self.gpu_arch}


@dataclass(frozen=True)
class Selection:
    """How one kernel is selected on one row, and what the server is then known to compute."""

    env: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    server_info: dict = field(default_factory=dict)  # keys /server_info must show with these values
    served_numerics: str = ""  # the evalgate kernel whose numerics the server computes
    shared_expert_fusion: str = "not fused"
    routed_scaling: str = "after the kernel"
    mega_moe: bool = True  # needs SGLang's mega-MoE path (--moe-a2a-backend megamoe) and SM100


@dataclass(frozen=True)
class Row:
    engine: str
    engine_range: tuple[str, str | None]  # [from, before)
    library_range: tuple[str, str | None] | None  # sgl-deep-gemm [from, before); None: the engine ignores it
    kernels: dict  # kernel name -> Selection, or the reason it is not available here
    source: str

    def matches(self, stack: Stack) -> bool:
        if stack.engine != self.engine or not in_range(stack.engine_version, self.engine_range):
            return False
        return self.library_range is None or in_range(stack.library_version, self.library_range)

    def describe(self) -> str:
        lib = "" if self.library_range is None else f", sgl-deep-gemm {_range_text(self.library_range)}"
        return f"{self.engine} {_range_text(self.engine_range)}{lib}"


def in_range(version: str | None, bounds: tuple[str, str | None]) -> bool:
    v = version_tuple(version)
    if v is None:
        return False
    lo, hi = bounds
    return v >= version_tuple(lo) and (hi is None or v < version_tuple(hi))


def _range_text(bounds: tuple[str, str | None]) -> str:
    lo, hi = bounds
    return f">= {lo}" if hi is None else f"{lo} to before {hi}"


def _mega(kernel: str, *, flag: bool = False, fused: bool = False, before: bool = False, env: dict | None = None,
          served: str | None = None) -> Selection:
    """A kernel on SGLang's DeepGEMM mega-MoE path: /server_info must show moe_a2a_backend=megamoe and, where
    the release has it (>= 0.5.19), the W4A4 switch set as the kernel needs."""
    info = dict(MEGA)
    if flag is not None:
        info["enable_w4a4_mxfp4_megamoe"] = flag
    return Selection(env=env or {}, flags=(W4A4_FLAG,) if flag else (), server_info=info,
                     served_numerics=served or kernel, shared_expert_fusion="fused" if fused else "not fused",
                     routed_scaling="before the kernel" if before else "after the kernel")


# SGLang before 0.5.19: no W4A4 switch (/server_info cannot show which kernel the DG_* variables chose)
_W4A8_ENV = _mega("w4a8_sglang", flag=None)
# 0.5.19-0.5.21: the shared expert runs beside the kernel and the output is scaled after it
_W4A8_19 = _mega("w4a8_sglang", flag=False)
# 0.5.22 on: the shared expert fused into the fp8xfp4 kernel (unless SGLANG_OPT_..._FUSE_SHARED_EXPERTS=0) and the
# router weights scaled before it
_W4A8_22 = _mega("w4a8_sglang", flag=False, fused=True, before=True)
_NO_PACKED = ("no released sgl-deep-gemm contains the packed kernel (no sm100_fp4_mega_moe.cuh, no DG_MEGA_MOE_FP4 "
              "in deep_gemm._C; it exists only in sgl-project/DeepGEMM PR #44): the server would run w4a4 under a "
              "w4a4_packed label; install a build of that PR")
_PACKED_ONLY_OLD = ("the packed kernel is selected by DG_MEGA_MOE_FP4 beside DG_USE_FP4_ACTS, which sgl-deep-gemm "
                    ">= 0.1.7 refuses and SGLang >= 0.5.19 no longer forwards: only SGLang 0.5.12-0.5.18 with a "
                    "PR #44 build of sgl-deep-gemm before 0.1.7 can run it")
_LEGACY_CRASH = ("sgl-deep-gemm >= 0.1.7 raises RuntimeError on DG_USE_FP4_ACTS when the mega-MoE buffer is made "
                 "(deep_gemm/mega/__init__.py:19-40, _check_legacy_fp4_acts_env)")
_TIES_TO_EVEN = (f"sgl-deep-gemm >= 0.2.0 rounds FP4 input ties to even (sm100_mega_moe_pre_dispatch.cuh): {W4A4_FLAG} "
                 "runs w4a4_te here")
_TIES_TO_ZERO = (f"sgl-deep-gemm before 0.2.0 rounds FP4 input ties toward zero (sm100_mega_moe_pre_dispatch.cuh): "
                 f"{W4A4_FLAG} runs w4a4 here")
_NO_SWITCH = f"this SGLang has no {W4A4_FLAG} (SGLang >= 0.5.19 with sgl-deep-gemm >= 0.2.0 serves w4a4_te)"
_OLD_LIBRARY = ("SGLang >= 0.5.19 calls sgl-deep-gemm's mma_type API and pins 0.1.7 or later; with an older library "
                "its FP8 pre-dispatch and the kernel disagree about the activation format: install the pinned one")
_VLLM_W4A4 = ("vLLM has no W4A4 kernel for DeepSeek-V4 on NVIDIA GPUs (its DeepGEMM mega-MoE backend is hard-wired to "
              "fp8xfp4, vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py; the MXFP4 oracle has no "
              "MXFP4xMXFP4 entry for it) and ignores every DG_* variable; gate W4A4 on SGLang")
# Every other MoE path these engines pick for DeepSeek-V4's FP4 experts (FlashInfer TRT-LLM MXFP4, Marlin W4A16,
# Humming, DeepGEMM's FP4 grouped GEMM, SGLang's flashinfer_mxfp4 default) is not an evalgate recipe: refused.
NOT_A_RECIPE = ("is not an evalgate recipe (FlashInfer MXFP4, Marlin, Humming or another non-mega-MoE backend): "
                "evalgate neither emulates nor labels it")

TABLE: tuple[Row, ...] = (
    Row("sglang", ("0.5.12", "0.5.19"), ("0.1.0", "0.1.7"), {
        "w4a8": _W4A8_ENV, "w4a8_sglang": _W4A8_ENV,
        "w4a4": _mega("w4a4", flag=None, env=FP4_ACTS_ENV),
        "w4a4_packed": _mega("w4a4_packed", flag=None, env=PACKED_ENV),
        "w4a4_te": _NO_SWITCH,
    }, "sglang 0.5.12 srt/layers/moe/mega_moe.py:42-57 (0.5.18: 48-63; _apply_mega_moe_dg_env forwards "
       "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS to DG_USE_FP4_ACTS), :265-266 (0.5.18: 284-285; y.mul_ "
       "routed_scaling_factor after the kernel); jit_kernel/csrc/deepseek_v4/mega_moe_pre_dispatch.cuh:76 (amax floor "
       "1e-10); sgl-deep-gemm 0.1.6 deep_gemm/mega/__init__.py:59 (reads DG_USE_FP4_ACTS)"),
    Row("sglang", ("0.5.12", "0.5.19"), ("0.1.7", None), {
        "w4a8": _W4A8_ENV, "w4a8_sglang": _W4A8_ENV,
        "w4a4": _LEGACY_CRASH, "w4a4_packed": _LEGACY_CRASH, "w4a4_te": _NO_SWITCH,
    }, "sgl-deep-gemm 0.1.7 deep_gemm/mega/__init__.py:19-40 (_check_legacy_fp4_acts_env); sglang 0.5.18 "
       "srt/environ.py:1030 (no W4A4 switch in server_args)"),
    Row("sglang", ("0.5.19", None), ("0.0.0", "0.1.7"),
        {k: _OLD_LIBRARY for k in ("w4a8", "w4a8_sglang", *W4A4_KERNELS)},
        "sglang 0.5.19 METADATA (Requires-Dist: sgl-deep-gemm==0.1.7); srt/layers/moe/mega_moe.py:258-272 "
        "(mega_moe_pre_dispatch(..., mma_type=))"),
    Row("sglang", ("0.5.19", "0.5.22"), ("0.1.7", "0.2.0"), {
        "w4a8": _W4A8_19, "w4a8_sglang": _W4A8_19,
        "w4a4": _mega("w4a4", flag=True), "w4a4_packed": _PACKED_ONLY_OLD, "w4a4_te": _TIES_TO_ZERO,
    }, "sglang 0.5.19 srt/server_args.py:2399-2405 (enable_w4a4_mxfp4_megamoe), srt/layers/moe/mega_moe.py:49 "
       "(mxf4xmxf4 if the switch is on, else fp8xfp4), :307-308 (routed scaling after the kernel; 0.5.20 :309-310, "
       "0.5.21 :414-415), srt/environ.py:1774-1779 (the FP4 variables deprecated, ignored); sgl-deep-gemm 0.1.7 "
       "sm100_mega_moe_pre_dispatch.cuh:54 (ties toward zero); no shared-expert fusion before 0.5.22"),
    Row("sglang", ("0.5.19", "0.5.22"), ("0.2.0", None), {
        "w4a8": _W4A8_19, "w4a8_sglang": _W4A8_19,
        "w4a4": _TIES_TO_EVEN, "w4a4_packed": _PACKED_ONLY_OLD, "w4a4_te": _mega("w4a4_te", flag=True),
    }, "sglang 0.5.20 srt/arg_groups/fields/exec_.py:669 (0.5.21: 744; enable_w4a4_mxfp4_megamoe), "
       "srt/layers/moe/mega_moe.py:49 (0.5.21: 59), :309-310 (0.5.21: 414-415; routed scaling after the kernel); "
       "sgl-deep-gemm 0.2.0 sm100_mega_moe_pre_dispatch.cuh:52 (ties to even)"),
    Row("sglang", ("0.5.22", None), ("0.1.7", "0.2.0"), {
        "w4a8": _W4A8_22, "w4a8_sglang": _W4A8_22,
        "w4a4": _mega("w4a4", flag=True, before=True), "w4a4_packed": _PACKED_ONLY_OLD, "w4a4_te": _TIES_TO_ZERO,
    }, "sglang 0.5.22 srt/environ.py:1331 (FUSE_SHARED_EXPERTS, default on), srt/layers/moe/mega_moe.py:197 (fusion "
       "for fp8xfp4 only), :384-385 (router weights scaled before the kernel); sgl-deep-gemm 0.1.7 "
       "sm100_mega_moe_pre_dispatch.cuh:54 (ties toward zero)"),
    Row("sglang", ("0.5.22", None), ("0.2.0", None), {
        "w4a8": _W4A8_22, "w4a8_sglang": _W4A8_22,
        "w4a4": _TIES_TO_EVEN, "w4a4_packed": _PACKED_ONLY_OLD, "w4a4_te": _mega("w4a4_te", flag=True, before=True),
    }, "sglang 0.5.23 srt/arg_groups/fields/exec_.py:870-875 (enable_w4a4_mxfp4_megamoe), srt/environ.py:1474 "
       "(FUSE_SHARED_EXPERTS), srt/layers/moe/mega_moe.py:56-60 (mma_type), :196-207 (fusion for fp8xfp4 only), "
       "srt/arg_groups/model_overrides/deepseek_v4.py:87 (without megamoe: moe_runner_backend=flashinfer_mxfp4); "
       "sgl-deep-gemm 0.2.5 sm100_mega_moe_pre_dispatch.cuh:53-54 (ties to even)"),
    Row("vllm", ("0.30", "0.35"), None, {
        "w4a8": Selection(env=VLLM_DEV_ENV, flags=VLLM_MEGA_FLAGS, server_info={"moe_backend": "deep_gemm_mega_moe"},
                          served_numerics="w4a8", shared_expert_fusion="fused", routed_scaling="before the kernel"),
        "w4a8_sglang": "vLLM does not run SGLang's FP8 pre-dispatch (its Triton staging floors the amax at 1e-4): "
                       "gate w4a8", "w4a4": _VLLM_W4A4, "w4a4_packed": _VLLM_W4A4, "w4a4_te": _VLLM_W4A4,
    }, "vllm 0.34 vllm/config/kernel.py:127 (moe_backend deep_gemm_mega_moe), engine/arg_utils.py:1874-1876 "
       "(--moe-backend), models/deepseek_v4/nvidia/model.py:228-239 (needs --enable-expert-parallel), :373-380 "
       "(shared expert fused at TP 1 or sequence-parallel MoE unless VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION), "
       ":484 (router weights scaled before the kernel); entrypoints/serve/dev/server_info/api_router.py:43-58 "
       "(/server_info?config_format=json), entrypoints/launchers/api_server/routers.py:46 (only with "
       "VLLM_SERVER_DEV_MODE=1); model_executor/layers/fused_moe/oracle/mxfp4.py:812-813 (with no --moe-backend the "
       "backend the oracle picks is only logged); the same in 0.30 (models/deepseek_v4/nvidia/model.py:730 fp8xfp4, "
       ":799 expert parallel, :937-938 fusion) and 0.31-0.33"),
)


def served_by(kernel: str) -> list[str]:
    """One line per table row that can serve ``kernel``: the stack, then the environment and flags that select
    it (``--moe-a2a-backend megamoe`` is the user's to pass on SGLang; evalgate adds the rest), and the numerics
    it then computes where they are another kernel's. Empty: no engine serves it (in-process only)."""
    lines = []
    for row in TABLE:
        how = row.kernels.get(kernel)
        if isinstance(how, Selection):
            needs = [f"{k}={v}" for k, v in how.env.items()] + list(how.flags)
            if how.server_info.get("moe_a2a_backend") == "megamoe":
                needs.insert(0, "--moe-a2a-backend megamoe")
            if kernel == "w4a4_packed":
                needs.append("(a build of sgl-deep-gemm with the packed kernel: PR #44)")
            if how.served_numerics and how.served_numerics != kernel:
                needs.append(f"(computes {how.served_numerics})")
            lines.append(f"{row.describe()}: {' '.join(needs) or 'no setting'}")
    return lines


def find_row(stack: Stack) -> Row | None:
    return next((row for row in TABLE if row.matches(stack)), None)


def selection_for(kernel: str, stack: Stack) -> tuple[Selection, Row]:
    """How ``kernel`` is selected on ``stack``; refuses in one line where the stack cannot run it."""
    if kernel.startswith("faulty/"):
        raise UserError(f"kernel {kernel!r} is a fault-injected test double of the emulator; a server cannot run it "
                        "(launch a real kernel, e.g. --kernel w4a4_te)")
    row = find_row(stack)
    if row is None and stack.engine_version is None:
        if kernel in ("w4a8", "w4a8_sglang"):  # the mega-MoE path on any version; verified from /server_info
            return (_W4A8_ENV if stack.engine == "sglang" else TABLE[-1].kernels["w4a8"]), None
        raise UserError(f"cannot read the {stack.engine} version in the server's Python, and how --kernel {kernel} "
                        "is selected depends on it; set EVALGATE_SERVER_PYTHON to the Python that runs the server")
    if row is None:
        known = "; ".join(r.describe() for r in TABLE if r.engine == stack.engine)
        raise UserError(f"{_stack_text(stack)} is not in evalgate's kernel table ({known}), so {kernel!r} cannot be "
                        "selected safely; use a listed version (docs/serving.md#kernel-selection-per-engine-version)")
    how = row.kernels.get(kernel)
    if how is None:
        raise UserError(f"kernel {kernel!r} has no server recipe on {row.describe()}")
    if isinstance(how, str):
        raise UserError(f"{_stack_text(stack)} cannot run --kernel {kernel}: {how}")
    if kernel == "w4a4_packed" and not stack.packed_build:
        raise UserError(f"{_stack_text(stack)} cannot run --kernel w4a4_packed: {_NO_PACKED}")
    if how.mega_moe and stack.gpu_arch not in (None, "sm100", "sm103"):
        raise UserError(f"--kernel {kernel} is a mega-MoE kernel that runs only on SM100 (B200/B300); this GPU is "
                        f"{stack.gpu_arch}, where the selection is silently ignored and another kernel serves")
    return how, row


def _stack_text(stack: Stack) -> str:
    lib = f" with sgl-deep-gemm {stack.library_version}" if stack.engine == "sglang" else ""
    return f"{stack.engine} {stack.engine_version or '(version unknown)'}{lib if stack.library_version else ''}"


# ---- reading the stack in the server's Python environment ----

_PROBE = r"""
import glob, importlib.metadata as md, importlib.util as iu, json, os
def v(d):
    try: return md.version(d)
    except md.PackageNotFoundError: return None
packed = False
spec = iu.find_spec("deep_gemm")
for root in (spec.submodule_search_locations or []) if spec else []:
    if glob.glob(os.path.join(root, "include", "**", "sm100_fp4_mega_moe.cuh"), recursive=True):
        packed = True
    for so in glob.glob(os.path.join(root, "_C*.so")):
        with open(so, "rb") as f:
            packed = packed or b"DG_MEGA_MOE_FP4" in f.read()
print(json.dumps({"engine_version": v(ENGINE), "library_version": v("sgl-deep-gemm"), "packed_build": packed}))
"""


def server_python(program: list[str], env: dict[str, str]) -> str:
    """The Python that runs the server: EVALGATE_SERVER_PYTHON, the program's own interpreter (``python -m
    sglang.launch_server``, or the shebang of a ``vllm`` script), else this one."""
    if env.get("EVALGATE_SERVER_PYTHON"):
        return env["EVALGATE_SERVER_PYTHON"]
    first = program[0] if program else sys.executable
    if os.path.basename(first).startswith("python"):
        return first
    path = shutil.which(first, path=env.get("PATH"))
    if path:
        try:
            with open(path, "rb") as f:
                line = f.readline().decode(errors="replace")
            if line.startswith("#!") and "python" in line:
                return line[2:].split()[-1] if line.split()[0].endswith("env") else line[2:].split()[0]
        except OSError:
            pass
    return sys.executable


def probe_stack(engine: str, python: str, env: dict[str, str]) -> Stack:
    """The engine's and sgl-deep-gemm's versions in ``python``'s environment, whether its deep_gemm ships the
    packed kernel, and the GPU architecture when ``nvidia-smi`` can see one."""
    found = {}
    try:
        out = subprocess.run([python, "-c", f"ENGINE={engine!r}\n{_PROBE}"], env=env, capture_output=True, text=True,
                             timeout=60)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        found = {}
    return Stack(engine, found.get("engine_version"), found.get("library_version"),
                 bool(found.get("packed_build")), gpu_arch(env))


def gpu_arch(env: dict[str, str]) -> str | None:
    """``smXY`` of the first visible GPU (``nvidia-smi``), or None when none is visible."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], env=env,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    match = re.fullmatch(r"(\d+)\.(\d+)", first.strip())
    return f"sm{match.group(1)}{match.group(2)}" if match else None


# ---- server arguments after `--` ----

def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` among ``args`` (``--x v`` or ``--x=v``; argparse prefixes too)."""
    value = None
    for i, arg in enumerate(args):
        key, eq, inline = arg.partition("=")
        # argparse takes an unambiguous prefix: SGLang reads `--tp 4 --dp 4` as --tp-size 4 --dp-size 4
        if any(key == n or (len(key) >= 4 and n.startswith(key) and key.startswith("--")) for n in names):
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def _int_flag(args: list[str], name: str, default: int) -> int:
    value = _flag_value(args, name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise UserError(f"{name} {value!r} after `--` is not an integer") from None


def _has_flag(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def mega_moe_on(args: list[str], env: dict[str, str], engine_version: str | None = None) -> bool:
    """Whether SGLang runs the DeepSeek-V4 MoE on DeepGEMM's mega-MoE path: ``--moe-a2a-backend megamoe`` (or
    ``--moe-runner-backend megamoe``), or SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE on 0.5.12-0.5.17, the releases that
    read it (0.5.17 srt/arg_groups/overrides.py:2465-2470)."""
    backend = _flag_value(args, "--moe-a2a-backend") or _flag_value(args, "--moe-runner-backend")
    old = (version_tuple(engine_version) or (0, 5, 12)) < (0, 5, 18)
    return backend == "megamoe" or (old and env.get(MEGA_ENV, "").lower() in ("1", "true", "yes"))


def preflight(kernel: str, stack: Stack, args: list[str], env: dict[str, str]) -> tuple[Selection, Row | None, list[str]]:
    """Refuse (one line) a launch of ``kernel`` on ``stack`` with server arguments ``args`` and environment
    ``env`` that cannot run it, would crash, or contradicts it; else its selection and warnings."""
    selection, row = selection_for(kernel, stack)
    warnings: list[str] = []
    if stack.engine == "sglang":
        flag_given = _has_flag(args, W4A4_FLAG)
        if flag_given and W4A4_FLAG not in selection.flags:
            raise UserError(f"`{W4A4_FLAG}` after `--` selects SGLang's W4A4 MXFP4 kernel, which contradicts "
                            f"--kernel {kernel}; drop it (evalgate adds the flags the kernel needs)")
        mega = mega_moe_on(args, env, stack.engine_version)
        if selection.server_info.get("moe_a2a_backend") == "megamoe" and not mega:
            raise UserError(f"--kernel {kernel} runs on SGLang's DeepGEMM mega-MoE path only: pass `-- "
                            "--moe-a2a-backend megamoe`; without it SGLang serves DeepSeek-V4's FP4 experts through "
                            f"another backend (flashinfer_mxfp4 from 0.5.19), which {NOT_A_RECIPE}")
        if mega:
            warnings += _mega_moe_settings(stack, args, env)
        tp, dp = _int_flag(args, "--tp-size", 1), _int_flag(args, "--dp-size", 1)
        if dp > 1 and not _has_flag(args, "--enable-dp-attention"):
            warnings.append(f"--dp-size {dp} runs {dp} whole model copies of --tp-size {tp}: {tp * dp} GPUs; "
                            "for one copy over the GPUs use --tp-size alone (or add --enable-dp-attention)")
    if stack.engine == "vllm":
        backend = _flag_value(args, "--moe-backend")
        if backend is not None and backend.lower().replace("-", "_") != "deep_gemm_mega_moe":
            raise UserError(f"`--moe-backend {backend}` after `--` selects a vLLM MoE backend that {NOT_A_RECIPE}; "
                            f"--kernel {kernel} runs on deep_gemm_mega_moe, which evalgate selects itself")
        if env.get(VLLM_NO_FUSION_ENV, "").strip().lower() in ("1", "true"):
            warnings.append(f"{VLLM_NO_FUSION_ENV} is set: the shared expert runs beside the kernel (recorded as not "
                            "fused)")
    if stack.engine_version is None:
        warnings.append(f"cannot read the {stack.engine} version in the server's Python; set EVALGATE_SERVER_PYTHON "
                        "to it so evalgate can check the kernel selection")
    return selection, row, warnings


def _mega_moe_settings(stack: Stack, args: list[str], env: dict[str, str]) -> list[str]:
    """DeepSeek-V4 mega-MoE settings that fail at start: the per-rank token budget (default 1024 in 0.5.12-0.5.17,
    srt/environ.py:1203 of 0.5.17; 8192 from 0.5.18, :1030 of 0.5.18) must cover a prefill chunk
    (arg_groups/deepseek_v4_hook.py in 0.5.17-0.5.20, arg_groups/mega_moe_hook.py from 0.5.21)."""
    size = None if _flag_value(args, "--chunked-prefill-size") is None else _int_flag(args, "--chunked-prefill-size", 0)
    cap_default = 8192 if (version_tuple(stack.engine_version) or (0,)) >= (0, 5, 18) else 1024
    try:
        cap = int(env.get(TOKENS_PER_RANK_ENV) or cap_default)
    except ValueError:
        raise UserError(f"{TOKENS_PER_RANK_ENV}={env[TOKENS_PER_RANK_ENV]!r} is not an integer") from None
    if size is None:
        return [f"mega-MoE: --chunked-prefill-size is not given; SGLang picks one from GPU memory, and it must not "
                f"exceed {TOKENS_PER_RANK_ENV} ({cap}) per rank"]
    if size <= 0:
        raise UserError("DeepSeek-V4 mega-MoE needs chunked prefill: --chunked-prefill-size must be positive, not "
                        f"{size}")
    dp = _int_flag(args, "--dp-size", 1)
    per_rank = size // dp if _has_flag(args, "--enable-dp-attention") and dp > 1 else size
    if per_rank > cap:
        raise UserError(f"DeepSeek-V4 mega-MoE: --chunked-prefill-size {size} needs {per_rank} tokens per rank but "
                        f"{TOKENS_PER_RANK_ENV} is {cap}; raise it to at least {per_rank} or lower the chunk size")
    return []
