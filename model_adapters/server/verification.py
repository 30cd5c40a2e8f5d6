"""After a server is up: does what it reports about itself agree with the kernel evalgate was told it runs?

``check_kernel`` reads the answers of ``/server_info`` (SGLang; vLLM only in dev mode, as JSON), ``/version``
(vLLM) and evalgate serve's own record, finds the row of the kernel table (``engines.TABLE``) for the engine
and version reported, and returns a ``KernelCheck``: ``verified`` (the server reports what the row says the
kernel needs), ``contradicted`` (it reports something that selects another kernel or a MoE path that is no
evalgate recipe: the run is refused), or ``unverified`` (it reports nothing that tells; the manifest, the
verdict and the reports say so). ``rests_on`` names the reported fields, with their values, that the status
rests on. The serving identity the comparison needs (served numerics, shared-expert fusion, where routed
scaling is applied) comes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evalgate.model_adapters.server.engines import (FUSE_SHARED_ENV, NOT_A_RECIPE, TABLE, VLLM_NO_FUSION_ENV, W4A4_KERNELS,
                                             Selection, Stack, find_row, in_range, version_tuple)

VERIFIED, CONTRADICTED, UNVERIFIED = "verified", "contradicted", "unverified"
UNVERIFIABLE = UNVERIFIED  # the name older callers import
# vLLM's MoE all-to-all backends that make the MoE sequence-parallel: the shared expert is fused there at any TP
# (vllm 0.34 config/parallel.py:859-871, use_sequence_parallel_moe)
VLLM_SEQUENCE_PARALLEL = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                          "flashinfer_nvlink_one_sided", "passthrough", "mori_high_throughput", "mori_low_latency",
                          "mori")


@dataclass(frozen=True)
class KernelCheck:
    status: str
    why: str
    engine: str | None = None
    engine_version: str | None = None
    serving: dict = field(default_factory=dict)  # served_numerics, shared_expert_fusion, routed_scaling
    rests_on: dict = field(default_factory=dict)  # "endpoint field" -> the value reported

    @property
    def verified(self) -> bool:
        return self.status == VERIFIED

    def record(self) -> dict:
        return {"status": self.status, "why": self.why, "engine": self.engine, "engine_version": self.engine_version,
                "rests_on": self.rests_on, **({"serving_identity": self.serving} if self.serving else {})}


def reported_engine(server_info: dict | None, version: dict | None) -> tuple[str | None, str | None]:
    """(engine, version) from what a server says: evalgate serve names itself, SGLang's /server_info carries its
    server arguments and version, vLLM answers /version (and, in dev mode, /server_info with ``vllm_config``)."""
    info = server_info or {}
    if isinstance(info.get("evalgate"), dict):
        return "evalgate", str(info.get("version"))
    vllm_version = str(version["version"]) if isinstance(version, dict) and version.get("version") else None
    if "vllm_config" in info:
        return "vllm", vllm_version
    if "moe_a2a_backend" in info or "enable_deterministic_inference" in info or "launch_command" in info:
        return "sglang", str(info["version"]) if info.get("version") else None
    if vllm_version:
        return "vllm", vllm_version
    return None, None


def check_kernel(kernel: str, server_info: dict | None, version: dict | None, launch: dict | None = None) -> KernelCheck:
    """The kernel check of a server that claims to run ``kernel`` (``launch``: evalgate's launch record)."""
    info = server_info or {}
    engine, engine_version = reported_engine(server_info, version)
    launch_stack = (launch or {}).get("stack") or {}
    if engine == "evalgate":
        name = ((info.get("evalgate") or {}).get("kernel") or {}).get("name")
        status = VERIFIED if name == kernel else CONTRADICTED
        return KernelCheck(status, f"evalgate serve reports kernel {name!r}", engine, engine_version,
                           {"served_numerics": name}, {"/server_info evalgate.kernel.name": name})
    if engine is None:
        return KernelCheck(UNVERIFIED, "the server reports neither SGLang's /server_info nor vLLM's /version, so "
                           "nothing tells which kernel it runs")
    stack = Stack(engine, engine_version, launch_stack.get("sgl_deep_gemm"), bool(launch_stack.get("packed_build")),
                  launch_stack.get("gpu_arch"))
    if engine == "vllm":
        return _check_vllm(kernel, info, stack, launch or {})
    return _check_sglang(kernel, info, stack, launch or {})


# ---- vLLM ----

def _check_vllm(kernel: str, info: dict, stack: Stack, launch: dict) -> KernelCheck:
    version = stack.engine_version
    seen = {"/version version": version}
    if kernel in W4A4_KERNELS:
        return KernelCheck(CONTRADICTED, f"vLLM {version} has no W4A4 kernel for DeepSeek-V4 and ignores DG_* "
                           "variables", "vllm", version, rests_on=seen)
    row = find_row(stack)
    how = row.kernels.get(kernel) if row else None
    if not isinstance(how, Selection):
        why = how if isinstance(how, str) else f"vLLM {version} with {kernel} is not in evalgate's kernel table"
        return KernelCheck(CONTRADICTED if isinstance(how, str) else UNVERIFIED, why, "vllm", version, rests_on=seen)
    config = info.get("vllm_config")
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    serving = {"served_numerics": how.served_numerics, "routed_scaling": how.routed_scaling,
               "shared_expert_fusion": _vllm_fusion(config, env, launch)}
    if not isinstance(config, dict):
        why = (f"vLLM {version} reports its MoE backend only in dev mode (/server_info?config_format=json with "
               "VLLM_SERVER_DEV_MODE=1), and this server did not; /version alone says nothing about the kernel")
        return KernelCheck(UNVERIFIED, why, "vllm", version, serving, seen)
    kernel_config = config.get("kernel_config") or {}
    parallel = config.get("parallel_config") or {}
    backend, expert_parallel = kernel_config.get("moe_backend"), parallel.get("enable_expert_parallel")
    seen.update({"/server_info vllm_config.kernel_config.moe_backend": backend,
                 "/server_info vllm_config.parallel_config.enable_expert_parallel": expert_parallel,
                 "/server_info vllm_config.parallel_config.tensor_parallel_size": parallel.get("tensor_parallel_size"),
                 f"/server_info vllm_env.{VLLM_NO_FUSION_ENV}": env.get(VLLM_NO_FUSION_ENV)})
    if backend != "deep_gemm_mega_moe":
        return KernelCheck(CONTRADICTED, f"/server_info reports kernel_config.moe_backend={backend!r}: vLLM's MXFP4 "
                           f"oracle picks the MoE kernel (FlashInfer TRT-LLM, DeepGEMM's FP4 grouped GEMM, Marlin or "
                           f"Humming), which {NOT_A_RECIPE}; {kernel} needs deep_gemm_mega_moe", "vllm", version,
                           serving, seen)
    if expert_parallel is not True:
        return KernelCheck(CONTRADICTED, "/server_info reports enable_expert_parallel false: vLLM's DeepSeek-V4 mega-"
                           "MoE needs expert parallelism and does not start without it", "vllm", version, serving, seen)
    return KernelCheck(VERIFIED, "/server_info reports kernel_config.moe_backend='deep_gemm_mega_moe' with expert "
                       f"parallelism (DeepGEMM's fp8xfp4 mega-MoE kernel: {kernel})", "vllm", version, serving, seen)


def _vllm_fusion(config, env: dict, launch: dict) -> str:
    """vLLM fuses the shared expert into the mega-MoE kernel at TP 1 or with a sequence-parallel MoE, unless
    VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION (vllm 0.34 models/deepseek_v4/nvidia/model.py:373-380)."""
    disabled = env.get(VLLM_NO_FUSION_ENV)
    if disabled is None:
        disabled = ((launch.get("engine_env") or {}).get(VLLM_NO_FUSION_ENV) or "0").strip().lower() in ("1", "true")
    if disabled is True or disabled in ("1", "true", "True"):
        return "not fused"
    if not isinstance(config, dict):
        return "fused at TP 1 or with a sequence-parallel MoE (not reported)"
    parallel = config.get("parallel_config") or {}
    if parallel.get("tensor_parallel_size") == 1 or parallel.get("all2all_backend") in VLLM_SEQUENCE_PARALLEL:
        return "fused"
    return "not fused"


# ---- SGLang ----

def _check_sglang(kernel: str, info: dict, stack: Stack, launch: dict) -> KernelCheck:
    version = stack.engine_version
    a2a, runner = info.get("moe_a2a_backend"), info.get("moe_runner_backend")
    mega = "megamoe" in (a2a, runner)
    flag = info.get("enable_w4a4_mxfp4_megamoe")
    seen = {"/server_info version": version, "/server_info moe_a2a_backend": a2a,
            **({"/server_info moe_runner_backend": runner} if "moe_runner_backend" in info else {}),
            **({"/server_info enable_w4a4_mxfp4_megamoe": flag} if "enable_w4a4_mxfp4_megamoe" in info else {})}
    if "moe_a2a_backend" not in info and "moe_runner_backend" not in info:
        return KernelCheck(UNVERIFIED, "/server_info does not report moe_a2a_backend or moe_runner_backend, so "
                           "nothing tells whether DeepGEMM's mega-MoE kernel serves the experts", "sglang", version,
                           rests_on=seen)
    if not mega:
        return KernelCheck(CONTRADICTED, f"/server_info reports moe_a2a_backend={a2a!r}, "
                           f"moe_runner_backend={runner!r}: DeepSeek-V4's experts are not on DeepGEMM's mega-MoE path, and the backend that serves "
                           f"them {NOT_A_RECIPE}", "sglang", version, rests_on=seen)
    if flag is True and kernel != _flag_kernel(stack):
        return KernelCheck(CONTRADICTED, f"/server_info reports enable_w4a4_mxfp4_megamoe=true: the server runs "
                           f"SGLang's W4A4 MXFP4 kernel ({_flag_kernel(stack)}), not {kernel}", "sglang", version,
                           rests_on=seen)
    rows = _sglang_rows(stack)
    if not rows:
        return KernelCheck(UNVERIFIED, f"SGLang {version} is not in evalgate's kernel table", "sglang", version,
                           rests_on=seen)
    selections = [r.kernels.get(kernel) for r in rows]
    if all(s is None for s in selections):
        return KernelCheck(UNVERIFIED, f"{kernel} is not in evalgate's kernel table for SGLang", "sglang", version,
                           rests_on=seen)
    wants = [s for s in selections if isinstance(s, Selection)]
    if not wants:
        return KernelCheck(CONTRADICTED, f"SGLang {version} cannot run {kernel}: {selections[0]}", "sglang", version,
                           rests_on=seen)
    selection = wants[0]
    serving = {"served_numerics": selection.served_numerics, "routed_scaling": selection.routed_scaling,
               "shared_expert_fusion": _fusion(selection, launch)}
    if "enable_w4a4_mxfp4_megamoe" in info:  # SGLang >= 0.5.19 reports the switch that selects W4A4
        mismatched = {k: info.get(k) for k, v in selection.server_info.items() if info.get(k) != v}
        if mismatched:
            return KernelCheck(CONTRADICTED, f"/server_info reports {mismatched}, {kernel} needs "
                               f"{selection.server_info}", "sglang", version, serving, seen)
        shown = ", ".join(f"{k}={v!r}" for k, v in selection.server_info.items())
        return KernelCheck(VERIFIED, f"/server_info reports {shown}", "sglang", version, serving, seen)
    why = ("SGLang before 0.5.19 selects W4A4 from DG_* variables, which /server_info does not report; it shows "
           "only that the mega-MoE path is on"
           + ("; evalgate set them at launch (launch.kernel_env)" if launch else ""))
    return KernelCheck(UNVERIFIED, why, "sglang", version, serving, seen)


def _sglang_rows(stack: Stack) -> list:
    """The table's rows for this SGLang version; a given server's sgl-deep-gemm is unknown, so all of them."""
    return [r for r in TABLE if r.engine == "sglang" and in_range(stack.engine_version, r.engine_range)
            and (stack.library_version is None or r.matches(stack))]


def _flag_kernel(stack: Stack) -> str:
    """What --enable-w4a4-mxfp4-megamoe computes: ties to even from sgl-deep-gemm 0.2.0 (w4a4_te), toward zero
    before (w4a4). With the library unknown, the release's pin decides: 0.5.19 pins 0.1.7 (w4a4), 0.5.20 on 0.2.x."""
    lib = version_tuple(stack.library_version)
    if lib is None:
        return "w4a4" if (version_tuple(stack.engine_version) or (0,)) < (0, 5, 20) else "w4a4_te"
    return "w4a4" if lib < (0, 2, 0) else "w4a4_te"


def _fusion(selection: Selection, launch: dict) -> str:
    """Shared-expert fusion: SGLang >= 0.5.22 fuses the shared expert into the fp8xfp4 (W4A8) mega-MoE kernel
    unless SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS is off; never into W4A4, never before 0.5.22."""
    if selection.shared_expert_fusion != "fused":
        return "not fused"
    env = (launch or {}).get("engine_env") or {}
    if FUSE_SHARED_ENV in env:
        return "fused" if env[FUSE_SHARED_ENV].strip().lower() in ("1", "true", "yes", "on") else "not fused"
    return "fused" if launch else "fused unless SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS=0 (not reported)"
