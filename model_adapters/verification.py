"""After a server is up: does what it reports about itself agree with the kernel evalgate was told it runs?

``check_kernel`` reads the answers of ``/server_info`` (SGLang; vLLM in dev mode), ``/version`` (vLLM) and
evalgate serve's own record, finds the row of the kernel table (``engines.TABLE``) for the engine and
version reported, and returns a ``KernelCheck``: ``verified`` (the server reports what the row says the
kernel needs), ``contradicted`` (it reports something that selects another kernel: the run is refused),
or ``unverifiable`` (it reports nothing that tells; the verdict says so). The serving identity the
comparison needs (served numerics, shared-expert fusion, where routed scaling is applied) comes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evalgate.model_adapters.engines import (FUSE_SHARED_ENV, TABLE, W4A4_KERNELS, Stack, find_row, in_range,
                                             version_tuple)

VERIFIED, CONTRADICTED, UNVERIFIABLE = "verified", "contradicted", "unverifiable"


@dataclass(frozen=True)
class KernelCheck:
    status: str
    why: str
    engine: str | None = None
    engine_version: str | None = None
    serving: dict = field(default_factory=dict)  # served_numerics, shared_expert_fusion, routed_scaling

    @property
    def verified(self) -> bool:
        return self.status == VERIFIED

    def record(self) -> dict:
        return {"status": self.status, "why": self.why, "engine": self.engine, "engine_version": self.engine_version,
                **({"serving_identity": self.serving} if self.serving else {})}


def reported_engine(server_info: dict | None, version: dict | None) -> tuple[str | None, str | None]:
    """(engine, version) from what a server says: evalgate serve names itself, SGLang's /server_info carries its
    server arguments and version, vLLM answers /version."""
    info = server_info or {}
    if isinstance(info.get("evalgate"), dict):
        return "evalgate", str(info.get("version"))
    if "moe_a2a_backend" in info or "enable_deterministic_inference" in info or "launch_command" in info:
        return "sglang", str(info["version"]) if info.get("version") else None
    if isinstance(version, dict) and version.get("version"):
        return "vllm", str(version["version"])
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
                           {"served_numerics": name})
    if engine is None:
        return KernelCheck(UNVERIFIABLE, "the server reports neither SGLang's /server_info nor vLLM's /version, so "
                           "nothing tells which kernel it runs")
    stack = Stack(engine, engine_version, launch_stack.get("sgl_deep_gemm"), bool(launch_stack.get("packed_build")),
                  launch_stack.get("gpu_arch"))
    if engine == "vllm":
        if kernel in W4A4_KERNELS:
            return KernelCheck(CONTRADICTED, f"vLLM {engine_version} runs DeepSeek-V4's MoE as W4A8 only and ignores "
                               "DG_* variables", engine, engine_version)
        row = find_row(stack) if kernel == "w4a8" else None
        why = (f"vLLM {engine_version} has one DeepSeek-V4 MoE kernel, W4A8 ({row.source})" if row else
               f"vLLM {engine_version} with {kernel} is not in evalgate's kernel table")
        return KernelCheck(VERIFIED if row else UNVERIFIABLE, why, engine, engine_version,
                           {"served_numerics": "w4a8", "shared_expert_fusion": "not fused",
                            "routed_scaling": "vLLM's own"})
    return _check_sglang(kernel, info, stack, launch or {})


def _check_sglang(kernel: str, info: dict, stack: Stack, launch: dict) -> KernelCheck:
    version = stack.engine_version
    mega = info.get("moe_a2a_backend") == "megamoe"
    flag = info.get("enable_w4a4_mxfp4_megamoe")
    rows = _sglang_rows(stack)
    if isinstance(flag, bool) and flag and kernel != _flag_kernel(stack):
        return KernelCheck(CONTRADICTED, f"/server_info reports enable_w4a4_mxfp4_megamoe=true: the server runs "
                           f"SGLang's W4A4 MXFP4 kernel ({_flag_kernel(stack)}), not {kernel}", "sglang", version)
    if kernel in W4A4_KERNELS and not mega:
        return KernelCheck(CONTRADICTED, f"/server_info reports moe_a2a_backend={info.get('moe_a2a_backend')!r}: the "
                           f"mega-MoE path that runs {kernel} is off", "sglang", version)
    if not rows:
        return KernelCheck(UNVERIFIABLE, f"SGLang {version} is not in evalgate's kernel table", "sglang", version)
    selections = [r.kernels.get(kernel) for r in rows]
    if all(s is None for s in selections):
        return KernelCheck(UNVERIFIABLE, f"{kernel} is not in evalgate's kernel table for SGLang", "sglang", version)
    wants = [s for s in selections if not isinstance(s, str) and s is not None]
    if not wants:
        return KernelCheck(CONTRADICTED, f"SGLang {version} cannot run {kernel}: {selections[0]}", "sglang", version)
    selection = wants[0]
    serving = {"served_numerics": selection.served_numerics, "routed_scaling": selection.routed_scaling,
               "shared_expert_fusion": _fusion(selection, mega, launch)}
    if "enable_w4a4_mxfp4_megamoe" in info:  # SGLang >= 0.5.20 reports the switch that selects W4A4
        mismatched = {k: info.get(k) for k, v in selection.server_info.items() if info.get(k) != v}
        if mismatched:
            return KernelCheck(CONTRADICTED, f"/server_info reports {mismatched}, {kernel} needs "
                               f"{selection.server_info}", "sglang", version, serving)
        return KernelCheck(VERIFIED, f"/server_info reports {selection.server_info or 'no W4A4 switch'} "
                           f"(moe_a2a_backend={info.get('moe_a2a_backend')!r})", "sglang", version, serving)
    why = ("SGLang before 0.5.20 selects the kernel from DG_* variables, which /server_info does not report"
           + ("; evalgate set them at launch (launch.kernel_env)" if launch else ""))
    return KernelCheck(UNVERIFIABLE, why, "sglang", version, serving)


def _sglang_rows(stack: Stack) -> list:
    """The table's rows for this SGLang version; a given server's sgl-deep-gemm is unknown, so all of them."""
    return [r for r in TABLE if r.engine == "sglang" and in_range(stack.engine_version, r.engine_range)
            and (stack.library_version is None or r.matches(stack))]


def _flag_kernel(stack: Stack) -> str:
    """What --enable-w4a4-mxfp4-megamoe computes: ties to even from sgl-deep-gemm 0.2.0 (w4a4_te), toward zero
    before (w4a4); SGLang >= 0.5.20 pins 0.2.x, so w4a4_te when the library is unknown."""
    lib = version_tuple(stack.library_version)
    return "w4a4" if lib is not None and lib < (0, 2, 0) else "w4a4_te"


def _fusion(selection, mega: bool, launch: dict) -> str:
    """Shared-expert fusion: SGLang >= 0.5.20 fuses the shared expert into the fp8xfp4 (W4A8) mega-MoE kernel
    unless SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS is off; never into W4A4."""
    if selection.shared_expert_fusion != "fused" or not mega:
        return "not fused"
    env = (launch or {}).get("engine_env") or {}
    if FUSE_SHARED_ENV in env:
        return "fused" if env[FUSE_SHARED_ENV].strip().lower() in ("1", "true", "yes", "on") else "not fused"
    return "fused" if launch else "fused unless SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS=0 (not reported)"
