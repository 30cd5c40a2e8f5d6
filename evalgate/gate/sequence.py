"""A candidate's sequence of looks against one baseline, and the α each look spends (docs/gate.md#reruns).

Every decision of a stored pair — a gate, a round with more samples per item, ``evalgate report``,
``evalgate.decide()``, a notebook's ``Comparison.verdict`` — is one **look**, decided at α·2^-(look+1)
(``Thresholds.at_look``), so all looks together spend less than α.

Two things keep a rerun from buying a PASS:

- *Determinism.* A look is identified by its data (``task_digest``: both sides' per-item scores, flags and
  sample counts). Data that reproduce an earlier look are that look and get its α, so its verdict. In-process
  runs on canonical numerics reproduce every sample (greedy, or keyed by item, sample index and the baseline's
  recorded seed), so the same candidate gets the same verdict however often it is rerun.
- *The record travels with the baseline.* Data that are new (a server that is not bit-reproducible, a
  rebuilt kernel) take the next look of this candidate's sequence, recorded in the **baseline's** folder
  (``<baseline>/looks/<candidate identity>/<task>.json``), keyed by the candidate's content identity
  (model fingerprint, kernel id and recipe, kernel library build, engine versions) — never its name, the
  working directory, the policy file's bytes or the task subset. A look is allocated under a file lock and
  written atomically, so two gates run at once take two looks.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from evalgate.errors import UserError
from evalgate.gate.policy import Thresholds, look_share
from evalgate.records import RunManifest

if TYPE_CHECKING:
    from evalgate.gate.verdict import Verdict

MAX_LOOKS = 12  # α·2^-13 is below anything a gate could use; a 13th look is refused
LOOKS = "looks"  # the subfolder of a baseline folder that holds its candidates' sequences
# what of a run's manifest identifies the candidate's numerics: not its name, folder, time or batch size
_MODEL_KEYS = ("fingerprint", "numerics", "dtype", "adapter", "torch", "transformers", "identity", "engine",
               "server_version", "server_settings_sha256", "kernel_library")
_KERNEL_KEYS = ("name", "version", "id", "recipe", "faulty", "build", "source_sha256", "library")


def candidate_identity(manifest: RunManifest) -> str:
    """The candidate's content identity, from its run manifest: the model's fingerprint and numerics, the
    kernel's id, recipe and (a real kernel) its library's build, the engine's versions. A rebuilt kernel, a
    new engine or other weights is another candidate with its own sequence; a new folder, name or batch
    size is not."""
    model, kernel = manifest.model.to_dict(), manifest.kernel.to_dict()  # open: an engine adds its own keys
    conformance = manifest.kernel.conformance
    key = {"model": {k: model.get(k) for k in _MODEL_KEYS if model.get(k) is not None},
           "kernel": {k: kernel.get(k) for k in _KERNEL_KEYS if kernel.get(k) is not None},
           "library": getattr(conformance, "library", None)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def reproducible(manifest: RunManifest) -> bool:
    """Whether rerunning this candidate reproduces its samples: an in-process run on canonical numerics
    (invariant forward, exact kernel accumulation), or a server run in its deterministic mode."""
    model = manifest.model
    numerics = getattr(model, "numerics", None)  # the adapter's own fields (open)
    if model.adapter == "hf" or numerics is not None:
        return numerics == "canonical-v1"
    determinism = getattr(model, "determinism", None) or {}
    return isinstance(determinism, dict) and determinism.get("deterministic") is True


def task_digest(pairs) -> str:
    """What one task's look decided on: per item, both sides' scores, flags and sample counts. Two looks with
    the same digest saw the same data."""
    sides = [[pairs.scores(s), [float(x) for x in pairs.invalid(s)], [float(x) for x in pairs.truncated(s)],
              pairs.n_samples(s)] for s in ("base", "cand")]
    return hashlib.sha256(json.dumps([list(map(str, pairs.doc_ids)), sides], sort_keys=True).encode()).hexdigest()


def _packaged(path: Path) -> Path | None:
    from evalgate.run.baselines import packaged_root

    try:
        return path.resolve().relative_to(packaged_root().resolve())
    except ValueError:
        return None


def looks_home(baseline_dir: Path, baselines_root: str | Path | None = None) -> Path:
    """Where a baseline's sequences live: its own folder's ``looks/``; for the canary's packaged (read-only)
    baselines, the user's baselines root's ``looks/canary/<baseline>`` (``baselines_root``, as --baselines-root
    gives it; else $EVALGATE_BASELINES, else ./results/baselines)."""
    from evalgate.run.baselines import user_root

    inside = _packaged(Path(baseline_dir))
    return user_root(baselines_root) / LOOKS / "canary" / inside if inside is not None else Path(baseline_dir) / LOOKS


def task_homes(dirs, tasks) -> dict[str, Path]:
    """task -> the baseline folder that holds its records (a stored baseline is one folder per task); found by
    the records file's presence, nothing read."""
    dirs = [Path(d) for d in dirs]
    return {t: next((d for d in dirs if (d / f"{t}.jsonl").is_file()), dirs[0]) for t in tasks}


