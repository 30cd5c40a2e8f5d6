"""The whole flow from a plan: run (or resume) what is missing, decide; and the A/A calibration.

``gate(plan, adapter)`` runs a ``evalgate.plan.GatePlan`` (``evalgate gate``, ``evalgate selfcheck``, the
Python API); ``calibrate`` records a baseline and its A/A record (``evalgate calibrate``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from evalgate.gate.compare import compare
from evalgate.gate.decide import decide
from evalgate.gate.policy import Thresholds
from evalgate.gate.verdict import Verdict
from evalgate.plan import GatePlan, GateRequest, find_baselines, local_fingerprint, plan_gate, stamp
from evalgate.run.baselines import StoredBaseline, read_aa, record, user_root, write_aa
from evalgate.run.observer import Collected, RunObserver
from evalgate.run.options import RunOptions
from evalgate.run.runner import execute, prepare_out
from evalgate.run.spec import LoadedTask, RunSpec, load_tasks, with_sampling
from evalgate.records import RunManifest, load_manifest
from evalgate.run.store import MANIFEST, Run, load_run
from evalgate.types import ModelAdapter


def run_or_resume(spec: RunSpec, out: Path, adapter: ModelAdapter | None = None, observer: RunObserver | None = None,
                  tasks: Mapping[str, LoadedTask] | None = None,
                  expected_tokens: dict[str, dict] | None = None, options: RunOptions | None = None) -> Run:
    """A complete run in ``out`` is reused, a partial one resumed, otherwise a new one is started; returns
    the run as stored, handed over by the runner (nothing it wrote is read back).

    ``observer``: the gate's early stop (``evalgate.gate.early_stop.EarlyStop``; None: every item runs). A
    run the gate stopped early is resumed like an interrupted one — to completion without it, or until it
    stops the run (at once, when what is stored already decides). ``expected_tokens``: the baselines' answer
    lengths, for the decoding schedule only. ``options``: how the in-process model loads (--device-map,
    --threads)."""
    if (out / MANIFEST).is_file():
        meta = load_manifest(out / MANIFEST)  # the status first: the records are read once, by whoever needs them
        if meta.status == "complete":
            return load_run(out, meta)
    watcher = observer if observer is not None else Collected()
    resume = (out / MANIFEST).is_file()
    if adapter is None:  # the in-process model, loaded once the folder and every task's data are checked
        prepare_out(out, resume)
        tasks = tasks if tasks is not None else load_tasks(spec)
        adapter = in_process_adapter(spec, options)
    execute(spec, out, adapter, resume=resume, observer=watcher, expected_tokens=expected_tokens,
            tasks=dict(tasks) if tasks is not None else None)
    return watcher.run  # type: ignore[attr-defined]  # (Collected and EarlyStop keep the finished run)


def in_process_adapter(spec: RunSpec, options: RunOptions | None = None) -> ModelAdapter:
    """``spec``'s model loaded in this process with its kernel: the adapter of every run without a server;
    ``options``: its device map and threads (--device-map, --threads)."""
    from evalgate.model_adapters.hf.adapter import HFAdapter  # torch and transformers: only once a model loads

    return HFAdapter(spec.model, spec.kernel, device=spec.device, dtype=spec.dtype, batch_size=spec.batch_size,
                     **(options or RunOptions()).loader_kwargs())


ROUND_TEMPERATURE = 0.2  # the rounds' temperature when the plan's own run is greedy: pass@1's convention (Chen et al. 2021)


def gate(plan: GatePlan, adapter: ModelAdapter | None = None) -> Verdict:
    """Run the plan's candidate (or take its stored one) and decide against its baseline with its policy;
    while a task is undecided and ``plan.max_samples`` allows, add coupled samples per item in rounds
    (docs/gate.md#sequential-rounds). Every decision is one look of the candidate's sequence against this
    baseline, at α·2^-(look+1) (docs/gate.md#reruns). ``adapter``: a server adapter (None: the in-process
    model of ``plan.spec``)."""
    from evalgate.gate.early_stop import EarlyStop

    candidate = plan.candidate
    if candidate is None:
        # stopped for at the α of the look the run will take (read when the run starts: its manifest names
        # the candidate); certain there, so certain at any earlier look's larger α too
        observer = (EarlyStop(plan.baseline, plan.policy, plan.allow_uncalibrated, plan.stop_on_conformance,
                              plan.across_serving, look_of=lambda manifest: _next_look(plan, manifest))
                    if plan.early_stop else None)
        assert plan.spec is not None and plan.out is not None  # (a plan holds a spec or a candidate)
        candidate = run_or_resume(plan.spec, plan.out, adapter, observer, plan.tasks, plan.baseline.answer_lengths,
                                  options=plan.options)
    verdict = decide_look(plan, plan.baseline, candidate)
    if plan.spec is None or verdict.decision is None or verdict.verdict != "INCONCLUSIVE":
        return verdict
    return _rounds(plan, adapter, verdict)


def gate_explanations(verdict: Verdict, report_dir: Path, replay: bool):
    """Why each flip flipped, for the gate's outputs (docs/explain.md#from-the-gate): replayed now when
    ``replay`` (``--explain``), else what a gate.json in ``report_dir`` already holds for the same two runs (a
    report rewritten from the stored run keeps them; nothing is replayed), else None. The explainer loads
    both kernels' models itself: the gate's own model is the runner's, and the baseline kernel's never loads."""
    from evalgate.explain import explain_flips
    from evalgate.report.explained import stored_explanations

    return explain_flips(verdict) if replay else stored_explanations(report_dir, verdict)


def _next_look(plan: GatePlan, manifest: RunManifest) -> int:
    """The look a candidate with this manifest would take next (read, not allocated)."""
    from evalgate.gate.sequence import Looks

    tasks = list(manifest.tasks)
    with Looks.held(plan.baseline.dirs, manifest, tasks, None) as looks:
        return looks.next_look


def decide_look(plan: GatePlan, baseline: StoredBaseline, candidate: Run, round_note: str = "") -> Verdict:
    """Decide one look through the one door (``evalgate.gate.door.decide_pair``): at the candidate's next
    look, unless its data reproduce an earlier look's (then that look's α and verdict); recorded with the
    plan's baseline (a round's sampled baseline included)."""
    from evalgate.gate.door import decide_pair

    return decide_pair(baseline, candidate, plan.policy, plan.allow_uncalibrated, plan.items, plan.across_serving,
                       sequence_of=plan.baseline, round_note=round_note, baselines_root=plan.baselines_root)


def next_samples(k: int, open_decisions, max_samples: int) -> int | None:
    """The next round's samples per item: 4 after a greedy look, else double, or more where the measured
    within-item variance says more are needed; at most ``max_samples`` (None: the budget is spent)."""
    if k >= max_samples:
        return None
    proposal = 4 if k == 1 else 2 * k
    measured = [d.resolution.samples_needed for d in open_decisions
                if d.resolution.samples_needed is not None and not d.resolution.samples_needed_is_bound]
    if measured:
        proposal = max(proposal, max(measured))
    return min(proposal, max_samples)


def _round_baseline(plan: GatePlan, spec: RunSpec, tasks, adapter, out: Path):
    """The baseline sampled as ``spec``: a stored one (``evalgate calibrate --samples k --temperature T
    --seed S``), else, in-process, the baseline kernel run in this round; None for a server without one."""
    from evalgate.run.baselines import load_stored_baseline, lookup_roots

    fingerprint = plan.baseline.run.meta.model.fingerprint
    stored, missing = load_stored_baseline(lookup_roots(plan.baselines_root), fingerprint,
                                           {t: lt.profile_id for t, lt in tasks.items()}, plan.baseline.run.kernel)
    if stored is not None:
        return stored
    if adapter is not None:
        return None
    run = run_or_resume(replace(spec, kernel=plan.baseline.run.kernel), out, tasks=tasks, options=plan.options)
    # the A/A check of the stack stands from the greedy baseline's record (keyed samples on canonical numerics
    # reproduce every sample: the sampled A/A flips nothing)
    aa = {t: {"verdict": a.get("verdict"), "flips": set(), "runs": a.get("runs"), "n": a.get("n"),
              "psi0": 0.0, "note": "the greedy baseline's A/A record; sampled with the same keys"}
          for t, a in plan.baseline.aa.items() if t in tasks}
    return StoredBaseline((run.path,), run, aa)


def baseline_seed(baseline) -> int:
    """The sampler's run seed the rounds use: the baseline's recorded one. Every sample's key is then fixed by
    the baseline (item, sample index, this seed): no flag of the candidate's gives fresh draws."""
    seed = getattr(baseline.run.meta.spec, "seed", None)  # the RunSpec's (open: an older run's has none)
    return seed if isinstance(seed, int) and seed >= 0 else 0


