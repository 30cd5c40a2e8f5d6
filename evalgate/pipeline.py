"""The whole flow from a plan: run (or resume) what is missing, decide; and the A/A calibration.

``gate(plan, adapter)`` runs a ``evalgate.plan.GatePlan`` (``evalgate gate``, ``evalgate selfcheck``, the
Python API); ``calibrate`` records a baseline and its A/A record (``evalgate calibrate``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from evalgate.gate.compare import compare
from evalgate.gate.decide import decide, gate_runs
from evalgate.gate.policy import Thresholds
from evalgate.gate.verdict import Verdict
from evalgate.plan import GatePlan, find_baselines, local_fingerprint, plan_gate, stamp
from evalgate.run.baselines import record, user_root, write_aa
from evalgate.run.observer import Collected, RunObserver
from evalgate.run.runner import LoadedTask, RunSpec, execute, load_tasks
from evalgate.run.store import MANIFEST, Run, load_run
from evalgate.types import ModelAdapter


def run_or_resume(spec: RunSpec, out: Path, adapter: ModelAdapter | None = None, observer: RunObserver | None = None,
                  tasks: Mapping[str, LoadedTask] | None = None,
                  expected_tokens: dict[str, dict] | None = None) -> Run:
    """A complete run in ``out`` is reused, a partial one resumed, otherwise a new one is started; returns
    the run as stored, handed over by the runner (nothing it wrote is read back).

    ``observer``: the gate's early stop (``evalgate.gate.early_stop.EarlyStop``; None: every item runs). A
    run the gate stopped early is resumed like an interrupted one — to completion without it, or until it
    stops the run (at once, when what is stored already decides). ``expected_tokens``: the baselines' answer
    lengths, for the decoding schedule only."""
    if (out / MANIFEST).is_file():
        stored = load_run(out)
        if stored.manifest.get("status") == "complete":
            return stored
    watcher = observer if observer is not None else Collected()
    execute(spec, out, resume=(out / MANIFEST).is_file(), adapter=adapter, observer=watcher,
            expected_tokens=expected_tokens, tasks=dict(tasks) if tasks is not None else None)
    return watcher.run


def gate(plan: GatePlan, adapter: ModelAdapter | None = None) -> Verdict:
    """Run the plan's candidate (or take its stored one) and decide against its baseline with its policy.
    ``adapter``: a server adapter (None: the in-process model of ``plan.spec``)."""
    from evalgate.gate.early_stop import EarlyStop

    candidate = plan.candidate
    if candidate is None:
        observer = (EarlyStop(plan.baseline, plan.policy, plan.allow_uncalibrated, plan.stop_on_conformance)
                    if plan.early_stop else None)
        candidate = run_or_resume(plan.spec, plan.out, adapter, observer, plan.tasks, plan.baseline.answer_lengths)
    return gate_runs(plan.baseline, candidate, plan.policy, plan.allow_uncalibrated)


def gate_model(spec: RunSpec, baseline_kernel: str = "w4a8", root: Path | None = None, out: Path | None = None,
               thresholds_path: str | None = None, allow_uncalibrated: bool = False,
               adapter: ModelAdapter | None = None, early_stop: bool = True,
               stop_on_conformance: bool = True) -> tuple[Verdict, Path]:
    """Plan and run one gate of ``spec`` against its stored baseline (``evalgate selfcheck``'s rows, the
    API): the verdict and the candidate's run folder."""
    fingerprint = adapter.info()["fingerprint"] if adapter is not None else None
    plan = plan_gate(spec=spec, baseline_kernel=baseline_kernel, baselines_root=root, thresholds=thresholds_path,
                     out=out, allow_uncalibrated=allow_uncalibrated, early_stop=early_stop,
                     stop_on_conformance=stop_on_conformance, fingerprint=fingerprint, served=adapter is not None)
    return gate(plan, adapter), plan.out


def calibration_stamp() -> str:
    """The time stamp that names one calibration's runs (and a launched server's log folder)."""
    return stamp()


def calibrate(spec: RunSpec, root: Path | None = None, runs_dir: Path = Path("results/runs"),
              thresholds_path: Thresholds | str | Path | None = None, second_batch_size: int | None = None,
              adapter: ModelAdapter | None = None, stamp: str | None = None) -> dict:
    """A/A: the baseline kernel twice (the second time with the items in reverse order and another batch
    size in-process, or half the concurrency on a server). Records the first run as the baseline if none is
    stored, then stores ψ0, Δ̂0, the flip set and the A/A verdict next to each task's baseline.

    ``adapter`` (a server adapter) runs both on that server: the second run reversed, as in-process."""
    import copy

    from evalgate.gate.policy import load_thresholds

    thresholds = thresholds_path if isinstance(thresholds_path, Thresholds) else load_thresholds(thresholds_path)
    tasks = load_tasks(spec)
    root = user_root(root)  # never the packaged canary baselines: they are read-only
    fingerprint = adapter.info()["fingerprint"] if adapter is not None else local_fingerprint(spec.model)
    baselines = find_baselines(fingerprint, {t: lt.profile_id for t, lt in tasks.items()}, spec.kernel, root,
                               packaged=False)
    stamp = stamp or calibration_stamp()
    name = f"calibrate-{stamp}-{spec.kernel.replace('/', '_')}"
    if any(d is None for d in baselines.values()):
        first = run_or_resume(spec, runs_dir / f"{name}-A", adapter=adapter, tasks=tasks)
        todo = [t for t, d in baselines.items() if d is None]
        for path in record(first.path, root, tasks=todo):
            baselines[load_run(path).tasks[0]] = path
    other = second_batch_size or (spec.batch_size * 2 if spec.batch_size < 8 else max(1, spec.batch_size // 2))
    second_spec = replace(spec, batch_size=other, order="reverse")
    second_adapter = adapter
    second_run = {"batch_size": other, "order": "reverse"}
    if adapter is not None:
        second_adapter = copy.copy(adapter)
        second_adapter.concurrency = max(1, adapter.concurrency // 2)
        second_run = {"batch_size": other, "order": "reverse", "concurrency": second_adapter.concurrency,
                      "server": adapter.url}
    second = run_or_resume(second_spec, runs_dir / f"{name}-B", adapter=second_adapter, tasks=tasks)
    results = {}
    for task, base_dir in baselines.items():
        base = load_run(base_dir)
        cmp = compare(base, second, tasks=[task], metrics={task: thresholds.task(task).metric})
        verdict = decide(cmp, thresholds, require_aa=False)
        dec = verdict.decision.tasks[task]
        # an item flips when its score moves (k > 1: the mean over its samples, not "all samples right")
        flips = [d for d, b, c in zip(cmp.pairs[task].doc_ids, cmp.pairs[task].scores("base"),
                                      cmp.pairs[task].scores("cand")) if b != c]
        entry = {"psi0": dec.flip_rate, "delta0": dec.delta, "n": dec.counts.n, "b": dec.counts.b,
                 "c": dec.counts.c, "flips": flips, "verdict": dec.verdict, "reasons": list(dec.reasons),
                 "second_run": {"path": str(second.path), **second_run},
                 "first_batch_size": base.manifest.get("spec", {}).get("batch_size")}
        aa = {"tasks": {task: entry}, "thresholds_sha256": thresholds.sha256,
              "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        write_aa(base_dir, aa, second.path)
        results[task] = {**entry, "baseline": str(base_dir)}
    return results
