"""Does a kernel compute the numerics it declares? Its routed-experts forward vs its reference's, on the model.

A kernel under test names the kernel whose numerics it claims to reproduce (`Kernel.reference`: a wrapped
real kernel names the emulated recipe it implements; a fault-injected test double names its healthy twin).
Before any item is generated, the gate feeds one of the model's own routed-experts modules a seeded batch
of tokens through both and measures DeepGEMM's `calc_diff` between the outputs. A correct real kernel stays
below `CALC_DIFF_LIMIT` against the emulation (docs/kernels.md#checking-a-real-kernel); a kernel that does
not compute what it declares fails the gate whatever the accuracy shows, because accuracy alone cannot
separate a recipe violation whose error is as large as a healthy kernel's (docs/gate.md#kernel-conformance).

A kernel that is its own reference (every emulated recipe in the catalog) has nothing to be held against:
it is recorded as such, not as checked.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .check import calc_diff
from .checkpoint import experts_modules
from .registry import get_kernel

CALC_DIFF_LIMIT = 1e-5  # docs/kernels.md#checking-a-real-kernel: what a correct kernel meets against the emulation
TOKENS = 64
SEED = 0
ROUTED_SCALING = 1.5  # DSV4's routed scaling, fused into the router weights (HF convention)


@dataclass(frozen=True)
class Conformance:
    """One kernel's conformance to its reference on one experts module of the model."""

    kernel: str
    reference: str
    checked: bool  # False: the kernel is its own reference (nothing to hold it against)
    ok: bool
    calc_diff: float | None = None
    identical: bool | None = None  # bit for bit
    differing: int | None = None  # output elements whose bits differ
    elements: int | None = None
    max_abs_diff: float | None = None
    layer: int | None = None
    tokens: int = TOKENS
    seed: int = SEED
    limit: float = CALC_DIFF_LIMIT
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}

    def summary(self) -> str:
        """One line, as the verdict prints it."""
        if not self.checked:
            return f"{self.kernel} is its own reference: nothing to hold it against"
        state = "conforms to" if self.ok else "does NOT compute"
        how = "bit-identical" if self.identical else f"calc_diff {self.calc_diff:.3g} (limit {self.limit:g})"
        return (f"{self.kernel} {state} {self.reference}: {how} on layer {self.layer}'s routed experts, "
                f"{self.tokens} seeded tokens")


def routed_case(module, tokens: int = TOKENS, seed: int = SEED):
    """Seeded BF16 hidden states [T, H] ~ N(0, 1) (what an RMS-normed layer input looks like), K distinct
    experts per token and softmax router weights x the routed scaling, on the module's device."""
    weight = module.gate_up_proj
    # down_proj is [E, H, I] in BF16 and [E, H, I/2] packed (model_adapters/streamed.py): H either way
    experts, hidden = int(module.num_experts), int(module.down_proj.shape[1])
    k = int(getattr(module.config, "num_experts_per_tok", 6)) if hasattr(module, "config") else 6
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1) * ROUTED_SCALING
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    return x.to(device), index.to(device), w.to(device)


@torch.no_grad()
def model_conformance(model, kernel_name: str, tokens: int = TOKENS, seed: int = SEED) -> Conformance:
    """``kernel_name`` vs its reference on the first routed-experts module of ``model`` (a DeepseekV4 model
    with the kernel's weights attached, as `HFAdapter` loads it)."""
    kernel = get_kernel(kernel_name)
    reference = kernel.reference
    if reference == kernel.name:
        return Conformance(kernel.name, reference, checked=False, ok=True, tokens=tokens, seed=seed)
    modules = experts_modules(model)
    if not modules:
        raise ValueError("the model has no routed-experts module to check the kernel on")
    layer = min(modules)
    module = modules[layer]
    t0 = time.perf_counter()
    x, index, w = routed_case(module, tokens, seed)
    out = kernel.experts_forward(module, x, index, w).float().cpu()
    ref = get_kernel(reference).experts_forward(module, x, index, w).float().cpu()
    differing = int((out.view(torch.int32) != ref.view(torch.int32)).sum())
    diff = calc_diff(out, ref)
    return Conformance(kernel.name, reference, checked=True, ok=diff <= CALC_DIFF_LIMIT, calc_diff=diff,
                       identical=differing == 0, differing=differing, elements=out.numel(),
                       max_abs_diff=float((out - ref).abs().max()), layer=layer, tokens=tokens, seed=seed,
                       seconds=round(time.perf_counter() - t0, 3))
