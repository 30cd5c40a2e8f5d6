"""Numerics checks: how far each kernel is from a reference, layer by layer and through a whole model.

- `layer_check(shape, tokens, seed)`: one synthetic MoE layer (docs/kernels.md#dsv4-flash-defaults DSV4-Flash shapes, FP4 weights with a
  realistic scale spread, tokens routed by a sqrt-softplus router); every kernel vs the FP32 reference
  (`reference.Fp32Reference`). Weights stay as FP4 codes (3.2 GB at dsv4-flash) and are dequantized a few
  experts at a time, only where tokens were routed, and shared by all kernels.
- `model_check(model, tokenizer, pairs)`: a model teacher-forced on (prompt, answer) pairs; each kernel's
  next-token distributions over the answer tokens vs the `bf16` kernel's: mean KL and top-1 agreement.

Both return lists of plain dicts, one per kernel.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from evalgate.errors import UserError

from . import formats
from .emulator import MoEEmulation, as_gemm_weights, run_chunk_together, weight_fault
from .reference import Bf16GroupedMM, Fp32Reference
from .catalogs import get_kernel, kernel_names
from .weights import Fp4ExpertWeights, double_one_group_per_row

SHAPES = {
    # spec docs/kernels.md#dsv4-flash-defaults defaults
    "dsv4-flash": dict(hidden=4096, intermediate=2048, experts=256, top_k=6, routed_scaling=1.5, swiglu_limit=10.0),
    "tiny": dict(hidden=256, intermediate=128, experts=16, top_k=4, routed_scaling=1.5, swiglu_limit=10.0),
    # benchmarks/bench_kernels.py's small shape: big enough for several K blocks and N tiles per GEMM
    "small": dict(hidden=1024, intermediate=512, experts=32, top_k=6, routed_scaling=1.5, swiglu_limit=10.0),
}
CHUNK_WEIGHT_BYTES = 768 << 20  # FP32 weights dequantized at once


@dataclass
class LayerCase:
    x: torch.Tensor  # BF16 [T, H]
    top_k_index: torch.Tensor  # [T, K]
    top_k_weights: torch.Tensor  # FP32 [T, K], normalised and x routed_scaling (HF convention)
    weights: Fp4ExpertWeights
    limit: float
    routed_scaling: float


def shape_params(shape: str) -> dict:
    if shape not in SHAPES:
        raise UserError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    return SHAPES[shape]


# --- a synthetic layer ------------------------------------------------------------------------------


def _code_pool(g: torch.Generator, groups: int = 8192):
    """Packed E2M1 codes and scale bytes of Gaussian N(0, 1) groups: what quantizing a trained weight
    row's groups looks like. Weight groups are drawn from this pool."""
    w = torch.randn(groups, formats.GROUP, generator=g)
    codes, byte = formats.quantize(w, "e2m1", formats.WEIGHTS, ties="even")
    return formats.pack_e2m1(codes), byte[:, 0].to(torch.int32)


