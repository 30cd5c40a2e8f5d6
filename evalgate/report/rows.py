"""One row per task with what every output (terminal, markdown, junit, HTML) shows of a verdict."""

from __future__ import annotations

from evalgate.gate.stopped import decided


def paired_rows(decision, pairing, aa: dict) -> list[dict]:
    """Rows of a paired decision (``OverallDecision``) over its ``Pairing``; ``aa``: task -> A/A summary."""
    rows = []
    for task, dec in decision.tasks.items():
        pairs = pairing.pairs[task]
        base, cand = pairs.scores("base"), pairs.scores("cand")
        stats, resolution, outcome = dec.statistics, dec.resolution, dec.outcome
        is_decided = decided(bool(pairs.imputed), outcome.verdict)
        # a task decided in a later round (more samples per item) has that look's Δ, CI and counts; the
        # pairing's scores are the first look's, so the row leaves them out (``earlier_look_lines`` says them)
        same_look = pairs.k == stats.n_samples
        scores = (sum(base) / len(base), sum(cand) / len(cand)) if base else (0.0, 0.0)
        rows.append({
            "task": task, "paired": True, "n": stats.counts.n, "k": stats.n_samples,
            "baseline": scores[0] if same_look else None, "candidate": scores[1] if same_look else None,
            "earlier": None if same_look else {"k": pairs.k, "baseline": scores[0], "candidate": scores[1]},
            "delta": stats.delta, "ci": stats.tango_ci,
            "newcombe": stats.newcombe_ci, "lower": stats.gate_lower, "b": stats.counts.b, "c": stats.counts.c,
            "p": stats.p_degradation, "p_adj": outcome.p_degradation_adjusted, "psi": stats.flip_rate,
            "psi0": resolution.aa_psi0 if resolution.aa_psi0 is not None else (aa.get(task) or {}).get("psi0"),
            "psi0_upper": resolution.aa_psi0_upper, "aa_n": resolution.aa_n,
            "margin": dec.rule.margin, "mde": resolution.mde,
            "samples_needed": resolution.samples_needed, "resolves_margin": dec.resolves_margin,
            # an undecided task's own reasons describe its best completion, not a finding: said as what it is
            "verdict": outcome.verdict, "warnings": list(outcome.warnings),
            "reasons": list(outcome.reasons) if is_decided else [undecided_reason(pairs.observed_counts(), outcome.verdict)],
            # a stopped-early candidate: what the items run showed (the numbers above are its best completion)
            "observed": pairs.observed_counts() if pairs.imputed else None,
            "decided": is_decided,
        })
    return rows


def undecided_reason(observed: dict, best: str) -> str:
    """Why a task of a stopped-early run has no verdict of its own."""
    return (f"not decided: {observed['items_run']} of {observed['items_total']} items run before the gate stopped "
            f"(its FAIL was already certain); the numbers shown are a bound, and even at best this task would be "
            f"{best}")


def early_stop_lines(verdict) -> list[str]:
    """A stopped-early verdict in words: the headline, then per task what was observed on the items run and
    which numbers are the bound (docs/gate.md#stopping-early). Empty for a run that ran every item."""
    info = getattr(verdict, "early_stop", None)
    if not info:
        return []
    from evalgate.gate.stopped import headline

    lines = [f"FAIL ({headline(info)})"]
    for r in task_rows(verdict):
        o = r.get("observed")
        if o is None:
            lines.append(f"{r['task']}: every item run")
            continue
        scores = ("" if not o["items_run"] else
                  f", candidate {o['candidate']:.4f} vs baseline {o['baseline']:.4f} on them")
        lines.append(f"{r['task']}: {o['items_run']} of {o['items_total']} items run — observed {o['b']} lost, "
                     f"{o['c']} gained{scores}; its candidate score, Δ, CI, p, ψ and the bound b / c are the best "
                     f"completion's, the {o['items_total'] - o['items_run']} items not run counted right, valid and "
                     "not truncated")
    return lines


def bound_cells(r: dict) -> dict:
    """The n, baseline, candidate and b / c cells of a table row: plain, or for a stopped-early task the
    observed counts beside the bound (best completion); "≤": the complete run's value can only be lower; "—":
    a score of another look than the row's (``earlier_look_lines``)."""
    o = r.get("observed")
    base = "—" if r.get("baseline") is None else f"{r['baseline']:.4f}"
    if not_run(r):  # no bound worth showing: every number would be the best completion of nothing
        return {"n": f"0/{r['n']}", "baseline": base, "candidate": "—", "b_c": "—", "le": ""}
    if r.get("candidate") is None:
        return {"n": str(r["n"]), "baseline": base, "candidate": "—", "b_c": f"{r['b']} / {r['c']}", "le": ""}
    if o is None:
        return {"n": str(r["n"]), "baseline": base, "candidate": f"{r['candidate']:.4f}",
                "b_c": f"{r['b']} / {r['c']}", "le": ""}
    return {"n": f"{o['items_run']}/{r['n']}", "baseline": base, "candidate": f"≤ {r['candidate']:.4f}",
            "b_c": f"{o['b']} / {o['c']} (bound {r['b']} / {r['c']})", "le": "≤ "}


