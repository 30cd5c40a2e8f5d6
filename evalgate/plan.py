"""The gate plan: one gate's inputs, read and checked once, before anything runs.

``plan_gate`` turns a command's ``GateRequest`` into a frozen ``GatePlan`` — the run spec and its loaded tasks,
the parsed policy, the stored baseline (records and A/A record), the output folders, how the run is carried
out (``RunOptions``: device map, threads, datasets, deterministic mode) — and
``evalgate.pipeline.gate(plan, adapter)`` runs it, for every branch (in-process model, server, stored
candidate). Nothing downstream opens the policy file, the task data or a baseline file again.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from evalgate.errors import UserError
from evalgate.canary import scored_as_canary
from evalgate.gate.policy import Thresholds, resolve_policy
from evalgate.run.options import RunOptions
from evalgate.run.baselines import (ROOT_ENV, StoredBaseline, could_be_stored, find_stored_baseline,
                                    load_baseline, load_stored_baseline, lookup_roots, user_root)
from evalgate.run.spec import LoadedTask, RunSpec, load_tasks, with_overrides
from evalgate.run.store import Run

RUNS_DIR = Path("results/runs")
# the most samples per item the gate's rounds go to (docs/gate.md#sequential-rounds: chosen from
# benchmarks/simulate_gate.py, where k = 8 coupled samples decide ≥ 99% of healthy HumanEval kernels at ψ = 6%)
DEFAULT_MAX_SAMPLES = 8


@dataclass(frozen=True)
class GatePlan:
    """Everything one gate decides from. Either ``spec`` (a candidate to run, or resume, into ``out``) or
    ``candidate`` (a stored run) is set."""

    policy: Thresholds
    baseline: StoredBaseline
    report_dir: Path
    allow_uncalibrated: bool = False
    spec: RunSpec | None = None
    tasks: Mapping[str, LoadedTask] = field(default_factory=lambda: MappingProxyType({}))
    out: Path | None = None
    early_stop: bool = True  # stop generating once the FAIL is certain (docs/gate.md#stopping-early)
    stop_on_conformance: bool = True  # False: a kernel failing conformance runs until its accuracy FAIL is certain
    candidate: Run | None = None
    # sequential rounds (docs/gate.md#sequential-rounds): while undecided, add coupled samples per item up to this
    max_samples: int = DEFAULT_MAX_SAMPLES
    baselines_root: Path | None = None  # where sampled baselines are looked up for the rounds
    items: str = "all"  # "candidate": decide on the stored candidate's items only (gate.subset)
    across_serving: bool = False  # compare although the servers differ in serving identity (said in the verdict)
    options: RunOptions = field(default_factory=RunOptions)  # how the candidate (and a round's baseline) run: device map, threads, ...


@dataclass(frozen=True)
class GateRequest:
    """What a gate is asked, as a command or a notebook gives it; ``plan_gate`` reads and checks it into a
    ``GatePlan``. Either ``spec`` (a candidate to run into ``out``; ``tasks``: its tasks already loaded, e.g.
    to start their preparation early; ``fingerprint``: the served model's when ``served``, else the local
    checkpoint's is computed) or ``candidate`` (a stored run to decide from). ``baselines``: baseline folders
    (default: the stored ``baseline_kernel`` baseline for the model and the tasks' profiles, under
    ``baselines_root``, else the canary's packaged ones). ``items="candidate"``: decide a stored candidate on
    its own items (the stored baseline found by profile name where the ids differ, e.g. a ``--limit`` run)."""

    spec: RunSpec | None = None
    candidate: Run | None = None
    tasks: Mapping[str, LoadedTask] | None = None
    fingerprint: str | None = None
    served: bool = False
    baselines: tuple = ()
    baseline_kernel: str = "w4a8"
    baselines_root: str | Path | None = None
    thresholds: Thresholds | None = None  # parsed at the edge (--thresholds); None: the resolver picks by profiles
    out: str | Path | None = None
    report_dir: str | Path | None = None
    allow_uncalibrated: bool = False
    early_stop: bool = True
    stop_on_conformance: bool = True
    max_samples: int | None = None
    items: str = "all"
    across_serving: bool = False
    options: RunOptions = field(default_factory=RunOptions)


def stamp() -> str:
    """The time stamp that names a gate's or a calibration's runs."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def gate_out(kernel: str) -> Path:
    return RUNS_DIR / f"gate-{stamp()}-{kernel.replace('/', '_')}"


def local_fingerprint(model: str) -> str:
    """A local checkpoint's identity (config, headers, tokenizer: no weights loaded)."""
    from evalgate.model_adapters.hf.fingerprint import check_model_dir, model_fingerprint

    return model_fingerprint(check_model_dir(model))["fingerprint"]


def find_baselines(fingerprint: str, profile_ids: dict[str, str], kernel: str, root: Path | None = None,
                   packaged: bool = True) -> dict[str, Path | None]:
    """task -> its stored baseline or None: the user's root first, then (``packaged``) the canary's baselines
    shipped in the package. ``calibrate`` looks in the user's root only: it writes next to what it finds."""
    roots = lookup_roots(root) if packaged else [user_root(root)]
    return {task: find_stored_baseline(roots, fingerprint, pid, kernel) for task, pid in profile_ids.items()}


def planned_profile_ids(spec: RunSpec) -> dict[str, str]:
    """task -> the profile id a run of ``spec`` will have (loads the data, not the model)."""
    return {t: lt.profile_id for t, lt in load_tasks(spec).items()}


def stored_baselines(spec: RunSpec, kernel: str, root: Path | None = None,
                     packaged: bool = True) -> dict[str, Path | None]:
    """task -> the stored ``kernel`` baseline for ``spec``'s local model and task profiles, or None."""
    return find_baselines(local_fingerprint(spec.model), planned_profile_ids(spec), kernel, root, packaged)


def missing_stored_baselines(spec: RunSpec, loaded: Mapping[str, LoadedTask], kernel: str,
                             root: str | Path | None) -> None:
    """Raise the gate's own refusal when a local model's run would find no stored ``kernel`` baseline for a
    task: asked before the run's heavy imports (the plan asks again, and is what decides)."""
    root = Path(root) if root else None
    found = find_baselines(local_fingerprint(spec.model), {t: lt.profile_id for t, lt in loaded.items()}, kernel,
                           root)
    missing = [t for t, path in found.items() if path is None]
    if missing:
        raise _missing_baseline(spec, missing, kernel, root, False)


def _shaping_flags(spec: RunSpec, root: Path | None) -> str:
    """The calibrate flags that give the baseline this gate's profile ids (tasks, profiles, limit, token
    limit, data) and put it where this gate looks."""
    import shlex

    flags = ["--tasks", ",".join(spec.tasks)]
    flags += [f for task, name in spec.profiles.items() for f in ("--profile", f"{task}={name}")]
    flags += ["--limit", str(spec.limit)] if spec.limit else []
    flags += ["--max-new-tokens", str(spec.max_new_tokens)] if spec.max_new_tokens else []
    flags += ["--data-dir", str(spec.data_dir)] if spec.data_dir else []
    for task, chosen in (spec.datasets or {}).items():  # the same items: the user's own dataset and columns
        flags += ["--dataset", f"{task}={chosen['source']}"]
        flags += [f for field, column in chosen.get("columns", {}).items()
                  for f in ("--dataset", f"{task}.{field}={column}")]
    flags += ["--baselines-root", str(root)] if root else []
    return " " + shlex.join(flags)


def _missing_baseline(spec: RunSpec | None, missing: list[str], kernel: str, root: Path | None,
                      served: bool) -> UserError:
    if spec is None:
        how = f"`evalgate calibrate --model MODEL --kernel {kernel}` with the candidate's model and tasks"
    else:
        sampled = ("" if spec.sampling().greedy else  # a sampled baseline must be sampled the same way
                   f" --samples {spec.samples} --temperature {spec.temperature:g} --seed {spec.seed}")
        sampled += _shaping_flags(spec, root)  # the same items, profiles and data: the same profile ids
        how = (f"`evalgate calibrate --model {spec.model} --kernel {kernel}{sampled}` (runs it twice and "
               "records it)" if not served else
               f"`evalgate calibrate --server URL --kernel {kernel}{sampled}` (or --launch ENGINE; runs it "
               "twice on the server and records it)")
    return UserError(f"no stored {kernel} baseline for this model and the {', '.join(missing)} profile(s) "
                     f"under {user_root(root)} (nor packaged with the canary); create one with {how}, or point "
                     f"--baselines-root or ${ROOT_ENV} at the folder that holds it")


def no_baseline_possible(spec: RunSpec, kernel: str, root: str | Path | None) -> None:
    """The missing-baseline refusal before the task data are read (reading them through ``datasets`` takes
    seconds; a profile's id needs them): raised when no stored ``kernel`` baseline has the model, task, profile,
    settings, item count and decoding ``spec`` would have. Where one might, the data are read and the profile
    id decides (docs/runs.md#baselines)."""
    from evalgate.tasks import get_task, resolve_profile

    fingerprint = local_fingerprint(spec.model)
    roots = lookup_roots(root)
    sampling = spec.sampling()
    missing = [t for t in spec.tasks
               if not could_be_stored(roots, fingerprint, kernel, t,
                                      with_overrides(resolve_profile(get_task(t), spec.profiles.get(t)), spec),
                                      spec.limit, sampling)]
    if missing:
        raise _missing_baseline(spec, missing, kernel, Path(root) if root else None, False)


def planned_profiles(spec: RunSpec) -> dict[str, str]:
    """task -> the profile name a run of ``spec`` will use (no data read: the policy can be checked first)."""
    from evalgate.tasks import get_task, resolve_profile

    return {t: resolve_profile(get_task(t), spec.profiles.get(t)).name for t in spec.tasks}


def checked_policy(thresholds: Thresholds | None, profiles: Mapping[str, str | None]) -> Thresholds:
    """The gate's policy (the one resolver) checked against the tasks it will decide, before anything loads:
    every task has a section, written for the profile the task runs. UserError (one line) otherwise."""
    policy = resolve_policy(thresholds, canary=scored_as_canary(dict(profiles)))
    problems = []
    for task, profile in profiles.items():
        if task not in policy.tasks:
            problems.append(f"tasks.{task}: no section for task {task!r} (have: {', '.join(sorted(policy.tasks))})")
        elif policy.tasks[task].profile != profile:
            problems.append(f"tasks.{task}.profile is {policy.tasks[task].profile!r} but the {task} runs use "
                            f"{profile!r}")
    if problems:
        raise UserError(f"{policy.path}: " + "; ".join(problems) + " — give --thresholds a policy written for "
                        "these tasks and profiles (its margins are set for them), or run the profiles it names")
    return policy


def plan_gate(request: GateRequest) -> GatePlan:
    """One gate's plan from its request (``GateRequest``). Raises UserError (one line) for anything that
    cannot be read or found."""
    spec, candidate, items, baselines = request.spec, request.candidate, request.items, request.baselines
    baselines_root, baseline_kernel, fingerprint = request.baselines_root, request.baseline_kernel, request.fingerprint
    tasks, max_samples, report_dir, served = request.tasks, request.max_samples, request.report_dir, request.served
    if (spec is None) == (candidate is None):
        raise ValueError("plan_gate takes a spec to run or a stored candidate, not both")
    if items not in ("all", "candidate"):
        raise UserError(f'--items must be "all" or "candidate", not {items!r}')
    if items == "candidate" and candidate is None:
        raise UserError("--items candidate decides a stored run on its own items: make it with `evalgate run "
                        "--limit N --out RUN`, then `evalgate gate --candidate RUN --items candidate`")
    root = Path(baselines_root) if baselines_root else None
    if candidate is not None:
        profiles = {t: s.name for t, s in candidate.meta.tasks.items()}
        profile_ids = {t: s.profile_id for t, s in candidate.meta.tasks.items()}
        fingerprint = fingerprint or candidate.meta.model.fingerprint
        loaded: Mapping[str, LoadedTask] = MappingProxyType({})
    else:
        assert spec is not None  # (one of the two, checked above)
        loaded = MappingProxyType(dict(tasks if tasks is not None else load_tasks(spec)))
        profiles = {t: lt.resolved.profile.name for t, lt in loaded.items()}
        profile_ids = {t: lt.profile_id for t, lt in loaded.items()}
    policy = checked_policy(request.thresholds, profiles)  # a bad policy, or one for other tasks, fails before any run
    baseline: StoredBaseline | None
    if baselines:
        baseline = load_baseline(list(baselines))
    else:
        if fingerprint is None:
            assert spec is not None  # a stored candidate's manifest holds its model's fingerprint
            fingerprint = local_fingerprint(spec.model)
        names = profiles if items == "candidate" else None
        baseline, missing = load_stored_baseline(lookup_roots(root), fingerprint, profile_ids, baseline_kernel, names)
        if missing and candidate is not None and items == "all":
            by_name, _ = load_stored_baseline(lookup_roots(root), fingerprint, profile_ids, baseline_kernel, profiles)
            if by_name is not None:  # the same profiles on other items: a --limit run
                raise UserError(f"{candidate.path} ran other items than the stored {baseline_kernel} baseline of its "
                                f"profiles ({', '.join(missing)}: e.g. a --limit run); decide it on its own items: add "
                                "`--items candidate` to this command")
        if missing:
            raise _missing_baseline(spec, missing, baseline_kernel, root, served)
    assert baseline is not None  # (none missing)
    rounds: dict[str, Any] = dict(max_samples=DEFAULT_MAX_SAMPLES if max_samples is None else max_samples, baselines_root=root,
                  allow_uncalibrated=request.allow_uncalibrated, across_serving=request.across_serving,
                  options=request.options)
    if rounds["max_samples"] < 1:
        raise UserError(f"--max-samples must be >= 1, got {rounds['max_samples']}")
    if candidate is not None:
        return GatePlan(policy=policy, baseline=baseline,
                        report_dir=Path(report_dir) if report_dir else candidate.path / "gate", candidate=candidate,
                        items=items, **rounds)
    assert spec is not None
    run_out = Path(request.out) if request.out else gate_out(spec.kernel)
    return GatePlan(policy=policy, baseline=baseline,
                    report_dir=Path(report_dir) if report_dir else run_out / "gate", spec=spec, tasks=loaded,
                    out=run_out, early_stop=request.early_stop, stop_on_conformance=request.stop_on_conformance,
                    **rounds)
