"""Runs tasks against a model adapter and streams per-item records into the run store, resumably."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from evalgate import collector
from evalgate.version import __version__
from evalgate.errors import UserError
from evalgate.run.progress import Progress
from evalgate.run.samples import SampleGroups, Sampling
from evalgate.records import SCHEMA_VERSION
from evalgate.files import write_bytes_atomic
from evalgate.run.store import MANIFEST, RecordWriter, load_run, read_records, write_manifest
from evalgate.tasks import get_task, resolve_profile
from evalgate.types import Request


@dataclass
class RunSpec:
    """Everything a run is made from; stored in the manifest so a run can be reproduced."""

    model: str
    kernel: str
    tasks: list[str]
    profiles: dict[str, str] = field(default_factory=dict)  # task -> profile name (default profile if absent)
    limit: int | None = None
    batch_size: int = 8
    device: str = "cpu"
    dtype: str | None = None
    data_dir: str | None = None
    order: str = "doc"  # "doc" or "reverse": the A/A second run decodes items in another order
    max_new_tokens: int | None = None  # override of the profile's limit; changes the profile id (smoke runs)
    # k samples per item at temperature T from run seed S (docs/scoring.md#k-samples); 1, 0.0: greedy
    samples: int = 1
    temperature: float = 0.0
    seed: int = 0

    def sampling(self) -> Sampling:
        return Sampling(self.samples, self.temperature, self.seed).check()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def with_overrides(profile, spec: RunSpec):
    """The profile with the run's overrides folded into its settings, so they are hashed like the rest."""
    if spec.max_new_tokens is None:
        return profile
    from dataclasses import replace

    settings = {**profile.settings, "max_new_tokens": spec.max_new_tokens,
                "overrides": {"max_new_tokens": spec.max_new_tokens}}
    return replace(profile, settings=settings)


def load_task(task, spec: RunSpec, data_dir):
    """(items, resolved profile) of ``task`` for ``spec``: overrides folded into the settings, the run's
    sampling settings into the decoding settings (both hashed into the profile id)."""
    from dataclasses import replace

    profile = with_overrides(resolve_profile(task, spec.profiles.get(task.name)), spec)
    items, resolved = task.load(profile, data_dir, spec.limit)
    return items, replace(resolved, decoding=spec.sampling().decoding(resolved.decoding))


# Files a run's own helpers may write before the run starts (the launched server's log).
SIDE_FILES = frozenset({"server.log"})


def prepare_out(out: Path, resume: bool) -> dict | None:
    """The existing manifest when resuming; refuses to touch a stored run otherwise."""
    manifest = out / MANIFEST
    if resume:
        if not manifest.is_file():
            raise UserError(f"--resume: {str(out)!r} holds no run to resume (no {MANIFEST}); drop --resume to start one")
        return load_run(out).manifest
    if out.exists() and any(p.name not in SIDE_FILES for p in out.iterdir()):
        raise UserError(f"{str(out)!r} already holds files; pass --resume to continue that run or choose another --out")
    return None


def prepare_ahead(spec: RunSpec) -> None:
    """Start every task's preparation (HumanEval's executor self-test: ~6 s of sandboxed programs) now, in
    the background, so that it runs beside the single-threaded imports and model load that follow; the
    run's ``prepare`` takes the result or waits for it. Anything that goes wrong here is left for the run to
    raise, where it always did."""
    try:
        from evalgate.tasks.data import resolve_data_dir

        data_dir = resolve_data_dir(spec.data_dir)
        for name in spec.tasks:
            task = get_task(name)
            _, resolved = load_task(task, spec, data_dir)
            task.prepare_ahead(resolved, data_dir)
    except Exception:  # noqa: BLE001 - raised again, with its message, by the run itself
        pass


def _dg_environment() -> dict[str, str]:
    from evalgate.kernels.environment import dg_environment  # imports torch: only when a run starts

    return dg_environment()


class _Stop:
    """A run's early-stop hook (docs/gate.md#stopping-early): ``stop_when(out, manifest)`` is consulted after
    each batch of items is scored and stored, and returns a record (why, when, items per task) once the run
    need not go on; ``check`` remembers the first such record and says True from then on."""

    def __init__(self, stop_when, out: Path, manifest: dict):
        self.stop_when, self.out, self.manifest = stop_when, out, manifest
        self.record: dict | None = None

    def check(self) -> bool:
        if self.record is None and self.stop_when is not None:
            self.record = self.stop_when(self.out, self.manifest)
        return self.record is not None

    @property
    def should_stop(self):
        """``check`` for the generation loops, or None when there is no hook (they then never ask)."""
        return self.check if self.stop_when is not None else None


