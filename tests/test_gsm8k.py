"""GSM8K profiles, prompts and extraction, against lm-evaluation-harness's documented behaviour."""

from __future__ import annotations

import json
import random

import pytest

from evalgate.errors import UserError
from evalgate.types import Generation
from evalgate.tasks.gsm8k import PROFILES, TASK, extract_answer, gold_answer


@pytest.mark.parametrize("text, strict, flexible", [
    ("She pays 5 + 3 = 8.\n#### 8", "8", "8"),
    ("#### 1,234", "1234", "1234"),                      # thousands separator removed
    ("It costs $18.\n#### $18", None, "18"),             # strict regex has no "$" class; flexible keeps "$18"
    ("#### -5", "-5", "-5"),                             # negative
    ("#### 3.50", "3.50", "3.50"),                       # decimal kept as text: 3.50 != 3.5
    ("#### 7.", "7", "7"),                               # trailing period removed by "\.$"
    ("#### 12\n#### 13", "12", "13"),                    # several ####: strict takes the first
    ("#### 42 apples and 7 pears", "42", "7"),           # text after the answer; flexible takes the last number
    ("no number here", None, None),                      # nothing matches: [invalid]
    ("so ... the end", None, ".."),                      # flexible [$0-9.,]{2,} also matches "...", then "\.$" drops one
])
def test_extractors_follow_lm_eval(text, strict, flexible):
    """Expected values are the normalised strings lm-eval compares (regexes_to_ignore, then lower-case)."""
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_cot_strict_needs_a_character_after_the_number():
    # "The answer is (N)." ends in an unescaped wildcard: an output ending right after N is invalid
    assert extract_answer("So The answer is 6.", "strict", "gsm8k-cot-8shot") == "6"
    assert extract_answer("So The answer is 6", "strict", "gsm8k-cot-8shot") is None
    assert extract_answer("The answer is 1,000 dollars", "strict", "gsm8k-cot-8shot") == "1000"


def test_bad_mode_is_refused():
    with pytest.raises(ValueError):
        extract_answer("#### 1", "loose")


def test_gold_keeps_what_follows_the_last_marker():
    assert gold_answer("He has 3+4=<<3+4=7>>7 apples.\n#### 7") == "7"
    assert gold_answer("x\n#### 2,125") == "2125"


def test_lmeval_prompt_uses_seeded_train_shots(data_dir):
    items, resolved = TASK.load(PROFILES["gsm8k-lmeval-v3"], data_dir, limit=3)
    train = [json.loads(l) for l in (data_dir / "gsm8k/train.jsonl").read_text().splitlines()]
    test = [json.loads(l) for l in (data_dir / "gsm8k/test.jsonl").read_text().splitlines()]
    rnd = random.Random(1234)  # lm-eval: one RNG per task, rnd.sample(train_docs, 5) per test doc in order
    for i, item in enumerate(items):
        shots = rnd.sample(train, 5)
        expected = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        expected += f"Question: {test[i]['question']}\nAnswer:"
        req = TASK.requests([item], resolved)[0]
        assert req.prompt == expected
        assert [train[j] for j in resolved.per_item[str(i)]] == shots
        assert req.stop == ("Question:", "</s>", "<|im_end|>") and req.max_new_tokens == 256


def test_cot_prompt_has_eight_fixed_exemplars(data_dir):
    items, resolved = TASK.load(PROFILES["gsm8k-cot-8shot"], data_dir, limit=2)
    prompt = TASK.requests(items, resolved)[1].prompt
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.count("The answer is") == 8 and prompt.endswith("\nA:")
    assert prompt.count("\n\nQ: ") == 8


def test_profile_id_covers_items_and_settings(data_dir):
    _, r3 = TASK.load(PROFILES["gsm8k-lmeval-v3"], data_dir, limit=3)
    _, r3b = TASK.load(PROFILES["gsm8k-lmeval-v3"], data_dir, limit=3)
    _, r4 = TASK.load(PROFILES["gsm8k-lmeval-v3"], data_dir, limit=4)
    _, c3 = TASK.load(PROFILES["gsm8k-cot-8shot"], data_dir, limit=3)
    assert r3.profile_id == r3b.profile_id
    assert len({r3.profile_id, r4.profile_id, c3.profile_id}) == 3
    assert r3.dataset_sha256["gsm8k/test.jsonl"].startswith("3730d312")


def test_score_records_both_filters_and_numeric_disagreement(data_dir):
    items, resolved = TASK.load(PROFILES["gsm8k-lmeval-v3"], data_dir, limit=1)
    req = TASK.requests(items, resolved)[0]
    gold = gold_answer(items[0]["answer"])
    rec = TASK.score(items[0], req, Generation(text=f"blah\n#### {gold}.0", finish_reason="stop", n_tokens=5), resolved)
    assert rec["exact_match,strict-match"] == 0.0  # "18.0" != "18" as strings
    assert rec["numeric_match"]["strict-match"] is True and rec["numeric_disagrees"] is True
    rec = TASK.score(items[0], req, Generation(text=f"#### {gold}", finish_reason="stop"), resolved)
    assert rec["exact_match,strict-match"] == 1.0 and rec["numeric_disagrees"] is False
    assert rec["doc_id"] == 0 and rec["prompt_hash"] and rec["resps"] == f"#### {gold}"
    rec = TASK.score(items[0], req, Generation(text="no idea", finish_reason="length"), resolved)
    assert rec["invalid,strict-match"] is True and rec["extracted"]["strict-match"] is None


def test_wrong_hash_is_refused(tmp_path, data_dir):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k/test.jsonl").write_text((data_dir / "gsm8k/test.jsonl").read_text()[:-10] + "tampered\n")
    with pytest.raises(UserError, match="sha256 mismatch"):
        TASK.load(PROFILES["gsm8k-cot-8shot"], tmp_path, limit=1)

