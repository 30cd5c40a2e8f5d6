"""What an emulated kernel computes, as data: a Recipe is the machine-readable form of spec docs/kernels.md#the-moe-forward for one
kernel, including the switches the spec leaves open (docs/kernels.md#open-choices) and, for fault-injected kernels, the fault."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .formats import SCALE_RULES, TIES

# The accumulation scheme, recorded with every kernel: runs made with another one are not comparable
# (docs/kernels.md#accumulation). "canonical-v1": exact dot products rounded once to FP32, in a forward pass
# with canonical numerics (docs/kernels.md#canonical-numerics).
ACCUMULATION = "canonical-v1"

ELEMENT_FORMATS = ("e2m1", "e4m3", "none")  # "none": no quantization (FP32 from the BF16 input)

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
    fault: str | None = None

    def __post_init__(self):
        for name in ("weights", "activations", "intermediate"):
            if getattr(self, name) not in ELEMENT_FORMATS:
                raise ValueError(f"recipe {name}={getattr(self, name)!r}; expected one of {ELEMENT_FORMATS}")
        if self.input_ties not in TIES:
            raise ValueError(f"recipe input_ties={self.input_ties!r}; expected one of {TIES}")
        if self.input_scale_rule not in SCALE_RULES:
            raise ValueError(f"recipe input_scale_rule={self.input_scale_rule!r}; expected one of {list(SCALE_RULES)}")
        if self.routed_scaling not in ("fused", "unfused"):
            raise ValueError(f"recipe routed_scaling={self.routed_scaling!r}; expected 'fused' or 'unfused'")
        if self.fault not in FAULTS:
            raise ValueError(f"recipe fault={self.fault!r}; expected one of {FAULTS}")

    def as_dict(self) -> dict:
        """The recipe as recorded in a Kernel, a run manifest and `evalgate kernels list --json`."""
        d = asdict(self)
        d["input_amax_floor"] = SCALE_RULES[self.input_scale_rule].amax_floor
        d["intermediate_ties"] = "even"  # cvt.rn.satfinite in every version (docs/kernels.md#tie-modes)
        d["intermediate_amax_floor"] = 0.0
        d["group_size"] = 32
        d["scale_rule"] = "ue8m0 rceil"
        d["router_weight"] = "after_requant" if self.fault == "router_weight_after_requant" else "before_requant"
        d["accumulate"] = "exact sum of the products, rounded once to fp32"  # docs/kernels.md#accumulation
        d["accumulation"] = ACCUMULATION
        d["combine"] = "fp32 in slot order, then bf16"
        return d