def execute(spec: RunSpec, out: str | Path, resume: bool = False, adapter=None, progress: Progress | None = None,
            stop_when=None, expected_tokens: dict[str, dict] | None = None) -> Path:
    """Run ``spec`` into ``out``; returns the run directory. ``adapter`` defaults to the in-process one.

    ``stop_when(out, manifest)`` (the gate's ``EarlyStop``; None: run every item) is consulted before
    anything is generated and after each batch of items is scored and stored; once it returns a record the
    generation stops (the decoding stream closed, its workers ended), whatever finished is scored and stored,
    and the manifest says ``"status": "stopped_early"`` with the record as ``early_stop``. Such a run resumes
    like an interrupted one (``resume=True``; the record moves to ``early_stop_history``).

    ``expected_tokens`` ({task: {doc_id: tokens}}, e.g. ``baselines.answer_lengths`` of the stored baselines)
    goes on each request (``Request.expected_tokens``) for the in-process model's schedule: no output, record
    or manifest depends on it."""
    from evalgate.tasks.data import resolve_data_dir

    out = Path(out)
    previous = prepare_out(out, resume)
    data_dir = resolve_data_dir(spec.data_dir)
    tasks = [get_task(name) for name in spec.tasks]
    loaded = {}
    for task in tasks:  # load and validate all data before the (slow) model
        loaded[task.name] = load_task(task, spec, data_dir)

    if adapter is None:
        from evalgate.model_adapters.hf import HFAdapter

        adapter = HFAdapter(spec.model, spec.kernel, device=spec.device, dtype=spec.dtype, batch_size=spec.batch_size)
    model_info = adapter.info()
    kernel = adapter.kernel
    manifest = {  # written through evalgate.records.RunManifest
        "schema_version": SCHEMA_VERSION,
        "evalgate_version": __version__,
        "run_id": out.name,
        "created": previous["created"] if previous else _now(),
        "status": "running",
        "spec": asdict(spec),
        "model": model_info,
        "kernel": {"name": kernel.name, "version": kernel.version, "id": kernel.id,
                   "description": kernel.description, "env": kernel.env, "recipe": kernel.recipe,
                   "faulty": kernel.faulty},
        "dg_env": _dg_environment(),
        "tasks": {name: {**resolved.summary(), "n_items": len(items)} for name, (items, resolved) in loaded.items()},
        "timings": {"load_model_s": round(adapter.load_s, 3)},
    }
    conformance = getattr(adapter, "conformance", None)  # in-process kernels only: a server's is out of reach
    if conformance is not None:
        manifest["kernel"]["conformance"] = conformance()
    if previous is not None:
        _check_resumable(previous, manifest, out)
        manifest["timings"] = {**previous.get("timings", {}), **manifest["timings"]}
        history = list(previous.get("early_stop_history") or [])
        if previous.get("early_stop"):  # a stopped-early run resumed: the stop becomes history
            history.append(previous["early_stop"])
        if history:
            manifest["early_stop_history"] = history
    write_manifest(out, manifest)
    collector.resume()  # start-up is over (the console script paused collection for its imports)

    stop = _Stop(stop_when, out, manifest)
    progress = progress or Progress()
    try:
        with progress:
            if previous is not None and stop.check():
                # what is stored already decides: nothing to generate (a stop found again is not new history)
                if previous.get("status") == "stopped_early":
                    manifest.pop("early_stop_history", None)
                    if previous.get("early_stop_history"):
                        manifest["early_stop_history"] = previous["early_stop_history"]
            elif getattr(adapter, "dispatch", None) is None and getattr(adapter, "generate_stream", None) is not None:
                _run_tasks_in_one_stream(tasks, loaded, adapter, out, manifest, progress, spec, data_dir, stop,
                                         expected_tokens)
            else:
                for task in tasks:
                    if stop.record is not None:
                        break  # the gate's FAIL is already certain: later tasks are not started
                    items, resolved = loaded[task.name]
                    _run_task(task, items, resolved, adapter, out, manifest, progress, spec, data_dir, stop,
                              expected_tokens)
    except BaseException:
        manifest["status"] = "interrupted"
        write_manifest(out, manifest)
        raise
    stored = None if stop.record is None else {  # items per task on disk, read only when the hook said stop
        name: len({r["doc_id"] for r in read_records(out / f"{name}.jsonl")[0]}) for name in manifest["tasks"]}
    if stored is not None and any(stored[t] < manifest["tasks"][t]["n_items"] for t in stored):
        manifest["status"] = "stopped_early"
        manifest["early_stop"] = {
            **stop.record, "items_run": sum(stored.values()),
            "items_total": sum(int(s["n_items"]) for s in manifest["tasks"].values()),
            "tasks": {t: {"items_run": stored[t], "items_total": int(manifest["tasks"][t]["n_items"])} for t in stored}}
        for name, summary in manifest["tasks"].items():
            summary["complete"] = stored[name] == summary["n_items"]
    else:
        manifest["status"] = "complete"
    manifest["finished"] = _now()
    write_manifest(out, manifest)
    return out


