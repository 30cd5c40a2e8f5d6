"""The kernel registry: one name -> one Kernel, mirrored into transformers' experts interfaces.

transformers dispatches an experts module's forward through ``ExpertsInterface`` (plain MoE experts) or
``FP8ExpertsInterface`` (FP8/FP4-quantized experts). Each keeps its own mapping, so a name registered on
one is invisible to the other: every kernel is registered on both, before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from evalgate.errors import UserError

if TYPE_CHECKING:
    from .fp8_moe import Fp8Recipe
    from .real.library import RealLibrary
    from .recipe import LibraryCall, Recipe, Unquantized
    from .tolerance import Tolerance


@dataclass(frozen=True)
class Kernel:
    name: str
    version: str  # which real kernel/release this emulates or wraps
    description: str  # one line: what it computes
    experts_forward: Callable  # fn(experts_module, hidden_states[T,H], top_k_index[T,K], top_k_weights[T,K]) -> [T,H]
    # what it computes, typed: recipe.Recipe (FP4 mega-MoE), fp8_moe.Fp8Recipe, recipe.Unquantized (bf16) or
    # recipe.LibraryCall; ``recipe`` is its machine-readable form (a manifest, `kernels list --json`)
    declared: "Recipe | Fp8Recipe | Unquantized | LibraryCall"
    faulty: bool = False  # fault-injected on purpose; never a default
    twin: str | None = None  # for a faulty kernel: the healthy kernel it was derived from
    api: dict = field(default_factory=dict)  # real-kernel API arguments (sgl-deep-gemm >= 0.1.7 picks by mma_type)
    prepare_model: Callable | None = None  # fn(model, checkpoint_dir) after loading, e.g. attach stored FP4 codes
    implements: str | None = None  # a real kernel: the emulated recipe it must compute (kernels/real/)
    library: "RealLibrary | None" = None  # a real or plugin kernel: what runs it (kernels/plugins.PluginLibrary)
    tolerance: "Tolerance | None" = None  # a real kernel's allowed difference from its recipe; None: bit-identity

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def reference(self) -> str:
        """The kernel whose numerics this one declares it computes (kernels/conformance.py): a real kernel
        (and a fault injected into it) names its emulated recipe; a faulty emulated kernel claims its healthy
        twin's; an emulated recipe is its own."""
        return self.implements or self.twin or self.name

    @property
    def real(self) -> bool:
        return self.library is not None

    @property
    def source_sha256(self) -> str | None:
        """The digest of the module files that compute it (kernels/source.py): a run's manifest records it and
        a candidate's content identity includes it, so a code change is another candidate."""
        from .source import source_sha256

        return source_sha256(self.experts_forward)

    @property
    def recipe(self) -> dict:
        """The declared recipe as recorded in a run's manifest and `evalgate kernels list --json`."""
        return self.declared.as_dict()


KERNELS: dict[str, Kernel] = {}
def register_kernel(kernel: Kernel) -> Kernel:
    from dataclasses import replace

    from transformers.integrations.moe import ExpertsInterface

    from .triton.dispatch import with_backend_choice

    if not kernel.real:  # emulated kernels run the Triton kernels on CUDA (same bits; EVALGATE_KERNEL_BACKEND overrides)
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
    """Every registered kernel; a fault injected into a real kernel only where its library can run (it is a
    test double for that machine: elsewhere it could neither run nor fail)."""
    return sorted(n for n, k in KERNELS.items()
                  if (include_faulty or not k.faulty) and not (k.faulty and k.real and k.library.missing()))
