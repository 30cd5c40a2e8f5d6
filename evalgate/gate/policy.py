"""The gate's policy file, thresholds.yaml: alpha and its split, multiplicity rule, CI method, margins.

``load_thresholds(path=None)`` reads a file and validates it with a pydantic model (``PolicyFile``). Any problem
(missing file, bad YAML, duplicate or unknown key, wrong type, value out of range, missing task) raises
``UserError`` with one line, "FILE[:LINE]: KEY: problem; expected ...": the YAML line comes from the node tree.
The file's sha256 is kept so a verdict can record exactly which policy decided it.

``resolve_policy(explicit, canary)`` is the one place that chooses the file: ``--thresholds``, else
``$EVALGATE_THRESHOLDS``, else (a run scored with the built-in canary's profiles) the canary's own policy, else
``./thresholds.yaml`` in the current directory, else the packaged default; ``Thresholds.source`` says which.
The packaged default is the repository's top-level ``thresholds.yaml`` (the one copy), built into installs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from evalgate.errors import UserError
from evalgate.stats.multiplicity import MULTIPLE_COMPARISONS

REQUIRED_TASKS = ("gsm8k", "humaneval")


def look_share(look: int) -> float:
    """The share of α that look ``look`` of a gate's sequence spends: ½, ¼, ⅛, … (they sum to < 1)."""
    return 0.5 ** (look + 1)


CI_METHODS = ("tango", "newcombe")
PACKAGE_DEFAULT = "thresholds.yaml"
DEFAULT_PACKAGE = "policy_default"  # evalgate/policy_default/thresholds.yaml in a built install (pyproject.toml)
ENV = "EVALGATE_THRESHOLDS"
# where a policy came from (Thresholds.source), in the order resolve_policy tries them
SOURCES = ("--thresholds", ENV, "canary", "./thresholds.yaml", "packaged default")


@dataclass(frozen=True)
class TaskThresholds:
    """Policy for one task. Margins and limits are in percentage points; the properties give fractions."""

    name: str
    profile: str
    metric: str
    margin_pp: float
    max_invalid_rise_pp: float = 1.0
    max_truncation_rise_pp: float = 1.0
    require_paired: bool = True
    min_aa_runs: int = 1
    min_rise_items: int = 4  # item floor of the rate limits: FAIL needs > max(limit·n, this) net new items

    @property
    def margin(self) -> float:
        return self.margin_pp / 100

    @property
    def max_invalid_rise(self) -> float:
        return self.max_invalid_rise_pp / 100

    @property
    def max_truncation_rise(self) -> float:
        return self.max_truncation_rise_pp / 100


@dataclass(frozen=True)
class Thresholds:
    path: str
    sha256: str  # of the file's bytes, recorded in every verdict
    alpha: float
    multiple_comparisons: str
    ci_method: str
    token_ratio_band: tuple[float, float]
    tasks: dict[str, TaskThresholds] = field(default_factory=dict)
    alpha_split: bool = True  # one α budget for the whole gate (False: the original rule (docs/gate.md#the-original-rule), every test at α)
    alpha_validity: float = 0.01  # the validity-rate checks' share of α (all tasks together)
    inconclusive: bool = True  # a third outcome, INCONCLUSIVE (exit 3), when the data show neither (docs/gate.md#inconclusive)
    source: str = ""  # how the file was chosen: one of SOURCES, or "path given" (a path passed to load_thresholds)

    def task(self, name: str) -> TaskThresholds:
        """The policy for one task; a task with no section is a user error (margins are set before runs)."""
        if name not in self.tasks:
            raise UserError(
                f"{self.path}: tasks.{name}: no thresholds for task {name!r}; "
                f"expected a section under 'tasks:' (have: {', '.join(sorted(self.tasks))})"
            )
        return self.tasks[name]

    def at_look(self, look: int) -> Thresholds:
        """The policy a gate's look ``look`` (0, 1, …) is decided with: α and α_validity spent as
        α·2^-(look+1), so every look of one gate's sequence together stays within α
        (docs/gate.md#sequential-rounds)."""
        if look < 0:
            raise ValueError(f"look must be >= 0, got {look}")
        share = look_share(look)
        return replace(self, alpha=self.alpha * share, alpha_validity=self.alpha_validity * share)

    def decision_kwargs(self, task: str) -> dict:
        """The policy settings ``evalgate.gate.rule.decide_task`` takes by name, for one task."""
        policy = self.task(task)
        return dict(margin=policy.margin, alpha=self.alpha, ci_method=self.ci_method,
                    max_invalid_rise=policy.max_invalid_rise, max_truncation_rise=policy.max_truncation_rise,
                    token_ratio_band=tuple(self.token_ratio_band), alpha_split=self.alpha_split,
                    alpha_validity=self.alpha_validity, min_rise_items=policy.min_rise_items,
                    inconclusive=self.inconclusive)

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------------------
# The file's schema. Each field's description is what the error message says is expected.
# --------------------------------------------------------------------------------------------------------

