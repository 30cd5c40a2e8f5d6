"""The one check every test and interval applies to its level (no scipy: the policy file is validated with
it before anything heavy loads)."""

from __future__ import annotations


def check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