def _check_resumable(previous: dict, current: dict, out: Path) -> None:
    diffs = []
    if previous["model"].get("fingerprint") != current["model"].get("fingerprint"):
        diffs.append("model fingerprint")
    if previous["kernel"].get("id") != current["kernel"]["id"]:
        diffs.append(f"kernel ({previous['kernel'].get('id')} vs {current['kernel']['id']})")
    for name, summary in current["tasks"].items():
        before = previous.get("tasks", {}).get(name)
        if before is None:
            diffs.append(f"task {name} not in the stored run")
        elif before.get("profile_id") != summary["profile_id"]:
            diffs.append(f"{name} profile (items, limit or settings changed)")
    if diffs:
        raise UserError(f"--resume: {str(out)!r} was made with a different {', '.join(diffs)}; rerun into a new --out")


class _TaskRun:
    """One task's share of a run: its prepared profile, the requests still to do (k samples each), its record
    file, scorer and progress bar. ``score_and_write`` takes finished samples; ``close`` settles the file."""

    def __init__(self, task, items, resolved, adapter, out: Path, manifest: dict, progress: Progress, spec: RunSpec,
                 data_dir, expected_tokens: dict[str, dict] | None = None):
        self.task, self.items, self.resolved, self.manifest = task, items, resolved, manifest
        self.entry = manifest["tasks"][task.name]
        prepared = task.prepare(resolved, data_dir)  # e.g. HumanEval's executor self-test: refuses a broken executor
        if prepared:
            self.entry["prepare"] = prepared
        self.path = out / f"{task.name}.jsonl"
        existing, _ = read_records(self.path)
        done = {r["doc_id"] for r in existing}
        self.by_id = {item["doc_id"]: item for item in items}
        requests = [r for r in task.requests(items, resolved) if r.doc_id not in done]
        lengths = (expected_tokens or {}).get(task.name) or {}
        if lengths:
            requests = [replace(r, expected_tokens=lengths.get(r.doc_id)) for r in requests]
        if spec.order == "reverse":
            requests.reverse()
        sampling = spec.sampling()
        self.groups = SampleGroups(sampling, requests)  # an item is scored once all its k samples are in
        self.requests = sampling.expand(requests)
        self.writer = RecordWriter(self.path)
        self.bar = progress.task(f"{task.name} [{adapter.kernel.name}]", total=len(items), done=len(done))
        self.times = {"generate_s": 0.0, "score_s": 0.0}

    def score_and_write(self, samples: list[Request], sample_generations) -> None:
        batch, generations = self.groups.add(samples, sample_generations)
        fresh = [i for i, r in enumerate(batch) if r.doc_id not in self.writer.stored]  # handed over again after a Ctrl-C
        if not fresh:
            return
        batch, generations = [batch[i] for i in fresh], [generations[i] for i in fresh]
        t0 = time.perf_counter()
        records = self.task.score_batch([self.by_id[r.doc_id] for r in batch], batch, generations, self.resolved)
        for record in records:
            record["profile_id"] = self.resolved.profile_id
        written = self.writer.append(records)
        self.times["score_s"] += time.perf_counter() - t0
        self.bar.advance(written)

    def close(self, stats: dict | None = None, generate_s: bool = True) -> None:
        """Close the record file, put it in item order, add the times (``generate_s`` False: the task shared
        one decoding stream with others, whose time is the run's) and say whether the task is complete."""
        self.writer.close()
        restore_item_order(self.path, [item["doc_id"] for item in self.items])
        timings = self.manifest["timings"].setdefault(self.task.name, {})
        if generate_s:
            timings["generate_s"] = round(timings.get("generate_s", 0.0) + self.times["generate_s"], 3)
        timings["score_s"] = round(timings.get("score_s", 0.0) + self.times["score_s"], 3)
        if stats is not None:
            timings["mean_in_flight"] = float(stats["mean_in_flight_until_tail"])
        self.entry["complete"] = len(read_records(self.path)[0]) == len(self.items)


