"""thresholds.yaml: the default policy loads, and every bad file gives one clear line naming file and key."""

import hashlib
from pathlib import Path

import pytest

from evalgate.errors import UserError
from evalgate.gate.policy import default_thresholds_path, load_thresholds, parse_thresholds

REPO = Path(__file__).resolve().parent.parent
POLICY_FILE = REPO / "thresholds.yaml"  # the top level, beside pyproject.toml
GOOD = POLICY_FILE.read_text(encoding="utf-8")


def test_default_file_loads_with_spec_defaults():
    thresholds = load_thresholds()
    assert Path(thresholds.path) == POLICY_FILE == default_thresholds_path()
    assert thresholds.alpha == 0.05
    assert thresholds.multiple_comparisons == "holm" and thresholds.ci_method == "tango"
    assert thresholds.token_ratio_band == (0.9, 1.1)
    gsm, he = thresholds.task("gsm8k"), thresholds.task("humaneval")
    assert (gsm.profile, gsm.metric, gsm.margin_pp) == ("gsm8k-lmeval-v3", "exact_match,strict-match", 1.5)
    assert (he.profile, he.metric, he.margin_pp) == ("humaneval-completion-codex", "pass@1", 5.0)
    assert gsm.margin == pytest.approx(0.015) and he.max_invalid_rise == pytest.approx(0.01)
    assert gsm.max_truncation_rise_pp == 1.0 and gsm.require_paired and gsm.min_aa_runs == 1
    assert thresholds.sha256 == hashlib.sha256(POLICY_FILE.read_bytes()).hexdigest()
    # the whole-gate budget (benchmarks/simulate_gate.py): alpha split, three outcomes, rate item floor
    assert thresholds.alpha_split is True and thresholds.alpha_validity == 0.01 and thresholds.inconclusive
    assert gsm.min_rise_items == he.min_rise_items == 4


def test_every_policy_setting_reaches_the_decision(tmp_path):
    # the gate passes the policy to the rule by name: a renamed setting is an error, never a silent default
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", 60, 0)
    text = (GOOD.replace("alpha_split: true", "alpha_split: false").replace("inconclusive: true", "inconclusive: false")
                .replace("min_rise_items: 4", "min_rise_items: 3").replace("alpha_validity: 0.01", "alpha_validity: 0.02")
                .replace("margin_pp: 1.5", "margin_pp: 7.5"))
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    dec = gate_runs(load_baseline(base), load_run(cand), load_thresholds(path), allow_uncalibrated=True).decision.tasks["gsm8k"]
    rule = dec.rule
    assert (rule.alpha_split, rule.inconclusive, rule.min_rise_items, rule.alpha_validity) == (False, False, 3, 0.02)
    assert rule.margin == pytest.approx(0.075)


def test_new_keys_default_when_absent(tmp_path):
    text = GOOD
    for line in ("alpha_split: true\n", "alpha_validity: 0.01\n", "inconclusive: true\n",
                 "    min_rise_items: 4\n"):
        assert line in text
        text = text.replace(line, "")
    path = tmp_path / "old_style.yaml"
    path.write_text(text)
    thresholds = load_thresholds(path)
    assert (thresholds.alpha_split, thresholds.alpha_validity, thresholds.inconclusive) == (True, 0.01, True)
    assert thresholds.task("humaneval").min_rise_items == 4


def test_every_setting_reaches_the_rule_by_name():
    # the rule is built from the policy's settings by name: one helper names them, so none can be dropped
    import dataclasses

    from evalgate.gate import rule

    kwargs = load_thresholds().decision_kwargs("humaneval")
    if hasattr(rule, "TaskRule"):  # the typed rule object decide_task takes
        assert set(kwargs) == {f.name for f in dataclasses.fields(rule.TaskRule)}
    else:  # decide_task's keyword parameters
        import inspect

        assert set(kwargs) <= set(inspect.signature(rule.decide_task).parameters)
    assert kwargs["inconclusive"] is True and kwargs["margin"] == pytest.approx(0.05)


