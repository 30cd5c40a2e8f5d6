"""The one door every verdict on a stored pair goes through: ``evalgate gate`` (each look and round),
``gate --candidate``, ``evalgate report``, ``evalgate.decide()`` and ``Comparison.verdict``.

One policy resolver (``gate.policy.policy_for_run``, called where the door's caller loads its inputs:
--thresholds, $EVALGATE_THRESHOLDS, the canary's own for canary runs, ./thresholds.yaml, the packaged
default), one decision (``gate_runs``), one look of the candidate's sequence
(``evalgate.gate.sequence.decide_at_look``): the same pair gets the same verdict at the same α whichever door
asks, and every door says which look it decided.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from evalgate.gate.policy import Thresholds
from evalgate.gate.verdict import Verdict

if TYPE_CHECKING:
    from evalgate.run.baselines import StoredBaseline
    from evalgate.run.store import Run


def items_digest(run) -> str:
    """The items a subset check covers (``--items candidate``): its own sequence of looks."""
    ids = {t: sorted(str(r["doc_id"]) for r in run.records.get(t, [])) for t in run.tasks}
    return hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()


def decide_pair(stored: StoredBaseline, candidate: Run, policy: Thresholds, allow_uncalibrated: bool = False,
                items: str = "all", across_serving: bool = False, sequence_of: StoredBaseline | None = None,
                round_note: str = "", baselines_root: str | Path | None = None) -> Verdict:
    """The verdict on a loaded pair, at the candidate's look (docs/gate.md#reruns). ``stored``: the baseline
    (``run.baselines.load_baseline``); ``candidate``: the run; ``policy``: as the edge resolved it
    (``gate.policy.policy_for_run``). ``sequence_of``: the baseline whose record holds the looks (a round's
    sampled baseline belongs to the gate's baseline; default ``stored``). ``baselines_root``: the user's
    baselines root (--baselines-root), where the packaged canary's look records go."""
    from evalgate.gate.decide import gate_runs
    from evalgate.gate.sequence import decide_at_look

    home = sequence_of if sequence_of is not None else stored
    subset = items_digest(candidate) if items == "candidate" else None
    tasks = [t for t in candidate.tasks if t in stored.run.meta.tasks] or list(candidate.tasks)
    return decide_at_look(lambda p: gate_runs(stored, candidate, p, allow_uncalibrated, items, across_serving), policy,
                          home.dirs, candidate.meta, tasks, subset, round_note, baselines_root)
