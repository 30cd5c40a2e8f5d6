"""The whole flow from a model: find the stored baselines first, run only what is missing, compare, decide.

Used by `evalgate gate` (with a model or server) and `evalgate calibrate`.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from evalgate.errors import UserError
from evalgate.gate.compare import compare
from evalgate.gate.decide import decide, gate_runs
from evalgate.gate.policy import load_thresholds
from evalgate.gate.verdict import Verdict
from evalgate.run.baselines import (ROOT_ENV, answer_lengths, find_stored_baseline, lookup_roots, record, user_root,
                                    write_aa)
from evalgate.run.runner import RunSpec, execute, load_task
from evalgate.run.store import MANIFEST, load_run
from evalgate.tasks import get_task


def planned_profile_ids(spec: RunSpec) -> dict[str, str]:
    """task -> the profile id a run of ``spec`` will have (loads data, not the model)."""
    from evalgate.tasks.data import resolve_data_dir

    data_dir = resolve_data_dir(spec.data_dir)
    ids = {}
    for name in spec.tasks:
        _, resolved = load_task(get_task(name), spec, data_dir)  # the same profile id execute() will record
        ids[name] = resolved.profile_id
    return ids


def model_fingerprint_of(spec: RunSpec, adapter=None) -> str:
    """The local checkpoint's fingerprint, or what a server adapter reports (a server has no local folder)."""
    if adapter is not None:
        return adapter.info()["fingerprint"]
    from evalgate.model_adapters.fingerprint import model_fingerprint
    from evalgate.model_adapters.hf import check_model_dir

    return model_fingerprint(check_model_dir(spec.model))["fingerprint"]


def stored_baselines(spec: RunSpec, kernel: str, root: Path | None = None, adapter=None,
                     packaged: bool = True) -> dict[str, Path | None]:
    """task -> its stored baseline or None: the user's root first, then (``packaged``) the canary's baselines
    shipped in the package. ``calibrate`` looks in the user's root only: it writes next to what it finds."""
    fingerprint = model_fingerprint_of(spec, adapter)
    roots = lookup_roots(root) if packaged else [user_root(root)]
    return {task: find_stored_baseline(roots, fingerprint, pid, kernel) for task, pid in planned_profile_ids(spec).items()}


def _stamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def run_or_resume(spec: RunSpec, out: Path, adapter=None, stop_when=None,
                  expected_tokens: dict[str, dict] | None = None) -> Path:
    """A complete run in ``out`` is reused, a partial one resumed, otherwise a new one is started.

    ``stop_when``: the gate's early-stop hook (``evalgate.gate.early_stop.EarlyStop``; None: every item runs).
    A run the gate stopped early is resumed like an interrupted one — to completion without the hook, or
    until the hook stops it (at once, when what is stored already decides). ``expected_tokens``: the
    baselines' answer lengths (``baselines.answer_lengths``), for the decoding schedule only."""
    if (out / MANIFEST).is_file():
        if load_run(out).manifest.get("status") == "complete":
            return out
        return execute(spec, out, resume=True, adapter=adapter, stop_when=stop_when, expected_tokens=expected_tokens)
    return execute(spec, out, adapter=adapter, stop_when=stop_when, expected_tokens=expected_tokens)


def early_stop_hook(baselines: list[Path], thresholds_path: str | None, allow_uncalibrated: bool,
                    on_conformance: bool = True):
    """The gate's early-stop monitor (docs/gate.md#stopping-early) against these baselines; None when they
    cannot be read (the gate itself then says why). ``on_conformance`` False: a failed kernel conformance
    check does not stop the run, only a certain accuracy FAIL does."""
    from evalgate.gate.early_stop import EarlyStop

    try:
        return EarlyStop(baselines, thresholds_path, allow_uncalibrated, on_conformance)
    except (UserError, OSError, ValueError):
        return None


def gate_out(kernel: str) -> Path:
    return Path("results/runs") / f"gate-{_stamp()}-{kernel.replace('/', '_')}"


