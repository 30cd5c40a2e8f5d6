"""The notebook surface: ``load_run``, ``compare`` and ``decide`` on stored runs (no model needed).

``compare(baseline, candidate)`` returns a ``Comparison``: the two runs paired item by item, with
``summary`` (scores, Δ, CI, b/c, p, verdict per task), ``flips(task)``, ``changed(task)``, ``show(task,
doc_id)`` and an HTML summary in Jupyter. Its statistics are the gate's rule, decided on first use with the
policy given (default: the canary's policy for canary runs, else the packaged one), the baseline's A/A
record when it has one, and no refusal for a missing calibration.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.errors import NotComparable, UserError
from evalgate.explain import Explainer, Explanation, summary_line
from evalgate.gate.compare import Pairing
from evalgate.gate.compare import compare as pair_runs
from evalgate.gate.compare import serving_difference
from evalgate.gate.decide import decide as decide_pairing
from evalgate.gate.decide import with_conformance
from evalgate.gate.door import decide_pair
from evalgate.gate.sequence import decide_at_look
from evalgate.gate.policy import Thresholds, policy_for_run
from evalgate.gate.subset import item_lists, restrict
from evalgate.gate.verdict import OverallDecision, Verdict
from evalgate.report.html import ItemView, comparison_html, display_question
from evalgate.records import load_manifest, load_verdict
from evalgate.run.baselines import StoredBaseline, aa_for_baseline, assemble, load_baseline
from evalgate.run.store import MANIFEST, Run, load_run
from evalgate.tasks import comparison_notes

SUMMARY_COLUMNS = ["task", "n", "baseline", "candidate", "delta", "ci_low", "ci_high", "b", "c", "p", "verdict"]


def _policy(thresholds, run: Run) -> Thresholds:
    """The one resolver the gate uses (``--thresholds``, $EVALGATE_THRESHOLDS, the canary's own, ./thresholds.yaml,
    the packaged default)."""
    return policy_for_run(thresholds, run)


def _stored(baseline) -> StoredBaseline:
    """A baseline as the gate's door takes it: loaded here, at the edge, from its folder or folders."""
    if isinstance(baseline, StoredBaseline):
        return baseline
    return load_baseline([Path(b) for b in baseline] if isinstance(baseline, (list, tuple)) else Path(baseline))


def _for_profiles_used(pairing: Pairing, policy: Thresholds, notes: list[str]) -> Thresholds:
    """The policy with each task's profile set to the one the runs used (a notebook may look at any profile)."""
    tasks = dict(policy.tasks)
    for task in pairing.pairs:
        used = pairing.candidate.meta.tasks[task].name
        if task in tasks and tasks[task].profile != used:
            notes.append(f"{task}: the policy is written for profile {tasks[task].profile!r}; "
                         f"its margin is applied to {used!r}")
            tasks[task] = dataclasses.replace(tasks[task], profile=used)
    return dataclasses.replace(policy, tasks=tasks)