PP = "a number of percentage points in [0, 100]"
WHOLE = "a whole number >= 0"


def _number(expected: str, **bounds) -> Any:
    return Annotated[float, Strict(), Field(description=expected, allow_inf_nan=False, **bounds)]


def _whole(expected: str) -> Any:
    return Annotated[int, Strict(), Field(description=expected, ge=0)]


def _flag() -> Any:
    return Annotated[bool, Strict(), Field(description="true or false")]


def _name(expected: str) -> Any:
    return Annotated[str, Strict(), Field(description=expected, pattern=r"\S")]


def _problem(key: str, problem: str, expected: str) -> PydanticCustomError:
    """A check of ours: it names its own key (pydantic's location would be the model's)."""
    return PydanticCustomError("policy", "{problem}", {"key": key, "problem": problem, "expected": expected})


class TaskSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    EXPECTED: ClassVar[str] = "a mapping with keys profile, metric, margin_pp"

    profile: _name("a profile name, e.g. gsm8k-lmeval-v3")
    metric: _name("a metric name, e.g. exact_match,strict-match")
    margin_pp: _number("a margin in percentage points, > 0 and <= 100 (e.g. 1.5)", gt=0, le=100)
    max_invalid_rise_pp: _number(PP, ge=0, le=100) = 1.0
    max_truncation_rise_pp: _number(PP, ge=0, le=100) = 1.0
    require_paired: _flag() = True
    min_aa_runs: _whole(WHOLE) = 1
    min_rise_items: _whole("a whole number of items >= 0 (0: the limit alone, as in docs/gate.md#the-original-rule)") = 4


TaskName = Annotated[str, Strict(), Field(pattern=r"^[a-z][a-z0-9_]*$")]
BAND = "[low, high] with 0 < low <= 1 <= high, e.g. [0.9, 1.1]"


class PolicyFile(BaseModel):
    """thresholds.yaml as written; ``parse_thresholds`` turns it into a ``Thresholds``."""

    model_config = ConfigDict(extra="forbid")
    EXPECTED: ClassVar[str] = "a mapping with keys alpha, tasks"

    alpha: _number("a number in (0, 0.5], e.g. 0.05", gt=0, le=0.5)
    tasks: Annotated[dict[TaskName, TaskSection], Strict(), Field(description="a mapping of task name to its thresholds")]
    multiple_comparisons: Literal[tuple(MULTIPLE_COMPARISONS)] = "holm"
    ci_method: Literal[CI_METHODS] = "tango"
    token_ratio_band: Annotated[tuple[_number(BAND), _number(BAND)], Field(description=BAND)] = (0.9, 1.1)
    alpha_split: _flag() = True
    alpha_validity: _number("a number in [0, alpha), e.g. 0.01") = 0.01
    inconclusive: _flag() = True

    @model_validator(mode="after")
    def _across_fields(self) -> PolicyFile:
        low, high = self.token_ratio_band
        if not 0 < low <= 1 <= high:
            raise _problem("token_ratio_band", f"{[low, high]!r} is out of range", BAND)
        # the accuracy checks get alpha - alpha_validity, so it must stay below alpha
        if not 0 <= self.alpha_validity < self.alpha:
            raise _problem("alpha_validity", f"{self.alpha_validity!r} is out of range",
                           f"a number in [0, alpha) = [0, {self.alpha:g}), e.g. 0.01")
        if self.ci_method == "newcombe":  # still reported beside Tango's; never the bound a verdict rests on
            raise _problem("ci_method", "newcombe is no longer a deciding method: its bound runs above alpha at the "
                           "margin (8.3% at n = 164, 7.1% at n = 1319 for alpha = 5%); its interval is still "
                           "reported", "tango (the exact test of Tango's statistic, docs/gate.md#intervals)")
        for name in REQUIRED_TASKS:
            if name not in self.tasks:
                raise _problem(f"tasks.{name}", "missing task section",
                               f"a section for each of {', '.join(REQUIRED_TASKS)}")
        return self


