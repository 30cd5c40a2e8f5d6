"""Runs tasks against a model adapter and streams per-item records into the run store, resumably."""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from evalgate import collector
from evalgate.version import __version__
from evalgate.errors import UserError
from evalgate.run.progress import Progress, TaskProgress
from evalgate.run.samples import SampleGroups
from evalgate.run.spec import LoadedTask, RunSpec, load_tasks
from evalgate.records import SCHEMA_VERSION, EarlyStopInfo, PrepareInfo, RunManifest, to_jsonable
from evalgate.run.observer import RunObserver
from evalgate.run.store import MANIFEST, RecordWriter, Run, load_run, write_manifest
from evalgate.types import ModelAdapter, Request


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# Files a run's own helpers may write before the run starts (the launched server's log).
SIDE_FILES = frozenset({"server.log"})
CONFORMANCE_PROMPTS = 8  # the run's first prompts whose hidden states the kernel is held to its reference on


def prepare_out(out: Path, resume: bool) -> RunManifest | None:
    """The existing manifest when resuming; refuses to touch a stored run otherwise."""
    manifest = out / MANIFEST
    if resume:
        if not manifest.is_file():
            raise UserError(f"--resume: {str(out)!r} holds no run to resume (no {MANIFEST}); drop --resume to start one")
        return load_run(out).meta
    if out.exists() and any(p.name not in SIDE_FILES for p in out.iterdir()):
        raise UserError(f"{str(out)!r} already holds files; pass --resume to continue that run or choose another --out")
    return None


def prepare_ahead(tasks: dict[str, LoadedTask]) -> None:
    """Start every task's preparation (HumanEval's executor self-test: ~6 s of sandboxed programs) now, in
    the background, so that it runs beside the single-threaded imports and model load that follow; the
    run's ``prepare`` takes the result or waits for it (and raises what went wrong)."""
    for loaded in tasks.values():
        loaded.task.prepare_ahead(loaded.resolved, loaded.data_dir)


def _dg_environment() -> dict[str, str]:
    from evalgate.kernels.environment import dg_environment  # imports torch: only when a run starts

    return dg_environment()


class _Stop:
    """A run's early stop (docs/gate.md#stopping-early): the observer's ``should_stop()`` is asked after each
    batch of items is scored and stored, and returns a record (why, when, items per task) once the run need
    not go on; ``check`` remembers the first such record and says True from then on."""

    def __init__(self, observer: RunObserver | None):
        self.observer = observer
        self.record: dict | None = None

    def check(self) -> bool:
        if self.record is None and self.observer is not None:
            self.record = self.observer.should_stop()
        return self.record is not None

    @property
    def should_stop(self):
        """``check`` for the generation loops, or None when there is no observer (they then never ask)."""
        return self.check if self.observer is not None else None


def execute(spec: RunSpec, out: str | Path, adapter: ModelAdapter, resume: bool = False,
            progress: Progress | None = None, observer: RunObserver | None = None,
            expected_tokens: dict[str, dict] | None = None, tasks: dict[str, LoadedTask] | None = None) -> Path:
    """Run ``spec`` into ``out`` with ``adapter`` (the in-process model or a server: the caller builds it,
    ``evalgate.pipeline.in_process_adapter``); returns the run directory. ``tasks`` (``load_tasks(spec)``)
    are loaded here when not given.

    ``observer`` (``evalgate.run.observer.RunObserver``, e.g. the gate's ``EarlyStop``; None: nobody watches)
    is told what is stored as it is stored, and asked ``should_stop()`` before anything is generated and
    after each batch; once it returns a record the generation stops (the decoding stream closed, its workers
    ended), whatever finished is scored and stored, and the manifest says ``"status": "stopped_early"`` with
    the record as ``early_stop``. Such a run resumes like an interrupted one (``resume=True``; the record
    moves to ``early_stop_history``). At the end the observer gets the whole run, without a read back.

    ``expected_tokens`` ({task: {doc_id: tokens}}, e.g. the stored baselines' answer lengths) goes on each
    request (``Request.expected_tokens``) for the in-process model's schedule: no output, record or manifest
    depends on it."""
    out = Path(out)
    previous = prepare_out(out, resume)
    loaded = tasks if tasks is not None else load_tasks(spec)
    model_info = adapter.info()
    kernel = adapter.kernel
    kernel_info = {"name": kernel.name, "version": kernel.version, "id": kernel.id, "description": kernel.description,
                   "recipe": kernel.recipe, "faulty": kernel.faulty}
    first = [r.prompt for t in loaded.values() for r in t.task.requests(t.items[:CONFORMANCE_PROMPTS], t.resolved)]
    conformance = adapter.conformance(first[:CONFORMANCE_PROMPTS])  # in-process kernels only: a server's is out of reach (None)
    if conformance is not None:
        kernel_info["conformance"] = conformance
    source = getattr(kernel, "source_sha256", None)  # the code that computes it: part of its content identity
    if source is not None:
        kernel_info["source_sha256"] = source
    timings = {"load_model_s": round(adapter.load_s, 3)}
    manifest = RunManifest.model_validate(to_jsonable({  # the one validation; the runner changes it as models
        "schema_version": SCHEMA_VERSION,
        "evalgate_version": __version__,
        "run_id": out.name,
        "created": previous.created if previous else _now(),
        "status": "running",
        "spec": asdict(spec),
        "model": model_info,
        "kernel": kernel_info,
        "dg_env": _dg_environment(),
        "tasks": {name: {**t.resolved.summary(), "n_items": len(t.items)} for name, t in loaded.items()},
        "timings": {**(previous.timings or {}), **timings} if previous is not None else timings,
    }))
    if previous is not None:
        _check_resumable(previous, manifest, out)
        history = list(previous.early_stop_history or [])
        if previous.early_stop is not None:  # a stopped-early run resumed: the stop becomes history
            history.append(previous.early_stop)
        if history:
            manifest.early_stop_history = history
    write_manifest(out, manifest)
    collector.resume()  # start-up is over (the console script paused collection for its imports)

    runs = {name: _TaskRun(t, adapter, out, manifest, spec, expected_tokens, observer) for name, t in loaded.items()}
    if observer is not None:
        observer.started(Run(path=out, manifest=manifest,  # the live manifest: the tasks' preparation joins it
                             records={name: list(run.writer.records) for name, run in runs.items()},
                             items={name: list(run.writer.items) for name, run in runs.items()}))
    stop = _Stop(observer)
    progress = progress or Progress()
    progress.in_flight = _in_flight(adapter, spec)
    try:
        with progress:
            if previous is not None and stop.check():
                # what is stored already decides: nothing to generate (a stop found again is not new history)
                if previous.status == "stopped_early":
                    manifest.early_stop_history = previous.early_stop_history or None
                    if not manifest.early_stop_history:
                        manifest.model_fields_set.discard("early_stop_history")  # not written, as before the stop
            elif adapter.serving == "stream":
                _run_tasks_in_one_stream(list(runs.values()), adapter, manifest, progress, spec, stop)
            else:
                for run in runs.values():
                    if stop.record is not None:
                        break  # the gate's FAIL is already certain: later tasks are not started
                    _run_task(run, adapter, progress, spec, stop)
    except BaseException:
        for run in runs.values():
            run.writer.close()
        manifest.status = "interrupted"
        write_manifest(out, manifest)
        raise
    for run in runs.values():
        run.close()
    stored = {name: len(run.writer.stored) for name, run in runs.items()}
    if stop.record is not None and any(stored[t] < manifest.tasks[t].n_items for t in stored):
        manifest.status = "stopped_early"
        manifest.early_stop = EarlyStopInfo.model_validate(to_jsonable({
            **stop.record, "items_run": sum(stored.values()),
            "items_total": sum(s.n_items for s in manifest.tasks.values()),
            "tasks": {t: {"items_run": stored[t], "items_total": manifest.tasks[t].n_items} for t in stored}}))
        for name, summary in manifest.tasks.items():
            summary.complete = stored[name] == summary.n_items
    else:
        manifest.status = "complete"
    manifest.finished = _now()
    write_manifest(out, manifest)
    if observer is not None:
        observer.finished(Run(path=out, manifest=manifest, records={n: list(r.writer.records) for n, r in runs.items()},
                              items={n: list(r.writer.items) for n, r in runs.items()}))
    return out


