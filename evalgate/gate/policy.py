"""The gate's policy file, thresholds.yaml: alpha and its split, multiplicity rule, CI method, margins.

``load_thresholds(path=None)`` reads and validates it. Any problem (missing file, bad YAML, duplicate or
unknown key, wrong type, value out of range, missing task) raises ``UserError`` with one line naming the
file, the line where known, the dotted key, and what is expected. The file's sha256 is kept so a verdict
can record exactly which policy decided it.

Without a path, the default policy shipped in the package is used (``evalgate/gate/thresholds.yaml``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from evalgate.errors import UserError
from evalgate.stats.multiplicity import MULTIPLE_COMPARISONS

REQUIRED_TASKS = ("gsm8k", "humaneval")
CI_METHODS = ("tango", "newcombe")
PACKAGE_DEFAULT = "thresholds.yaml"
_TASK_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


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

    def task(self, name: str) -> TaskThresholds:
        """The policy for one task; a task with no section is a user error (margins are set before runs)."""
        if name not in self.tasks:
            raise UserError(
                f"{self.path}: tasks.{name}: no thresholds for task {name!r}; "
                f"expected a section under 'tasks:' (have: {', '.join(sorted(self.tasks))})"
            )
        return self.tasks[name]


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
# Locating the file
# --------------------------------------------------------------------------------------------------------


def default_thresholds_path() -> Path:
    """The default policy, shipped inside the package (one copy: ``evalgate/gate/thresholds.yaml``)."""
    return Path(str(resources.files("evalgate.gate") / PACKAGE_DEFAULT))


# --------------------------------------------------------------------------------------------------------
# Validation helpers: every error is one line, "FILE[:LINE]: KEY: problem; expected ..."
# --------------------------------------------------------------------------------------------------------


class _Validator:
    def __init__(self, path: str, lines: dict[str, int]):
        self.path = path
        self.lines = lines  # dotted key -> 1-based line number, from the YAML node tree

    def error(self, key: str, problem: str, expected: str) -> UserError:
        line = self._line(key)
        where = f"{self.path}:{line}" if line else self.path
        return UserError(_one_line(f"{where}: {key}: {problem}; expected {expected}"))

    def _line(self, key: str) -> int | None:
        # a missing key has no line of its own: point at its nearest parent that has one
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def mapping(self, value: Any, key: str, expected: str) -> dict:
        if not isinstance(value, dict):
            raise self.error(key, f"is {_describe(value)}", expected)
        return value

    def keys(self, mapping: dict, key: str, required: tuple, optional: tuple) -> None:
        prefix = f"{key}." if key else ""
        allowed = required + optional
        for name in mapping:
            if not isinstance(name, str) or name not in allowed:
                raise self.error(f"{prefix}{name}", "unknown key", f"one of {', '.join(allowed)}")
        for name in required:
            if name not in mapping:
                raise self.error(f"{prefix}{name}", "missing required key", f"it under {key or 'the top level'}")

    def number(self, value: Any, key: str, low: float, high: float, *, low_open: bool = False,
               expected: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"is {_describe(value)}", expected)
        too_low = value <= low if low_open else value < low
        if too_low or value > high or value != value:  # value != value: NaN
            raise self.error(key, f"{value!r} is out of range", expected)
        return float(value)

    def integer(self, value: Any, key: str, low: int, expected: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"is {_describe(value)}", expected)
        if value < low:
            raise self.error(key, f"{value!r} is out of range", expected)
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"is {_describe(value)}", "true or false")
        return value

    def text(self, value: Any, key: str, expected: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"is {_describe(value)}", expected)
        return value

    def choice(self, value: Any, key: str, choices: tuple) -> str:
        expected = f"one of {', '.join(choices)}"
        if not isinstance(value, str):
            raise self.error(key, f"is {_describe(value)}", expected)
        if value not in choices:
            raise self.error(key, f"unknown value {value!r}", expected)
        return value


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _describe(value: Any) -> str:
    if value is None:
        return "empty"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)
    shown = repr(value)
    return f"{kind} ({shown[:40]}{'...' if len(shown) > 40 else ''})" if kind != "a mapping" else kind


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


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------

_TOP_REQUIRED = ("alpha", "tasks")
_TOP_OPTIONAL = ("multiple_comparisons", "ci_method", "token_ratio_band", "alpha_split", "alpha_validity",
                 "inconclusive")
# keys of earlier policies that no longer exist, with what to do instead
_REMOVED = {"margin_floor": ("no longer a setting: the gate never raises the margin (issue 14); a margin the data "
                             "cannot resolve gives INCONCLUSIVE (docs/gate.md#inconclusive)",
                             "the line deleted (inconclusive: false gives the original two outcomes)")}
_TASK_REQUIRED = ("profile", "metric", "margin_pp")
_TASK_OPTIONAL = ("max_invalid_rise_pp", "max_truncation_rise_pp", "require_paired", "min_aa_runs",
                  "min_rise_items")


def _task_thresholds(name: str, section: Any, check: _Validator) -> TaskThresholds:
    key = f"tasks.{name}"
    if not isinstance(name, str) or not _TASK_NAME.match(name):
        raise check.error(key, "invalid task name", "lower-case letters, digits and underscores")
    section = check.mapping(section, key, f"a mapping with keys {', '.join(_TASK_REQUIRED)}")
    check.keys(section, key, _TASK_REQUIRED, _TASK_OPTIONAL)
    pp = "a number of percentage points in [0, 100]"
    return TaskThresholds(
        name=name,
        profile=check.text(section["profile"], f"{key}.profile", "a profile name, e.g. gsm8k-lmeval-v3"),
        metric=check.text(section["metric"], f"{key}.metric", "a metric name, e.g. exact_match,strict-match"),
        margin_pp=check.number(section["margin_pp"], f"{key}.margin_pp", 0, 100, low_open=True,
                               expected="a margin in percentage points, > 0 and <= 100 (e.g. 1.5)"),
        max_invalid_rise_pp=check.number(section.get("max_invalid_rise_pp", 1.0),
                                         f"{key}.max_invalid_rise_pp", 0, 100, expected=pp),
        max_truncation_rise_pp=check.number(section.get("max_truncation_rise_pp", 1.0),
                                            f"{key}.max_truncation_rise_pp", 0, 100, expected=pp),
        require_paired=check.boolean(section.get("require_paired", True), f"{key}.require_paired"),
        min_aa_runs=check.integer(section.get("min_aa_runs", 1), f"{key}.min_aa_runs", 0,
                                  "a whole number >= 0"),
        min_rise_items=check.integer(section.get("min_rise_items", 4), f"{key}.min_rise_items", 0,
                                     "a whole number of items >= 0 (0: the limit alone, as in docs/gate.md#the-original-rule)"),
    )


def _token_band(value: Any, check: _Validator) -> tuple[float, float]:
    expected = "[low, high] with 0 < low <= 1 <= high, e.g. [0.9, 1.1]"
    if not isinstance(value, list) or len(value) != 2:
        raise check.error("token_ratio_band", f"is {_describe(value)}", expected)
    low = check.number(value[0], "token_ratio_band", 0, 1, low_open=True, expected=expected)
    high = check.number(value[1], "token_ratio_band", 1, float("inf"), expected=expected)
    return low, high


def parse_thresholds(text: str, path: str = "<thresholds>", sha256: str | None = None) -> Thresholds:
    """Validate thresholds YAML text; ``path`` only labels the error messages."""
    data, lines = _parse_yaml(text, path)
    check = _Validator(path, lines)
    if data is None:
        raise UserError(f"{path}: file is empty; expected a mapping with keys {', '.join(_TOP_REQUIRED)}")
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level is {_describe(data)}; expected a mapping with keys "
                        f"{', '.join(_TOP_REQUIRED)}")
    for name, (problem, expected) in _REMOVED.items():
        if name in data:
            raise check.error(name, problem, expected)
    check.keys(data, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    alpha = check.number(data["alpha"], "alpha", 0, 0.5, low_open=True, expected="a number in (0, 0.5], e.g. 0.05")
    rule = check.choice(data.get("multiple_comparisons", "holm"), "multiple_comparisons",
                        tuple(MULTIPLE_COMPARISONS))
    ci_method = check.choice(data.get("ci_method", "tango"), "ci_method", CI_METHODS)
    band = _token_band(data.get("token_ratio_band", [0.9, 1.1]), check)
    alpha_split = check.boolean(data.get("alpha_split", True), "alpha_split")
    # the accuracy checks get alpha - alpha_validity, so it must stay below alpha
    alpha_validity = check.number(data.get("alpha_validity", 0.01), "alpha_validity", 0, alpha,
                                  expected=f"a number in [0, alpha) = [0, {alpha:g}), e.g. 0.01")
    if alpha_validity >= alpha:
        raise check.error("alpha_validity", f"{alpha_validity!r} is out of range",
                          f"a number in [0, alpha) = [0, {alpha:g}), e.g. 0.01")
    inconclusive = check.boolean(data.get("inconclusive", True), "inconclusive")
    sections = check.mapping(data["tasks"], "tasks", "a mapping of task name to its thresholds")
    for name in REQUIRED_TASKS:
        if name not in sections:
            raise check.error(f"tasks.{name}", "missing task section",
                              f"a section for each of {', '.join(REQUIRED_TASKS)}")
    tasks = {name: _task_thresholds(name, section, check) for name, section in sections.items()}
    digest = sha256 or hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Thresholds(path, digest, alpha, rule, ci_method, band, tasks, alpha_split, alpha_validity, inconclusive)


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Load and validate a thresholds file (default: ``default_thresholds_path()``); errors are UserError."""
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
    return parse_thresholds(text, shown, hashlib.sha256(raw).hexdigest())
