"""Every kernel name evalgate registers, known without importing torch or transformers.

The command line checks ``--kernel`` against these before anything heavy loads (a typo answers in a fraction
of a second, not after the model); the catalogs register exactly these names and tests/test_kernels.py holds
the two equal. Faults injected at a real kernel's boundary are named ``faulty/<real kernel>-<fault>``.
"""

from __future__ import annotations

EMULATED = ("bf16", "w4a8", "w4a8_sglang", "w4a4", "w4a4_packed", "w4a4_te", "fp8_block128", "fp8_rowwise")
FAULTY_EMULATED = tuple(f"faulty/w4a4_packed-{fault}" for fault in
                        ("scale-exp", "fp8-layout", "weight-after-requant", "drop-slot", "one-expert"))
REAL = ("deepgemm/fp8_block128", "torch/fp8_rowwise", "sgl-deep-gemm/w4a8", "sgl-deep-gemm/w4a4")
REAL_WITH_FAULTS = ("deepgemm/fp8_block128", "torch/fp8_rowwise")  # SM90 kernels this machine may run
REAL_FAULTS = ("scale-layout", "swap-expert", "stale-scale")  # kernels/real/faults.py
FAULTY_REAL = (tuple(f"faulty/{real}-{fault}" for real in REAL_WITH_FAULTS for fault in REAL_FAULTS)
               + ("faulty/deepgemm/fp8_block128-fallback",))  # runs torch.mm: the execution witness's test double

ALL = frozenset(EMULATED + FAULTY_EMULATED + REAL + FAULTY_REAL)


def listed_names() -> list[str]:
    """The names an error message offers: all but the faults of real kernels, which `evalgate kernels list`
    shows only where their library runs."""
    return sorted(ALL - set(FAULTY_REAL))
