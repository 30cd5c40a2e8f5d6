"""Does a kernel compute the numerics it declares? Held against its reference on every MoE layer of the model.

A kernel names the kernel whose numerics it claims (`Kernel.reference`: a real kernel names the emulated
recipe it implements, a fault-injected test double its healthy twin). Before any item is generated, the
model runs its own forward pass over the run's first prompts and every routed-experts module records what it
was handed (hidden states, top-k experts, router weights). Each layer's inputs then go through the kernel and
its reference twice: as they came (one combined output per token) and one (token, slot) per row (one output
per slot, so each expert's rows can be compared on their own). Every expert and every token of every layer
is held to its limit: bit-identity, or a real kernel's `Tolerance` (kernels/tolerance.py). One expert or
one token over its limit fails the kernel, so a fault confined to one expert of 256 is not diluted.

A kernel that is its own reference (every emulated recipe in the catalog) has nothing to be held against:
it is recorded as such, not as checked.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .checkpoint import experts_modules
from .catalogs import get_kernel

PROMPTS = 8  # at most this many of the run's first prompts supply the hidden states
SHOWN = 8  # worst experts / tokens kept in the record (all that fail are kept, up to FAILED_SHOWN)
FAILED_SHOWN = 64
EXPERTS_ARGS = ("hidden_states", "top_k_index", "top_k_weights")  # transformers' experts call


@dataclass(frozen=True)
class Finding:
    """One expert or one token of one layer: the kernel's outputs against its reference's."""

    layer: int
    kind: str  # "expert" | "token"
    index: int  # expert id, or the token's position among the captured tokens
    rows: int  # (token, slot) rows for an expert; 1 for a token
    calc_diff: float
    differing: int  # output elements whose bits differ
    elements: int
    max_rel: float  # max |kernel - reference| / max |reference| over the same rows
    ok: bool

    def label(self) -> str:
        return f"layer {self.layer} {self.kind} {self.index}"


@dataclass(frozen=True)
class Conformance:
    """One kernel's conformance to its reference over the model's MoE layers."""

    kernel: str
    reference: str
    checked: bool  # False: the kernel is its own reference (nothing to hold it against)
    ok: bool
    calc_diff: float | None = None  # the worst expert's
    limit: float | None = None  # per expert; 0.0 = bit-identity
    token_limit: float | None = None
    identical: bool | None = None  # bit for bit, everywhere
    differing: int | None = None
    elements: int | None = None
    max_rel: float | None = None
    layers: int | None = None
    experts: int | None = None  # (layer, expert) pairs checked
    tokens: int | None = None  # captured tokens per layer
    prompts: int | None = None
    failed_experts: int = 0
    failed_tokens: int = 0
    worst_experts: list = field(default_factory=list)  # Finding dicts, worst first
    worst_tokens: list = field(default_factory=list)
    per_layer: list = field(default_factory=list)  # one dict per layer, worst first
    implementation: dict | None = None  # a real kernel's library, version and build
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}

    def summary(self) -> str:
        """One line, as the verdict prints it."""
        if not self.checked:
            return f"{self.kernel} is its own reference: nothing to hold it against"
        source = f"the run's first {self.prompts} prompts" if self.prompts else "captured hidden states"
        where = f"{self.layers} layers, {self.experts} (layer, expert) pairs, {self.tokens} tokens of {source}"
        limit = "bit-identity" if self.limit == 0.0 else f"limit {self.limit:g} per expert, {self.token_limit:g} per token"
        worst = self.worst_experts[0] if self.worst_experts else None
        worst_text = (f"worst {worst['label']} calc_diff {worst['calc_diff']:.3g}" if worst else "no expert routed")
        if self.ok:
            how = "bit-identical" if self.identical else f"{worst_text}, {self.differing / max(self.elements, 1):.2%} of outputs differ"
            return f"{self.kernel} conforms to {self.reference} ({limit}): {how} on {where}"
        return (f"{self.kernel} does NOT compute {self.reference} ({limit}): {self.failed_experts} (layer, expert) "
                f"and {self.failed_tokens} (layer, token) pairs over the limit; {worst_text}; on {where}")


# --- capture ------------------------------------------------------------------------------------------


@torch.no_grad()
def capture_routed_inputs(model, prompts: list[torch.Tensor]) -> dict[int, tuple]:
    """Layer -> (hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) that the model's own
    forward pass over ``prompts`` (token id tensors) hands its routed experts, all prompts' tokens together."""
    modules = experts_modules(model)
    if not modules:
        raise ValueError("the model has no routed-experts module to check the kernel on")
    seen: dict[int, list] = {layer: [] for layer in modules}

    def recorder(layer):
        def hook(module, args, kwargs):
            values = list(args[:3]) + [kwargs[name] for name in EXPERTS_ARGS[len(args):]]
            seen[layer].append(tuple(v.detach().clone() for v in values))
        return hook

    hooks = [m.register_forward_pre_hook(recorder(layer), with_kwargs=True) for layer, m in modules.items()]
    try:
        device = next(model.parameters()).device
        for ids in prompts:
            model(input_ids=ids.reshape(1, -1).to(device))
    finally:
        for h in hooks:
            h.remove()
    return {layer: tuple(torch.cat(parts) for parts in zip(*calls)) for layer, calls in seen.items() if calls}


