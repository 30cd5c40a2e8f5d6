"""A stopped-early gate's verdict in words and in gate.json, and the check that such a run decides only a FAIL
(docs/gate.md#stopping-early). Kept apart from the monitor (``early_stop``), which decides with
``evalgate.gate.decide``; ``decide`` reads these, so they must not import it."""

from __future__ import annotations

from evalgate.errors import NotComparable

HOLDS = "the FAIL holds whatever the remaining items give"


def decided(partly_run: bool, verdict: str) -> bool:
    """Whether a task's verdict stands: always for a task the candidate ran in full; for one it stopped
    before finishing, only a FAIL (certain on the best completion; any other verdict is only its best case)."""
    return not partly_run or verdict == "FAIL"


def headline(info: dict) -> str:
    """"stopped early after 58 of 364 items: gsm8k 20/200, humaneval 38/164 — the FAIL holds whatever the
    remaining items give"."""
    if not info["items_run"]:  # a kernel that failed its conformance check: stopped before generating
        return f"stopped before generating any of its {info['items_total']} items — {HOLDS}"
    tasks = ", ".join(f"{t} {e['items_run']}/{e['items_total']}" for t, e in info["tasks"].items())
    return f"stopped early after {info['items_run']} of {info['items_total']} items: {tasks} — {HOLDS}"


def verdict_text(verdict) -> str:
    """The verdict word, with the early stop when there was one: "FAIL (stopped early after … )"."""
    info = getattr(verdict, "early_stop", None)
    return f"{verdict.verdict} ({headline(info)})" if info else verdict.verdict


def summary(pairing, run_info: dict | None) -> dict:
    """gate.json's ``early_stop``: the run's record (reason, when) with the items run and the flips observed
    on them per task; the decision's own numbers are those of the best completion."""
    info = dict(run_info or {})
    tasks = {}
    for task, pairs in pairing.pairs.items():
        observed = pairs.observed_counts()
        tasks[task] = {**observed, "imputed": len(pairs.imputed)}
    info["tasks"] = tasks
    info["items_run"] = sum(t["items_run"] for t in tasks.values())
    info["items_total"] = sum(t["items_total"] for t in tasks.values())
    info.setdefault("reason", f"FAIL certain on the best completion: {HOLDS}")
    info["bound"] = ("best completion: every item not run counted right, valid and not truncated; the decision's "
                     "Δ, intervals, b / c, p and ψ are computed on it")
    return info


def check_stopped_verdict(verdict, candidate_path, conformance: dict | None = None) -> None:
    """A stopped-early run decides nothing but FAIL: its kernel failed its conformance check (``conformance``,
    the run's record: a FAIL whatever the items give), or its best completion FAILs on accuracy (it does
    under the policy and baseline that stopped it, by monotonicity). Another policy or baseline may not —
    then it must be completed first."""
    if conformance is not None and conformance.get("ok", True) is False:
        return
    accuracy = verdict.decision.verdict if verdict.decision is not None else None
    if accuracy != "FAIL":
        raise NotComparable(
            f"{candidate_path} stopped early, and on its best completion the accuracy verdict is {accuracy} under "
            f"this policy and baseline (not a certain FAIL); complete it first: `evalgate run --resume --out "
            f"{candidate_path}` or `evalgate gate --no-early-stop --out {candidate_path}`")