@dataclass(repr=False)  # the Pairing's short repr
class Comparison(Pairing):
    """A ``Pairing`` with statistics for notebooks: ``summary``, ``show``, and an HTML summary."""

    thresholds: object = None  # a policy file, a ``Thresholds``, or None for the default
    notes: list[str] = field(default_factory=list)  # how the runs were paired and the statistics decided
    baseline_dirs: list[Path] = field(default_factory=list)  # the baseline folder(s), for their A/A records
    stats_problem: str | None = None  # why statistics could not be decided (not retried)
    items: object = None  # the subset compared on (``compare(..., items=...)``); None: every item
    across_serving: bool = False  # paired across a serving difference, as asked
    _verdict: Verdict | None = field(default=None, repr=False)
    _explainer: Explainer | None = field(default=None, repr=False)  # the replaying models, loaded on first use

    @property
    def verdict(self) -> Verdict | None:
        """The gate's verdict on this pair (decided once, on first use); None when it cannot be decided."""
        if self._verdict is None and self.stats_problem is None:
            try:
                aa = aa_for_baseline(self.baseline_dirs or [self.baseline.path])
            except (OSError, ValueError):  # an unreadable aa.json must not stop anyone looking at flips
                aa = {}
            try:
                self._verdict = self._decide(aa)
            except UserError as exc:  # NotComparable included: the numbers would not be a valid gate
                self.stats_problem = f"no statistics: {exc}"
                self.notes.append(self.stats_problem)
                return None
            self.notes.extend(self._verdict.notes)
        return self._verdict

    def _decide(self, aa: dict) -> Verdict:
        """Through the gate's door (``decide_pair``: its policy resolver, decision and look), uncalibrated
        allowed; a policy written for another profile has its margin applied to the one used (noted)."""
        policy = _for_profiles_used(self, _policy(self.thresholds, self.candidate), self.notes)
        dirs = self.baseline_dirs or [self.baseline.path]
        if self.items is None or self.items == "candidate":
            return decide_pair(_stored(dirs), self.candidate, policy, allow_uncalibrated=True,
                               items="candidate" if self.items else "all", across_serving=self.across_serving)
        # an explicit list of items: this pairing, decided as the gate decides, its own sequence of looks
        from evalgate.gate.door import items_digest

        def decide(at_look: Thresholds) -> Verdict:
            return with_conformance(decide_pairing(self, at_look, aa=aa, require_aa=False), self.candidate)

        return decide_at_look(decide, policy, dirs, self.candidate.meta, list(self.pairs),
                              items_digest(self.candidate))

    @property
    def decision(self) -> OverallDecision | None:
        verdict = self.verdict
        return verdict.decision if verdict is not None else None

    def ensure_decision(self) -> OverallDecision | None:
        return self.decision

    @property
    def aa(self) -> dict:
        verdict = self.verdict
        return verdict.aa if verdict is not None else {}

    @property
    def summary(self):
        """One row per task: task, n, baseline, candidate, delta, ci_low, ci_high, b, c, p, verdict, ..."""
        import pandas as pd

        decision = self.decision
        rows = []
        for task, p in self.pairs.items():
            base, cand = p.correct("base"), p.correct("cand")
            row = {"task": task, "n": len(base), "baseline": sum(p.scores("base")) / len(base),
                   "candidate": sum(p.scores("cand")) / len(cand),
                   "b": sum(x and not y for x, y in zip(base, cand)), "c": sum(y and not x for x, y in zip(base, cand))}
            row["delta"] = row["candidate"] - row["baseline"]
            dec = decision.tasks.get(task) if decision is not None else None
            if dec is not None:
                stats = dec.statistics
                row.update(ci_low=stats.tango_ci[0], ci_high=stats.tango_ci[1], lower_bound=stats.gate_lower,
                           p=stats.p_degradation, p_adjusted=dec.outcome.p_degradation_adjusted, margin=dec.rule.margin,
                           verdict=dec.outcome.verdict)
            rows.append(row)
        columns = SUMMARY_COLUMNS + [k for k in rows[0] if k not in SUMMARY_COLUMNS] if rows else SUMMARY_COLUMNS
        return pd.DataFrame(rows, columns=columns)

    def flips(self, task: str | None = None, direction: str | None = None, failure_class: str | None = None,
              explain: bool = False):
        """Items whose score differs (``Pairing.flips``); a HumanEval item's ``question`` is its signature and
        the first line of its docstring, as in the report. ``explain=True`` replays every flip shown
        (``explain``) and adds its ``explanation`` (near-tie, divergence, ...), ``margin``, ``divergence_at``
        (token), ``layer`` and ``expert``."""
        df = super().flips(task, direction, failure_class)
        names = [task] * len(df) if task is not None else list(df["task"]) if len(df) else []
        if len(df):
            records = {t: {str(d): r for d, r in zip(p.doc_ids, p.base)} for t, p in self.pairs.items()}
            df["question"] = [display_question(t, records[t][str(d)]) for t, d in zip(names, df["doc_id"])]
        if explain:
            found = [self.explain(t, d) for t, d in zip(names, df["doc_id"])]
            df["explanation"] = [x.kind for x in found]
            df["margin"] = [x.margin for x in found]
            df["divergence_at"] = [x.position for x in found]
            df["layer"] = [x.layer for x in found]
            df["expert"] = [x.expert for x in found]
        return df

    def explainer(self, model=None, device: str = "cpu") -> Explainer:
        """The replaying models of this pair (loaded on first use, kept): ``model`` a checkpoint to replay
        instead of the run's own (a run through a server needs one)."""
        if self._explainer is None or (model is not None and Path(model) != self._explainer.model) \
                or device != self._explainer.device:
            self._explainer = Explainer(self, model=Path(model) if model is not None else None, device=device)
        return self._explainer

    def explain(self, task: str, item, model=None, device: str = "cpu") -> Explanation:
        """Why ``item`` flipped (or, for any item, where its two generations part): the two runs' tokens
        replayed teacher-forced through both kernels (evalgate/explain.py); a DataFrame per layer
        (``.frame``), the top-2 tokens (``.top``) and a rendered view in Jupyter."""
        return self.explainer(model, device).explain(task, item)

    def explain_flips(self, task: str | None = None, model=None, device: str = "cpu") -> list[Explanation]:
        """Every flip of ``task`` (default: all tasks) explained, in ``flips()`` order."""
        df = self.flips(task)
        names = [task] * len(df) if task is not None else list(df["task"]) if len(df) else []
        return [self.explain(t, d, model, device) for t, d in zip(names, df["doc_id"])]

    def show(self, task: str, doc_id) -> ItemView:
        """One item side by side: question, gold, both completions diffed, answers highlighted (HTML in Jupyter)."""
        if task not in self.pairs:
            raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(self.pairs)}")
        p = self.pairs[task]
        index = {str(d): i for i, d in enumerate(p.doc_ids)}
        i = index.get(str(doc_id))
        if i is None:
            raise UserError(f"{task} has no item {doc_id!r}; ids run from {p.doc_ids[0]!r} to {p.doc_ids[-1]!r}")
        return ItemView(task, p.doc_ids[i], p.base[i], p.cand[i], p.metric,
                        flips_in_aa=p.doc_ids[i] in self.aa_flips.get(task, set()))

    def _repr_html_(self) -> str:
        return comparison_html(self)