# --- comparison ---------------------------------------------------------------------------------------


def _row_stats(out: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: the sums calc_diff needs (float64), differing elements, max |diff| and max |ref|."""
    a, b = out.double(), ref.double()
    return {"xy": (a * b).sum(1), "xx": (a * a).sum(1), "yy": (b * b).sum(1),
            "differing": (out.float().view(torch.int32) != ref.float().view(torch.int32)).sum(1).double(),
            "max_diff": (a - b).abs().amax(1), "max_ref": b.abs().amax(1)}


def _grouped(stats: dict, group: torch.Tensor, groups: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, v in stats.items():
        if key in ("max_diff", "max_ref"):
            out[key] = torch.zeros(groups, dtype=v.dtype, device=v.device).scatter_reduce(0, group, v, "amax")
        else:
            out[key] = torch.zeros(groups, dtype=v.dtype, device=v.device).index_add(0, group, v)
    out["rows"] = torch.bincount(group, minlength=groups).double()
    return out


def _calc_diff(g: dict) -> torch.Tensor:
    """DeepGEMM's calc_diff per group: 1 - 2<x,y> / (|x|^2 + |y|^2); 0 where both are all zero."""
    denom = g["xx"] + g["yy"]
    return torch.where(denom > 0, 1 - 2 * g["xy"] / denom.clamp(min=1e-300), torch.zeros_like(denom))


def _findings(layer: int, kind: str, g: dict, width: int, limit: float | None) -> list[Finding]:
    diff = _calc_diff(g).cpu()
    rel = (g["max_diff"] / g["max_ref"].clamp(min=1e-30)).cpu()
    rows, differing = g["rows"].cpu(), g["differing"].cpu()
    found = []
    for i in torch.nonzero(rows > 0).flatten().tolist():
        d = max(float(diff[i]), 0.0)
        ok = int(differing[i]) == 0 if limit is None else d <= limit
        found.append(Finding(layer, kind, i, int(rows[i]), d, int(differing[i]), int(rows[i]) * width,
                             float(rel[i]) if g["max_diff"][i] > 0 else 0.0, ok))
    return found


def _severity(f: Finding):
    return (f.ok, -f.calc_diff, -f.differing)


def _layer_findings(layer, kernel, reference, module, x, index, weights, tolerance) -> tuple[list[Finding], list[Finding]]:
    """(experts, tokens) of one layer."""
    num_experts = int(module.num_experts) if hasattr(module, "num_experts") else int(index.max()) + 1
    out = kernel.experts_forward(module, x, index, weights)
    ref = reference.experts_forward(module, x, index, weights)
    t, k = index.shape
    tokens = _grouped(_row_stats(out, ref), torch.arange(t, device=out.device), t)
    # one (token, slot) per row: each row's output is that slot's expert output alone
    flat = index.reshape(-1).long()
    valid = torch.nonzero((flat >= 0) & (flat < num_experts)).flatten()
    xs, idx1, w1 = x[valid // k], flat[valid].view(-1, 1).to(index.dtype), weights.reshape(-1)[valid].view(-1, 1)
    slot_out = kernel.experts_forward(module, xs, idx1, w1)
    slot_ref = reference.experts_forward(module, xs, idx1, w1)
    experts = _grouped(_row_stats(slot_out, slot_ref), flat[valid].to(slot_out.device), num_experts)
    width = x.shape[-1]
    return (_findings(layer, "expert", experts, width, tolerance and tolerance.expert_calc_diff),
            _findings(layer, "token", tokens, width, tolerance and tolerance.token_calc_diff))


def _finding_dict(f: Finding) -> dict:
    return {**asdict(f), "label": f.label()}


def _kept(found: list[Finding]) -> list[dict]:
    """Worst first: every one over its limit (up to FAILED_SHOWN), at least SHOWN."""
    ranked = sorted(found, key=_severity)  # over the limit first, then by calc_diff
    failed = sum(not f.ok for f in ranked)
    return [_finding_dict(f) for f in ranked[:max(SHOWN, min(failed, FAILED_SHOWN))]]


@torch.no_grad()
def model_conformance(model, kernel_name: str, prompts: list[torch.Tensor] | None = None,
                      captured: dict[int, tuple] | None = None) -> Conformance:
    """``kernel_name`` against its reference on every routed-experts module of ``model``, fed what the
    model's own forward pass over ``prompts`` (token id tensors, the run's first ones) handed each layer;
    ``captured`` gives those inputs directly (``capture_routed_inputs``)."""
    kernel = get_kernel(kernel_name)
    reference_name = kernel.reference
    if reference_name == kernel.name:
        return Conformance(kernel.name, reference_name, checked=False, ok=True)
    if kernel.real:
        kernel.library.require()
    reference = get_kernel(reference_name)
    t0 = time.perf_counter()
    if captured is None:
        if not prompts:
            raise ValueError("conformance needs the run's first prompts to capture the model's hidden states")
        captured = capture_routed_inputs(model, prompts[:PROMPTS])
    modules = experts_modules(model)
    tolerance = kernel.tolerance
    experts, tokens, per_layer = [], [], []
    for layer, (x, index, weights) in sorted(captured.items()):
        e, t = _layer_findings(layer, kernel, reference, modules[layer], x, index, weights, tolerance)
        experts += e
        tokens += t
        worst_e, worst_t = min(e, key=_severity, default=None), min(t, key=_severity, default=None)
        per_layer.append({"layer": layer, "ok": all(f.ok for f in e + t),
                          "experts": len(e), "tokens": len(t),
                          "worst_expert": worst_e and _finding_dict(worst_e),
                          "worst_token": worst_t and _finding_dict(worst_t),
                          "differing": sum(f.differing for f in t), "elements": sum(f.elements for f in t)})
    per_layer.sort(key=lambda d: (d["ok"], -(d["worst_expert"] or {}).get("calc_diff", 0.0)))
    differing, elements = sum(f.differing for f in tokens), sum(f.elements for f in tokens)
    failed_e, failed_t = sum(not f.ok for f in experts), sum(not f.ok for f in tokens)
    first = next(iter(captured.values()), None)
    return Conformance(
        kernel.name, reference_name, checked=True, ok=failed_e == 0 and failed_t == 0,
        calc_diff=max((f.calc_diff for f in experts), default=0.0),
        limit=tolerance.expert_calc_diff if tolerance else 0.0,
        token_limit=tolerance.token_calc_diff if tolerance else 0.0,
        identical=differing == 0 and all(f.differing == 0 for f in experts), differing=differing, elements=elements,
        max_rel=max((f.max_rel for f in experts + tokens), default=0.0),
        layers=len(captured), experts=len(experts), tokens=int(first[0].shape[0]) if first else 0,
        prompts=len(prompts[:PROMPTS]) if prompts else None,
        failed_experts=failed_e, failed_tokens=failed_t,
        worst_experts=_kept(experts), worst_tokens=_kept(tokens), per_layer=per_layer,
        implementation=kernel.library.identity() if kernel.real else None,
        seconds=round(time.perf_counter() - t0, 3))
