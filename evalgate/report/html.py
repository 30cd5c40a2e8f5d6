"""HTML views of a comparison: the notebook reprs and the self-contained ``report.html``.

Everything is rendered by the Jinja2 templates in ``templates/`` beside this module with autoescaping on; completions
are model output and may contain ``<script>``. Data embedded for the report's script is JSON with ``<``,
``>`` and ``&`` escaped, so it can never close its ``<script>`` element. The report fetches nothing: CSS,
JS and the charts are inline, and its Content-Security-Policy forbids every network load.
"""

from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from evalgate.gate.compare import extracted_answer, item_gold
from evalgate.gate.verdict import run_identity as verdict_identity
from evalgate.report.rows import (alpha_text, conformance_line, early_stop_lines, paired_rows, task_rows,
                                  verdict_reason)
from evalgate.records import RunManifest
from evalgate.tasks import get_task

TEMPLATES = Path(__file__).parent / "templates"
STDERR_LINES = 25  # the end of a traceback says what went wrong
WORD = re.compile(r"\s+|\w+|[^\w\s]")  # diff by words, spaces and single symbols
VERDICT_COLORS = {"PASS": "#1a7f37", "INCONCLUSIVE": "#9a6700", "FAIL": "#cf222e",
                  "undecided": "#6e7781"}  # the interval chart's stroke


@lru_cache(maxsize=1)
def environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["pp"] = lambda x: "—" if x is None else f"{100 * x:+.2f}"
    env.filters["pct"] = lambda x: "—" if x is None else f"{100 * x:.1f}%"
    env.filters["num"] = lambda x, fmt=".3g": "—" if x is None else format(x, fmt)
    env.filters["short"] = lambda x, n=12: "" if x is None else (str(x)[:n] + "…" if len(str(x)) > n + 1 else str(x))
    env.filters["tojson_safe"] = embed_json
    return env


def render(template: str, **context) -> str:
    return environment().get_template(template).render(**context)