def _gate_file(path: Path) -> Path | None:
    """``gate.json`` of a gate's report folder, or of a run folder the gate wrote into (``<run>/gate/``)."""
    for candidate in (path / "gate.json", path / "gate" / "gate.json"):
        if candidate.is_file():
            return candidate
    return None


def _is_path(x) -> bool:
    return isinstance(x, (str, Path))


def _is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def _is_baselines_root(path: Path) -> bool:
    """A folder of stored baselines, ``<model>/<profile>/<kernel>/manifest.json`` (e.g. ``evalgate.canary.BASELINES``)."""
    return path.is_dir() and not _is_run_dir(path) and next(path.glob(f"*/*/*/{MANIFEST}"), None) is not None


def _gate_record(path: Path):
    found = _gate_file(path)
    if found is None:
        return None
    record = load_verdict(found)
    if record.candidate is None:
        raise UserError(f"{found} decided against an aggregate-only baseline: there are no items to pair")
    return record


def _candidate(candidate) -> Run:
    """A ``Run``, a run folder, or a gate's report folder (``<run>/gate``): the run it decided on."""
    if isinstance(candidate, Run):
        return candidate
    path = Path(candidate)
    if not _is_run_dir(path):
        record = _gate_record(path) if path.is_dir() else None
        if record is not None:
            return load_run(record.candidate.path)
    return load_run(path)


def _sides(baseline, candidate):
    """What ``compare`` was given, as (baseline: a Run, a run folder, a list of folders or a baselines root;
    candidate: a Run); a gate's output folder alone stands for both sides it decided on."""
    if candidate is None:
        record = _gate_record(Path(baseline)) if _is_path(baseline) else None
        if record is None:
            raise UserError(f"compare needs a baseline and a candidate, or a gate's output folder (with gate.json); "
                            f"{baseline!r} is neither")
        dirs = record.baseline_dirs or [record.baseline.path]
        return [Path(d) for d in dirs], load_run(record.candidate.path)
    cand = _candidate(candidate)
    if isinstance(baseline, (list, tuple)):
        return [Path(b) for b in baseline], cand
    if _is_path(baseline):
        path = Path(baseline)
        if not _is_run_dir(path) and path.is_dir():
            record = _gate_record(path)
            if record is not None:  # a gate's output folder: the baselines it decided with
                return [Path(d) for d in (record.baseline_dirs or [record.baseline.path])], cand
    return baseline, cand


