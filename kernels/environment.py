"""The process environment that selects real DeepGEMM kernels (docs/kernels.md#environment-variables)."""

from __future__ import annotations

import os


def dg_environment() -> dict[str, str]:
    """Every DG_* / SGLANG_OPT_DEEPGEMM* variable of this process: they select real kernels; recorded in runs."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("DG_", "SGLANG_OPT_DEEPGEMM"))}