def _run_task(task, items, resolved, adapter, out: Path, manifest: dict, progress: Progress, spec: RunSpec, data_dir,
              stop: _Stop | None = None, expected_tokens: dict[str, dict] | None = None) -> None:
    run = _TaskRun(task, items, resolved, adapter, out, manifest, progress, spec, data_dir, expected_tokens)
    dispatch = getattr(adapter, "dispatch", None)  # a server adapter: continuous dispatch
    stats = None
    should_stop = stop.should_stop if stop is not None else None
    try:
        if should_stop is not None and should_stop():
            pass  # decided before anything is generated (a kernel that failed its conformance check)
        elif dispatch is not None and run.requests:
            stats = _dispatch_continuously(dispatch, run.requests, run.score_and_write, run.times, should_stop)
        else:
            run_in_process(adapter, run.requests, spec.batch_size, run.score_and_write, run.times, should_stop)
    finally:
        run.close(stats)


def _run_tasks_in_one_stream(tasks, loaded: dict, adapter, out: Path, manifest: dict, progress: Progress,
                             spec: RunSpec, data_dir, stop: _Stop | None = None,
                             expected_tokens: dict[str, dict] | None = None) -> None:
    """Every task's requests in one continuous-batching stream (an in-process model): the decoding processes
    never wait at a task's tail for the next task's first prompts. Each finished sample goes to its own
    task's scorer and file; nothing an item produces depends on what it was batched with."""
    runs = []
    try:
        for task in tasks:  # every task prepared (and its self-test passed) before anything decodes
            items, resolved = loaded[task.name]
            runs.append(_TaskRun(task, items, resolved, adapter, out, manifest, progress, spec, data_dir,
                                 expected_tokens))
        requests = [r for run in runs for r in run.requests]
        owner = {id(r): run for run in runs for r in run.requests}
        times = {"generate_s": 0.0, "score_s": 0.0}

        def score_and_write(samples: list[Request], sample_generations) -> None:
            parts: dict[int, tuple] = {}
            for sample, generation in zip(samples, sample_generations):
                run = owner[id(sample)]
                parts.setdefault(id(run), (run, [], []))[1].append(sample)
                parts[id(run)][2].append(generation)
            for run, own_samples, own_generations in parts.values():
                run.score_and_write(own_samples, own_generations)

        should_stop = stop.should_stop if stop is not None else None
        if should_stop is not None and should_stop():
            return  # decided before anything is generated (a kernel that failed its conformance check)
        run_in_process(adapter, requests, spec.batch_size, score_and_write, times, should_stop)
        manifest["timings"]["generate_s"] = round(manifest["timings"].get("generate_s", 0.0) + times["generate_s"], 3)
    finally:
        for run in runs:
            run.close(generate_s=False)


def run_in_process(adapter, requests: list[Request], batch_size: int, score_and_write, times: dict,
                   should_stop=None) -> None:
    """The in-process model: continuous batching where the adapter streams (``generate_stream``), else one
    batch of ``--batch-size`` at a time. ``should_stop()`` (None: never) is asked after each batch of items
    is scored and stored; True ends the generation (what finished is still scored and stored)."""
    stream = getattr(adapter, "generate_stream", None)
    if stream is None or not requests:
        _run_in_batches(adapter, requests, batch_size, score_and_write, times, should_stop)
    else:
        _run_streaming(stream, requests, batch_size, score_and_write, times, should_stop)


def _run_streaming(stream, requests: list[Request], batch_size: int, score_and_write, times: dict,
                   should_stop=None) -> None:
    """Every request handed to the adapter's stream at once (at most ``batch_size`` decode together, a
    finished item's slot is refilled); finished items are scored and stored on one background thread while
    the model goes on (HumanEval's programs run in the sandbox beside the decoding). A chunk goes to the
    scorer when it is idle or ``batch_size`` items wait; after an error or Ctrl-C the items that finished are
    still scored and stored before it propagates, so a resume redoes only what was lost.

    ``should_stop()`` runs on the scorer's thread after each chunk is stored; once it says True the stream is
    closed (which ends the decoding workers), and the items that had finished are scored and stored."""
    from concurrent.futures import ThreadPoolExecutor

    pending: list[tuple[Request, object]] = []
    queued: list = []  # futures of the chunks handed to the scorer, in order
    stopping = False

    def score_then_ask(samples, generations) -> bool:
        score_and_write(samples, generations)
        return bool(should_stop is not None and should_stop())

    def settle(wait: bool) -> bool:
        said_stop = False
        while queued and (wait or queued[0].done()):
            said_stop |= queued.pop(0).result()  # a scoring error surfaces here
        return said_stop

    def hand_over(pool) -> None:
        chunk = list(pending)
        pending.clear()
        queued.append(pool.submit(score_then_ask, [r for r, _ in chunk], [g for _, g in chunk]))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="evalgate-score") as pool:
        generated = stream(requests, batch_size)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    finished = next(generated)
                except StopIteration:
                    break
                finally:
                    times["generate_s"] += time.perf_counter() - t0
                pending.extend((requests[i], g) for i, g in finished)
                if settle(wait=False):
                    stopping = True
                    break
                if not queued or len(pending) >= batch_size:
                    hand_over(pool)
        except BaseException:
            generated.close()
            try:
                settle(wait=True)
            finally:
                if pending:
                    score_and_write([r for r, _ in pending], [g for _, g in pending])
            raise
        try:
            if stopping:
                generated.close()  # GeneratorExit in the stream: its decoding workers are terminated
        finally:
            if pending:  # finished before the stop: scored and stored all the same
                hand_over(pool)
            settle(wait=True)


