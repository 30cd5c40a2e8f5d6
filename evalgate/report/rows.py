"""One row per task with what every output (terminal, markdown, junit, HTML) shows of a verdict."""

from __future__ import annotations


def paired_rows(decision, pairing, aa: dict) -> list[dict]:
    """Rows of a paired decision (``OverallDecision``) over its ``Pairing``; ``aa``: task -> A/A summary."""
    rows = []
    for task, dec in decision.tasks.items():
        pairs = pairing.pairs[task]
        base, cand = pairs.scores("base"), pairs.scores("cand")
        rows.append({
            "task": task, "paired": True, "n": dec.counts.n, "k": dec.n_samples, "baseline": sum(base) / len(base),
            "candidate": sum(cand) / len(cand), "delta": dec.delta, "ci": dec.tango_ci,
            "newcombe": dec.newcombe_ci, "lower": dec.gate_lower, "b": dec.counts.b, "c": dec.counts.c,
            "p": dec.p_degradation, "p_adj": dec.p_degradation_adjusted, "psi": dec.flip_rate,
            "psi0": dec.aa_psi0 if dec.aa_psi0 is not None else (aa.get(task) or {}).get("psi0"),
            "psi0_upper": dec.aa_psi0_upper, "aa_n": dec.aa_n,
            "margin": dec.margin_enforced, "margin_requested": dec.margin_requested, "mde": dec.mde,
            "samples_needed": dec.samples_needed, "resolves_margin": dec.resolves_margin,
            "verdict": dec.verdict, "reasons": list(dec.reasons), "warnings": list(dec.warnings),
        })
    return rows


def unpaired_rows(unpaired: dict, alpha: float) -> list[dict]:
    """Rows of an aggregate-only (unpaired) verdict: task -> ``UnpairedResult.to_dict()``."""
    return [{"task": task, "paired": False, "delta": res["delta"], "ci": res["ci"], "lower": res["lower_bound"],
             "p": res["p_degradation"], "margin": res["margin"], "margin_requested": res["margin"], "mde": None,
             "verdict": "PASS" if res["non_inferior"] and res["p_degradation"] > alpha else "FAIL",
             "reasons": [res["note"]], "warnings": []}
            for task, res in unpaired.items()]


def task_rows(verdict) -> list[dict]:
    if verdict.decision is None:
        return unpaired_rows(verdict.unpaired, verdict.thresholds.alpha)
    return paired_rows(verdict.decision, verdict.comparison, verdict.aa)


def conformance_line(verdict) -> str | None:
    """"kernel conformance PASS|FAIL: ..." when the candidate kernel was held against the kernel it declares
    (kernels/conformance.py); None when it is its own reference or was not checked (then a note says so)."""
    conf = verdict.conformance
    if not conf or not conf.get("checked"):
        return None
    return f"kernel conformance {'PASS' if conf['ok'] else 'FAIL'}: {conf['summary']}"