def _rounds(plan: GatePlan, adapter, verdict: Verdict) -> Verdict:
    """Add coupled samples per item to the undecided tasks, one look per round, until every task is decided
    or ``plan.max_samples`` is reached. The verdict returned is the first look's, with each task's decision
    replaced by the look that decided it."""
    from evalgate.gate.verdict import EXIT_CODES, OverallDecision, overall_verdict

    assert plan.spec is not None and plan.out is not None and verdict.decision is not None  # (gate: a run, decided)
    k = plan.spec.samples
    temperature = plan.spec.temperature or ROUND_TEMPERATURE
    tasks = dict(verdict.decision.tasks)
    looks = list(verdict.sequence["looks"]) if verdict.sequence else []
    notes = list(verdict.notes)
    while overall_verdict(d.outcome.verdict for d in tasks.values()) == "INCONCLUSIVE":
        open_tasks = [t for t, d in tasks.items() if d.outcome.verdict == "INCONCLUSIVE"]
        k_next = next_samples(k, [tasks[t] for t in open_tasks], plan.max_samples)
        if k_next is None:
            break
        spec = replace(plan.spec, tasks=open_tasks, samples=k_next, temperature=temperature,
                       seed=baseline_seed(plan.baseline))
        if plan.spec.sampling().greedy and all(t in plan.tasks for t in open_tasks):  # the items loaded once
            loaded = {t: with_sampling(plan.tasks[t], spec) for t in open_tasks}
        else:
            loaded = load_tasks(spec)
        out = plan.out / f"round-k{k_next}"
        baseline = _round_baseline(plan, spec, loaded, adapter, out / f"baseline-{plan.baseline.run.kernel.replace('/', '_')}")
        if baseline is None:
            notes.append(f"rounds stopped before k = {k_next}: no stored baseline sampled that way on this server; "
                         f"record one with `evalgate calibrate --server URL --kernel {plan.baseline.run.kernel} "
                         f"--samples {k_next} --temperature {temperature:g} --seed {spec.seed}`")
            break
        candidate = run_or_resume(spec, out / "candidate", adapter, None, loaded, options=plan.options)
        round_verdict = decide_look(plan, baseline, candidate, f" (round k = {k_next})")
        assert round_verdict.sequence is not None and round_verdict.decision is not None  # (a paired look)
        looks += round_verdict.sequence["looks"]
        notes += [n for n in round_verdict.notes if n.startswith("look ")]
        for task in open_tasks:
            tasks[task] = round_verdict.decision.tasks[task]
        k = k_next
    final = overall_verdict(d.outcome.verdict for d in tasks.values())
    if len(looks) > 1:
        decided_at = {t: next((x["look"] for x in reversed(looks) if t in x["tasks"]), 0) for t in tasks}
        notes.append("decided in rounds: " + "; ".join(
            f"{t} {d.outcome.verdict} at look {decided_at[t] + 1} (k = {d.statistics.n_samples})" for t, d in tasks.items()))
    old = verdict.decision
    reasons = tuple(f"{t}: {r}" for t, d in tasks.items() if d.outcome.verdict == final for r in d.outcome.reasons) \
        or old.reasons
    if final == "PASS":
        reasons = (f"all {len(tasks)} task(s) passed",)
    decision = OverallDecision(final, tasks, reasons,
                               tuple(f"{t}: {w}" for t, d in tasks.items() for w in d.outcome.warnings),
                               old.alpha, old.multiple_comparisons)
    sequence = {**(verdict.sequence or {}), "looks": looks}
    return replace(verdict, verdict=final if verdict.verdict != "FAIL" else "FAIL",
                   exit_code=EXIT_CODES[final if verdict.verdict != "FAIL" else "FAIL"], decision=decision,
                   notes=notes, sequence=sequence)