def test_spec_policy_settings_load(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(GOOD.replace("\nalpha_split: true\n", "\nalpha_split: false\n")
                    .replace("inconclusive: true", "inconclusive: false")
                    .replace("min_rise_items: 4", "min_rise_items: 0")
                    .replace("alpha_validity: 0.01", "alpha_validity: 0"))
    thresholds = load_thresholds(path)
    assert (thresholds.alpha_split, thresholds.alpha_validity, thresholds.inconclusive) == (False, 0.0, False)
    assert thresholds.task("gsm8k").min_rise_items == 0



def test_extra_tasks_and_optional_keys(tmp_path):
    text = GOOD + (
        "  gsm8k_canary:\n    profile: gsm8k-lmeval-v3\n    metric: exact_match,strict-match\n"
        "    margin_pp: 10\n    min_aa_runs: 0\n    require_paired: false\n"
    )
    path = tmp_path / "t.yaml"
    path.write_text(text)
    canary = load_thresholds(path).task("gsm8k_canary")
    assert canary.margin_pp == 10.0 and canary.min_aa_runs == 0 and canary.require_paired is False
    assert canary.max_invalid_rise_pp == 1.0  # default


def test_override_path_changes_sha(tmp_path):
    path = tmp_path / "strict.yaml"
    path.write_text(GOOD.replace("margin_pp: 1.5", "margin_pp: 1.0"))
    thresholds = load_thresholds(path)
    assert thresholds.task("gsm8k").margin_pp == 1.0
    assert thresholds.sha256 != load_thresholds().sha256


def test_unknown_task_lookup_is_a_user_error():
    with pytest.raises(UserError, match=r"thresholds.yaml: tasks.mmlu: no thresholds for task 'mmlu'"):
        load_thresholds().task("mmlu")


def replace_once(old, new):
    assert GOOD.count(old) >= 1, old
    return GOOD.replace(old, new, 1)


# (case, file text, fragments the one-line message must contain: the key and what is expected)
BAD_FILES = [
    ("unknown top-level key", GOOD + "alpah: 0.05\n", ["alpah", "unknown key", "expected one of alpha"]),
    ("unknown task key", replace_once("margin_pp: 1.5", "margin_pp: 1.5\n    margn_pp: 2"),
     ["tasks.gsm8k.margn_pp", "unknown key", "margin_pp"]),
    ("margin as a string", replace_once("margin_pp: 1.5", "margin_pp: '1.5'"),
     ["tasks.gsm8k.margin_pp", "a string", "expected a margin in percentage points"]),
    ("negative margin", replace_once("margin_pp: 5.0", "margin_pp: -5"),
     ["tasks.humaneval.margin_pp", "out of range", "> 0"]),
    ("alpha too big", replace_once("alpha: 0.05", "alpha: 0.6"), ["alpha", "out of range", "(0, 0.5]"]),
    ("alpha zero", replace_once("alpha: 0.05", "alpha: 0"), ["alpha", "out of range", "(0, 0.5]"]),
    ("alpha as a boolean", replace_once("alpha: 0.05", "alpha: yes"), ["alpha", "a boolean", "(0, 0.5]"]),
    ("missing task section", GOOD.split("  humaneval:")[0],
     ["tasks.humaneval", "missing task section", "gsm8k, humaneval"]),
    ("missing required task key", replace_once("    metric: pass@1\n", ""),
     ["tasks.humaneval.metric", "missing"]),
    ("duplicate key", replace_once("margin_pp: 1.5", "margin_pp: 1.5\n    margin_pp: 2.0"),
     ["tasks.gsm8k.margin_pp", "duplicate key", "once"]),
    ("duplicate task", GOOD + "  gsm8k:\n    profile: x\n", ["tasks.gsm8k", "duplicate key"]),
    ("unknown multiple-comparison rule", replace_once("multiple_comparisons: holm", "multiple_comparisons: sidak"),
     ["multiple_comparisons", "'sidak'", "holm, bonferroni, none"]),
    ("unknown ci method", replace_once("ci_method: tango", "ci_method: wald"),
     ["ci_method", "'wald'", "tango, newcombe"]),
    ("bad YAML syntax", replace_once("tasks:\n", "tasks: [\n"), ["invalid YAML syntax", "expected"]),
    ("tab indentation", replace_once("  gsm8k:\n", "\tgsm8k:\n"), ["invalid YAML syntax"]),
    ("empty file", "# only a comment\n", ["file is empty", "expected a mapping"]),
    ("top level is a list", "- alpha\n- tasks\n", ["top level is a list", "expected a mapping"]),
    ("top level is a scalar", "thresholds\n", ["top level is a string", "expected a mapping"]),
    ("tasks is a list", "alpha: 0.05\ntasks: [gsm8k, humaneval]\n", ["tasks", "a list", "mapping"]),
    ("task section empty", replace_once("  humaneval:\n", "  humaneval:\n  humaneval_x:\n"),
     ["tasks.humaneval", "empty", "a mapping"]),
    ("require_paired not a bool", replace_once("require_paired: true", "require_paired: 'yes'"),
     ["tasks.gsm8k.require_paired", "true or false"]),
    ("min_aa_runs fractional", replace_once("min_aa_runs: 1", "min_aa_runs: 1.5"),
     ["tasks.gsm8k.min_aa_runs", "whole number"]),
    ("negative rate limit", replace_once("max_invalid_rise_pp: 1.0", "max_invalid_rise_pp: -1"),
     ["tasks.gsm8k.max_invalid_rise_pp", "out of range", "[0, 100]"]),
    ("bad task name", GOOD + "  GSM-8K:\n    profile: x\n", ["tasks.GSM-8K", "invalid task name"]),
    ("alpha_validity equal to alpha", replace_once("alpha_validity: 0.01", "alpha_validity: 0.05"),
     ["alpha_validity", "out of range", "[0, alpha) = [0, 0.05)"]),
    ("alpha_validity above alpha", replace_once("alpha_validity: 0.01", "alpha_validity: 0.2"),
     ["alpha_validity", "out of range", "[0, alpha)"]),
    ("alpha_validity negative", replace_once("alpha_validity: 0.01", "alpha_validity: -0.01"),
     ["alpha_validity", "out of range", "[0, alpha)"]),
    ("alpha_validity as a string", replace_once("alpha_validity: 0.01", "alpha_validity: 1%"),
     ["alpha_validity", "a string", "[0, alpha)"]),
    ("alpha_split not a bool", replace_once("\nalpha_split: true\n", "\nalpha_split: 'split'\n"),
     ["alpha_split", "true or false"]),
    ("inconclusive not a bool", replace_once("inconclusive: true", "inconclusive: 3.7"),
     ["inconclusive", "a number", "true or false"]),
    # a policy of before issue 14: the margin floor is gone, and the message says what replaced it
    ("removed margin_floor", replace_once("inconclusive: true", "margin_floor: true"),
     ["margin_floor", "no longer a setting", "never raises the margin", "INCONCLUSIVE", "expected the line deleted"]),
    ("removed margin_floor even when off", replace_once("inconclusive: true", "margin_floor: false"),
     ["margin_floor", "no longer a setting"]),
    ("min_rise_items negative", replace_once("min_rise_items: 4", "min_rise_items: -1"),
     ["tasks.gsm8k.min_rise_items", "out of range", "whole number of items >= 0"]),
    ("min_rise_items fractional", replace_once("min_rise_items: 4", "min_rise_items: 2.5"),
     ["tasks.gsm8k.min_rise_items", "a number", "whole number of items"]),
    ("token band reversed", replace_once("[0.9, 1.1]", "[1.1, 0.9]"), ["token_ratio_band", "0 < low <= 1"]),
]


@pytest.mark.parametrize("case, text, fragments", BAD_FILES, ids=[case for case, _, _ in BAD_FILES])
def test_bad_file_gives_one_clear_line(tmp_path, case, text, fragments):
    path = tmp_path / "bad_thresholds.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError) as info:
        load_thresholds(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))  # names the file (with the line when known)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"
    assert info.value.exit_code == 2


