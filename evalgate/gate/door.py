"""The one door every verdict on a stored pair goes through: ``evalgate gate`` (each look and round),
``gate --candidate``, ``evalgate report``, ``evalgate.decide()`` and ``Comparison.verdict``.

One policy resolver (``resolve_policy``: --thresholds, $EVALGATE_THRESHOLDS, the canary's own for canary runs,
./thresholds.yaml, the packaged default), one decision (``gate_runs``), one look of the candidate's sequence
(``evalgate.gate.sequence.decide_at_look``): the same pair gets the same verdict at the same α whichever door
asks, and every door says which look it decided.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from evalgate.gate.policy import Thresholds, resolve_policy
from evalgate.gate.verdict import Verdict


def policy_for_run(thresholds, run) -> Thresholds:
    """The policy deciding ``run``: the one resolver, told whether the run is scored as the canary."""
    from evalgate.canary import policy_for

    return resolve_policy(thresholds, canary=policy_for(run) is not None)


def items_digest(run) -> str:
    """The items a subset check covers (``--items candidate``): its own sequence of looks."""
    ids = {t: sorted(str(r["doc_id"]) for r in run.records.get(t, [])) for t in run.tasks}
    return hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()


def decide_pair(baseline, candidate, thresholds=None, allow_uncalibrated: bool = False, items: str = "all",
                across_serving: bool = False, sequence_of=None, round_note: str = "",
                baselines_root=None) -> Verdict:
    """The verdict on a stored pair, at the candidate's look (docs/gate.md#reruns). ``baseline``: a
    ``StoredBaseline`` or its folder(s); ``candidate``: a ``Run`` or its folder; ``thresholds``: a policy, a
    file, or None (resolved). ``sequence_of``: the baseline whose record holds the looks (a round's sampled
    baseline belongs to the gate's baseline; default ``baseline``). ``baselines_root``: the user's baselines
    root (--baselines-root), where the packaged canary's look records go."""
    from evalgate.gate.decide import gate_runs
    from evalgate.gate.sequence import decide_at_look
    from evalgate.run.baselines import StoredBaseline, load_baseline
    from evalgate.run.store import Run, load_run

    stored = baseline if isinstance(baseline, StoredBaseline) else load_baseline(
        [Path(b) for b in baseline] if isinstance(baseline, (list, tuple)) else Path(baseline))
    cand = candidate if isinstance(candidate, Run) else load_run(candidate)
    policy = policy_for_run(thresholds, cand)
    home = sequence_of if sequence_of is not None else stored
    subset = items_digest(cand) if items == "candidate" else None
    tasks = [t for t in cand.tasks if t in stored.run.meta.tasks] or list(cand.tasks)
    return decide_at_look(lambda p: gate_runs(stored, cand, p, allow_uncalibrated, items, across_serving), policy,
                          home.dirs, cand.meta, tasks, subset, round_note, baselines_root)