def find_baselines(root, candidate: Run, tasks: list[str] | None = None, kernel: str = "w4a8") -> list[Path]:
    """The stored baseline folder of every task of ``candidate`` under a baselines ``root``: same model
    fingerprint, same profile (by id; by name where no id matches, e.g. a candidate run on a subset of
    the items, which ``compare(..., items=...)`` then checks item by item), ``kernel``."""
    from evalgate.run.baselines import list_baselines

    root = Path(root)
    fingerprint = candidate.meta.model.fingerprint
    rows = [r for r in list_baselines(root) if r["model"] == fingerprint and r["kernel"] == kernel]
    found = []
    for task in tasks or candidate.tasks:
        summary = candidate.meta.tasks[task]
        same = [r for r in rows if r["task"] == task and r["profile_id"] == summary.profile_id]
        named = [r for r in rows if r["task"] == task and r["profile"] == summary.name]
        pick = same or named
        if not pick:
            have = sorted({f"{r['task']} {r['profile']} [{r['kernel']}]" for r in list_baselines(root)
                           if r["model"] == fingerprint}) or ["none for this model"]
            raise NotComparable(f"no stored {kernel} baseline of task {task} (profile {summary.name}, model "
                                f"{fingerprint}) under {root}; there: {', '.join(have)}")
        if len(pick) > 1:
            raise UserError(f"{len(pick)} stored {kernel} baselines of {task} ({summary.name}) under {root} match "
                            f"by name and none by id; pass the one to use: {', '.join(r['path'] for r in pick)}")
        found.append(Path(pick[0]["path"]))
    return found


def _subset_hint(base: Run, cand: Run, tasks: list[str]) -> str:
    """What to pass when the baseline lacks some of the candidate's tasks (baselines are stored one task per
    folder), or the candidate holds some of the baseline's items (a ``--limit`` run)."""
    held = [t for t in tasks if t in base.meta.tasks]
    if len(held) < len(tasks):
        has = ", ".join(base.meta.tasks) or "no task"
        only = f"tasks={held!r}, " if held else ""
        return (f"; the baseline holds {has} (stored baselines are one folder per task): pass {only}every task's "
                "baseline folder as a list, or the baselines root (e.g. evalgate.canary.BASELINES)")
    for task in tasks:
        b = {str(r["doc_id"]) for r in base.records.get(task, [])}
        c = {str(r["doc_id"]) for r in cand.records.get(task, [])}
        if c and c < b:
            return (f"; the candidate holds {len(c)} of the baseline's {len(b)} {task} items: pass "
                    'items="candidate" to compare on those items (checked item by item)')
    return ""


