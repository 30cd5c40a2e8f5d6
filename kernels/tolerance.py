"""How far a real kernel may sit from its emulated recipe (docs/gate.md#kernel-conformance).

A real kernel accumulates in its own order (FP8 tensor cores sum 128 K at a time in fewer bits, then add
in FP32), so its BF16 outputs are not bit-identical to the exact recipe. Its limits are set from
differences measured on the hardware (docs/kernels.md#real-kernels) and hold for every expert and every
token of every layer: a fault confined to one expert is not averaged away. A kernel without a tolerance
must be bit-identical (every emulated recipe: its sums are exact).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerance:
    expert_calc_diff: float  # calc_diff over one expert's (token, slot) outputs, per layer
    token_calc_diff: float  # calc_diff over one token's combined output, per layer
    measured: str  # where the numbers come from: the measurement they rest on

    def as_dict(self) -> dict:
        return asdict(self)
