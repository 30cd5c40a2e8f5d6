"""The published files' rows read line by line (``source._published_jsonl_rows``) are the rows ``datasets``
reads from the same bytes, and a gate's start-up reads them without importing ``datasets``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from evalgate.tasks import source
from evalgate.tasks.data import verified_path
from evalgate.tasks.gsm8k import FILES as GSM8K_FILES
from evalgate.tasks.humaneval.problems import FIELDS as HUMANEVAL_FIELDS
from evalgate.tasks.humaneval.problems import PUBLISHED as HUMANEVAL_FILE

FILES = {f.path: (f, ("question", "answer")) for f in GSM8K_FILES.values()}
FILES[HUMANEVAL_FILE.path] = (HUMANEVAL_FILE, HUMANEVAL_FIELDS)


@pytest.mark.parametrize("rel", sorted(FILES))
def test_line_by_line_equals_datasets_and_the_published_items_hash(rel):
    pytest.importorskip("datasets")
    file, fields = FILES[rel]
    path = verified_path(None, file)
    fast = source._published_jsonl_rows(path, fields)
    through_datasets = source._rows(source._load_files(source._builder(path), str(path), rel), "t", fields, {}, rel)
    assert fast == through_datasets and len(fast) > 100
    assert source.items_sha256(fast, fields) == file.items_sha256


def test_other_formats_and_rows_without_text_fields_go_through_datasets(tmp_path):
    assert source._published_jsonl_rows(tmp_path / "x.parquet", ("a",)) is None
    numbers = tmp_path / "x.jsonl"
    numbers.write_text('{"a": "text"}\n{"a": 3}\n')
    assert source._published_jsonl_rows(numbers, ("a",)) is None  # datasets then names the column that is not text
    text = tmp_path / "y.jsonl"
    text.write_text('{"a": "one", "b": 1}\n\n{"a": "two\\u00e9", "b": 2}\n')
    assert source._published_jsonl_rows(text, ("a",)) == [{"a": "one"}, {"a": "twoé"}]


def test_the_canary_tasks_load_without_importing_datasets():
    code = ("import sys; from evalgate.canary import PROFILES; from evalgate.run.spec import RunSpec, load_tasks; "
            "t = load_tasks(RunSpec(model='m', kernel='w4a8', tasks=['gsm8k', 'humaneval'], profiles=dict(PROFILES))); "
            "print(sorted(t), len(t['gsm8k'].items), len(t['humaneval'].items), 'datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["['gsm8k',", "'humaneval']", "200", "164", "False"]