def embed_json(obj) -> str:
    """JSON that is safe inside a ``<script type="application/json">`` element."""
    import markupsafe

    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return markupsafe.Markup(text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


# ---------------------------------------------------------------- one item, side by side

def answer_span(text: str, answer) -> tuple[int, int] | None:
    """Where the extracted answer sits in the completion (its last occurrence: extractors take the last)."""
    if not text or answer in (None, "", "[invalid]"):
        return None
    start = text.rfind(str(answer))
    return (start, start + len(str(answer))) if start >= 0 else None


def diff_segments(base: str, cand: str) -> tuple[list[list], list[list]]:
    """Both texts as [text, kind] runs: kind "" (same), "del" (baseline only) or "ins" (candidate only)."""
    a, b = WORD.findall(base or ""), WORD.findall(cand or "")
    left, right = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            left.append(["".join(a[i1:i2]), ""])
            right.append(["".join(b[j1:j2]), ""])
            continue
        if i2 > i1:
            left.append(["".join(a[i1:i2]), "del"])
        if j2 > j1:
            right.append(["".join(b[j1:j2]), "ins"])
    return left, right


def mark_span(segments: list[list], span: tuple[int, int] | None) -> list[list]:
    """Split the runs at the answer's span and add " ans" to the kind of the runs inside it."""
    if span is None:
        return segments
    out, pos = [], 0
    for text, kind in segments:
        end = pos + len(text)
        cuts = sorted({0, len(text), *(c - pos for c in span if pos < c < end)})
        for lo, hi in zip(cuts, cuts[1:]):
            inside = span[0] <= pos + lo and pos + hi <= span[1]
            out.append([text[lo:hi], (kind + " ans").strip() if inside else kind])
        pos = end
    return out


def response_text(record: dict) -> str:
    resps = record.get("resps")
    if isinstance(resps, list):  # lm-eval style [[text]] or several samples: show the first
        while isinstance(resps, list) and resps:
            resps = resps[0]
    return "" if resps is None or isinstance(resps, list) else str(resps)



def display_question(task: str, record: dict) -> str | None:
    """What a row names the item by: the task's ``item_heading`` (GSM8K's question; HumanEval's signature
    and docstring line, its id being in a column of its own)."""
    return get_task(task).item_heading(record)


def prompt_of(task: str, record: dict) -> str | None:
    """The prompt, when the record holds it (the task's ``item_prompt``; HumanEval's program before the
    completion)."""
    return get_task(task).item_prompt(record)


def stderr_excerpt(record: dict) -> str | None:
    text = record.get("stderr") or ""
    if not text.strip():
        return record.get("exception") or None
    lines = text.rstrip("\n").splitlines()
    return "\n".join((["…"] if len(lines) > STDERR_LINES else []) + lines[-STDERR_LINES:])


def item_data(task: str, doc_id, base: dict, cand: dict, metric: str, flips_in_aa: bool = False) -> dict:
    """What both the notebook view and the report show for one item."""
    left, right = diff_segments(response_text(base), response_text(cand))
    sides = {}
    for name, record, segments in (("base", base, left), ("cand", cand, right)):
        answer = extracted_answer(task, record)
        sides[name] = {
            "score": float(record.get(metric, 0.0)), "extracted": answer,
            "finish_reason": record.get("finish_reason"), "failure_class": record.get("failure_class"),
            "stderr": stderr_excerpt(record) if record.get("failure_class") not in (None, "passed") else None,
            "n_tokens": record.get("n_tokens"),
            "segments": mark_span(segments, answer_span(response_text(record), answer)),
        }
    bs, cs = sides["base"]["score"], sides["cand"]["score"]
    return {"task": task, "doc_id": doc_id, "question": display_question(task, base), "gold": item_gold(task, base),
            "prompt": prompt_of(task, base), "metric": metric, "flips_in_aa": flips_in_aa,
            "direction": "lost" if bs > cs else "gained" if cs > bs else "same",
            "same_text": response_text(base) == response_text(cand), "base": sides["base"], "cand": sides["cand"]}


class ItemView:
    """``Comparison.show(task, doc_id)``: HTML in Jupyter, a unified diff in a terminal."""

    def __init__(self, task: str, doc_id, base: dict, cand: dict, metric: str, flips_in_aa: bool = False):
        self.task, self.doc_id, self.base, self.cand = task, doc_id, base, cand
        self.data = item_data(task, doc_id, base, cand, metric, flips_in_aa)

    def _repr_html_(self) -> str:
        return render("item.html.j2", item=self.data)

    def __str__(self) -> str:
        d = self.data
        lines = [f"{d['task']} {d['doc_id']}: {d['direction']}" + ("  (flips in A/A too)" if d["flips_in_aa"] else ""),
                 f"question: {d['question']}", f"gold: {d['gold']}"]
        for name, label in (("base", "baseline"), ("cand", "candidate")):
            s = d[name]
            extra = f", {s['failure_class']}" if s["failure_class"] else ""
            answer = f", answer {s['extracted']!r}" if s["extracted"] is not None else ""
            lines.append(f"{label}: {d['metric']} = {s['score']:g}{answer}, finish {s['finish_reason']}{extra}")
        diff = difflib.unified_diff(response_text(self.base).splitlines(), response_text(self.cand).splitlines(),
                                    "baseline", "candidate", lineterm="")
        lines += list(diff) or ["(identical completions)"]
        for name, label in (("base", "baseline"), ("cand", "candidate")):
            if d[name]["stderr"]:
                lines += [f"{label} stderr:", d[name]["stderr"]]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


# ---------------------------------------------------------------- scores and intervals

def ci_chart(delta: float, ci: tuple[float, float], lower: float | None, margin: float, verdict: str,
             width: int = 320, height: int = 56) -> dict:
    """Coordinates of the Δ-with-CI chart (in pp): the interval, the point, 0 and the −margin line."""
    points = [delta, ci[0], ci[1], -margin, 0.0] + ([lower] if lower is not None else [])
    lo, hi = min(points), max(points)
    pad = max((hi - lo) * 0.12, 0.002)
    lo, hi = lo - pad, hi + pad
    left, right = 10, width - 10

    def x(v: float) -> float:
        return round(left + (v - lo) / (hi - lo) * (right - left), 1)

    x_delta = x(delta)
    anchor = "start" if x_delta < left + 30 else "end" if x_delta > right - 30 else "middle"
    close = abs(x(0.0) - x(-margin)) < 20  # keep the "−M" and "0" labels apart
    return {"width": width, "height": height, "y": 22, "delta_anchor": anchor,
            "x_lo": x(ci[0]), "x_hi": x(ci[1]), "x_delta": x_delta,
            "x_zero": x(0.0), "x_margin": x(-margin),
            "zero_anchor": "start" if close else "middle", "margin_anchor": "end" if close else "middle", "x_lower": x(lower) if lower is not None else None,
            "ok": verdict == "PASS", "color": VERDICT_COLORS.get(verdict, VERDICT_COLORS["FAIL"]), "left": left, "right": right, "delta_label": f"{100 * delta:+.2f}",
            "title": f"Δ {100 * delta:+.2f} pp, 95% CI [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}], "
                     f"−margin {-100 * margin:.2f} pp"}


def _with_charts(rows: list[dict]) -> list[dict]:
    for r in rows:
        # an undecided task's interval is a bound, drawn grey: never a green interval under a FAIL
        r["chart"] = ci_chart(r["delta"], r["ci"], r.get("lower"), r["margin"],
                              r["verdict"] if r.get("decided", True) else "undecided")
    return rows


def flip_counts(comparison) -> dict[str, dict]:
    out = {}
    for task in comparison.tasks:
        f = comparison.flips(task)
        lost = int((f["direction"] == "lost").sum())
        out[task] = {"lost": lost, "gained": len(f) - lost, "in_aa": int(f["flips_in_aa"].sum())}
    return out


def comparison_html(comparison) -> str:
    """``Comparison._repr_html_``: verdict, per-task scores with the CI chart, flip counts."""
    decision = comparison.ensure_decision()
    return render("comparison.html.j2", cmp=comparison, decision=decision,
                  rows=_with_charts(paired_rows(decision, comparison, comparison.aa)) if decision is not None else [],
                  flips=flip_counts(comparison), base=run_identity(comparison.baseline),
                  cand=run_identity(comparison.candidate))


# ---------------------------------------------------------------- the report

def run_identity(run) -> dict:
    """The short identity the report's header shows, taken from the verdict's identity of the run."""
    ident = verdict_identity(run)
    model, kernel = ident["model"], ident["kernel"]
    return {"path": ident["path"], "run_id": ident["run_id"], "kernel": kernel.get("id") or kernel.get("name"),
            "kernel_name": kernel.get("name"), "model": model.get("fingerprint"), "model_type": model.get("model_type")}


MAY_DIFFER = frozenset({("run", "id"), ("run", "created"), ("run", "finished"), ("kernel", "id"), ("kernel", "name"),
                        ("kernel", "version"), ("kernel", "description"), ("kernel", "fault injected"),
                        ("model", "path"), ("model", "device"), ("model", "batch size"), ("machine", "platform"),
                        ("machine", "cuda"), ("machine", "DG_* environment")})


def manifest_rows(base: RunManifest | dict, cand: RunManifest | dict) -> list[dict]:
    """The two manifests side by side, as (section, key, baseline, candidate, differs) rows (models, or the
    dicts a notebook holds)."""
    def get(m, *keys):
        for k in keys:  # a part's typed and open fields by name; inside an open field, its dict
            m = getattr(m, k, None) if isinstance(m, BaseModel) else m.get(k) if isinstance(m, dict) else None
        return m

    fields = [
        ("run", "id", ("run_id",)), ("run", "created", ("created",)), ("run", "finished", ("finished",)),
        ("run", "status", ("status",)), ("run", "aggregate only", ("aggregate_only",)),
        ("kernel", "id", ("kernel", "id")), ("kernel", "name", ("kernel", "name")),
        ("kernel", "version", ("kernel", "version")), ("kernel", "description", ("kernel", "description")),
        ("kernel", "fault injected", ("kernel", "faulty")),
        ("model", "fingerprint", ("model", "fingerprint")), ("model", "type", ("model", "model_type")),
        ("model", "path", ("model", "path")), ("model", "config sha256", ("model", "config_sha256")),
        ("model", "adapter", ("model", "adapter")), ("model", "dtype", ("model", "dtype")),
        ("model", "device", ("model", "device")), ("model", "batch size", ("model", "batch_size")),
        ("versions", "evalgate", ("evalgate_version",)), ("versions", "torch", ("model", "torch")),
        ("versions", "transformers", ("model", "transformers")), ("versions", "python", ("model", "machine", "python")),
        ("machine", "platform", ("model", "machine", "platform")), ("machine", "cuda", ("model", "machine", "cuda")),
        ("machine", "DG_* environment", ("dg_env",)),
    ]
    rows = [{"section": s, "key": k, "base": get(base, *p), "cand": get(cand, *p)} for s, k, p in fields]
    for task in sorted(set(get(base, "tasks") or {}) | set(get(cand, "tasks") or {})):
        for key, path in (("profile", ("name",)), ("profile id", ("profile_id",)), ("items", ("n_items",)),
                          ("dataset sha256", ("dataset_sha256",)), ("decoding", ("decoding",)),
                          ("sandbox python", ("prepare", "python"))):
            rows.append({"section": f"task {task}", "key": key, "base": get(base, "tasks", task, *path),
                         "cand": get(cand, "tasks", task, *path)})
    for r in rows:
        # highlighted only where the runs must agree: a run's id, times, folder, batch, device and kernel differ
        r["differs"] = r["base"] != r["cand"] and (r["section"], r["key"]) not in MAY_DIFFER
        for side in ("base", "cand"):
            value = r[side]
            r[side] = "—" if value in (None, {}, "") else (json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value))
    return [r for r in rows if not (r["base"] == "—" and r["cand"] == "—")]