@dataclass
class Ledger:
    """One task's looks of one candidate against one baseline (``path``: its JSON file; None: nowhere to
    record, e.g. a read-only baseline folder)."""

    path: Path | None
    looks: list = field(default_factory=list)

    @classmethod
    def read(cls, path: Path | None) -> Ledger:
        if path is None or not path.is_file():
            return cls(path, [])
        try:
            looks = list(json.loads(path.read_text())["looks"])
            if not all(isinstance(x.get("look"), int) and isinstance(x.get("digest"), str) for x in looks):
                raise ValueError("an entry without its look or digest")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}: the candidate's look record is unreadable ({exc}); it holds every look this "
                            "candidate took against this baseline, so it cannot be skipped: restore it, or record "
                            "a new baseline to start a new sequence knowingly") from exc
        return cls(path, looks)

    def recorded(self, digest: str) -> int | None:
        return next((x["look"] for x in self.looks if x["digest"] == digest), None)

    @property
    def next_look(self) -> int:
        return max((x["look"] for x in self.looks), default=-1) + 1

    def add(self, entry: dict) -> None:
        if self.recorded(entry["digest"]) is not None:
            return
        self.looks.append(entry)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"looks": self.looks}, indent=1))
        tmp.replace(self.path)  # atomic: a reader sees the old list or the new one