def compare(baseline, candidate=None, tasks: list[str] | None = None, metrics: dict[str, str] | None = None,
            aa_flips: dict[str, set] | None = None, thresholds=None, items=None,
            baseline_kernel: str = "w4a8", across_serving: bool = False) -> Comparison:
    """Pair two stored runs; refuses (``NotComparable``) when they must not be compared.

    ``baseline``: a run or baseline folder, a ``Run``, a list of per-task baseline folders (as stored by
    ``evalgate calibrate``), a baselines root such as ``evalgate.canary.BASELINES`` (the ``baseline_kernel``
    baseline of the candidate's model and profiles is looked up there), or a gate's output folder (the
    baselines it decided with). ``candidate``: a run folder, a ``Run`` or a gate's output folder (the run it
    decided on); ``compare(gate_dir)`` alone pairs what a gate decided on.

    ``items`` compares on a subset: ``"candidate"`` (the items the candidate ran, e.g. with ``limit``), a list
    of item ids, or a dict task -> ids. Both runs are cut to those items after checking, item by item, what
    the profile id covers (profile, settings, dataset, decoding, each item's prompt); without it the item
    sets must be equal. ``thresholds`` (a policy file or ``Thresholds``) is used when ``summary`` needs
    statistics. ``across_serving``: pair two server runs whose serving identity (shared-expert fusion,
    routed-scaling placement) differs, which is otherwise refused; the notes say so.
    """
    baseline, cand = _sides(baseline, candidate)
    baseline_dirs: list[Path] = []
    if _is_path(baseline) and _is_baselines_root(Path(baseline)):
        baseline = find_baselines(baseline, cand, tasks or (list(items) if isinstance(items, dict) else None),
                                  baseline_kernel)
    if isinstance(baseline, list):
        baseline_dirs = baseline
        if aa_flips is None:
            aa_flips = {t: a["flips"] for t, a in aa_for_baseline(baseline).items()}
        baseline = assemble(baseline)
    base = baseline if isinstance(baseline, Run) else load_run(baseline)
    baseline_dirs = baseline_dirs or [base.path]
    notes: list[str] = []
    if items is not None:
        lists = item_lists(items, base, cand, tasks)
        base, cand, notes = restrict(base, cand, lists)
        tasks = list(lists)
    names = tasks or [t for t in cand.tasks if t in cand.records]
    try:
        pairing = pair_runs(base, cand, tasks=tasks, metrics=metrics, aa_flips=aa_flips, across_serving=across_serving)
    except NotComparable as exc:
        hint = _subset_hint(base, cand, names) if items is None else ""
        raise NotComparable(f"{exc}{hint}") from None
    notes += comparison_notes(base.meta, cand.meta, list(pairing.pairs))
    differs = serving_difference(base, cand) if across_serving else None
    if differs:
        notes.append(f"compared across a serving difference, as asked: {differs}")
    return Comparison(pairing.baseline, pairing.candidate, pairing.pairs, pairing.aa_flips, thresholds=thresholds,
                      notes=notes, baseline_dirs=baseline_dirs, items=items, across_serving=across_serving)


def run_kernel(kernel: str, out, model: str | None = None, tasks=("gsm8k", "humaneval"), limit: int | None = None,
               batch_size: int = 16, profiles: dict[str, str] | None = None, resume: bool = False,
               progress: bool = False, options=None) -> Run:
    """Run ``kernel`` in process into the folder ``out``, as ``evalgate run`` does, and return the stored run.

    ``model`` None is the built-in canary with its own profiles. ``limit`` runs the first N items of each
    task (its profile id then covers those items only: compare such a run with a full baseline through
    ``compare(..., items="candidate")``). ``resume`` continues or reuses a run already in ``out``.
    ``options`` (``evalgate.run.options.RunOptions``): the device map, threads and datasets, as
    ``--device-map``, ``--threads`` and ``--dataset`` give them to ``evalgate run``.
    """
    from evalgate.run.options import RunOptions
    from evalgate.canary import PROFILES as CANARY_PROFILES
    from evalgate.canary import canary_path
    from evalgate.run.progress import Progress
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.runner import execute, prepare_out
    from evalgate.run.spec import RunSpec, load_tasks

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    chosen = dict(profiles or {})
    if model is None:
        chosen = {t: chosen.get(t, CANARY_PROFILES[t]) for t in tasks if t in CANARY_PROFILES} | chosen
    options = options or RunOptions()
    spec = RunSpec(model=str(model or canary_path()), kernel=kernel, tasks=tasks, profiles=chosen, limit=limit,
                   batch_size=batch_size, datasets=options.datasets)
    out = Path(out)
    if resume and (out / MANIFEST).is_file() and load_manifest(out / MANIFEST).status == "complete":
        return load_run(out)
    bar = None if progress else Progress(enabled=False, stream=io.StringIO())  # no lines in a notebook's output
    resume = resume and (out / MANIFEST).is_file()
    prepare_out(out, resume)  # the folder, then every task's data, checked before the model loads
    loaded = load_tasks(spec)
    return load_run(execute(spec, out, in_process_adapter(spec, options), resume=resume, progress=bar, tasks=loaded))


def decide(baseline, candidate, thresholds=None, allow_uncalibrated: bool = False) -> Verdict:
    """The gate's verdict from stored runs: ``baseline`` a folder or a list of per-task baseline folders."""
    cand = candidate if isinstance(candidate, Run) else load_run(candidate)
    return decide_pair(_stored(baseline), cand, _policy(thresholds, cand), allow_uncalibrated)


__all__ = ["Comparison", "Explanation", "Run", "compare", "decide", "find_baselines", "load_run", "run_kernel",
           "summary_line"]
