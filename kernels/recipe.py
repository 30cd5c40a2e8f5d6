"""What an FP4 mega-MoE kernel computes, as a typed object: a Recipe is the machine-readable form of spec
docs/kernels.md#the-moe-forward for one kernel, including the switches the spec leaves open
(docs/kernels.md#open-choices) and, for fault-injected kernels, the fault.

Importing this module needs neither torch nor transformers: the command line checks a kernel's declared
recipe (a plugin's too, docs/kernels.md#your-own-kernel) before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Mapping

# The accumulation scheme, recorded with every kernel: runs made with another one are not comparable
# (docs/kernels.md#accumulation). "canonical-v1": exact dot products rounded once to FP32, in a forward pass
# with canonical numerics (docs/kernels.md#canonical-numerics). A kernel that sums in another order
# declares this recipe and a tolerance (kernels/tolerance.py).
ACCUMULATION = "canonical-v1"

ELEMENT_FORMATS = ("e2m1", "e4m3", "none")  # "none": no quantization (FP32 from the BF16 input)
TIES = ("zero", "even")  # formats.TIES (tests hold the two equal)
# amax floors of the scale rules an input may use (formats.SCALE_RULES; tests hold the two equal)
INPUT_AMAX_FLOORS = {"pre_dispatch": 1e-4, "sglang_fp8": 1e-10, "epilogue": 0.0, "weights": 0.0}
ROUTER_WEIGHT = ("before_requant", "after_requant")  # quantize(w * h) (T6) | w * quantize(h)
ROUTED_SCALING = ("fused", "unfused")
# The routed experts only: the model adds the shared expert in BF16 outside the kernel (the experts
# interface hands a kernel no shared expert, so a kernel that fuses it cannot be held to a recipe here).
SHARED_EXPERT = ("outside",)

FAULTS = (
    None,
    "weight_scale_exponent_plus_one",  # (a) one UE8M0 byte +1 in one group of every weight row
    "fp8_layout_read_as_packed_fp4",  # (b) docs/kernels.md#the-packed-fp4-hazard interop hazard: FP8-written x read by the packed FP4 kernel
    "router_weight_after_requant",  # (c) w * quantize(h) instead of quantize(w * h) (T6)
    "drop_last_slot",  # (d) the combine skips slot K-1: one expert's output lost for every token
    "one_expert_router_weight",  # (e) one expert's router weight x (1 + 1/512): a fault confined to one expert
)


@dataclass(frozen=True)
class Recipe:
    weights: str = "e2m1"  # expert weights: E2M1 + UE8M0 per (row, 32 K) for every FP4 kernel (docs/kernels.md#the-moe-forward, step 1)
    activations: str = "e4m3"  # L1 input x (docs/kernels.md#the-moe-forward, step 2)
    input_ties: str = "zero"  # E2M1 input rounding at exact midpoints (docs/kernels.md#tie-modes, open docs/kernels.md#open-choices); unused for E4M3
    input_scale_rule: str = "pre_dispatch"  # amax floor of x: pre_dispatch 1e-4 | sglang_fp8 1e-10 (docs/kernels.md#ue8m0-scales)
    intermediate: str = "e4m3"  # L2 input, always RNE, epilogue scale rule (no floor) (docs/kernels.md#the-moe-forward, step 6)
    # Open docs/kernels.md#open-choices: is routed_scaling_factor fused into top-k weights (HF, default) or applied by SGLang to
    # the BF16 output after the kernel ("unfused": the kernel sees w / 1.5, the output is multiplied by 1.5)?
    routed_scaling: str = "fused"
    router_weight: str = "before_requant"  # where the router weight meets the intermediate (docs/kernels.md#the-moe-forward, step 6)
    shared_expert: str = "outside"
    accumulation: str = ACCUMULATION
    fault: str | None = None

    def __post_init__(self):
        for name in ("weights", "activations", "intermediate"):
            _one_of(name, getattr(self, name), ELEMENT_FORMATS)
        _one_of("input_ties", self.input_ties, TIES)
        _one_of("input_scale_rule", self.input_scale_rule, tuple(INPUT_AMAX_FLOORS))
        _one_of("routed_scaling", self.routed_scaling, ROUTED_SCALING)
        _one_of("router_weight", self.router_weight, ROUTER_WEIGHT)
        _one_of("shared_expert", self.shared_expert, SHARED_EXPERT)
        _one_of("accumulation", self.accumulation, (ACCUMULATION,))
        _one_of("fault", self.fault, FAULTS)
        if self.fault == "router_weight_after_requant":  # the fault is that placement, by accident
            object.__setattr__(self, "router_weight", "after_requant")

    @classmethod
    def from_fields(cls, given: "Recipe | Mapping", owner: str = "a kernel") -> "Recipe":
        """A Recipe from a mapping of its fields (what a plugin may declare instead of the object): an
        unknown field, or a value no kernel computes, is a ValueError naming it and the choices."""
        if isinstance(given, cls):
            return given
        if not isinstance(given, Mapping):
            raise ValueError(f"{owner} declares recipe {given!r}; expected evalgate.kernels.recipe.Recipe or a "
                             "mapping of its fields")
        known = [f.name for f in fields(cls) if f.name != "fault"]  # a fault is evalgate's test doubles' only
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{owner} declares unknown recipe field {unknown[0]!r}; known fields: {', '.join(known)}")
        try:
            return cls(**given)
        except ValueError as exc:
            raise ValueError(f"{owner} declares {exc}") from None

    def as_dict(self) -> dict:
        """The recipe as recorded in a Kernel, a run manifest and `evalgate kernels list --json`."""
        d = asdict(self)
        d["input_amax_floor"] = INPUT_AMAX_FLOORS[self.input_scale_rule]
        d["intermediate_ties"] = "even"  # cvt.rn.satfinite in every version (docs/kernels.md#tie-modes)
        d["intermediate_amax_floor"] = 0.0
        d["group_size"] = 32
        d["scale_rule"] = "ue8m0 rceil"
        d["accumulate"] = "exact sum of the products, rounded once to fp32"  # docs/kernels.md#accumulation
        d["combine"] = "fp32 in slot order, then bf16"
        return d


def _one_of(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"recipe {name}={value!r}; expected one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class Unquantized:
    """The BF16 reference (``bf16``): no quantization anywhere; transformers' own experts forward."""

    def as_dict(self) -> dict:
        return {"weights": "bf16", "activations": "bf16", "intermediate": "bf16"}


@dataclass(frozen=True)
class LibraryCall:
    """A real kernel that computes an emulated recipe through a library's API: which recipe, and the call
    that selects it (``fp8_fp4_mega_moe, mma_type=...``)."""

    implements: str
    mma_type: str

    def as_dict(self) -> dict:
        return {"implements": self.implements, "mma_type": self.mma_type}