def gate_model(spec: RunSpec, baseline_kernel: str = "w4a8", root: Path | None = None, out: Path | None = None,
               thresholds_path: str | None = None, allow_uncalibrated: bool = False,
               adapter=None, early_stop: bool = True, stop_on_conformance: bool = True) -> tuple[Verdict, Path]:
    """Find the stored baselines, run (or resume) the candidate into ``out``, decide. ``early_stop`` (the
    default): stop generating once the gate's FAIL is certain whatever the items not yet run give
    (docs/gate.md#stopping-early); False runs every item. ``stop_on_conformance`` False: a kernel that fails
    its conformance check still runs until its accuracy FAIL is certain (what ``evalgate selfcheck`` measures)."""
    load_thresholds(thresholds_path)  # a bad policy file fails before anything runs
    baselines = stored_baselines(spec, baseline_kernel, root, adapter)
    missing = [t for t, d in baselines.items() if d is None]
    if missing:
        # a sampled baseline must be sampled the same way
        sampled = ("" if spec.sampling().greedy else
                   f" --samples {spec.samples} --temperature {spec.temperature:g} --seed {spec.seed}")
        how = (f"`evalgate calibrate --model {spec.model} --kernel {baseline_kernel}{sampled}` (runs it twice and "
               "records it)" if adapter is None else
               f"`evalgate calibrate --server URL --kernel {baseline_kernel}{sampled}` (or --launch ENGINE; runs it "
               "twice on the server and records it)")
        raise UserError(f"no stored {baseline_kernel} baseline for this model and the {', '.join(missing)} profile(s) "
                        f"under {user_root(root)} (nor packaged with the canary); create one with {how}, or point "
                        f"--baselines-root or ${ROOT_ENV} at the folder that holds it")
    out = out or gate_out(spec.kernel)
    dirs = [baselines[t] for t in spec.tasks]
    hook = early_stop_hook(dirs, thresholds_path, allow_uncalibrated, stop_on_conformance) if early_stop else None
    run_dir = run_or_resume(spec, out, adapter, stop_when=hook, expected_tokens=answer_lengths(dirs))
    verdict = gate_runs(dirs, run_dir, thresholds_path, allow_uncalibrated)
    return verdict, run_dir


def calibration_stamp() -> str:
    """The time stamp that names one calibration's runs (and a launched server's log folder)."""
    return _stamp()


def calibrate(spec: RunSpec, root: Path | None = None, runs_dir: Path = Path("results/runs"),
              thresholds_path: str | None = None, second_batch_size: int | None = None, adapter=None,
              stamp: str | None = None) -> dict:
    """A/A: the baseline kernel twice (the second time with the items in reverse order and another batch
    size in-process, or half the concurrency on a server). Records the first run as the baseline if none is
    stored, then stores ψ0, Δ̂0, the flip set and the A/A verdict next to each task's baseline.

    ``adapter`` (a server adapter) runs both on that server: the second run reversed, as in-process."""
    import copy

    thresholds = load_thresholds(thresholds_path)
    root = user_root(root)  # never the packaged canary baselines: they are read-only
    baselines = stored_baselines(spec, spec.kernel, root, adapter, packaged=False)
    stamp = stamp or _stamp()
    name = f"calibrate-{stamp}-{spec.kernel.replace('/', '_')}"
    if any(d is None for d in baselines.values()):
        first = run_or_resume(spec, runs_dir / f"{name}-A", adapter=adapter)
        todo = [t for t, d in baselines.items() if d is None]
        for path in record(first, root, tasks=todo):
            baselines[load_run(path).tasks[0]] = path
    from dataclasses import replace

    other = second_batch_size or (spec.batch_size * 2 if spec.batch_size < 8 else max(1, spec.batch_size // 2))
    second_spec = replace(spec, batch_size=other, order="reverse")
    second_adapter = adapter
    second_run = {"batch_size": other, "order": "reverse"}
    if adapter is not None:
        second_adapter = copy.copy(adapter)
        second_adapter.concurrency = max(1, adapter.concurrency // 2)
        second_run = {"batch_size": other, "order": "reverse", "concurrency": second_adapter.concurrency,
                      "server": adapter.url}
    second = run_or_resume(second_spec, runs_dir / f"{name}-B", adapter=second_adapter)
    results = {}
    for task, base_dir in baselines.items():
        cmp = compare(base_dir, second, tasks=[task], metrics={task: thresholds.task(task).metric})
        verdict = decide(cmp, thresholds, require_aa=False)
        dec = verdict.decision.tasks[task]
        # an item flips when its score moves (k > 1: the mean over its samples, not "all samples right")
        flips = [d for d, b, c in zip(cmp.pairs[task].doc_ids, cmp.pairs[task].scores("base"),
                                      cmp.pairs[task].scores("cand")) if b != c]
        entry = {"psi0": dec.flip_rate, "delta0": dec.delta, "n": dec.counts.n, "b": dec.counts.b,
                 "c": dec.counts.c, "flips": flips, "verdict": dec.verdict, "reasons": list(dec.reasons),
                 "second_run": {"path": str(second), **second_run},
                 "first_batch_size": load_run(base_dir).manifest.get("spec", {}).get("batch_size")}
        aa = {"tasks": {task: entry}, "thresholds_sha256": thresholds.sha256,
              "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        write_aa(base_dir, aa, second)
        results[task] = {**entry, "baseline": str(base_dir)}
    return results