def _fp4_matrix(pool, g, n: int, rows: int, k: int, log2_std: float):
    """[n, rows, k] FP4 weights: Gaussian groups with std 2^log2_std, each row's scale jittered by
    -1, 0 or +1 binade (rows of trained weights differ in scale)."""
    packed, byte = pool
    pick = torch.randint(0, packed.shape[0], (n, rows, k // formats.GROUP), generator=g)
    row_shift = torch.randint(-1, 2, (n, rows, 1), generator=g, dtype=torch.int32)
    scale = (byte[pick] + round(log2_std) + row_shift).clamp(1, 254).to(torch.uint8)
    return packed[pick].reshape(n, rows, k // 2), scale


def synthetic_weights(experts: int, hidden: int, intermediate: int, seed: int) -> Fp4ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    pool = _code_pool(g)
    w1, s1, w2, s2 = [], [], [], []
    step = 16
    for lo in range(0, experts, step):  # bounded temporaries at dsv4-flash size
        n = min(step, experts - lo)
        a, b = _fp4_matrix(pool, g, n, 2 * intermediate, hidden, -0.5 * math.log2(hidden))
        c, d = _fp4_matrix(pool, g, n, hidden, intermediate, -0.5 * math.log2(intermediate))
        w1.append(a), s1.append(b), w2.append(c), s2.append(d)
    return Fp4ExpertWeights(torch.cat(w1), torch.cat(s1), torch.cat(w2), torch.cat(s2), source="synthetic")


def sqrt_softplus_route(x: torch.Tensor, experts: int, top_k: int, routed_scaling: float, g: torch.Generator):
    """DeepseekV4TopKRouter (spec docs/kernels.md#dsv4-flash-defaults): scores = sqrt(softplus(x W^T)); top-k of scores + bias (bias only
    selects, unsorted); weights = scores / sum * routed_scaling."""
    h = x.shape[-1]
    gate = torch.randn(experts, h, generator=g) / math.sqrt(h)
    bias = 0.1 * torch.randn(experts, generator=g)
    scores = torch.sqrt(torch.nn.functional.softplus(x.to(torch.float32) @ gate.T))
    idx = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling


def synthetic_layer(shape: str, tokens: int, seed: int = 0) -> LayerCase:
    p = shape_params(shape)
    if tokens < 1:
        raise UserError(f"--tokens must be at least 1 (got {tokens})")
    g = torch.Generator().manual_seed(seed + 1)
    h = p["hidden"]
    # post-RMSNorm hidden states: unit scale with a few outlier channels
    channel = torch.exp(0.5 * torch.randn(h, generator=g))
    channel[torch.randperm(h, generator=g)[: max(1, h // 256)]] *= 8.0
    x = (torch.randn(tokens, h, generator=g) * channel).to(torch.bfloat16)
    idx, w = sqrt_softplus_route(x, p["experts"], p["top_k"], p["routed_scaling"], g)
    weights = synthetic_weights(p["experts"], h, p["intermediate"], seed)
    return LayerCase(x, idx, w, weights, p["swiglu_limit"], p["routed_scaling"])


# --- metrics ----------------------------------------------------------------------------------------


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's calc_diff (spec docs/kernels.md#checking-a-real-kernel): 1 - 2<x,y> / (|x|^2 + |y|^2), in float64."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.double(), ref.double()
    diff = out - ref
    return {
        "rel_rmse": float(diff.norm() / ref.norm()),
        "cosine": float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)),
        "max_abs_err": float(diff.abs().max()),
        "calc_diff": calc_diff(out, ref),
        "bf16_identical": float((out.to(torch.bfloat16) == ref.to(torch.bfloat16)).double().mean()),
    }


# --- layer-level check ------------------------------------------------------------------------------


class Fp4ExpertsModule(torch.nn.Module):
    """A routed-experts module holding a case's FP4 weights as stored (what `weights.fp4_weights` reads)."""

    def __init__(self, weights: Fp4ExpertWeights, limit: float, device):
        super().__init__()
        self.gate_up_proj, self.gate_up_proj_scale_inv = weights.w1.to(device), weights.w1_scale.to(device)
        self.down_proj, self.down_proj_scale_inv = weights.w2.to(device), weights.w2_scale.to(device)
        self.num_experts, self.limit = weights.num_experts, limit


class ForwardRunner:
    """A kernel that is no `MoEEmulation` (a real kernel, an FP8 recipe): its experts function on a module
    holding the case's weights, on the GPU where the kernel's library runs there."""

    def __init__(self, name: str, case: LayerCase):
        kernel = get_kernel(name)
        if kernel.real:
            kernel.library.require()
        device = "cuda" if kernel.real or torch.cuda.is_available() else "cpu"
        capability = getattr(kernel.library, "capability", None)  # a plugin kernel says where it runs
        if capability is not None:
            device = "cuda" if "cuda" in capability.devices and torch.cuda.is_available() else "cpu"
        module = Fp4ExpertsModule(case.weights, case.limit, device)
        with torch.no_grad():
            self.out = kernel.experts_forward(module, case.x.to(device), case.top_k_index.to(device),
                                              case.top_k_weights.to(device)).float().cpu()

    def finish(self) -> torch.Tensor:
        return self.out


def _runner(name: str, case: LayerCase):
    args = (case.x, case.top_k_index, case.top_k_weights, case.weights.num_experts, case.limit)
    if name == "bf16":
        return Bf16GroupedMM(*args)
    recipe = getattr(get_kernel(name).experts_forward, "recipe", None)
    if recipe is None:
        return ForwardRunner(name, case)
    x, idx, w, experts, limit = args
    return MoEEmulation(x, idx, w, recipe, experts, limit, routed_scaling_factor=case.routed_scaling)


def layer_check(shape: str = "tiny", tokens: int = 64, seed: int = 0, kernels: list[str] | None = None,
                case: LayerCase | None = None, progress=None) -> list[dict]:
    """Every kernel (default: all registered) on one synthetic MoE layer vs the FP32 reference.
    ``progress(what, done, total)``: called as each kernel is prepared and each chunk of experts is done (a
    long check's progress lines)."""
    case = case or synthetic_layer(shape, tokens, seed)
    runnable = [n for n in kernel_names() if not (get_kernel(n).real and get_kernel(n).library.missing())]
    names = kernels or sorted(runnable, key=lambda n: (get_kernel(n).faulty, n))
    runners = {}
    for i, n in enumerate(names, 1):
        if progress is not None:
            progress(f"preparing {n}, kernels prepared", i - 1, len(names))
        runners[n] = _runner(n, case)
        if progress is not None:
            progress("kernels prepared", i, len(names))
    reference = Fp32Reference(case.x, case.top_k_index, case.top_k_weights, case.weights.num_experts, case.limit)
    # Runners that share FP32 weights run together: one batched matmul per GEMM reads each weight once.
    groups: dict = {None: [reference]}
    for r in runners.values():
        if isinstance(r, ForwardRunner):
            continue  # computed already, whole
        groups.setdefault(weight_fault(r.recipe) if isinstance(r, MoEEmulation) else None, []).append(r)
    hit = torch.bincount(case.top_k_index.flatten(), minlength=case.weights.num_experts) > 0
    per_expert = 3 * case.weights.hidden * case.weights.intermediate * 4
    step = max(1, CHUNK_WEIGHT_BYTES // per_expert)
    t0 = time.perf_counter()
    for lo in range(0, case.weights.num_experts, step):
        hi = min(lo + step, case.weights.num_experts)
        if not bool(hit[lo:hi].any()):
            continue  # nobody routed here: never dequantized
        w1, w2 = case.weights.dequantize(lo, hi)  # row-major: read by padded bmm without a copy
        for fault, members in groups.items():
            if fault is None:
                run_chunk_together(members, lo, hi, w1, w2)
            else:  # fault (a), derived from the healthy weights (x2 = byte + 1)
                run_chunk_together(members, lo, hi, double_one_group_per_row(w1), double_one_group_per_row(w2))
        del w1, w2
        if progress is not None:
            progress("experts", hi, case.weights.num_experts)
    seconds = time.perf_counter() - t0
    ref = reference.finish()
    outs = {n: r.finish() for n, r in runners.items()}
    rows = []
    for n in names:
        k = get_kernel(n)
        row = {"kernel": n, "faulty": k.faulty, "twin": k.twin, "shape": shape, "tokens": case.x.shape[0],
               **error_metrics(outs[n], ref)}
        if k.twin in outs:  # how a faulty kernel looks when held against its healthy twin's emulation (docs/kernels.md#checking-a-real-kernel)
            row["calc_diff_vs_twin"] = calc_diff(outs[n], outs[k.twin])
        rows.append(row)
    for row in rows:
        row["layer_seconds_all_kernels"] = round(seconds, 2)
    return rows


# --- model-level check ------------------------------------------------------------------------------


def _answer_logprobs(model, tokenizer, prompt: str, answer: str) -> torch.Tensor:
    """Log-probabilities [n_answer, V] of the model's next-token distribution at each answer position,
    teacher-forced on prompt + answer."""
    p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    full = tokenizer(prompt + answer, add_special_tokens=True)["input_ids"]
    n_prompt = len(p_ids) if full[: len(p_ids)] == p_ids else len(p_ids) - 1  # merge at the seam
    n_prompt = max(1, n_prompt)
    ids = torch.tensor([full])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[n_prompt - 1 : len(full) - 1], dim=-1)


def model_check(model, tokenizer, pairs: list[tuple[str, str]], kernels: list[str] | None = None,
                baseline: str = "bf16") -> list[dict]:
    """Teacher-forced KL(baseline || kernel) and top-1 agreement over the answer tokens of `pairs`.
    Switches kernels with `model.set_experts_implementation`; restores the original one at the end."""
    if not pairs:
        raise UserError("the model-level check got no (prompt, answer) pairs; check --tasks and --limit")
    names = kernels or [n for n in kernel_names()]
    names = [baseline] + [n for n in names if n != baseline]
    for n in names:
        get_kernel(n)
    original = getattr(model.config, "_experts_implementation", None)
    ref: list[torch.Tensor] = []
    rows = []
    try:
        for n in names:
            model.set_experts_implementation(n)
            t0 = time.perf_counter()
            lps = [_answer_logprobs(model, tokenizer, p, a) for p, a in pairs]
            secs = time.perf_counter() - t0
            if n == baseline:
                ref = lps
            kl, agree, count = 0.0, 0, 0
            for lp, rp in zip(lps, ref):
                kl += float(torch.nn.functional.kl_div(lp, rp, log_target=True, reduction="sum"))
                agree += int((lp.argmax(-1) == rp.argmax(-1)).sum())
                count += lp.shape[0]
            k = get_kernel(n)
            rows.append({"kernel": n, "faulty": k.faulty, "twin": k.twin, "items": len(pairs), "tokens": count,
                         "mean_kl": kl / max(count, 1), "top1_agreement": agree / max(count, 1),
                         "seconds": round(secs, 2)})
    finally:
        if original:
            model.set_experts_implementation(original)
    return rows


# --- Triton backend vs the emulator, bit for bit -----------------------------------------------------


def emulated_outputs(case: LayerCase, names: list[str], device="cpu") -> dict[str, torch.Tensor]:
    """The emulator's output for each emulated kernel on `case`, computed on `device` (its numerics are
    canonical: the same bits on any device); runners sharing weights run together, as in `layer_check`."""
    dev = torch.device(device)
    on = LayerCase(case.x.to(dev), case.top_k_index.to(dev), case.top_k_weights.to(dev), case.weights.to(dev),
                   case.limit, case.routed_scaling)
    runners = {n: _runner(n, on) for n in names}
    groups: dict = {}
    for r in runners.values():
        if isinstance(r, ForwardRunner):
            continue  # computed already, whole
        groups.setdefault(weight_fault(r.recipe), []).append(r)
    hit = torch.bincount(on.top_k_index.flatten(), minlength=on.weights.num_experts) > 0
    step = max(1, CHUNK_WEIGHT_BYTES // (3 * on.weights.hidden * on.weights.intermediate * 4))
    for lo in range(0, on.weights.num_experts, step):
        hi = min(lo + step, on.weights.num_experts)
        if not bool(hit[lo:hi].any()):
            continue
        w1, w2 = on.weights.dequantize(lo, hi)
        for fault, members in groups.items():
            f1, f2 = (w1, w2) if fault is None else (double_one_group_per_row(w1), double_one_group_per_row(w2))
            if dev.type == "cpu":
                run_chunk_together(members, lo, hi, f1, f2)
            else:  # run_chunk_together builds CPU index tensors; one runner at a time is device-agnostic
                g1, g2 = as_gemm_weights(f1), as_gemm_weights(f2)
                for r in members:
                    r.run_chunk(lo, hi, g1, g2)
        del w1, w2
    return {n: r.finish().cpu() for n, r in runners.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().view(torch.int32)


def triton_layer_check(shape: str = "tiny", tokens: int = 64, seed: int = 0, kernels: list[str] | None = None,
                       case: LayerCase | None = None, device: str | None = None,
                       reference_device: str = "cpu") -> list[dict]:
    """Every emulated kernel (default: all) on one synthetic layer: the Triton kernels on `device` (CUDA when
    there is one, else the CPU under TRITON_INTERPRET=1) against the emulator on `reference_device`, bit
    for bit. One row per kernel: identical, differing elements, rows the host recomputed, seconds."""
    from .triton.dispatch import supports, unavailable_reason

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    reason = unavailable_reason(torch.device(device).type)
    if reason:
        raise UserError(f"--backend triton: {reason}")
    from .triton import moe

    case = case or synthetic_layer(shape, tokens, seed)
    names = [n for n in (kernels or sorted(kernel_names(), key=lambda n: (get_kernel(n).faulty, n)))
             if getattr(get_kernel(n).experts_forward, "recipe", None) is not None]
    unsupported = [n for n in names if not supports(get_kernel(n).experts_forward.recipe)]
    if unsupported:
        raise UserError(f"the Triton backend does not compute {', '.join(unsupported)}")
    t0 = time.perf_counter()
    reference = emulated_outputs(case, names, reference_device)
    reference_seconds = time.perf_counter() - t0
    dev = torch.device(device)
    x, idx, w = case.x.to(dev), case.top_k_index.to(dev), case.top_k_weights.to(dev)
    weights = case.weights.to(dev)
    rows = []
    for n in names:
        recipe = get_kernel(n).experts_forward.recipe
        before = dict(moe.STATS)
        t0 = time.perf_counter()
        out = moe.moe_forward(x, idx, w, weights, recipe, case.limit, case.routed_scaling)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        out = out.cpu()
        differ = int((_bits(out) != _bits(reference[n])).sum())
        rows.append({"kernel": n, "faulty": get_kernel(n).faulty, "shape": shape, "tokens": case.x.shape[0],
                     "device": device, "reference_device": reference_device, "identical": differ == 0,
                     "differing": differ, "max_abs_diff": float((out - reference[n]).abs().max()),
                     "gemm_rows": moe.STATS["rows"] - before["rows"],
                     "host_rows": moe.STATS["host_rows"] - before["host_rows"],
                     "triton_seconds": round(seconds, 3), "emulator_seconds_all": round(reference_seconds, 2)})
    return rows
