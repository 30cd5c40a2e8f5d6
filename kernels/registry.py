"""The kernel registry: one name -> one Kernel, mirrored into transformers' experts interfaces.

transformers dispatches an experts module's forward through ``ExpertsInterface`` (plain MoE experts) or
``FP8ExpertsInterface`` (FP8/FP4-quantized experts). Each keeps its own mapping, so a name registered on
one is invisible to the other: every kernel is registered on both, before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from evalgate.errors import UserError


@dataclass(frozen=True)
class Kernel:
    name: str
    version: str  # which real kernel/release this emulates or wraps
    description: str  # one line: what it computes
    experts_forward: Callable  # fn(experts_module, hidden_states[T,H], top_k_index[T,K], top_k_weights[T,K]) -> [T,H]
    env: dict[str, str] = field(default_factory=dict)  # what a server's launch environment needs to select it
    recipe: dict = field(default_factory=dict)  # the numerics, machine-readable (formats, tie modes...)
    faulty: bool = False  # fault-injected on purpose; never a default
    twin: str | None = None  # for a faulty kernel: the healthy kernel it was derived from
    api: dict = field(default_factory=dict)  # real-kernel API arguments (sgl-deep-gemm >= 0.1.7 picks by mma_type)
    prepare_model: Callable | None = None  # fn(model, checkpoint_dir) after loading, e.g. attach stored FP4 codes

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def reference(self) -> str:
        """The kernel whose numerics this one declares it computes (kernels/conformance.py): a faulty kernel
        claims its healthy twin's; an emulated recipe is its own."""
        return self.twin or self.name


KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    from dataclasses import replace

    from transformers.integrations.moe import ExpertsInterface

    from .triton.dispatch import with_backend_choice

    # emulated kernels run the Triton kernels on CUDA (same bits; EVALGATE_KERNEL_BACKEND overrides)
    kernel = replace(kernel, experts_forward=with_backend_choice(kernel.experts_forward))
    KERNELS[kernel.name] = kernel
    ExpertsInterface.register(kernel.name, kernel.experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # older transformers without the FP8 experts interface
        pass
    else:
        FP8ExpertsInterface.register(kernel.name, kernel.experts_forward)
    return kernel


def get_kernel(name: str) -> Kernel:
    if name not in KERNELS:
        known = ", ".join(sorted(KERNELS))
        raise UserError(f"unknown kernel {name!r}; choose one of: {known} (see `evalgate kernels list`)")
    return KERNELS[name]


def kernel_names(include_faulty: bool = True) -> list[str]:
    return sorted(n for n, k in KERNELS.items() if include_faulty or not k.faulty)
