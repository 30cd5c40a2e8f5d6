"""A baseline shipped inside evalgate, as this install reads it: its stored manifest names the canary model
where it was recorded (a developer's folder). Stored baselines are never rewritten, so the path is resolved
at read: the model is the canary this install carries, and that is the path every output shows."""

from __future__ import annotations

import copy
from pathlib import Path

from evalgate.records import RunManifest


def _shipped(path: Path) -> bool:
    from evalgate.canary import BASELINES

    try:
        return path.resolve().is_relative_to(BASELINES.resolve())
    except OSError:
        return False


def as_installed(path: Path, manifest: RunManifest) -> RunManifest:
    """``manifest`` of the run at ``path``; for a baseline shipped with evalgate, its model paths (recorded on
    the machine that made it) replaced by this install's canary folder. Other runs are returned as stored."""
    if not _shipped(path) or (manifest.model.path is None and (manifest.spec is None or manifest.spec.model is None)):
        return manifest
    from evalgate.canary import CANARY_DIR

    shown = manifest.model_copy(deep=True)
    as_read = copy.deepcopy(manifest.as_read)  # the file's dict, unmigrated, shows the install's paths too
    if shown.model.path is not None:
        shown.model.path = as_read["model"]["path"] = str(CANARY_DIR)
    if shown.spec is not None and shown.spec.model is not None:
        shown.spec.model = as_read["spec"]["model"] = str(CANARY_DIR)
    shown._as_read = as_read
    return shown