# keys of earlier policies that no longer exist, with what to do instead
_REMOVED = {"margin_floor": ("no longer a setting: the gate never raises the margin (issue 14); a margin the data "
                             "cannot resolve gives INCONCLUSIVE (docs/gate.md#inconclusive)",
                             "the line deleted (inconclusive: false gives the original two outcomes)")}


# --------------------------------------------------------------------------------------------------------
# Error messages: one line, "FILE[:LINE]: KEY: problem; expected ..."
# --------------------------------------------------------------------------------------------------------


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _describe(value: Any) -> str:
    if value is None:
        return "empty"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)
    shown = repr(value)
    return f"{kind} ({shown[:40]}{'...' if len(shown) > 40 else ''})" if kind != "a mapping" else kind


def _error(path: str, lines: dict[str, int], key: str, problem: str, expected: str) -> UserError:
    line, probe = None, key
    while probe and line is None:  # a missing key has no line of its own: its nearest parent's
        line = lines.get(probe)
        probe = probe.rpartition(".")[0]
    where = f"{path}:{line}" if line else path
    return UserError(_one_line(f"{where}: {key}: {problem}; expected {expected}"))


_OUT_OF_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def _schema(loc: list) -> tuple[type[TaskSection] | type[PolicyFile], Any]:
    """The model a location's last key belongs to, and that key's field (None for a whole task section)."""
    if loc[:1] == ["tasks"] and len(loc) >= 2:
        return TaskSection, TaskSection.model_fields.get(loc[2]) if len(loc) > 2 else None
    return PolicyFile, PolicyFile.model_fields.get(loc[0]) if loc else None


def _explain(err: ErrorDetails) -> tuple[str, str, str]:
    """(dotted key, problem, expected) of one pydantic error on a ``PolicyFile``."""
    if err["type"] == "policy":
        ctx = err["ctx"]
        return ctx["key"], ctx["problem"], ctx["expected"]
    if err["loc"][-1:] == ("[key]",):  # tasks.NAME's name
        return ".".join(map(str, err["loc"][:-1])), "invalid task name", "lower-case letters, digits and underscores"
    loc = [part for part in err["loc"] if not isinstance(part, int)]  # a band's element is the band
    key = ".".join(map(str, loc))
    model, info = _schema(loc)
    value, kind = err.get("input"), err["type"]
    if kind == "extra_forbidden":
        return key, "unknown key", f"one of {', '.join(model.model_fields)}"
    if kind == "missing":
        return key, "missing required key", f"it under {key.rpartition('.')[0] or 'the top level'}"
    if kind == "literal_error":
        expected = f"one of {', '.join(get_args(info.annotation))}"
        return key, f"unknown value {value!r}" if isinstance(value, str) else f"is {_describe(value)}", expected
    expected = info.description if info is not None else model.EXPECTED
    if kind in _OUT_OF_RANGE:
        return key, f"{value!r} is out of range", expected
    return key, f"is {_describe(value)}", expected


# --------------------------------------------------------------------------------------------------------
# Parsing: compose the node tree first, to find duplicate keys and line numbers, then load plain values
# --------------------------------------------------------------------------------------------------------