def _check_resumable(previous: RunManifest, current: RunManifest, out: Path) -> None:
    diffs = []
    if previous.model.fingerprint != current.model.fingerprint:
        diffs.append("model fingerprint")
    if previous.kernel.id != current.kernel.id:
        diffs.append(f"kernel ({previous.kernel.id} vs {current.kernel.id})")
    elif previous.kernel.source_sha256 != current.kernel.source_sha256:  # its records would mix two codes
        diffs.append(f"kernel source ({current.kernel.id}'s code changed since the run began)"
                     if previous.kernel.source_sha256 else
                     f"kernel source (the stored run did not record {current.kernel.id}'s code)")
    for name, summary in current.tasks.items():
        before = previous.tasks.get(name)
        if before is None:
            diffs.append(f"task {name} not in the stored run")
        elif before.profile_id != summary.profile_id:
            diffs.append(f"{name} profile (items, limit or settings changed)")
    if diffs:
        raise UserError(f"--resume: {str(out)!r} was made with a different {', '.join(diffs)}; rerun into a new --out")


class _TaskRun:
    """One task's share of a run: its prepared profile, the requests still to do (k samples each), its record
    file, scorer and progress bar. ``score_and_write`` takes finished samples; ``close`` settles the file."""

    def __init__(self, loaded: LoadedTask, adapter: ModelAdapter, out: Path, manifest: RunManifest, spec: RunSpec,
                 expected_tokens: dict[str, dict] | None = None, observer: RunObserver | None = None):
        self.task, self.items, self.resolved, self.manifest = loaded.task, loaded.items, loaded.resolved, manifest
        self.data_dir, self.observer, self.kernel_name = loaded.data_dir, observer, adapter.kernel.name
        self.entry = manifest.tasks[self.task.name]
        self.writer = RecordWriter(out / f"{self.task.name}.jsonl")  # a resumed run's records, read once
        self.by_id = {item["doc_id"]: item for item in self.items}
        requests = [r for r in self.task.requests(self.items, self.resolved) if r.doc_id not in self.writer.stored]
        lengths = (expected_tokens or {}).get(self.task.name) or {}
        # what the progress bar weighs each item by: its expected answer length, else its token limit
        self.weights = dict(lengths) or {r.doc_id: r.max_new_tokens for r in requests}
        if lengths:
            requests = [replace(r, expected_tokens=lengths.get(r.doc_id)) for r in requests]
        if spec.order == "reverse":
            requests.reverse()
        sampling = spec.sampling()
        self.groups = SampleGroups(sampling, requests)  # an item is scored once all its k samples are in
        self.requests = sampling.expand(requests)
        self.times = {"generate_s": 0.0, "score_s": 0.0}
        self.bar: TaskProgress | None = None
        self.closed = False

    def prepare(self, progress: Progress) -> None:
        """What must hold before any item is scored (HumanEval's executor self-test: refuses a broken
        executor), then the task's progress bar."""
        prepared = self.task.prepare(self.resolved, self.data_dir)
        if prepared:
            self.entry.prepare = PrepareInfo.model_validate(to_jsonable(prepared))
        ids = {item["doc_id"] for item in self.items}
        self.bar = progress.task(f"{self.task.name} [{self.kernel_name}]", total=len(self.items),
                                 done=len(self.writer.stored), done_ids=list(self.writer.stored),
                                 weights={d: t for d, t in self.weights.items() if d in ids})

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
        if self.bar is not None:
            self.bar.advance(len(written), [r["doc_id"] for r in written])
        if written and self.observer is not None:
            self.observer.scored(self.task.name, written)

    def add_times(self, stats: dict | None = None, generate_s: bool = True) -> None:
        """Add the times (``generate_s`` False: the task shared one decoding stream with others, whose time
        is the run's)."""
        if self.manifest.timings is None:
            self.manifest.timings = {}
        timings = self.manifest.timings.setdefault(self.task.name, {})
        assert isinstance(timings, dict)  # a task's timings, beside the run's own numbers
        if generate_s:
            timings["generate_s"] = round(timings.get("generate_s", 0.0) + self.times["generate_s"], 3)
        timings["score_s"] = round(timings.get("score_s", 0.0) + self.times["score_s"], 3)
        if stats is not None:
            timings["mean_in_flight"] = float(stats["mean_in_flight_until_tail"])

    def close(self) -> None:
        """Close the record file in item order and say whether the task is complete."""
        if not self.closed:
            self.writer.close([item["doc_id"] for item in self.items])
            self.closed = True
        self.entry.complete = len(self.writer.stored) == len(self.items)


