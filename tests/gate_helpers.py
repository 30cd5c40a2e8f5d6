"""Build stored runs for gate tests: a real tiny-model run, then copies with chosen per-item outcomes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SMALL_N_POLICY = """
alpha: 0.05
multiple_comparisons: holm
ci_method: tango
tasks:
  gsm8k:
    profile: gsm8k-lmeval-v3
    metric: exact_match,strict-match
    margin_pp: {margin}
    max_invalid_rise_pp: {rate}
    max_truncation_rise_pp: {rate}
    require_paired: {paired}
  humaneval:
    profile: humaneval-completion-codex
    metric: pass@1
    margin_pp: 5.0
"""


def policy(tmp_path: Path, margin: float = 60.0, rate: float = 100.0, paired: str = "true") -> Path:
    path = tmp_path / "thresholds.yaml"
    path.write_text(SMALL_N_POLICY.format(margin=margin, rate=rate, paired=paired))
    return path


def derive_run(source: Path, dest: Path, correct: list[bool], kernel: str | None = None,
               invalid: list[bool] | None = None, truncated: list[bool] | None = None) -> Path:
    """A copy of ``source`` whose GSM8K items are right/wrong as ``correct`` says (by doc order)."""
    shutil.copytree(source, dest)
    path = dest / "gsm8k.jsonl"
    records = sorted((json.loads(l) for l in path.read_text().splitlines()), key=lambda r: r["doc_id"])
    assert len(records) == len(correct)
    for i, (r, ok) in enumerate(zip(records, correct)):
        value = 1.0 if ok else 0.0
        r["exact_match,strict-match"] = value
        r["exact_match"]["strict-match"] = value
        r["invalid,strict-match"] = bool(invalid[i]) if invalid is not None else False
        r["finish_reason"] = "length" if truncated is not None and truncated[i] else "stop"
        r["extracted"]["strict-match"] = r["target"] if ok else "0"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if kernel is not None:
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest["kernel"].update(name=kernel, id=f"{kernel}@test")
        (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest
