"""A baseline shipped inside evalgate, as this install reads it: its stored manifest names the canary model
where it was recorded (a developer's folder). Stored baselines are never rewritten, so the path is resolved
at read: the model is the canary this install carries, and that is the path every output shows."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def _shipped(path: Path) -> bool:
    from evalgate.canary import BASELINES

    try:
        return path.resolve().is_relative_to(BASELINES.resolve())
    except OSError:
        return False


def as_installed(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` of the run at ``path``; for a baseline shipped with evalgate, its model paths (recorded on
    the machine that made it) replaced by this install's canary folder. Other runs are returned as stored."""
    if not _shipped(path):
        return manifest
    from evalgate.canary import CANARY_DIR

    shown = copy.deepcopy(manifest)
    if isinstance(shown.get("model"), dict) and "path" in shown["model"]:
        shown["model"]["path"] = str(CANARY_DIR)
    if isinstance(shown.get("spec"), dict) and "model" in shown["spec"]:
        shown["spec"]["model"] = str(CANARY_DIR)
    return shown