def _run_task(run: _TaskRun, adapter: ModelAdapter, progress: Progress, spec: RunSpec, stop: _Stop) -> None:
    run.prepare(progress)
    stats = None
    should_stop = stop.should_stop
    try:
        if should_stop is not None and should_stop():
            pass  # decided before anything is generated (a kernel that failed its conformance check)
        elif adapter.serving == "dispatch" and run.requests:
            stats = _dispatch_continuously(adapter.dispatch, run.requests, run.score_and_write, run.times, should_stop)
        else:
            run_in_process(adapter, run.requests, spec.batch_size, run.score_and_write, run.times, should_stop)
    finally:
        run.add_times(stats)
        run.close()


def _run_tasks_in_one_stream(runs: list[_TaskRun], adapter: ModelAdapter, manifest: RunManifest, progress: Progress,
                             spec: RunSpec, stop: _Stop) -> None:
    """Every task's requests in one continuous-batching stream (an in-process model): the decoding processes
    never wait at a task's tail for the next task's first prompts. Each finished sample goes to its own
    task's scorer and file; nothing an item produces depends on what it was batched with."""
    try:
        for run in runs:  # every task prepared (and its self-test passed) before anything decodes
            run.prepare(progress)
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

        should_stop = stop.should_stop
        if should_stop is not None and should_stop():
            return  # decided before anything is generated (a kernel that failed its conformance check)
        run_in_process(adapter, requests, spec.batch_size, score_and_write, times, should_stop)
        timings = manifest.timings if manifest.timings is not None else {}
        before = timings.get("generate_s", 0.0)
        before = before if isinstance(before, (int, float)) else 0.0
        manifest.timings = {**timings, "generate_s": round(before + times["generate_s"], 3)}
    finally:
        for run in runs:
            run.add_times(generate_s=False)
            run.close()


def _in_flight(adapter: ModelAdapter, spec: RunSpec) -> int:
    """Items decoded at once: a server's concurrent requests, else a batch per decoding process."""
    concurrency = getattr(adapter, "concurrency", None)
    if isinstance(concurrency, int) and concurrency > 0:
        return concurrency
    workers = 1
    if getattr(adapter, "device", None) == "cpu":
        from evalgate.cores import generation_workers

        workers = generation_workers()[0]
    return spec.batch_size * workers


def run_in_process(adapter: ModelAdapter, requests: list[Request], batch_size: int, score_and_write, times: dict,
                   should_stop=None) -> None:
    """The in-process model: continuous batching where the adapter streams (``serving == "stream"``), else
    one batch of ``--batch-size`` at a time. ``should_stop()`` (None: never) is asked after each batch of
    items is scored and stored; True ends the generation (what finished is still scored and stored)."""
    if adapter.serving != "stream" or not requests:
        _run_in_batches(adapter, requests, batch_size, score_and_write, times, should_stop)
    else:
        _run_streaming(adapter.generate_stream, requests, batch_size, score_and_write, times, should_stop)


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
                warm_later_imports()
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


# what the gate imports once the model has run (pandas: the flips' tables); imported while the decoding
# processes work instead of after them. Never before they are forked: a fork while another thread holds a
# module's import lock leaves that lock held in the child.
LATER_IMPORTS = ("pandas",)
_warmed = threading.Event()


def warm_later_imports() -> None:
    """Import ``LATER_IMPORTS`` on a background thread, once a process (the first item has arrived: the decoding
    processes, if any, are forked)."""
    if not _warmed.is_set():
        _warmed.set()
        threading.Thread(target=_import_later, name="evalgate-imports", daemon=True).start()


def _import_later() -> None:
    import importlib

    for name in LATER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # said where it is needed, if it is
            pass


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