def report_items(comparison) -> list[dict]:
    """Every flipped item of every task, lost before gained, with what its expanded row shows."""
    items = []
    for direction in ("lost", "gained"):
        for task in comparison.tasks:
            p = comparison.pairs[task]
            aa = comparison.aa_flips.get(task, set())
            for doc_id, b, c in zip(p.doc_ids, p.base, p.cand):
                if doc_id in p.imputed:  # not run (a stopped-early candidate): no flip to show
                    continue
                bs, cs = float(b.get(p.metric, 0.0)), float(c.get(p.metric, 0.0))
                if (bs > cs) if direction == "lost" else (cs > bs):
                    items.append(item_data(task, doc_id, b, c, p.metric, doc_id in aa))
    return items


def report_html(verdict, explanations=None, explained: str | None = None) -> str:
    """``report.html``: one self-contained page a person reads in a minute. ``explanations``: the flips'
    ``FlipExplanations`` (``evalgate gate --explain``), or (task, doc_id as text) -> {"kind", "line", and
    optionally "margin"} of the flips ``evalgate explain`` replayed: each flip tagged with its kind, the flips
    sortable by kind and margin; ``explained``: the summary line (a ``FlipExplanations`` has its own)."""
    from evalgate.report.explained import FlipExplanations

    if isinstance(explanations, FlipExplanations):
        explained, explanations = explanations.summary, explanations.tags()
    cmp = verdict.comparison
    rows = _with_charts(task_rows(verdict))
    items = report_items(cmp) if cmp is not None else []
    for item in items:
        item["explanation"] = (explanations or {}).get((item["task"], str(item["doc_id"])))
    failure_classes = sorted({s[k]["failure_class"] for s in items for k in ("base", "cand")} - {None, "passed"})
    return render(
        "report.html.j2", verdict=verdict, rows=rows, items=items, failure_classes=failure_classes, alpha=alpha_text(verdict),
        notes=verdict.notes, conformance=conformance_line(verdict), early_stop=early_stop_lines(verdict),
        reason=verdict_reason(verdict), explained=explained, tagged=any(i["explanation"] for i in items),
        tasks=cmp.tasks if cmp is not None else [], flips=flip_counts(cmp) if cmp is not None else {},
        base=run_identity(cmp.baseline) if cmp is not None else None,
        cand=run_identity(cmp.candidate) if cmp is not None else None,
        manifest=manifest_rows(cmp.baseline.meta, cmp.candidate.meta) if cmp is not None else [],
        detail=[{"question": i["question"], "gold": i["gold"], "prompt": i["prompt"], "metric": i["metric"],
                 "base": i["base"], "cand": i["cand"], "same_text": i["same_text"]} for i in items],
    )
