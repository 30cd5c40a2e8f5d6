"""Typed, versioned records: the files evalgate writes and reads back.

=====================  =========================================  ==================
file                   model                                      kind (in messages)
=====================  =========================================  ==================
``manifest.json``      :class:`RunManifest`                       run manifest
``<task>.jsonl`` line  its task's ``record_model``: an            per-item record
                       :class:`ItemRecord` with the task's fields
``aa.json``            :class:`AARecord`                          A/A record
``gate.json``          :class:`VerdictRecord`                     gate verdict
=====================  =========================================  ==================

Versions. Every file evalgate writes carries ``"schema_version": 3`` (:data:`SCHEMA_VERSION`); this
evalgate reads versions 1, 2 and 3 (:data:`READABLE_VERSIONS`). A file without the field is version 1: the
format of evalgate 0.1.0 (kept in ``tests/fixtures/v1-baselines/``), which differs from version 2 only in
lacking the field. Version 3 is version 2 plus what the early stop added: the run manifest's ``"status":
"stopped_early"`` with ``early_stop`` / ``early_stop_history`` (:class:`EarlyStopInfo`), and ``gate.json``'s
``early_stop``. Each version's migration (:data:`MIGRATIONS`) brings a dict to the next version by setting the
field, and nothing else; the file on disk is never rewritten. A version-2 manifest that holds
``stopped_early`` is read, not refused: such files exist (they must still resume and gate), and the fields
are typed alike in both. A file of any other version (a
newer evalgate's, or garbage such as ``"x"``) is refused with one line naming the file, the version found and
the versions this evalgate reads; so is content of the wrong type. Both are
:class:`~evalgate.errors.UserError`: the CLI prints the line and exits 2.

Types are strict (a count written as ``"200"`` is refused, not coerced) where the code reads a field, and
open (``extra="allow"``) everywhere else, so settings, machine descriptions and scorer details can grow
without a schema change. A field the code starts to read, or a change in the meaning or type of one, is a
new version: bump :data:`SCHEMA_VERSION`, add a migration from the previous one, keep reading the old ones.
A field no longer written whose number another field holds is not: both evalgates still read both files.
So ``gate.json``'s ``margin_requested`` and ``margin_enforced`` (always equal to ``margin``; no longer
written) are read, in a file of any version, as its one ``margin``; and a task decision written as one flat
dict (before its parts) is read in the parts written now, every value as it was (:class:`TaskDecisionRecord`,
:func:`nested_task_decision`).

Reading keeps the file's own dict too (:attr:`Record.as_read`), so code that reads records as dicts sees
exactly what is on disk. This module imports only pydantic, the standard library and ``evalgate.errors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from evalgate.errors import UserError

SCHEMA_VERSION: Final = 3
# 1: no "schema_version" field (evalgate 0.1.0); 2: before the early stop (the packaged canary baselines); 3: now
READABLE_VERSIONS = (1, 2, 3)


def _v1_to_v2(data: dict) -> dict:
    """Version 1 is version 2 without the field."""
    return {**data, "schema_version": 2}


def _v2_to_v3(data: dict) -> dict:
    """Version 3 added fields (the manifest's ``stopped_early`` status, ``early_stop`` and
    ``early_stop_history``; gate.json's ``early_stop``) and changed none, so a version-2 dict is a version-3 one
    as it is. A version-2 dict that holds them already (evalgate wrote them before it set version 3) is kept too."""
    return {**data, "schema_version": 3}


# version -> the function that turns a dict of that version into one of the next version
MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _v1_to_v2, 2: _v2_to_v3}

_CONFIG = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class Part(BaseModel):
    """A nested part of a record: strict where typed, open to other fields."""

    model_config = _CONFIG

    def to_dict(self) -> dict[str, Any]:
        """The fields that were given (typed and open ones), as they would be written."""
        return self.model_dump(mode="python", by_alias=True, exclude_unset=True)


class Record(BaseModel):
    """A whole file (or JSONL line) with a ``schema_version``."""

    model_config = _CONFIG
    KIND: ClassVar[str] = "record"

    schema_version: Literal[3] = SCHEMA_VERSION
    _read_version: int = PrivateAttr(default=SCHEMA_VERSION)
    _as_read: dict | None = PrivateAttr(default=None)

    @property
    def read_version(self) -> int:
        """The version of the file this was read from (1 for a file without ``schema_version``)."""
        return self._read_version

    @property
    def as_read(self) -> dict:
        """The dict as it was in the file, unmigrated; for a record built in memory, :meth:`to_dict`."""
        return self._as_read if self._as_read is not None else self.to_dict()

    def updated(self: R, **changes: Any) -> R:
        """A copy with ``changes`` (models or values of the fields' types; not validated again), its dict
        (``as_read``) what it now holds."""
        out = self.model_copy(update=changes)
        out._as_read = None
        return out

    def to_dict(self) -> dict:
        """What is written: the fields that were given (none added), with ``"schema_version": 3`` first."""
        out = self.model_dump(mode="python", by_alias=True, exclude_unset=True)
        out.pop("schema_version", None)
        return {"schema_version": self.schema_version, **out}


# --- run manifest (manifest.json) ------------------------------------------------------------------------


class RunSpecInfo(Part):
    """``manifest["spec"]``: the RunSpec the run was made from (evalgate.run.spec.RunSpec)."""

    model: str | None = None
    kernel: str | None = None
    tasks: list[str] | None = None
    profiles: dict[str, str] | None = None
    limit: int | None = None
    batch_size: int | None = None
    device: str | None = None
    dtype: str | None = None
    data_dir: str | None = None
    order: str | None = None
    max_new_tokens: int | None = None


class ModelInfo(Part):
    """``manifest["model"]``: what the adapter reports; the identity keys are compared between runs."""

    adapter: str | None = None
    fingerprint: str | None = None
    model_type: str | None = None
    model_id: str | None = None
    config_sha256: str | None = None
    safetensors_headers_sha256: str | None = None
    weights_hashed: str | None = None  # "bytes" (weight values covered) or "headers" (large checkpoints)
    tokenizer_sha256: str | None = None
    dtype: str | None = None
    device: str | None = None
    batch_size: int | None = None
    path: str | None = None
    machine: dict[str, Any] | None = None


class ConformanceInfo(Part):
    """``manifest["kernel"]["conformance"]``: the kernel against the one it declares it computes
    (kernels/conformance.py)."""

    kernel: str
    reference: str
    checked: bool
    ok: bool
    summary: str
    calc_diff: float | None = None
    limit: float | None = None


class KernelInfo(Part):
    """``manifest["kernel"]``: the kernel the run used."""

    name: str
    id: str | None = None
    version: str | None = None
    description: str | None = None
    env: dict[str, str] | None = None
    recipe: dict[str, Any] | None = None
    faulty: bool | None = None
    source_sha256: str | None = None  # the digest of the code that computes it (kernels/source.py); absent before
    conformance: ConformanceInfo | None = None  # absent: a server run, or a run made before evalgate checked it


class PrepareInfo(Part):
    """``manifest["tasks"][task]["prepare"]``: a task's preparation (HumanEval's executor self-test)."""

    ok: bool | None = None


class TaskSummary(Part):
    """``manifest["tasks"][task]``: the resolved profile and the item count (aggregate-only: the score)."""

    name: str
    profile_id: str
    n_items: int
    version: str | None = None
    complete: bool | None = None
    dataset_sha256: dict[str, str] | None = None
    decoding: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None
    prepare: PrepareInfo | None = None
    score: float | None = None  # aggregate-only baselines: the published score


class BaselineInfo(Part):
    """``manifest["baseline"]``: where a stored baseline came from."""

    task: str | None = None
    kernel: str | None = None
    source_run: str | None = None
    source: str | None = None
    aggregate_only: bool | None = None


class EarlyStopTask(Part):
    """One task's share of a run the gate stopped early: the items scored and stored, of all its items."""

    items_run: int
    items_total: int


class EarlyStopInfo(Part):
    """``manifest["early_stop"]``: the gate stopped generating because its FAIL was certain whatever the items
    not yet run would give (docs/gate.md#stopping-early). The run's ``status`` is then ``"stopped_early"``: it
    can be resumed to completion (``evalgate run --resume``, ``evalgate gate --no-early-stop``) but never be a
    baseline. In ``gate.json`` the same record, with the observed flip counts per task."""

    reason: str
    items_run: int
    items_total: int
    tasks: dict[str, EarlyStopTask]
    at: str | None = None  # when the run stopped (UTC, ISO 8601)


class RunManifest(Record):
    """``<run>/manifest.json``; also each baseline folder's and its ``aa/`` folder's."""

    KIND: ClassVar[str] = "run manifest"

    # "stopped_early": the gate stopped generating once its FAIL was certain (``early_stop`` says when and why)
    status: Literal["running", "interrupted", "complete", "stopped_early"]
    kernel: KernelInfo
    model: ModelInfo
    tasks: dict[str, TaskSummary]
    evalgate_version: str | None = None
    run_id: str | None = None
    created: str | None = None
    finished: str | None = None
    spec: RunSpecInfo | None = None
    dg_env: dict[str, str] | None = None
    timings: dict[str, float | dict[str, float]] | None = None
    baseline: BaselineInfo | None = None
    aggregate_only: bool | None = None
    early_stop: EarlyStopInfo | None = None  # status "stopped_early" only
    early_stop_history: list[EarlyStopInfo] | None = None  # earlier stops of a run resumed since


# --- per-item records (<task>.jsonl) ----------------------------------------------------------------------


class ItemRecord(Record):
    """One line of ``<task>.jsonl``: the fields every task writes; task-specific ones are allowed. A task's
    ``record_model`` subclasses it with its own fields (``evalgate.tasks.get_task(name).record_model``)."""

    KIND: ClassVar[str] = "per-item record"

    doc_id: int | str
    profile_id: str | None = None
    prompt_hash: str | None = None
    resps: str | list[str] | None = None
    finish_reason: str | None = None  # "stop" or "length" (truncated)
    stop_hit: str | None = None
    n_prompt_tokens: int | None = None
    n_tokens: int | None = None
    latency_s: float | None = None


# --- A/A record (aa.json next to a baseline) --------------------------------------------------------------


class AASecondRun(Part):
    path: str | None = None
    batch_size: int | None = None
    order: str | None = None


class AATask(Part):
    """One task's A/A calibration: the flip rate ψ0 the gate's margin floor uses, and the flip set."""

    psi0: float
    n: int
    delta0: float | None = None
    b: int | None = None
    c: int | None = None
    flips: list[int | str] = Field(default_factory=list)
    verdict: str | None = None  # the A/A pair's own gate verdict; the gate refuses a baseline whose A/A failed
    reasons: list[str] | None = None
    first_batch_size: int | None = None
    second_run: AASecondRun | None = None


class AARecord(Record):
    """``<baseline>/aa.json``."""

    KIND: ClassVar[str] = "A/A record"

    tasks: dict[str, AATask]
    thresholds_sha256: str | None = None
    recorded: str | None = None


# --- gate verdict (gate.json) -----------------------------------------------------------------------------


class ThresholdsRef(Part):
    path: str | None = None
    sha256: str | None = None
    alpha: float
    multiple_comparisons: str
    ci_method: str


# gate.json's task decision in parts (``evalgate.gate.verdict.TaskDecision``): which flat field goes to which part
_DECISION_PARTS = {
    "rule": ("margin", "alpha", "ci_method", "alpha_split", "alpha_validity", "min_rise_items"),
    "statistics": ("counts", "n_samples", "delta", "flip_rate", "p_degradation", "p_mid", "p_two_sided", "tango_ci",
                   "tango_lower", "newcombe_ci", "newcombe_lower", "wald_ci", "p_inferior", "p_pass", "exact_lower",
                   "gate_lower"),
    "checks": ("invalid", "truncation", "tokens"),
    "resolution": ("mde", "mde_power", "mde_method", "samples_needed", "samples_needed_is_bound", "mde_limit",
                   "within_variance", "aa_psi0", "aa_psi0_upper", "aa_n", "aa_mde", "resolves_margin"),
    "outcome": ("verdict", "reasons", "warnings", "look", "n_tasks", "multiple_comparisons", "alpha_accuracy",
                "p_degradation_adjusted", "p_inferior_adjusted", "degraded", "inferior", "spec_degraded",
                "non_inferior", "spec_verdict"),
}


def nested_task_decision(flat: dict) -> dict:
    """A task decision as gate.json held it before its parts (one flat dict, the policy's settings copied into
    it) in the parts it is written in now, each value as it was. The rule's rate limits and token band, which
    the flat form kept only inside its checks, are read from them; a field no part names stays at the top."""
    data = dict(flat)
    if "margin_requested" in data or "margin_enforced" in data:  # before issue 28: the margin three times, equal
        old = [data.pop(key) for key in ("margin_enforced", "margin_requested") if key in data]
        data.setdefault("margin", old[0])
    out: dict[str, Any] = {"task": data.pop("task")} if "task" in data else {}
    for part, keys in _DECISION_PARTS.items():
        out[part] = {key: data.pop(key) for key in keys if key in data}
    if "inconclusive_enabled" in data:
        out["rule"]["inconclusive"] = data.pop("inconclusive_enabled")
    for key, check in (("max_invalid_rise", "invalid"), ("max_truncation_rise", "truncation")):
        if isinstance(out["checks"].get(check), dict) and "limit" in out["checks"][check]:
            out["rule"][key] = out["checks"][check]["limit"]
    if isinstance(out["checks"].get("tokens"), dict) and "band" in out["checks"]["tokens"]:
        out["rule"]["token_ratio_band"] = out["checks"]["tokens"]["band"]
    if "data_warnings" in data:
        out["checks"]["input_warnings"] = data.pop("data_warnings")
    return {**out, **data}


class DecisionRule(Part):
    """A task decision's ``rule``: the policy's settings it was decided under (α: its look's)."""

    margin: float | None = None  # the margin gated on, a fraction


class DecisionStatistics(Part):
    n_samples: int | None = None  # k, samples per item


class DecisionResolution(Part):
    """What the data can resolve (absent in gate.json files written before it was reported)."""

    mde: float | None = None  # minimum detectable effect at 80% power, a fraction
    aa_psi0: float | None = None  # the A/A flip structure ψ₀ and its one-sided upper bound
    aa_psi0_upper: float | None = None
    aa_n: int | None = None  # items the A/A calibration rests on


class DecisionOutcome(Part):
    verdict: str
    reasons: list[str] = Field(default_factory=list)
    warnings: list[str] | None = None


class TaskDecisionRecord(Part):
    """``decision.tasks[task]``: one task's decision in its parts (``TaskDecision.to_dict``): the rule, the
    statistics, the checks, the resolution and the outcome; the numbers open, the verdict and reasons typed."""

    task: str | None = None
    rule: DecisionRule = Field(default_factory=DecisionRule)
    statistics: DecisionStatistics = Field(default_factory=DecisionStatistics)
    checks: dict[str, Any] = Field(default_factory=dict)
    resolution: DecisionResolution = Field(default_factory=DecisionResolution)
    outcome: DecisionOutcome

    @model_validator(mode="before")
    @classmethod
    def _in_parts(cls, data: Any) -> Any:
        """gate.json files written before the parts hold one flat dict per task (its verdict at the top):
        read in parts (``nested_task_decision``), every value as it was."""
        if isinstance(data, dict) and "outcome" not in data and "verdict" in data:
            return nested_task_decision(data)
        return data


class DecisionRecord(Part):
    verdict: Literal["PASS", "FAIL", "INCONCLUSIVE"]  # INCONCLUSIVE: exit 3 (docs/gate.md#exit-codes)
    spec_verdict: str | None = None
    reasons: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    alpha: float | None = None
    multiple_comparisons: str | None = None
    tasks: dict[str, TaskDecisionRecord] = Field(default_factory=dict)


class RunIdentity(Part):
    """``gate.json``'s ``baseline`` / ``candidate``: which runs were compared (the manifest, less settings)."""

    path: str
    run_id: str | None = None
    kernel: KernelInfo
    model: ModelInfo
    tasks: dict[str, TaskSummary]
    dg_env: dict[str, str] | None = None
    created: str | None = None
    aggregate_only: bool = False


class FlipRow(Part):
    """One flipped item (``gate.json``'s ``flips[task]``); the other columns are the report's."""

    doc_id: int | str
    direction: str | None = None


class VerdictRecord(Record):
    """``gate.json``: the top-level fields of ``Verdict.to_dict()``."""

    KIND: ClassVar[str] = "gate verdict"

    verdict: Literal["PASS", "FAIL", "INCONCLUSIVE"]
    exit_code: int
    notes: list[str] = Field(default_factory=list)
    thresholds: ThresholdsRef
    aa: dict[str, AATask] = Field(default_factory=dict)
    decision: DecisionRecord | None = None
    unpaired: dict[str, dict[str, Any]] = Field(default_factory=dict)  # aggregate-only baselines
    baseline_dirs: list[str] = Field(default_factory=list)  # every baseline folder (one per task); absent before
    conformance: ConformanceInfo | None = None  # the candidate kernel's, from its run (absent: not recorded)
    baseline: RunIdentity | None = None  # absent when there was no paired comparison
    candidate: RunIdentity | None = None
    flips: dict[str, list[FlipRow]] | None = None
    # the candidate run stopped early: decided on its best completion (docs/gate.md#stopping-early)
    early_stop: EarlyStopInfo | None = None


# --- reading and writing ----------------------------------------------------------------------------------

R = TypeVar("R", bound=Record)


def _readable() -> str:
    return f"{', '.join(map(str, READABLE_VERSIONS[:-1]))} and {READABLE_VERSIONS[-1]}"


def version_of(data: dict, source: str, kind: str = "record") -> int:
    """The schema version of a record's dict (1 without the field); UserError for any version not readable."""
    if "schema_version" not in data:
        return 1
    found = data["schema_version"]
    if type(found) is not int or found not in READABLE_VERSIONS:  # True is not version 1
        raise UserError(f"{source}: {kind} has schema_version {json.dumps(found)[:40]}, which this evalgate cannot "
                        f"read (it reads schema_version {_readable()}; no schema_version means 1); "
                        f"use the evalgate version that wrote it")
    return found


def migrate(data: dict, version: int) -> dict:
    """A dict of ``version`` brought to :data:`SCHEMA_VERSION` (a new dict; ``data`` is not changed)."""
    while version < SCHEMA_VERSION:
        data = MIGRATIONS[version](data)
        version += 1
    return data


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def describe_error(exc: ValidationError) -> str:
    """The first problem of a validation error, on one line: ``where: what (got value)``."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    # a union (``int | str``) reports one error per member, each with the member's name appended to the location
    same = [e for e in errors if e["input"] is first["input"] and e["loc"][:-1] == first["loc"][:-1]]
    if len(same) > 1:
        loc, what = first["loc"][:-1], "wrong type (expected " + " or ".join(str(e["loc"][-1]) for e in same) + ")"
    else:
        loc, what = first["loc"], first["msg"][0].lower() + first["msg"][1:]
    where = ".".join(str(p) for p in loc) or "the top level"
    got = "" if first["type"] == "missing" else f" (got {_short(first['input'])})"
    more = len(errors) - len(same) if len(same) > 1 else len(errors) - 1
    text = f"{where}: {what}{got}" + (f"; and {more} more problem(s)" if more > 0 else "")
    return " ".join(text.split())  # one line, whatever the input held


def parse(model: type[R], data: Any, source: str) -> R:
    """Validate a record read from ``source`` (a file, or a file and line), migrating older versions.

    Raises UserError with one line for a non-object, an unknown version, or content of the wrong type.
    """
    if not isinstance(data, dict):
        raise UserError(f"{source}: a {model.KIND} must be a JSON object, not {type(data).__name__}; the file is damaged")
    version = version_of(data, source, model.KIND)
    try:
        obj = model.model_validate(migrate(data, version))
    except ValidationError as exc:
        raise UserError(f"{source}: not a valid {model.KIND} (schema_version {version}): {describe_error(exc)}") from None
    obj._read_version = version
    obj._as_read = data
    return obj


def read_json(path: str | Path, kind: str) -> Any:
    """A JSON file's content; UserError (one line) when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {kind} {str(path)!r}: {exc.__class__.__name__}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); the {kind} is damaged") from None


def load(model: type[R], path: str | Path) -> R:
    """Read and validate one JSON file as ``model``."""
    return parse(model, read_json(path, model.KIND), repr(str(path)))


def load_manifest(path: str | Path) -> RunManifest:
    return load(RunManifest, path)


def load_aa(path: str | Path) -> AARecord:
    return load(AARecord, path)


def load_verdict(path: str | Path) -> VerdictRecord:
    """``gate.json`` as a VerdictRecord (refuses an unknown schema_version in one line), the runs it names
    found from here (``evalgate.located``: a gate folder read from anywhere, or copied with its run)."""
    from evalgate.located import recorded_run

    record = load(VerdictRecord, path)
    gate_dir = Path(path).parent
    for side in (record.candidate, record.baseline):
        if side is not None:
            side.path = recorded_run(side.path, gate_dir, side.run_id, _run_id_in)
    record.baseline_dirs = [recorded_run(d, gate_dir) for d in record.baseline_dirs]
    return record


def _run_id_in(folder: Path) -> str | None:
    """The run id of the run stored in ``folder``, or None where none this evalgate reads is."""
    from evalgate.located import MANIFEST

    try:
        return load_manifest(folder / MANIFEST).run_id
    except UserError:
        return None


def json_default(o: Any) -> Any:
    """``json.dumps``'s ``default`` for what a writer may hold: sets sorted, numpy scalars as numbers, other as str."""
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    return str(o)


def to_jsonable(obj: Any) -> Any:
    """``obj`` as JSON would give it back: tuples as lists, sets sorted, numpy scalars as numbers, other as str."""
    return json.loads(json.dumps(obj, default=json_default, ensure_ascii=False))


def dump(model: type[R], data: dict | R) -> dict:
    """The dict to write for ``data`` (a model, or a dict in the current or an older version).

    Validates first; a wrong type here is a bug in the writer (pydantic's ValidationError, not a UserError).
    """
    if isinstance(data, model):
        return data.to_dict()
    plain = to_jsonable(data)
    version = version_of(plain, f"{model.KIND} to write", model.KIND)
    return model.model_validate(migrate(plain, version)).to_dict()


def dump_manifest(data: dict | RunManifest) -> dict:
    return dump(RunManifest, data)


def dump_aa(data: dict | AARecord) -> dict:
    return dump(AARecord, data)


def dump_verdict(data: dict | VerdictRecord) -> dict:
    """What ``gate.json`` holds for ``Verdict.to_dict()``: validated, with ``"schema_version": 3``."""
    return dump(VerdictRecord, data)


def verdict_json(data: dict | VerdictRecord) -> str:
    """The text of ``gate.json`` (indented, in the field order of Verdict.to_dict(), newline-terminated)."""
    return json.dumps(dump_verdict(data), indent=2, ensure_ascii=False) + "\n"