def gate_model(spec: RunSpec, baseline_kernel: str = "w4a8", root: str | Path | None = None, out: Path | None = None,
               thresholds: Thresholds | None = None, allow_uncalibrated: bool = False,
               adapter: ModelAdapter | None = None, early_stop: bool = True,
               stop_on_conformance: bool = True, options: RunOptions | None = None) -> tuple[Verdict, Path]:
    """Plan and run one gate of ``spec`` against its stored baseline (``evalgate selfcheck``'s rows, the
    API): the verdict and the candidate's run folder. ``thresholds``: a parsed policy, or None for the
    resolver's choice (the plan's)."""
    fingerprint = adapter.info()["fingerprint"] if adapter is not None else None
    plan = plan_gate(GateRequest(spec=spec, baseline_kernel=baseline_kernel, baselines_root=root,
                                 thresholds=thresholds, out=out, allow_uncalibrated=allow_uncalibrated,
                                 early_stop=early_stop, stop_on_conformance=stop_on_conformance,
                                 fingerprint=fingerprint, served=adapter is not None,
                                 options=options or RunOptions()))
    assert plan.out is not None  # (a plan of a spec has its run folder)
    return gate(plan, adapter), plan.out


def calibration_stamp() -> str:
    """The time stamp that names one calibration's runs (and a launched server's log folder)."""
    return stamp()