def test_error_names_the_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(replace_once("margin_pp: 1.5", "margin_pp: -1"))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "margin_pp: -1" in text)
    with pytest.raises(UserError, match=rf"^{path}:{line}: tasks.gsm8k.margin_pp: "):
        load_thresholds(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(UserError, match=rf"^{path}: file not found; expected .*--thresholds FILE"):
        load_thresholds(path)


def test_directory_and_binary_files(tmp_path):
    with pytest.raises(UserError, match="expected a readable thresholds YAML file"):
        load_thresholds(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00alpha")
    with pytest.raises(UserError, match="not UTF-8"):
        load_thresholds(binary)


def test_parse_text_without_file():
    thresholds = parse_thresholds(GOOD, "inline")
    assert thresholds.path == "inline" and thresholds.task("gsm8k").margin_pp == 1.5


def test_default_policy_is_the_one_top_level_file():
    # one copy of the default policy, at the top level; a built install carries it as package data
    # (tests/test_policy_packaging.py builds one)
    path = default_thresholds_path()
    assert path == POLICY_FILE and path.is_file()
    assert not (REPO / "evalgate" / "gate" / "thresholds.yaml").exists()
    assert load_thresholds().sha256 == hashlib.sha256(POLICY_FILE.read_bytes()).hexdigest()
    assert load_thresholds().source == "packaged default"