@dataclass
class Looks:
    """A gate's ledgers, one per task, held under their locks (``Looks.held``)."""

    identity: str
    ledgers: dict[str, Ledger]
    writable: bool = True

    @property
    def next_look(self) -> int:
        return max((led.next_look for led in self.ledgers.values()), default=0)

    def look_for(self, digests: dict[str, str]) -> tuple[int, bool]:
        """(the look these data are, whether every task's data repeat an earlier look). New data of any task
        take that task's next look; the gate decides all its tasks at the latest of their looks."""
        looks, repeated = [], True
        for task, digest in digests.items():
            ledger = self.ledgers[task]
            seen = ledger.recorded(digest)
            repeated &= seen is not None
            looks.append(ledger.next_look if seen is None else seen)
        look = max(looks, default=0)
        if look >= MAX_LOOKS:
            raise UserError(f"this candidate (content identity {self.identity}) has taken {look} looks against this "
                            "baseline, every one at a share of α; a further look is refused. A rebuilt kernel is "
                            "another candidate with its own sequence; otherwise record a new baseline")
        return look, repeated

    def record(self, look: int, digests: dict[str, str], entry: dict) -> None:
        """Add this look to every task's ledger; a ledger whose folder cannot be written (a read-only
        baseline) leaves ``writable`` False: the look was read, not recorded."""
        for task, digest in digests.items():
            try:
                self.ledgers[task].add({**entry, "look": look, "digest": digest,
                                        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
            except OSError:
                self.writable = False

    @property
    def where(self) -> list[str]:
        return sorted({str(led.path.parent) for led in self.ledgers.values() if led.path is not None})

    @classmethod
    @contextlib.contextmanager
    def held(cls, baseline_dirs, candidate_manifest: RunManifest, tasks, subset: str | None = None,
             baselines_root: str | Path | None = None) -> Iterator[Looks]:
        """The ledgers of ``tasks`` for this candidate against these baseline folders, locked (in a fixed
        order) for as long as the block runs: allocate a look, decide, record. ``subset``: a digest of the
        items when a check covers some of the baseline's items (its own sequence: it does not spend the full
        gate's looks). ``baselines_root``: where the packaged canary's records go (``looks_home``)."""
        identity = candidate_identity(candidate_manifest)
        homes = task_homes(list(baseline_dirs), tasks)
        suffix = f".items-{subset[:12]}" if subset else ""
        paths = {t: looks_home(homes[t], baselines_root) / identity / f"{t}{suffix}.json" for t in tasks}
        with contextlib.ExitStack() as stack:
            # The lock is the baseline folder itself (flock on a directory, read-only ones too): nothing is
            # created before a look is recorded, so a gate refused as bad input leaves the baseline as it was.
            for home in sorted({homes[t].resolve() for t in tasks}):
                fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
                stack.callback(os.close, fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield cls(identity, {t: Ledger.read(p) for t, p in paths.items()})


def decide_at_look(decide: Callable[[Thresholds], Verdict], policy: Thresholds, baseline_dirs,
                   candidate_manifest: RunManifest, tasks, subset: str | None = None, round_note: str = "", baselines_root: str | Path | None = None):
    """Decide one look of a stored pair: ``decide(policy_at_look)`` gives the verdict. At this candidate's next
    look, unless the data reproduce an earlier look's (then that look's α, hence its verdict); recorded with
    the baseline. The verdict says which look it is (``sequence``, notes, each task's ``look``)."""
    with Looks.held(baseline_dirs, candidate_manifest, tasks, subset, baselines_root) as looks:
        first = looks.next_look
        verdict = decide(policy.at_look(min(first, MAX_LOOKS - 1)))
        if verdict.comparison is None or verdict.decision is None:  # aggregate-only: one unpaired decision
            return verdict
        digests = {t: task_digest(verdict.comparison.pairs[t]) for t in verdict.decision.tasks}
        look, repeated = looks.look_for(digests)
        if look != first:
            verdict = decide(policy.at_look(look))
        assert verdict.comparison is not None and verdict.decision is not None  # (the same pair at any look)
        k = max((p.k for p in verdict.comparison.pairs.values()), default=1)
        alpha = policy.at_look(look).alpha
        task_verdicts = {t: d.outcome.verdict for t, d in verdict.decision.tasks.items()}
        if not repeated:
            looks.record(look, digests, {"k": k, "alpha": alpha, "share": look_share(look),
                                          "verdict": verdict.verdict, "tasks": task_verdicts})
    entry = {"look": look, "k": k, "alpha": alpha, "verdict": verdict.verdict, "repeated": repeated,
             "candidate": str(verdict.comparison.candidate.path), "tasks": task_verdicts}
    notes = [f"look {look + 1} of this candidate against this baseline{round_note}: decided at α = {alpha:.4g} "
             f"(α·2^-{look + 1}; docs/gate.md#reruns)" + (" — the same data as that earlier look" if repeated else "")]
    if not looks.writable:
        notes.append("the look was not recorded: the baseline's folder is not writable (a rerun on new data would "
                     "be decided at this same look)")
    if not reproducible(verdict.comparison.candidate.meta):
        notes.append("the candidate's run is not bit-reproducible (not canonical numerics, or a server not in its "
                     "deterministic mode): a rerun gives new data, decided at the next look")
    decision = replace(verdict.decision, tasks={t: replace(d, outcome=replace(d.outcome, look=look))
                                                   for t, d in verdict.decision.tasks.items()})
    sequence = {"identity": looks.identity, "ledgers": looks.where, "looks": [entry]}
    return replace(verdict, decision=decision, sequence=sequence, notes=[*verdict.notes, *notes])