def _run_in_batches(adapter, requests: list[Request], batch_size: int, score_and_write, times: dict,
                    should_stop=None) -> None:
    """One batch of ``--batch-size`` at a time, scored and stored after each."""
    for start in range(0, len(requests), batch_size):
        if start and should_stop is not None and should_stop():
            return
        batch: list[Request] = requests[start:start + batch_size]
        t0 = time.perf_counter()
        try:
            generations = adapter.generate(batch)
        except BaseException as exc:
            # A server adapter hands back the items that finished before the fault ({index: Generation}):
            # keep them, so a resume redoes only what was lost.
            finished = getattr(exc, "finished", None) or {}
            if finished:
                score_and_write([batch[i] for i in sorted(finished)], [finished[i] for i in sorted(finished)])
            raise
        finally:
            times["generate_s"] += time.perf_counter() - t0
        score_and_write(batch, generations)


# Records of a server run are appended as they finish, grouped so that one write (one fsync, ~5 ms) serves
# many: at most every WRITE_EVERY_S seconds or WRITE_AT_MOST records, and always before an error propagates.
WRITE_EVERY_S = 0.5
WRITE_AT_MOST = 256


def _dispatch_continuously(dispatch, requests: list[Request], score_and_write, times: dict,
                           should_stop=None) -> dict:
    """A server: every request handed to the adapter's pool at once; records are scored and stored as they
    finish (in completion order; ``restore_item_order`` puts the file back in item order afterwards). The
    generation time is the wall time minus the time spent scoring, which overlaps the requests in flight.
    ``should_stop()`` is asked after each write; True closes the pool (requests in flight are abandoned) and
    stores what had finished."""
    t0 = time.perf_counter()
    score_before = times["score_s"]
    pending: list = []
    last_write = time.perf_counter()

    def write() -> None:
        nonlocal last_write
        if pending:
            score_and_write([r for r, _ in pending], [g for _, g in pending])
            pending.clear()
        last_write = time.perf_counter()

    run = dispatch(requests)
    try:
        for chunk in run:
            pending.extend(chunk)
            if len(pending) >= WRITE_AT_MOST or time.perf_counter() - last_write >= WRITE_EVERY_S:
                write()
                if should_stop is not None and should_stop():
                    pending.extend(run.close())  # finished, not handed over yet: kept
                    break
        write()
    except BaseException:
        pending.extend(run.close())  # finished, not handed over yet (Ctrl-C while scoring): keep them
        write()
        raise
    finally:
        times["generate_s"] += (time.perf_counter() - t0) - (times["score_s"] - score_before)
    return run.stats()


def restore_item_order(path: Path, doc_ids: list) -> None:
    """Rewrite ``<task>.jsonl`` with its records in item order (continuous dispatch and the reversed A/A run
    append them in the order they finish). The record lines are moved as they are, never re-serialized;
    the file is replaced atomically (temp file, fsync, rename), and left alone when already in order."""
    if not path.exists():
        return
    data = path.read_bytes()
    lines, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a torn tail is dropped, as the store does on read
        lines.append(line)
        good += len(line)
    records, _ = read_records(path)
    if len(records) != len(lines):
        return  # an unreadable line: leave the file for the store to report
    rank = {doc_id: i for i, doc_id in enumerate(doc_ids)}
    keys = [rank.get(r["doc_id"], len(rank)) for r in records]
    if keys == sorted(keys) and good == len(data):
        return
    order = sorted(range(len(lines)), key=lambda i: keys[i])  # stable: unknown ids keep their place at the end
    write_bytes_atomic(path, b"".join(lines[i] for i in order))