def _with_earlier_runs(entry: dict, earlier: dict | None, task: str) -> dict:
    """This A/A run's record, keeping the earlier runs of the same baseline in ``runs`` (the gate pools them
    and counts them against ``min_aa_runs``); a failed earlier pair keeps the record failed."""
    this = {key: entry[key] for key in ("psi0", "n", "b", "c", "verdict")}
    before = ((earlier or {}).get("tasks") or {}).get(task)
    if not before:
        return {**entry, "runs": [this]}
    runs = before.get("runs") or [{key: before.get(key) for key in ("psi0", "n", "b", "c", "verdict")}]
    verdict = "FAIL" if any(r.get("verdict") == "FAIL" for r in runs) else entry["verdict"]
    flips = [f for f in entry["flips"]] + [f for f in before.get("flips", []) if str(f) not in set(map(str, entry["flips"]))]
    return {**entry, "verdict": verdict, "flips": flips, "runs": [*runs, this]}


def calibrate(spec: RunSpec, thresholds: Thresholds, root: Path | None = None, runs_dir: Path = Path("results/runs"),
              second_batch_size: int | None = None,
              adapter: ModelAdapter | None = None, stamp: str | None = None,
              options: RunOptions | None = None) -> dict:
    """A/A: the baseline kernel twice (the second time with the items in reverse order and another batch
    size in-process, or half the concurrency on a server). Records the first run as the baseline if none is
    stored, then stores ψ0, Δ̂0, the flip set and the A/A verdict next to each task's baseline.

    ``adapter`` (a server adapter) runs both on that server: the second run reversed, as in-process.
    ``options``: how the in-process model loads (--device-map, --threads). ``thresholds``: the policy, as the
    edge resolved it (each task's metric)."""
    import copy

    tasks = load_tasks(spec)
    root = user_root(root)  # never the packaged canary baselines: they are read-only
    fingerprint = adapter.info()["fingerprint"] if adapter is not None else local_fingerprint(spec.model)
    baselines = find_baselines(fingerprint, {t: lt.profile_id for t, lt in tasks.items()}, spec.kernel, root,
                               packaged=False)
    stamp = stamp or calibration_stamp()
    name = f"calibrate-{stamp}-{spec.kernel.replace('/', '_')}"
    if any(d is None for d in baselines.values()):
        first = run_or_resume(spec, runs_dir / f"{name}-A", adapter=adapter, tasks=tasks, options=options)
        todo = [t for t, d in baselines.items() if d is None]
        for path in record(first.path, root, tasks=todo):
            baselines[load_run(path).tasks[0]] = path
    other = second_batch_size or (spec.batch_size * 2 if spec.batch_size < 8 else max(1, spec.batch_size // 2))
    second_spec = replace(spec, batch_size=other, order="reverse")
    second_adapter = adapter
    second_run = {"batch_size": other, "order": "reverse"}
    if adapter is not None:
        server: Any = adapter  # a server's adapter (model_adapters.server): its concurrency and URL
        second_adapter = copy.copy(server)
        second_adapter.concurrency = max(1, server.concurrency // 2)
        second_run = {"batch_size": other, "order": "reverse", "concurrency": second_adapter.concurrency,
                      "server": server.url}
    second = run_or_resume(second_spec, runs_dir / f"{name}-B", adapter=second_adapter, tasks=tasks, options=options)
    results = {}
    for task, base_dir in baselines.items():
        assert base_dir is not None  # (each task's baseline found or recorded above)
        base = load_run(base_dir)
        cmp = compare(base, second, tasks=[task], metrics={task: thresholds.task(task).metric})
        verdict = decide(cmp, thresholds, require_aa=False)
        assert verdict.decision is not None  # (a paired comparison)
        dec = verdict.decision.tasks[task]
        # an item flips when its score moves (k > 1: the mean over its samples, not "all samples right")
        flips = [d for d, b, c in zip(cmp.pairs[task].doc_ids, cmp.pairs[task].scores("base"),
                                      cmp.pairs[task].scores("cand")) if b != c]
        stats = dec.statistics
        entry = {"psi0": stats.flip_rate, "delta0": stats.delta, "n": stats.counts.n, "b": stats.counts.b,
                 "c": stats.counts.c, "flips": flips, "verdict": dec.outcome.verdict, "reasons": list(dec.outcome.reasons),
                 "second_run": {"path": str(second.path), **second_run},
                 "first_batch_size": base.meta.spec.batch_size if base.meta.spec is not None else None}
        entry = _with_earlier_runs(entry, read_aa(base_dir), task)
        aa = {"tasks": {task: entry}, "thresholds_sha256": thresholds.sha256,
              "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        write_aa(base_dir, aa, second.path)
        results[task] = {**entry, "baseline": str(base_dir)}
    return results
