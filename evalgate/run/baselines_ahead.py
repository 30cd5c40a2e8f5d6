"""The gate's missing-baseline refusal before the task data are read (docs/runs.md#baselines).

Reading the task data (through ``datasets``) takes seconds; a profile's id needs it, but most gates that will
find no baseline can be told without it: no stored baseline has the model, task, profile, settings, item
count and decoding the run would have. Where one might, the gate reads the data and the profile id decides.
"""

from __future__ import annotations

from pathlib import Path

from evalgate.run.baselines import could_be_stored, lookup_roots
from evalgate.run.runner import RunSpec, with_overrides


def no_baseline_possible(spec: RunSpec, kernel: str, root: str | Path | None) -> None:
    """Raise the gate's own missing-baseline refusal when no stored ``kernel`` baseline can match ``spec``."""
    from evalgate.plan import _missing_baseline, local_fingerprint  # the plan's one wording of the refusal
    from evalgate.tasks import get_task, resolve_profile

    fingerprint = local_fingerprint(spec.model)
    roots = lookup_roots(root)
    sampling = spec.sampling()
    missing = [t for t in spec.tasks
               if not could_be_stored(roots, fingerprint, kernel, t,
                                      with_overrides(resolve_profile(get_task(t), spec.profiles.get(t)), spec),
                                      spec.limit, sampling)]
    if missing:
        raise _missing_baseline(spec, missing, kernel, Path(root) if root else None, False)