def _walk_nodes(node: yaml.Node, key: str, lines: dict[str, int], path: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set = set()
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "<complex key>"
        dotted = f"{key}.{name}" if key else str(name)
        line = key_node.start_mark.line + 1
        if name in seen:
            raise UserError(f"{path}:{line}: {dotted}: duplicate key; expected each key once per mapping")
        seen.add(name)
        lines[dotted] = line
        _walk_nodes(value_node, dotted, lines, path)


def _parse_yaml(text: str, path: str) -> tuple[Any, dict[str, int]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        lines: dict[str, int] = {}
        if root is not None:
            _walk_nodes(root, "", lines, path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(_one_line(f"{where}: invalid YAML syntax ({problem}); expected a YAML mapping "
                                  "like the default thresholds.yaml")) from None
    return data, lines


def parse_thresholds(text: str, path: str = "<thresholds>", sha256: str | None = None,
                     source: str = "path given") -> Thresholds:
    """Validate thresholds YAML text; ``path`` labels the error messages, ``source`` says how it was chosen."""
    data, lines = _parse_yaml(text, path)
    if data is None:
        raise UserError(f"{path}: file is empty; expected {PolicyFile.EXPECTED}")
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level is {_describe(data)}; expected {PolicyFile.EXPECTED}")
    for name, (problem, expected) in _REMOVED.items():
        if name in data:
            raise _error(path, lines, name, problem, expected)
    try:
        policy = PolicyFile.model_validate(data)
    except ValidationError as exc:
        raise _error(path, lines, *_explain(exc.errors()[0])) from None
    tasks = {name: TaskThresholds(name, **section.model_dump()) for name, section in policy.tasks.items()}
    settings = policy.model_dump(exclude={"tasks"})
    digest = sha256 or hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Thresholds(path=path, sha256=digest, tasks=tasks, source=source, **settings)


# --------------------------------------------------------------------------------------------------------
# Locating and loading the file
# --------------------------------------------------------------------------------------------------------


def default_thresholds_path() -> Path:
    """The packaged default policy: the repository's top-level thresholds.yaml (its one copy). A built install
    carries it as ``evalgate/policy_default/thresholds.yaml``; a source checkout (an editable install) reads it
    in place, beside ``evalgate/``."""
    package = resources.files("evalgate")
    built = package / DEFAULT_PACKAGE / PACKAGE_DEFAULT
    if built.is_file():
        return Path(str(built))
    checkout = Path(str(package)).parent / PACKAGE_DEFAULT
    return checkout if checkout.is_file() else Path(str(built))


def _source_of(file: Path) -> str:
    """How a path handed to ``load_thresholds`` was chosen, where the path itself says so."""
    from evalgate.canary import THRESHOLDS

    known = {default_thresholds_path().resolve(): "packaged default", THRESHOLDS.resolve(): "canary"}
    return known.get(file.resolve(), "path given")


def load_thresholds(path: str | Path | Thresholds | None = None, source: str | None = None) -> Thresholds:
    """Load and validate a thresholds file (default: ``default_thresholds_path()``); errors are UserError.
    A ``Thresholds`` is returned as it is, so callers may pass a policy already parsed."""
    if isinstance(path, Thresholds):
        return path
    file = Path(path) if path is not None else default_thresholds_path()
    shown = str(file)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{shown}: file not found; expected a thresholds YAML file "
                        "(pass --thresholds FILE, or copy the default thresholds.yaml)") from None
    except OSError as exc:
        raise UserError(_one_line(f"{shown}: cannot read ({exc.strerror or exc}); expected a readable "
                                  "thresholds YAML file")) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{shown}: not UTF-8 text; expected a thresholds YAML file") from None
    return parse_thresholds(text, shown, hashlib.sha256(raw).hexdigest(), source or _source_of(file))


def policy_source(explicit: str | Path | None = None, canary: bool = False) -> tuple[Path, str]:
    """Which policy file a gate uses, and why (one of ``SOURCES``): ``explicit`` (--thresholds), else
    $EVALGATE_THRESHOLDS, else the canary's own policy when ``canary`` (the run is scored with the built-in
    canary's profiles), else ./thresholds.yaml in the current directory, else the packaged default."""
    if explicit:
        return Path(explicit), "--thresholds"
    env = os.environ.get(ENV, "").strip()
    if env:
        if not Path(env).is_file():
            raise UserError(f"{ENV}={env}: file not found; expected a thresholds YAML file, or {ENV} unset")
        return Path(env), ENV
    if canary:
        from evalgate.canary import THRESHOLDS

        return THRESHOLDS, "canary"
    local = Path(PACKAGE_DEFAULT)
    if local.is_file():
        return local.resolve(), "./thresholds.yaml"
    return default_thresholds_path(), "packaged default"


def resolve_policy(explicit: str | Path | Thresholds | None = None, canary: bool = False) -> Thresholds:
    """The gate's policy, parsed once: the file ``policy_source`` chooses, its path, sha256 and source kept."""
    if isinstance(explicit, Thresholds):
        return explicit
    file, source = policy_source(explicit, canary)
    return load_thresholds(file, source)


def policy_for_run(thresholds: str | Path | Thresholds | None, run) -> Thresholds:
    """The policy deciding the stored ``run``: the one resolver, told whether the run is scored as the canary."""
    from evalgate.canary import policy_for

    return resolve_policy(thresholds, canary=policy_for(run) is not None)