def earlier_look_lines(verdict) -> list[str]:
    """For each task decided in a later round: which look its row's numbers are, and the first look's scores
    and flips (the flip lists are that look's), so no line mixes two looks."""
    lines = []
    for r in task_rows(verdict):
        e = r.get("earlier")
        if e:
            lines.append(f"{r['task']}: the row's Δ, CI, b / c, p and ψ are the look that decided it (k = {r['k']} "
                         f"samples per item); at the first look (k = {e['k']}) baseline {e['baseline']:.4f}, "
                         f"candidate {e['candidate']:.4f}, and the flipped items listed are that look's")
    return lines


def first_look_suffix(verdict, task: str) -> str:
    """" at the first look (k = 4)" after a flip count of a task decided in a later round, else ""."""
    for r in task_rows(verdict):
        if r["task"] == task and r.get("earlier"):
            return f" at the first look (k = {r['earlier']['k']})"
    return ""


def alpha_text(verdict) -> str:
    """The α each task was decided at: the policy's, or each deciding look's share of it (rounds)."""
    policy = verdict.thresholds.alpha
    if verdict.decision is None:
        return f"α = {policy}"
    spent = {t: d.rule.alpha for t, d in verdict.decision.tasks.items()}
    if len(set(spent.values())) == 1:
        return f"α = {next(iter(spent.values())):.4g}"
    return "α = " + ", ".join(f"{a:.4g} ({t})" for t, a in spent.items()) + " at each task's deciding look"


def unpaired_rows(unpaired: dict, alpha: float) -> list[dict]:
    """Rows of an aggregate-only (unpaired) verdict: task -> ``UnpairedResult.to_dict()``."""
    return [{"task": task, "paired": False, "decided": True, "observed": None, "delta": res["delta"], "ci": res["ci"], "lower": res["lower_bound"],
             "p": res["p_degradation"], "margin": res["margin"], "mde": None,
             "verdict": "PASS" if res["non_inferior"] and res["p_degradation"] > alpha else "FAIL",
             "reasons": [res["note"]], "warnings": []}
            for task, res in unpaired.items()]


def not_run(r: dict) -> bool:
    """A task of a stopped-early run that ran none of its items (e.g. a kernel that failed its conformance
    check before the first item)."""
    o = r.get("observed") or {}
    return bool(o) and not o["items_run"]


def label(r: dict, long: bool = False) -> str:
    """A row's verdict as shown: the verdict, "not run" for a task of a stopped-early run that ran none of its
    items, or "undecided" for one whose best completion does not FAIL (``long``: "undecided (at best PASS)")."""
    if r.get("decided", True):
        return r["verdict"]
    if not_run(r):
        return "not run (the gate stopped before its first item)" if long else "not run"
    return f"undecided (at best {r['verdict']})" if long else "undecided"


def task_rows(verdict) -> list[dict]:
    if verdict.decision is None:
        return unpaired_rows(verdict.unpaired, verdict.thresholds.alpha)
    return paired_rows(verdict.decision, verdict.comparison, verdict.aa)


def verdict_reason(verdict) -> str | None:
    """What decides the overall verdict, said first everywhere (terminal, report.md, report.html) as
    "VERDICT — reason": a failed conformance check, else the first decided FAIL task's reason, else the first
    INCONCLUSIVE task's; None for a PASS."""
    if verdict.verdict == "PASS":
        return None
    conf = verdict.conformance
    if verdict.verdict == "FAIL" and conf and conf.get("checked") and not conf.get("ok"):
        return f"{verdict.verdict} — {conformance_line(verdict)}"
    for r in task_rows(verdict):
        if r.get("decided", True) and r["verdict"] == verdict.verdict and r["reasons"]:
            return f"{verdict.verdict} — {r['task']}: {r['reasons'][0]}"
    return None


def conformance_line(verdict) -> str | None:
    """"kernel conformance PASS|FAIL: ..." when the candidate kernel was held against the kernel it declares
    (kernels/conformance.py); None when it is its own reference or was not checked (then a note says so)."""
    conf = verdict.conformance
    if not conf or not conf.get("checked"):
        return None
    return f"kernel conformance {'PASS' if conf['ok'] else 'FAIL'}: {conf['summary']}"
