"""The built-in canary: a small DeepSeek-V4 that memorised GSM8K *train* solutions and HumanEval's canonical
solutions, shipped in DeepSeek-V4's FP4 checkpoint format. Its scores measure kernel fidelity, never
capability (see ``model/MODEL_CARD.md``).

``canary_path()`` is where the checkpoint lives; ``evalgate run`` and ``evalgate gate`` use it when no
``--model`` is given. Its training and packaging scripts live in the source repository's ``scripts/canary/``. ``BASELINES`` holds
its stored W4A8 baselines.
"""

from __future__ import annotations

from pathlib import Path

from evalgate.errors import UserError

CANARY_DIR = Path(__file__).resolve().parent / "model"
THRESHOLDS = Path(__file__).resolve().parent / "thresholds-canary.yaml"
# The canary's stored W4A8 baselines (and A/A), shipped as package data: read-only to the gate, which
# looks here after the user's baselines root (evalgate.run.baselines.lookup_roots).
BASELINES = Path(__file__).resolve().parent / "baselines"
GSM8K_PROFILE = "gsm8k-canary-v1"
HUMANEVAL_PROFILE = "humaneval-canary-v1"
PROFILES = {"gsm8k": GSM8K_PROFILE, "humaneval": HUMANEVAL_PROFILE}


def canary_path() -> Path:
    if not (CANARY_DIR / "config.json").is_file():
        raise UserError(f"the built-in canary model is missing from {CANARY_DIR}; reinstall evalgate or pass --model PATH")
    return CANARY_DIR


def scored_as_canary(profiles: dict[str, str | None]) -> bool:
    """Whether every task is scored with the canary's own profile (such a gate takes the canary's policy)."""
    return bool(profiles) and all(PROFILES.get(t) == name for t, name in profiles.items())


def policy_for(run) -> Path | None:
    """The canary's own policy for a run scored with the canary's profiles; None (the default policy) otherwise."""
    return THRESHOLDS if scored_as_canary({t: s.name for t, s in run.meta.tasks.items()}) else None
